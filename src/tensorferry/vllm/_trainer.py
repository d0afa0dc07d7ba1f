"""Trainer side: vLLM's ``TrainerWeightTransferEngine`` for ``backend="tensorferry"``.

``WeightTransferTrainerFactory.trainer_init(TensorferryTrainerInitInfo(rank=r),
client=..., source=...)`` on every trainer rank; rank 0 sends the workers
the handshake (``init_weight_transfer_engine``). Each ``send_weights()``:

1. every rank takes its state from the ``WeightSource`` (whole tensors on
   one rank; local shards boxed by the metadata's placements on several, or
   by torch's DTensor placements where the release's metadata has none:
   ``_sources.source_state``) and puts it with a kept ``SendPlan``, made
   on the first round (again when a parameter was replaced): later rounds
   copy bytes (cast with ``dtype``, compared with ``delta``), no per-tensor
   work;
2. rank 0 collects every rank's ticket (``_exchange``), no rank gathers the
   model, and drives the client: ``start_weight_update``,
   ``update_weights`` (the tickets, a few KB of JSON), ``finish_weight_update``;
3. the round is released on every rank once rank 0's calls returned (every
   worker then holds it).
"""

from __future__ import annotations

import base64
import time
from dataclasses import asdict
from typing import Any, NamedTuple

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

import tensorferry as tf

from ..errors import ConfigurationError, PlanStaleError, TransferError
from ._exchange import TicketExchange
from ._infos import TensorferryInitInfo, TensorferryTrainerInitInfo, TensorferryUpdateInfo
from ._placements import state_nbytes
from ._sources import source_state, trainer_base_kwargs

__all__ = ["TensorferryTrainerWeightTransferEngine", "RoundReport"]

# Pool room beyond the weights: every tensor's 16-byte alignment padding and
# the copy plan's bookkeeping, with margin (64 MiB is ~0.5% of a 7B bf16 model).
_POOL_SLACK_NBYTES = 64 << 20


class RoundReport(NamedTuple):
    """What one ``send_weights`` did on this rank (``engine.last_round``).

    Attributes:
        round: rounds sent so far (1 for the first).
        seconds: the whole ``send_weights`` on this rank (rank 0: the
            workers' receipt and load included).
        put_seconds: this rank's put: the copy into its pool (cast and
            compare included), and a plan when one was made.
        nbytes: the bytes this rank's round holds (after ``dtype``).
        delta_nbytes: ``delta=True``: the delta a worker holding the previous
            round read (0: none sent this round).
        changed: ``delta=True``: elements that changed since the previous round.
        bytes_sent: what this rank's sender sent this round (tcp, nixl; shm
            workers copy out of its memory: 0).
        planned: this round made the plan (the first, or parameters replaced).
    """

    round: int
    seconds: float
    put_seconds: float
    nbytes: int
    delta_nbytes: int
    changed: int
    bytes_sent: int
    planned: bool


class TensorferryTrainerWeightTransferEngine(TrainerWeightTransferEngine[TensorferryTrainerInitInfo]):
    """Puts each rank's weights with a kept plan; rank 0 hands the round's tickets to vLLM.

    Made by
    [``trainer_init``][tensorferry.vllm.TensorferryTrainerWeightTransferEngine.trainer_init]
    on every trainer rank; ``send_weights`` and ``shutdown`` are called on
    every rank too.
    """

    init_info_cls = TensorferryTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, init_info: TensorferryTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender, **trainer_base_kwargs(init_info.rank))
        self.rank = init_info.rank  # vLLM 0.33's base sets it too; 0.32's takes no rank
        self.info = init_info
        self._dtype = None if init_info.dtype is None else getattr(torch, init_info.dtype)
        self._sender: Any = None
        self._plan: Any = None
        self._exchange: TicketExchange | None = None
        self.rounds = 0
        self.last_round: RoundReport | None = None
        self._step = ""  # the client call rank 0 is in, for messages

    @classmethod
    def trainer_init(cls, init_info: TensorferryTrainerInitInfo, *, client: Any, source: Any = None) -> "TensorferryTrainerWeightTransferEngine":
        """Make this rank's engine; rank 0 sends the workers the handshake.

        A collective with several ranks (the ticket exchange's gloo group).

        Raises:
            ConfigurationError: no ``source``, init info of another backend,
                or ranks that are not ``torch.distributed``'s.
        """
        if not isinstance(init_info, TensorferryTrainerInitInfo):
            raise ConfigurationError(f"{cls.__name__}.trainer_init takes a TensorferryTrainerInitInfo, not a {type(init_info).__name__}")
        if source is None:
            raise ConfigurationError(
                "the tensorferry trainer sends a WeightSource every round: pass source=ModuleSource(model) "
                "(vllm.distributed.weight_transfer) or a WeightSource of your own"
            )
        engine = cls(client=client, source=source, init_info=init_info)
        if init_info.world_size > 1:
            engine._exchange = TicketExchange(init_info.rank, init_info.world_size)
        if engine.is_sender:
            client.init_weight_transfer_engine(engine.worker_init_info())
        return engine

    def worker_init_info(self) -> dict[str, Any]:
        """What rank 0 sends each worker at the handshake (JSON-safe)."""
        info = self.info
        return asdict(
            TensorferryInitInfo(
                transport=info.transport,
                token=info.token,
                relay=info.fanout is not None,
                host=info.worker_host,
                timeout_seconds=info.timeout_seconds,
                sources=info.world_size,
            )
        )

    def send_weights(self) -> None:
        """Put this rank's weights; on rank 0, drive the workers' round. Every rank calls it.

        Raises:
            TransferError: a client call of rank 0 failed (named, its error
                chained; on the other ranks: that rank 0's round failed).
            PoolExhaustedError: ``capacity_nbytes`` cannot hold this rank's weights.
        """
        t0 = time.perf_counter()
        state = source_state(self.source, self.rank, self.info.world_size)
        planned = self._plan is None or not self._plan.matches(state)
        if planned:
            self._make_plan(state)
        # The k-th round's tickets say version k on every rank, a plan made
        # again included: a worker's sharded get checks they agree.
        self._plan.puts = self.rounds
        sent_before = self._sender.stats().get("bytes_sent", 0)
        try:
            ticket = self._put()
        except PlanStaleError:  # a parameter moved under the plan's check
            self._make_plan(state)
            planned = True
            self._plan.puts = self.rounds
            ticket = self._put()
        put_seconds = time.perf_counter() - t0
        payload = ticket.to_bytes()
        tickets = self._exchange.gather(payload) if self._exchange is not None else [payload]
        error: BaseException | None = None
        if self.is_sender:
            if tickets is None:  # rank 0 drives the client, and gather() returns every rank's ticket there
                raise ConfigurationError(f"trainer rank {self.rank} drives vLLM's client but holds no tickets: only rank 0 of the trainer group may")
            try:
                self._drive([base64.b64encode(t).decode("ascii") for t in tickets])
            except Exception as exc:  # noqa: BLE001 - other ranks must hear of it before it is raised
                error = TransferError(
                    f"round {self.rounds + 1}: vLLM's {self._step} failed ({type(exc).__name__}: {exc}); the workers' own "
                    "error is in the engine's log. The round was released; send_weights again once the engine is healthy "
                    "(a worker that missed it reads the next round whole)"
                )
                error.__cause__ = exc
            except BaseException as exc:  # KeyboardInterrupt and the like: other ranks hear of it too
                error = exc
        ok = self._exchange.agree(error is None) if self._exchange is not None else error is None
        self._release(ticket, ok)
        if error is not None:
            raise error
        if not ok:
            raise TransferError(
                f"round {self.rounds + 1}: trainer rank 0 could not complete the workers' update (see its error); "
                "this rank's part was put and released"
            )
        self.rounds += 1
        stats = self._sender.stats()
        delta = ticket.delta
        self.last_round = RoundReport(
            round=self.rounds,
            seconds=time.perf_counter() - t0,
            put_seconds=put_seconds,
            nbytes=self._plan.layout.total_nbytes,
            delta_nbytes=delta.nbytes if delta is not None and delta.base else 0,
            changed=delta.changed if delta is not None else 0,
            bytes_sent=stats.get("bytes_sent", 0) - sent_before,
            planned=planned,
        )

    def shutdown(self) -> None:
        """Close this rank's sender (workers keep the weights they hold) and the exchange's group."""
        self._plan = None
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None

    # -- internals

    def _make_plan(self, state: dict[str, Any]) -> None:
        factor = 2 if self.info.delta else 1  # a delta plan keeps the last round in the pool too
        need = factor * state_nbytes(state, self._dtype) + _POOL_SLACK_NBYTES
        if self._sender is None or self._sender.stats()["capacity_nbytes"] < need:
            if self._sender is not None:
                self._sender.close()
            info = self.info
            self._sender = tf.Sender(
                info.transport, capacity_nbytes=info.capacity_nbytes or need, host=info.host, token=info.token or None, prefault=True
            )
        self._plan = None  # a delta plan's kept round goes back to the pool first
        self._plan = self._sender.plan(state, dtype=self._dtype, delta=self.info.delta)

    def _put(self) -> Any:
        readers = self.info.readers
        return self._sender.put(self._plan, readers=readers, one_shot=True, fanout=self.info.fanout)

    def _drive(self, tickets: list[str]) -> None:
        update = asdict(TensorferryUpdateInfo(tickets=tickets, round=self.rounds + 1))
        self._step = "start_weight_update"
        self.client.start_weight_update()
        self._step = "update_weights"
        self.client.update_weights(update)
        self._step = "finish_weight_update"
        self.client.finish_weight_update()

    def _release(self, ticket: Any, ok: bool) -> None:
        if self.info.readers is None or not ok:
            self._sender.discard(ticket)  # every worker holds it: vLLM's update_weights returned
        else:
            self._sender.wait_released(ticket, timeout=self.info.timeout_seconds)
