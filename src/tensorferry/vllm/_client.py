"""Trainer side: vLLM's four-method weight-sync client over an offline ``vllm.LLM``.

vLLM ships clients for a server (``HTTPVLLMWeightSyncClient``) and for Ray
actors (``RayVLLMWeightSyncClient``); an ``LLM`` made in the trainer's own
process takes its requests wrapped (``WeightTransferInitRequest``,
``WeightTransferUpdateRequest``). :class:`LLMClient` wraps them, so
``trainer_init(..., client=LLMClient(llm))`` drives it like the others.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLMClient"]


class LLMClient:
    """``VLLMWeightSyncClient`` of an offline ``vllm.LLM`` (or anything with its weight-sync methods)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
