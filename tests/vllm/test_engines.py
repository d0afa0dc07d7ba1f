"""Trainer engine to vLLM worker engines in processes of their own, through vLLM's classes.

The workers (two replicas, tensor parallel 1) are built as vLLM builds
them (plugins loaded, ``WeightTransferEngineFactory.create_engine``) over
a model of vLLM's parallel layers; the trainer is made with
``WeightTransferTrainerFactory.trainer_init`` and talks to them with
vLLM's ``HTTPVLLMWeightSyncClient`` (JSON over loopback HTTP). Every
round updates the trainer's weights in place and checks every worker
parameter bit for bit against the checkpoint fused and sliced by hand.
"""

from __future__ import annotations

import pytest
import torch

import _vllm_support

_vllm_support.skip_without_vllm()

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

from _vllm_model import Spec, checkpoint, expected_worker_params, module_of, perturb  # noqa: E402
from _vllm_workers import HttpFront, Workers  # noqa: E402

import tensorferry.vllm as tv  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# 1.4 MB of fp32: large enough that 1% of its elements is enough changed
# words per 4096-word chunk of a delta for a chunk's own record to cost little.
SPEC = Spec(vocab=512, hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2)


@pytest.fixture(scope="module")
def workers():
    tv.register()
    group = Workers(SPEC, replicas=2)
    front = HttpFront(group)
    yield group, front
    front.close()
    group.close()


def _check(group: Workers, ckpt: dict, want_dtype: torch.dtype, which: str = "model", only: list[int] | None = None) -> dict:
    """Every worker's parameters against ``ckpt`` fused and sliced; returns worker 0's data pointers."""
    want = expected_worker_params(ckpt, group.spec, 0, 1, want_dtype)
    ptrs = {}
    for i in only if only is not None else range(len(group.procs)):
        got = group.params(i, which)
        assert sorted(got) == sorted(want)
        for name, (tensor, ptr) in got.items():
            assert tensor.dtype == want_dtype, name
            assert torch.equal(tensor, want[name]), f"worker {i}: {name} differs"
            ptrs.setdefault(i, {})[name] = ptr
    return ptrs


def _trainer(front: HttpFront, model: torch.nn.Module, **kwargs) -> tv.TensorferryTrainerWeightTransferEngine:
    info = tv.TensorferryTrainerInitInfo(rank=0, **kwargs)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=front.client(), source=ModuleSource(model))
    assert isinstance(engine, tv.TensorferryTrainerWeightTransferEngine)
    return engine


def _rounds(front: HttpFront, group: Workers, want_dtype: torch.dtype, rounds: int = 3, **kwargs) -> list:
    """``rounds`` rounds, the trainer's weights changed in place before each; all checked.
    Returns the trainer's reports and worker 0's parameter addresses after each round."""
    ckpt = checkpoint(group.spec, seed=7)
    model = module_of(ckpt)
    engine = _trainer(front, model, **kwargs)
    state = dict(model.named_parameters())
    out = []
    try:
        for r in range(rounds):
            with torch.no_grad():
                perturb(ckpt, r, 0.05)
                for name, p in state.items():
                    p.copy_(ckpt[name])  # in place: the trainer's plan stays valid
            engine.send_weights()
            out.append((engine.last_round, _check(group, ckpt, want_dtype)))
    finally:
        engine.shutdown()
    return out


def test_rounds_over_shm_are_exact_and_replay_the_plan(workers) -> None:
    group, front = workers
    out = _rounds(front, group, torch.float32)
    assert [report.planned for report, _ in out] == [True, False, False]
    assert [report.round for report, _ in out] == [1, 2, 3]
    # loaded in place: the workers' parameters are the same memory every round
    assert out[0][1] == out[-1][1]
    figures = group.call("stats")
    assert [(s["rounds"], s["layerwise_sessions"]) for s in figures] == [(3, 0)] * 2  # no reload metadata: in place
    assert all(s["last_get_seconds"] > 0 and s["last_load_seconds"] > 0 for s in figures), figures  # the last round, timed


def test_fp32_trainer_to_bf16_engine_over_tcp(workers) -> None:
    group, front = workers
    group.call("rebuild", ("bfloat16", False))
    try:
        out = _rounds(front, group, torch.bfloat16, rounds=2, dtype="bfloat16", transport="tcp")
        fp32_nbytes = sum(t.numel() * 4 for t in checkpoint(SPEC).values())
        assert out[-1][0].nbytes == fp32_nbytes // 2  # cast on the trainer: half the bytes on the wire
    finally:
        group.call("rebuild", ("float32", False))


def test_layerwise_reload_wraps_the_rounds(workers) -> None:
    group, front = workers
    group.call("rebuild", ("float32", True))  # a model as vLLM's loader builds it: reload metadata recorded
    try:
        out = _rounds(front, group, torch.float32, rounds=2)
        # vLLM's layerwise reload copies the reloaded values back into the kernel tensors
        assert out[0][1] == out[-1][1]
        assert [s["layerwise_sessions"] for s in group.call("stats")] == [2, 2]
    finally:
        group.call("rebuild", ("float32", False))


def test_draft_model_is_a_target_of_its_own(workers) -> None:
    group, front = workers
    base = {n: t for n, (t, _) in group.params(0).items()}
    front.draft = True
    try:
        ckpt = checkpoint(SPEC, seed=11)
        engine = _trainer(front, module_of(ckpt))
        engine.send_weights()
        engine.shutdown()
    finally:
        front.draft = False
    _check(group, ckpt, torch.float32, which="draft")
    after = {n: t for n, (t, _) in group.params(0).items()}
    # bitwise (a model never loaded may hold NaNs in vLLM's uninitialised parameters)
    same = all(torch.equal(base[n].view(torch.uint8), after[n].view(torch.uint8)) for n in base)
    assert same, "the draft session must leave the target model alone"


def test_counted_readers_release_each_round(workers) -> None:
    """``readers=2``: each round is put for exactly the two workers and released
    by them (``wait_released``), not discarded; the pool holds one round at a time."""
    group, front = workers
    out = _rounds(front, group, torch.float32, rounds=2, readers=2)
    assert [report.round for report, _ in out] == [1, 2]


def test_a_failed_worker_call_is_a_transfer_error_naming_it(workers) -> None:
    """Workers that lost the handshake (a fresh engine each) answer ``update_weights`` with an
    error (HTTP 500): the trainer raises a TransferError naming the call, the cause chained."""
    from tensorferry.errors import TransferError

    group, front = workers
    ckpt = checkpoint(SPEC, seed=17)
    engine = _trainer(front, module_of(ckpt))
    try:
        group.call("rebuild", ("float32", False))
        with pytest.raises(TransferError, match="update_weights failed") as err:
            engine.send_weights()
        assert err.value.__cause__ is not None
        assert engine.rounds == 0
    finally:
        engine.shutdown()


def test_relayed_rounds_send_one_copy(workers) -> None:
    group, front = workers
    out = _rounds(front, group, torch.float32, rounds=2, transport="tcp", fanout=1)
    for report, _ in out:
        # two workers in a chain: the trainer sends the round once, the first worker relays it
        assert report.nbytes <= report.bytes_sent < 1.2 * report.nbytes


def test_delta_rounds_move_a_few_percent_and_a_restarted_worker_gets_all(workers) -> None:
    delta_group, delta_front = workers
    engine = None
    try:
        ckpt = checkpoint(SPEC, seed=3)
        model = module_of(ckpt)
        state = dict(model.named_parameters())
        engine = _trainer(delta_front, model, transport="tcp", delta=True)

        def round_(r: int, fraction: float) -> int:
            """One round; the bytes the trainer sent for it (over tcp: what the two workers read)."""
            with torch.no_grad():
                perturb(ckpt, r, fraction)
                for name, p in state.items():
                    p.copy_(ckpt[name])
            engine.send_weights()
            _check(delta_group, ckpt, torch.float32)
            return engine.last_round.bytes_sent

        nbytes = sum(t.numel() * 4 for t in ckpt.values())
        assert round_(0, 0.5) == 2 * nbytes  # the first round: each worker reads it whole
        for r in (1, 2):
            sent = round_(r, 0.01)
            delta = engine.last_round.delta_nbytes
            assert 0 < delta <= 0.05 * nbytes, f"round {r}: a delta of {delta} bytes of {nbytes}"
            assert sent == 2 * delta  # each worker read the delta, nothing else
        delta_group.restart(1)
        sent = round_(3, 0.01)
        assert sent == nbytes + engine.last_round.delta_nbytes  # the restarted worker reads the whole round
        sent = round_(4, 0.01)
        assert sent == 2 * engine.last_round.delta_nbytes <= 2 * 0.05 * nbytes  # and deltas again after it
    finally:
        if engine is not None:
            engine.shutdown()


class _EngineCore:
    """Stands in for vLLM's engine core, which cannot start here (vLLM's compiled ``_C``
    is a CUDA build): ``collective_rpc`` runs the named Worker call on every worker
    process, with the kwargs vLLM's offline ``LLM`` passes."""

    def __init__(self, group: Workers) -> None:
        self.group = group
        self.version: str | None = None

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> None:
        import json

        kwargs = kwargs or {}
        if method == "init_weight_transfer_engine":
            self.group.init_info = json.dumps(kwargs["init_info"])
            self.group.call("init", self.group.init_info)
        elif method == "start_weight_update":
            self.group.call("start")
        elif method == "update_weights":
            self.group.call("update", json.dumps(kwargs["update_info"]))
        elif method == "finish_weight_update":
            self.group.call("finish")
        else:
            raise AssertionError(f"unexpected call {method}")

    def set_weight_version(self, version: str) -> None:
        self.version = version


def test_offline_llm_client_drives_vllms_offline_methods(workers) -> None:
    """``tv.LLMClient`` over vLLM's own offline weight-sync methods (``RLOfflineMixin``, what ``vllm.LLM`` inherits)."""
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    group, _ = workers

    class OfflineLLM(RLOfflineMixin):
        def __init__(self, core: _EngineCore) -> None:
            self.llm_engine = core

    core = _EngineCore(group)
    ckpt = checkpoint(SPEC, seed=13)
    engine = WeightTransferTrainerFactory.trainer_init(tv.TensorferryTrainerInitInfo(rank=0), client=tv.LLMClient(OfflineLLM(core)),
                                                       source=ModuleSource(module_of(ckpt)))
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    _check(group, ckpt, torch.float32)
