"""Trainer side: vLLM's four-method weight-sync client over an offline ``vllm.LLM``.

vLLM ships clients for a server (``HTTPVLLMWeightSyncClient``) and for Ray
actors (``RayVLLMWeightSyncClient``); an ``LLM`` made in the trainer's own
process takes its requests wrapped (``WeightTransferInitRequest``,
``WeightTransferUpdateRequest``). :class:`LLMClient` wraps them, so
``trainer_init(..., client=LLMClient(llm))`` drives it like the others.
:class:`EnginesClient` drives several engines (replicas) as one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLMClient", "EnginesClient"]


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


class EnginesClient:
    """vLLM's four-method weight-sync client over several engines: every call goes to all of them at once.

    ``EnginesClient([HTTPVLLMWeightSyncClient(url) for url in urls])``: one
    trainer feeds several replicas (each its own ``vllm serve``); with
    ``fanout`` the replicas' workers relay each round to each other, so
    their ``update_weights`` must run at the same time, which this does (a
    thread an engine). A call returns when every engine answered; if any
    failed, it raises a ``TransferError`` naming each failed engine, its
    error chained (the first).

    Args:
        clients: one client an engine (``HTTPVLLMWeightSyncClient``,
            ``LLMClient``, or anything with the four methods).

    Raises:
        ConfigurationError: no clients, or one without the four methods.
    """

    _METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")

    def __init__(self, clients: Any) -> None:
        from ..errors import ConfigurationError

        self.clients = list(clients)
        if not self.clients:
            raise ConfigurationError("EnginesClient([]): pass one client an engine (e.g. HTTPVLLMWeightSyncClient(url))")
        for i, client in enumerate(self.clients):
            missing = [m for m in self._METHODS if not callable(getattr(client, m, None))]
            if missing:
                raise ConfigurationError(
                    f"EnginesClient: client {i} ({type(client).__name__}) has no {', '.join(missing)}: pass vLLM's "
                    "weight-sync clients (HTTPVLLMWeightSyncClient, RayVLLMWeightSyncClient) or LLMClient"
                )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version)

    def _all(self, method: str, *args: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from ..errors import TransferError

        if len(self.clients) == 1:
            getattr(self.clients[0], method)(*args)
            return
        with ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="tensorferry-engines") as pool:
            futures = [pool.submit(getattr(client, method), *args) for client in self.clients]
        errors = [(i, e) for i, e in enumerate(f.exception() for f in futures) if e is not None]
        if errors:
            named = "; ".join(f"engine {i}: {type(e).__name__}: {e}" for i, e in errors)
            error = TransferError(f"{method} failed on {len(errors)} of {len(self.clients)} engines ({named}); the others completed it")
            raise error from errors[0][1]
