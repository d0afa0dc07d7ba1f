"""bench_delta's ``sharded`` part: sharded deltas on one host.

Two source ranks (processes) hold row bands of ``COUNT`` bfloat16
matrices as ``tf.Box``es (the ``Shard(0)`` of FSDP); two worker processes
hold tensor-parallel slices (matrices alternately split by rows and by
columns: a worker's share is half the model; a column slice is part of
every source row). Each rank keeps two plans of the same tensors: a plain
kept plan (the full sharded sync, the peer) and a delta plan; each worker
keeps a ``ShardedPlan`` of each into targets of its own. Every round
changes ``fraction`` of every rank's elements in place (untimed), then
runs both syncs in an order rotated every round (round 0 a warm-up). A
sync is timed from the command to the ranks until both workers' gets
returned. After the last round each worker checks its delta targets
against its full-sync targets, bit for bit. Reported per fraction
(medians of the rounds): the delta sync's time against the full sync's,
and each worker's received bytes against its share.

With ``hosts`` (network namespaces, ``tests/_hosts.py``; root) every rank
and worker is on a host of its own, each link at the hosts' rate, over
tcp: the issue's target there is a 1% step in at most 0.15x the full
sharded sync. With ``replicas`` R > 1, R replicas of the two workers, and
both syncs relayed: ranks ``put(plan, fanout=1)``, workers are relaying
receivers (whole shares and delta records pass from replica to replica).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from typing import Any

from _common import MIB, log, med, rotated
from bench_sharded import enter_host

RANKS, WORKERS, COUNT = 2, 2, 8
NAMES = ("full", "delta")
TOKEN = "bench-sharded-delta"  # servers off loopback need one


def _slice(k: int, w: int, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Worker ``w``'s slice of matrix ``k``: (offsets, sizes); rows for even ``k``, columns for odd."""
    half = d // 2
    return ((w * half, 0), (half, d)) if k % 2 == 0 else ((0, w * half), (d, half))


def _source(rank: int, d: int, transport: str, cmds: Any, out: Any, where: Any, readers: int, fanout: int | None) -> None:
    try:
        here = enter_host(where)
        import torch

        import tensorferry as tf

        torch.set_num_threads(1)
        rows = d // RANKS
        g = torch.Generator().manual_seed(rank)
        sd = {f"w{k}": tf.Box(torch.randn(rows, d, generator=g).to(torch.bfloat16), (rank * rows, 0), (d, d)) for k in range(COUNT)}
        shard = COUNT * rows * d * 2
        with tf.Sender(transport, capacity_nbytes=4 * shard + 64 * MIB, host=here, token=TOKEN) as s:
            plans = {"full": s.plan(sd), "delta": s.plan(sd, delta=True)}
            out.put(("ready", rank, shard))
            live = None
            while (cmd := cmds.get()) is not None:
                if cmd[0] == "change":
                    _, fraction, seed = cmd
                    cg = torch.Generator().manual_seed(seed * 97 + rank)
                    for b in sd.values():
                        flat = b.tensor.view(-1)
                        idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * fraction)),), generator=cg)
                        flat[idx] = (flat[idx].float() + 1.0).to(torch.bfloat16)
                    out.put(("changed", rank, None))
                elif cmd[0] == "put":
                    live = s.put(plans[cmd[1]], readers=readers, fanout=fanout)
                    d_ = live.delta
                    out.put(("ticket", rank, (live.to_bytes(), d_.nbytes if d_ is not None and d_.base else None)))
                else:  # "release": the workers are done
                    s.wait_released(live, timeout=120)
                    out.put(("released", rank, None))
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def _worker(w: int, d: int, transport: str, cmds: Any, out: Any, where: Any, relay: bool) -> None:
    try:
        here = enter_host(where)
        me, w = w, w % WORKERS  # its number, and its rank in its replica
        import torch

        import tensorferry as tf

        torch.set_num_threads(1)
        targets = {name: {f"w{k}": tf.Box(torch.zeros(_slice(k, w, d)[1], dtype=torch.bfloat16), _slice(k, w, d)[0], (d, d)) for k in range(COUNT)}
                   for name in NAMES}
        share = sum(b.tensor.numel() * 2 for b in targets["full"].values())
        plans: dict[str, Any] = {}
        kw = {"relay": True, "host": here} if relay else {}
        with tf.Receiver(transport, timeout=120.0, token=TOKEN, **kw) as r:
            out.put(("ready", 100 + me, share))
            while (cmd := cmds.get()) is not None:
                if cmd[0] == "check":
                    same = all(torch.equal(targets["full"][k].tensor.view(torch.int16), targets["delta"][k].tensor.view(torch.int16))
                               for k in targets["full"])
                    out.put(("checked", 100 + me, same))
                    continue
                _, name, tickets = cmd
                tickets = [tf.Ticket.from_bytes(t) for t in tickets]
                if name not in plans:
                    plans[name] = r.plan(tickets, into=targets[name])
                before = r.bytes_received
                t0 = time.perf_counter()
                r.get(tickets, into=plans[name])
                out.put(("got", 100 + me, (time.perf_counter() - t0, r.bytes_received - before)))
    except BaseException:
        out.put(("error", 100 + me, traceback.format_exc()))


def _take(q: Any, kind: str, n: int) -> dict[int, Any]:
    got: dict[int, Any] = {}
    while len(got) < n:
        k, who, item = q.get(timeout=600)
        if k == "error":
            raise RuntimeError(f"process {who} failed:\n{item}")
        assert k == kind, (k, kind, item)
        got[who] = item
    return got


def sharded_part(size_mib: int, repeats: int, fractions: tuple[float, ...], transport: str, hosts: Any = None, replicas: int = 1) -> dict:
    """The part over ``transport`` (shm or tcp): ``size_mib`` of bf16 over
    the ranks; on ``hosts`` (a ``Hosts`` of RANKS + WORKERS * replicas) if
    given; ``replicas`` over 1: relayed (tcp)."""
    import math

    d = int(math.sqrt(size_mib * MIB / 2 / COUNT)) // 4 * 4
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    src_cmds = [ctx.Queue() for _ in range(RANKS)]
    workers = WORKERS * replicas
    wk_cmds = [ctx.Queue() for _ in range(workers)]
    where = [None] * (RANKS + workers) if hosts is None else [(hosts.namespace(i), hosts.address(i)) for i in range(RANKS + workers)]
    fanout = 1 if replicas > 1 else None
    procs = [ctx.Process(target=_source, args=(k, d, transport, src_cmds[k], out, where[k], workers, fanout), daemon=True) for k in range(RANKS)]
    procs += [ctx.Process(target=_worker, args=(w, d, transport, wk_cmds[w], out, where[RANKS + w], replicas > 1), daemon=True)
              for w in range(workers)]
    for p in procs:
        p.start()
    result: dict[str, Any] = {"transport": transport, "matrices": COUNT, "d": d, "nbytes": COUNT * d * d * 2, "fractions": {},
                              "hosts": repr(hosts) if hosts is not None else None, "replicas": replicas}
    where_name = f"{transport}{' hosts' if hosts is not None else ''}{f' x{replicas} relayed' if replicas > 1 else ''}"
    try:
        ready = _take(out, "ready", RANKS + workers)
        shares = [ready[100 + w] for w in range(workers)]

        def sync(name: str) -> dict:
            t0 = time.perf_counter()
            for q in src_cmds:
                q.put(("put", name))
            got = _take(out, "ticket", RANKS)
            tickets = [got[k][0] for k in range(RANKS)]
            for q in wk_cmds:
                q.put(("get", name, tickets))
            done = _take(out, "got", workers)
            seconds = time.perf_counter() - t0
            for q in src_cmds:
                q.put(("release",))
            _take(out, "released", RANKS)
            received = [done[100 + w][1] / shares[w] for w in range(workers)]
            delta = [got[k][1] for k in range(RANKS)]
            return {"seconds": seconds, "received_vs_share": received, "delta_nbytes": delta}

        for fraction in fractions:
            records: dict[str, list] = {n: [] for n in NAMES}
            for rnd in range(repeats + 1):
                for q in src_cmds:
                    q.put(("change", fraction, rnd + int(fraction * 1e6)))
                _take(out, "changed", RANKS)
                for i in rotated(len(NAMES), rnd):
                    rec = sync(NAMES[i])
                    if rnd:
                        records[NAMES[i]].append(rec)
            for q in wk_cmds:
                q.put(("check",))
            checked = _take(out, "checked", workers)
            assert all(checked.values()), f"a worker's delta targets differ from its full sync's: {checked}"
            full = med([r["seconds"] for r in records["full"]])
            delta = med([r["seconds"] for r in records["delta"]])
            per_round = [r["seconds"] / f["seconds"] for r, f in zip(records["delta"], records["full"])]
            worst_received = med([max(r["received_vs_share"]) for r in records["delta"]])
            result["fractions"][str(fraction)] = {
                "full_seconds": full, "delta_seconds": delta, "delta_vs_full": delta / full, "delta_vs_full_rounds": per_round,
                "received_vs_share": worst_received, "full_received_vs_share": med([max(r["received_vs_share"]) for r in records["full"]]),
                "delta_sent": [r["delta_nbytes"] for r in records["delta"]], "rounds": repeats,
            }
            log(f"sharded {where_name} {fraction:>5.1%} changed: full {full * 1e3:7.1f} ms, delta {delta * 1e3:7.1f} ms ({delta / full:.2f}x), "
                f"each worker received {worst_received:.3f}x its share (delta sent: {records['delta'][-1]['delta_nbytes']})")
    finally:
        for q in src_cmds + wk_cmds:
            q.put(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return result
