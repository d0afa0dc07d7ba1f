"""Tensor-parallel vLLM workers (TP=2 over gloo) and sharded trainer ranks.

vLLM's parallel layers are built on CPU in each worker process after
vLLM's parallel state is initialised over gloo; the engine hands them
whole checkpoint tensors and vLLM's weight loaders fuse and slice them.
Proves: each TP rank's fused (qkv, gate/up) and sliced (column, row,
vocabulary) parameters are exactly the checkpoint's, from a one-rank
trainer and from two FSDP2 trainer ranks on a gloo mesh, each putting only
its own shards (no rank gathers the model) while rank 0 drives the round.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

import _vllm_support

_vllm_support.skip_without_vllm()

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

from _vllm_model import Spec, checkpoint, expected_worker_params, module_of, perturb  # noqa: E402
from _vllm_workers import HttpFront, Workers, rendezvous_file  # noqa: E402

import tensorferry.vllm as tv  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SPEC = Spec()
TP = 2


@pytest.fixture(scope="module")
def tp_workers():
    group = Workers(SPEC, replicas=1, tp=TP)
    front = HttpFront(group)
    yield group, front
    front.close()
    group.close()


def _check_tp(group: Workers, ckpt: dict) -> None:
    for rank in range(TP):
        want = expected_worker_params(ckpt, SPEC, rank, TP, torch.float32)
        got = group.params(rank)
        assert sorted(got) == sorted(want)
        for name, (tensor, _) in got.items():
            assert tensor.shape == want[name].shape, f"TP rank {rank}: {name} {tuple(tensor.shape)}"
            assert torch.equal(tensor, want[name]), f"TP rank {rank}: {name} differs"


def test_one_trainer_to_tp2_workers_fuses_and_slices(tp_workers) -> None:
    group, front = tp_workers
    ckpt = checkpoint(SPEC, seed=21)
    model = module_of(ckpt)
    engine = WeightTransferTrainerFactory.trainer_init(tv.TensorferryTrainerInitInfo(rank=0), client=front.client(), source=ModuleSource(model))
    try:
        for r in range(2):
            perturb(ckpt, r, 0.05)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(ckpt[name])
            engine.send_weights()
            _check_tp(group, ckpt)
    finally:
        engine.shutdown()


def _trainer_rank(conn: Any, rank: int, world: int, rendezvous: str, url: str, transport: str, fanout: int | None, rounds: int) -> None:
    """One FSDP2 trainer rank: shards the model over a gloo mesh, updates its shards in place, sends."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from tensorferry.shards import local_box

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        ckpt = checkpoint(SPEC, seed=5)
        model = module_of(ckpt)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        info = tv.TensorferryTrainerInitInfo(rank=rank, world_size=world, transport=transport, fanout=fanout)
        client = HTTPVLLMWeightSyncClient(url, timeout=120)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        for r in range(rounds):
            perturb(ckpt, r, 0.05)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    local, _, offsets = local_box(p)
                    local.copy_(ckpt[name][tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))])
            engine.send_weights()
            report = engine.last_round
            conn.send(("ok", (report.nbytes, report.planned, report.bytes_sent)))
            conn.recv()  # the test has checked the workers
        engine.shutdown()
        conn.send(("ok", None))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("transport", "fanout"), [("shm", None), ("tcp", 1)])
def test_sharded_trainer_ranks_to_tp2_workers(tp_workers, transport: str, fanout: int | None) -> None:
    """shm: both workers read each rank's shards; tcp with fanout=1: each rank sends
    its shards once, and the second worker takes them from the first (a relay)."""
    group, front = tp_workers
    ctx = mp.get_context("spawn")
    rendezvous, rounds, world = rendezvous_file(), 2, 2
    pipes, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_trainer_rank, args=(child, rank, world, rendezvous, front.url, transport, fanout, rounds), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    full_nbytes = sum(t.numel() * 4 for t in checkpoint(SPEC).values())
    ckpt = checkpoint(SPEC, seed=5)
    try:
        for r in range(rounds):
            replies = []
            for pipe in pipes:
                assert pipe.poll(180), "a trainer rank did not finish its round"
                status, value = pipe.recv()
                assert status == "ok", value
                replies.append(value)
            perturb(ckpt, r, 0.05)
            _check_tp(group, ckpt)
            # each rank put its own shards: about half the model, never the whole
            assert all(nbytes < 0.6 * full_nbytes for nbytes, _, _ in replies), (replies, full_nbytes)
            assert sum(nbytes for nbytes, _, _ in replies) == full_nbytes
            assert [planned for _, planned, _ in replies] == [r == 0] * world
            if fanout is not None:
                # one copy of each rank's shards left the rank, for two workers
                assert all(nbytes <= sent < 1.2 * nbytes for nbytes, _, sent in replies), replies
            for pipe in pipes:
                pipe.send("next")
        for pipe in pipes:
            assert pipe.poll(60)
            status, value = pipe.recv()
            assert status == "ok", value
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
