"""Processes of the DTensor suites (``test_sharded_dtensor.py``): source
ranks on a (2, 2) CPU mesh and worker ranks on a (2,) mesh, each group a
real gloo process group on loopback. Started with the ``spawn`` context;
they talk to the test through queues (tickets as bytes, results as data).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

SEED = 11
# name -> (global shape, source placements on the (2, 2) mesh, target
# placement on the (2,) mesh: "vocab" / "column" Shard(0), "row" Shard(1),
# "replicate"). Sizes are uneven on purpose.
TENSORS: dict[str, tuple[tuple[int, ...], tuple[str, str], str]] = {
    "embed.weight": ((11, 6), ("S0", "S1"), "S0"),  # vocab-parallel
    "q.weight": ((9, 5), ("S0", "R"), "S0"),  # column-parallel
    "o.weight": ((7, 10), ("R", "S0"), "S1"),  # row-parallel
    "mlp.up": ((5, 13), ("S1", "S0"), "S1"),
    "norm.weight": ((5,), ("R", "R"), "R"),  # replicated
    "step": ((), ("R", "R"), "R"),  # 0-d
}
TIED = ("lm_head.weight", "embed.weight")  # one DTensor under two names on both sides


def globals_(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, _, _) in TENSORS.items()}


def _placement(code: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if code == "R" else Shard(int(code[1:]))


def _init(rank: int, world: int, port: int, shape: tuple[int, ...]) -> Any:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["UCX_NET_DEVICES"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    return init_device_mesh("cpu", shape)


def source_main(rank: int, port: int, transports: tuple[str, ...], readers: int, out: Any, go: Any) -> None:
    """A trainer rank: sync 1 (planned), sync 2 after its shards changed in
    place, sync 3 cast to bf16; each put's ticket per transport to ``out``;
    waits for ``go`` between syncs (the workers have read)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    import tensorferry as tf

    try:
        mesh = _init(rank, 4, port, (2, 2))
        full = globals_()
        sd = {name: distribute_tensor(full[name], mesh, [_placement(p) for p in TENSORS[name][1]]) for name in TENSORS}
        sd[TIED[0]] = sd[TIED[1]]
        with tf.Sender(transports[0], extra_transports=transports[1:]) as s:
            plan = s.plan(sd)
            for sync in (1, 2):
                if sync == 2:
                    with torch.no_grad():
                        for name in TENSORS:
                            sd[name].to_local().add_(1)  # in place: the plan's memory
                t = s.put(plan, readers=readers)
                out.put((rank, sync, [s.ticket_for(t, tr).to_bytes() for tr in transports]))
                go.get()
            half = s.plan(sd, dtype=torch.bfloat16)
            t = s.put(half, readers=2)
            out.put((rank, 3, [t.to_bytes()]))
            go.get()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, -1, traceback.format_exc()))


def worker_main(rank: int, port: int, transports: tuple[str, ...], tickets: Any, out: Any) -> None:
    """An inference rank: a sharded target on its (2,) mesh, planned once per
    transport and replayed; every local shard checked against the global
    tensors' slices; what it received reported."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import tensorferry as tf

    def target(dtype: torch.dtype) -> dict[str, Any]:
        t = {}
        for name, (shape, _, where) in TENSORS.items():
            zeros = torch.zeros(shape, dtype=dtype)
            t[name] = zeros if name == "step" else distribute_tensor(zeros, mesh, [_placement(where)])
        t[TIED[0]] = t[TIED[1]]
        return t

    def check(t: dict[str, Any], want: dict[str, torch.Tensor]) -> list[str]:
        bad = []
        for name in [*TENSORS, TIED[0]]:
            x = t[name]
            if isinstance(x, torch.Tensor) and hasattr(x, "device_mesh"):
                shape, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
                expect = want[name.replace(*TIED)][tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
                got = x.to_local()
            else:
                expect, got = want[name], x
            if not torch.equal(got, expect):
                bad.append(name)
        return bad

    def errors(r: Any, first: dict, second: dict) -> dict[str, bool]:
        """Each mismatch is refused, named, before any byte moves."""
        from tensorferry import LayoutMismatchError

        def refused(tickets: list, into: Any, *needles: str) -> bool:
            try:
                r.get(tickets, into=into)
            except LayoutMismatchError as exc:
                return all(n in str(exc) for n in needles) and not any(
                    x.to_local().any() if hasattr(x, "to_local") else x.any() for x in into.values())
            return False

        wide = target(torch.float32)
        wide["q.weight"] = distribute_tensor(torch.zeros(9, 6), mesh, [_placement("S0")])
        half = target(torch.bfloat16)
        extra = target(torch.float32)
        extra["bias"] = torch.zeros(3)
        return {
            "global shape": refused([second[k][0] for k in sorted(second)], wide, "['q.weight']", "(9, 5)", "(9, 6)"),
            "dtype": refused([second[k][0] for k in sorted(second)], half, "float32", "torch.bfloat16"),
            "key on one side": refused([second[k][0] for k in sorted(second)], extra, "['bias'] is in the target"),
            # Worker 0's vocab rows are only on rank 0; worker 1's mlp.up columns 7:13, rows 3:5 only on rank 3.
            "uncovered": refused([second[k][0] for k in range(4) if k != (0 if rank == 0 else 3)], target(torch.float32), "no source holds region"),
            "mixed versions": refused([first[0][0]] + [second[k][0] for k in (1, 2, 3)], target(torch.float32), "different versions"),
        }

    try:
        mesh = _init(rank, 2, port, (2,))
        full = globals_()
        share = sum(v.to_local().numel() * 4 if hasattr(v, "to_local") else v.numel() * 4 for k, v in target(torch.float32).items() if k != TIED[0])
        report: dict[str, Any] = {"share": share, "bad": {}, "received": {}}
        with tf.Receiver() as r:
            _, by_rank = tickets.get()
            targets = {tr: target(torch.float32) for tr in transports}
            plans = {}
            for i, tr in enumerate(transports):
                mine = [by_rank[k][i] for k in sorted(by_rank)[::-1]]  # any order
                before = r.bytes_received
                plans[tr] = r.plan(mine, into=targets[tr])
                r.get(mine, into=plans[tr])
                report["received"][f"{tr}-1"] = r.bytes_received - before
                report["bad"][f"{tr}-1"] = check(targets[tr], full)
            out.put(("read", rank, 1))
            first = by_rank
            _, by_rank = tickets.get()
            report["errors"] = errors(r, first, by_rank)
            plus = {k: v + 1 for k, v in full.items()}
            for i, tr in enumerate(transports):
                r.get([by_rank[k][i] for k in sorted(by_rank)], into=plans[tr])
                report["bad"][f"{tr}-2"] = check(targets[tr], plus)
            out.put(("read", rank, 2))
            _, by_rank = tickets.get()
            half = target(torch.bfloat16)
            r.get([by_rank[k][0] for k in sorted(by_rank)], into=half)
            report["bad"]["bf16"] = check(half, {k: v.to(torch.bfloat16) for k, v in plus.items()})
        out.put(("report", rank, report))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def gpt2(seed: int = 0) -> Any:
    """A small GPT-2 from its config (random weights, nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=32, bos_token_id=0, eos_token_id=0))


def fsdp_source_main(rank: int, port: int, out: Any, go: Any) -> None:
    """A trainer rank of a GPT-2 sharded with FSDP2's ``fully_shard`` on a
    (2,) CPU mesh: its kept plan of the model's state dict, one put."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import tensorferry as tf

    try:
        mesh = _init(rank, 2, port, (2,))
        model = gpt2()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with tf.Sender("tcp") as s:
            t = s.put(s.plan(model.state_dict()), readers=2)
            out.put((rank, 1, [t.to_bytes()]))
            go.get()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, -1, traceback.format_exc()))


def fsdp_watch_main(rank: int, port: int, out: Any) -> None:
    """A trainer rank of an MLP sharded with ``fully_shard`` (the first
    layer kept unsharded between its forward and backward, the root as
    FSDP2 leaves it): real training steps with a put of a kept plan of the
    module between each forward and backward and after each optimizer
    step, each ticket's shards checked against the module's; then each way
    of replacing a parameter, each of which a put must refuse, with
    nothing sent. Reports what it saw as data."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import tensorferry as tf

    def shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.to_local().detach().clone() for k, v in model.state_dict().items()}

    def same(got: dict, want: dict) -> bool:
        return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    def refused(s: Any, plan: Any) -> str:
        before = (s.stats()["live_tickets"], s.stats()["transfers"])
        try:
            s.put(plan, readers=1)
        except tf.PlanStaleError as exc:
            after = (s.stats()["live_tickets"], s.stats()["transfers"])
            return str(exc) if after == before else f"refused, but a ticket was made: {before} -> {after}"
        return "not refused"

    def fresh(p: Any) -> torch.nn.Parameter:
        return torch.nn.Parameter(DTensor.from_local(p.to_local().detach().clone(), p.device_mesh, p.placements, run_check=False,
                                                             shape=p.shape, stride=p.stride()))

    try:
        mesh = _init(rank, 2, port, (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
        fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        report: dict[str, Any] = {"steps": [], "states": []}
        with tf.Sender("shm") as s, tf.Receiver("shm") as r:
            plan = s.plan(model)
            for step in range(3):
                x = torch.randn(4, 6)
                opt.zero_grad()
                before = shards(model)
                loss = model(x).square().mean()
                groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in m._get_fsdp_state()._fsdp_param_groups]
                report["states"].append([g.is_sharded for g in groups])
                mid = r.get(s.put(plan, readers=1))  # between the forward and the backward
                loss.backward()
                opt.step()
                after = r.get(s.put(plan, readers=1))
                report["steps"].append((same(mid, before), same(after, shards(model)), same(after, before)))
            # one parameter set to another DTensor Parameter (FSDP2 itself
            # would register its own again at the next forward)
            model[2].bias = fresh(model[2].bias)
            report["setattr"] = refused(s, plan)
            # load_state_dict(assign=True) with DTensors of other memory,
            # which FSDP2 adopts
            model.load_state_dict({k: fresh(v) for k, v in model.state_dict().items()}, assign=True)
            report["assign"] = refused(s, plan)
            plan = s.plan(model)
            report["replanned"] = same(r.get(s.put(plan, readers=1)), shards(model))
            # swapped in place: the same object, another local tensor
            torch.utils.swap_tensors(model[0].weight, fresh(model[0].weight))
            report["swapped"] = refused(s, plan)
            plan = s.plan(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(4, 6)).square().mean().backward()
                opt.step()
            report["after"] = same(r.get(s.put(plan, readers=1)), shards(model))
            # A torch whose FSDP2 groups cannot be read: the slots that hold
            # a DTensor now are checked (FSDP2's unsharded ones are plain).
            from tensorferry.plans import _watch

            _watch._fsdp_groups = lambda module: []
            plan = s.plan(model)
            opt.zero_grad()
            loss = model(torch.randn(4, 6)).square().mean()
            mid = same(r.get(s.put(plan, readers=1)), shards(model))
            loss.backward()
            opt.step()
            report["unread"] = (mid, same(r.get(s.put(plan, readers=1)), shards(model)))
            model[2].bias = fresh(model[2].bias)
            report["unread_setattr"] = refused(s, plan)
        out.put(("report", rank, report))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


DELTA_SHAPES = {"wq": (512, 768), "w2": (301, 700), "bias": (300,)}  # Shard(0) on 2 ranks; uneven rows


def delta_source_main(rank: int, port: int, transport: str, fractions: list[float], readers: int, out: Any, go: Any) -> None:
    """A trainer rank of row-sharded (FSDP-like) DTensors: a bfloat16 delta
    plan, and a put after each step, which changes ``fraction`` of the
    rank's elements in place; each ticket and the local shards as sent
    (bf16 bits, with their row offsets) to ``out``; waits on ``go``."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    import tensorferry as tf

    try:
        mesh = _init(rank, 2, port, (2,))
        g = torch.Generator().manual_seed(SEED)
        sd = {name: distribute_tensor(torch.randn(shape, generator=g), mesh, [Shard(0)]) for name, shape in DELTA_SHAPES.items()}
        mine = torch.Generator().manual_seed(SEED + 1 + rank)
        with tf.Sender(transport) as s:
            plan = s.plan(sd, dtype=torch.bfloat16, delta=True)
            for step, fraction in enumerate(fractions):
                with torch.no_grad():
                    for v in sd.values():
                        flat = v.to_local().view(-1)
                        n = int(flat.numel() * fraction)
                        if n:
                            flat[torch.randint(0, flat.numel(), (n,), generator=mine)] += 1.0
                t = s.put(plan, readers=readers)
                shards = {}
                for name, v in sd.items():
                    _, offsets = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
                    shards[name] = (int(offsets[0]), v.to_local().to(torch.bfloat16).view(torch.int16).numpy().copy())
                out.put((rank, step, t.to_bytes(), shards))
                go.get()
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, -1, traceback.format_exc()))
