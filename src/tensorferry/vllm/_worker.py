"""Worker side: vLLM's ``WeightTransferEngine`` for ``backend="tensorferry"``.

vLLM builds one in every worker (``WeightTransferEngineFactory.create_engine``)
and drives it from the trainer's four calls: ``init_weight_transfer_engine``
(:meth:`init_transfer_engine`: a ``Receiver`` for the trainer's transport),
then each round ``start_weight_update``, ``update_weights`` (one round's
tickets: :meth:`receive_weights`), ``finish_weight_update``.

The first round allocates a whole tensor for every checkpoint name of the
tickets (``_targets.checkpoint_targets``) and plans the get into them: a
``RecvPlan`` for one trainer rank (deltas apply to it), a ``ShardedPlan``
for several (each rank's shards read straight into their place). Later
rounds replay the plan: bytes only, no per-tensor work, the same tensors.
They are handed to ``model.load_weights`` under their checkpoint names, so
vLLM's own loaders fuse (qkv, gate/up) and slice for tensor parallelism,
and stay untouched until the next round (after ``finish_weight_update``),
as vLLM's layerwise reload needs.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

import tensorferry as tf

from ..errors import ConfigurationError, LayoutMismatchError, PlanStaleError, TicketError, TransferError
from ._infos import TensorferryInitInfo, TensorferryUpdateInfo
from ._targets import checkpoint_targets

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["TensorferryWeightTransferEngine", "decode_tickets"]


class _Kept(NamedTuple):
    """A target model's kept receive: its plan, the tensors it fills, and the layouts it was made for."""

    plan: Any
    targets: dict
    layouts: tuple


def decode_tickets(info: TensorferryUpdateInfo) -> list[Any]:
    """The round's tickets, decoded and validated (``Ticket.from_bytes``: bounded, nothing unpickled).

    Raises:
        TicketError: a ticket that is not base64 or not a valid ticket.
    """
    tickets = []
    for rank, text in enumerate(info.tickets):
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise TicketError(
                f"round {info.round}: trainer rank {rank}'s ticket ({len(text)} characters) is not base64: {exc}; "
                "send Ticket.to_bytes() base64-encoded, as the tensorferry trainer engine does"
            ) from exc
        tickets.append(tf.Ticket.from_bytes(raw))
    return tickets


class TensorferryWeightTransferEngine(WeightTransferEngine[TensorferryInitInfo, TensorferryUpdateInfo]):
    """Receives a trainer's rounds with kept tensorferry plans and loads them with ``load_weights``.

    Runs in each vLLM worker (every tensor-parallel rank of every replica
    is a reader of every round). Drafts (speculative decoding) work: vLLM
    sets the draft model as the target for a session, and each target model
    keeps a plan of its own.
    """

    init_info_cls = TensorferryInitInfo
    update_info_cls = TensorferryUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config: "WeightTransferConfig", vllm_config: "VllmConfig", device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._info: TensorferryInitInfo | None = None
        self._receiver: Any = None
        self._kept: dict[torch.nn.Module, _Kept] = {}
        self._layerwise = False
        self._stager: Any = None
        self.rounds = 0
        """Rounds received since the handshake."""
        self.layerwise_sessions = 0
        """Sessions wrapped in vLLM's layerwise reload since the handshake."""
        self.last_get_seconds = 0.0
        """The last round's receipt: tickets decoded, planned where needed, the get."""
        self.last_load_seconds = 0.0
        """The last round's ``load_weights`` (vLLM's layerwise reload included)."""

    # -- vLLM's parse hooks: a ConfigurationError (a ValueError, as vLLM's own) naming the fields

    def parse_init_info(self, init_dict: dict[str, Any]) -> TensorferryInitInfo:
        return _parse(TensorferryInitInfo, init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> TensorferryUpdateInfo:
        return _parse(TensorferryUpdateInfo, update_dict)

    def init_transfer_engine(self, init_info: TensorferryInitInfo) -> None:
        """Make this worker's ``Receiver`` for the trainer's transport (again
        for a new trainer: the last one's plans are dropped, so its first
        round is received whole)."""
        self.shutdown()
        self._info = init_info
        self._receiver = tf.Receiver(
            token=init_info.token or None, timeout=init_info.timeout_seconds, relay=init_info.relay, host=init_info.host
        )
        if self.device.type == "cuda":
            from ._device import DeviceStager

            self._stager = DeviceStager(self.device)

    def start_weight_update(self) -> None:
        """Note whether the target model takes vLLM's layerwise reload (a model vLLM's loader built
        records the metadata it needs); the model is not touched until the round has arrived."""
        self._layerwise = _supports_layerwise(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One round; the device is synchronized only where there is one (a CPU worker has none)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: TensorferryUpdateInfo) -> None:
        """Get the round into the kept tensors (planning on the first round, or when the
        trainer's layout changed) and hand them to ``load_weights``.

        Raises:
            TransferError: no handshake yet, or the get failed (its subclasses say how).
            TicketError: tickets that do not decode.
            LayoutMismatchError: the tickets' names, shapes or dtypes disagree across ranks.
        """
        if self._receiver is None or self._info is None:
            raise TransferError(
                "tensorferry weight transfer: update_weights before init_weight_transfer_engine; "
                "the trainer's WeightTransferTrainerFactory.trainer_init makes the handshake: call it first"
            )
        tickets = decode_tickets(update_info)
        if len(tickets) != self._info.sources:
            raise ConfigurationError(
                f"round {update_info.round} carries {len(tickets)} tickets, the handshake said {self._info.sources} trainer "
                "ranks: every rank must take part in every send_weights (init again after changing world_size)"
            )
        started = time.perf_counter()
        layouts = tuple(t.layout_bytes for t in tickets)
        kept = self._kept.get(self.model)
        if kept is None or kept.layouts != layouts:
            kept = self._plan(tickets, layouts)
        try:
            self._get(kept, tickets)
        except (PlanStaleError, LayoutMismatchError):
            if len(tickets) == 1:
                raise
            # A trainer rank planned again (its layout or version moved): plan
            # with the tickets as they are; what cannot match raises again, named.
            kept = self._plan(tickets, layouts)
            self._get(kept, tickets)
        self.rounds += 1
        received = time.perf_counter()
        self._load(kept.targets)
        self.last_get_seconds, self.last_load_seconds = received - started, time.perf_counter() - received

    def finish_weight_update(self) -> None:
        """Let the round's device copies go (the model was reloaded within ``update_weights``)."""
        self._layerwise = False
        if self._stager is not None:
            self._stager.release()

    def stats(self) -> dict[str, float]:
        """``rounds`` received and ``layerwise_sessions`` since the handshake; the last round's
        ``last_get_seconds`` (its tickets decoded, planned where needed, received) and
        ``last_load_seconds`` (``load_weights``, vLLM's layerwise reload included); and the
        receiver's figures (``bytes_received``, ``gets``, ...; ``Receiver.stats``)."""
        figures = {} if self._receiver is None else dict(self._receiver.stats())
        return {"rounds": self.rounds, "layerwise_sessions": self.layerwise_sessions, "last_get_seconds": self.last_get_seconds,
                "last_load_seconds": self.last_load_seconds, **figures}

    def shutdown(self) -> None:
        """Close the receiver and drop the plans and their tensors; the worker goes on serving."""
        self._kept.clear()
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = None
        self._stager = None

    # -- internals

    def _plan(self, tickets: list[Any], layouts: tuple) -> _Kept:
        targets = checkpoint_targets([t.layout for t in tickets], pin_memory=self.device.type == "cuda")
        source = tickets[0] if len(tickets) == 1 else tickets
        kept = _Kept(self._receiver.plan(source, into=targets), targets, layouts)
        self._kept[self.model] = kept
        return kept

    def _get(self, kept: _Kept, tickets: list[Any]) -> None:
        if self._info is None:
            raise ConfigurationError("receive_weights before init_transfer_engine: vLLM calls init_transfer_engine first; call it with the trainer's init info")
        source = tickets[0] if len(tickets) == 1 else tickets
        self._receiver.get(source, into=kept.plan, timeout=self._info.timeout_seconds)

    def _load(self, targets: dict) -> None:
        """Hand the round to ``load_weights``; with layerwise reload, the whole reload session
        (``initialize_layerwise_reload`` .. ``finalize_layerwise_reload``) lies inside this one call.

        vLLM runs a worker's ``update_weights`` between two model steps, and a
        reload session empties the layers (meta tensors) until it is
        finalized: a session spanning ``start_weight_update`` to
        ``finish_weight_update`` lets a request that the engine serves in
        between (no ``/pause``) run on empty layers and kill the engine. Opened
        and closed here, after the round has arrived, a step sees the old
        weights or the new ones, never a layer of each.
        """
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self.layerwise_sessions += 1
            try:
                self._load_weights(targets)
            finally:  # a failed load still closes the session: layers with nothing loaded get their old tensors back
                finalize_layerwise_reload(self.model, self.model_config)
        else:
            self._load_weights(targets)

    def _load_weights(self, targets: dict) -> None:
        with _mtp_check_off():
            if self._stager is not None:
                self._stager.load(targets.items(), self.model.load_weights)
            else:
                self.model.load_weights(targets.items())


def _parse(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ConfigurationError(f"{cls.__name__}: expected a dict, got {type(data).__name__}")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigurationError(
            f"{cls.__name__}: unknown fields {unknown}; it takes {sorted(known)} (a trainer of another tensorferry version?)"
        )
    return cls(**data)


def _supports_layerwise(model: torch.nn.Module) -> bool:
    """Whether vLLM recorded ``model``'s layer metadata for reloading (its loader does, for every model it builds)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    # record_metadata_for_reloading enters every module; vLLM's own lookups
    # (get_layerwise_info) enter only the module they are asked about.
    return model in LAYERWISE_INFO and any(child in LAYERWISE_INFO for child in model.children())


def _mtp_check_off() -> Any:
    """vLLM's context that lets a round load a multi-token-prediction model's weights
    piecewise (its ``nccl`` engine uses it); a no-op where vLLM has none."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()
