"""Sharded weight sync: FSDP-style trainer ranks to tensor-parallel workers.

A model of ``--nbytes`` fp32 (default 1 GiB: ``--tensors`` square
matrices) is held by 4 source ranks as DTensors, ``Shard(0)`` on a (4,)
gloo CPU mesh; 2 worker processes hold tensor-parallel slices of it
(matrices alternately column-parallel, rows split in two, and
row-parallel, columns split in two: a worker's share is half the model),
as :class:`tensorferry.Box` targets. Four ways to sync, interleaved
(every round runs each once, the order rotated), each timed from the
command to the sources until both workers hold their slices:

* ``sharded``: every source ``put(plan)`` of its shards; each worker
  ``get(tickets, into=sharded_plan)``: it reads only its slices' bytes,
  from the ranks that hold them, all at once;
* ``unsharded``: the peer of the same bytes per worker: rank 0 alone holds
  a plain object of one worker's share, ``put(plan)``; each worker
  ``get(ticket, into=recv_plan)`` into the same target tensors (both
  workers read the one object: half the bytes packed);
* ``unsharded-own``: the peer of the same bytes per worker and in all:
  rank ``w`` holds a plain object of worker ``w``'s own share (ranks 0
  and 1), ``put(plan)``; each worker gets its own into its targets (the
  whole model packed, as in ``sharded``);
* ``gather``: the naive way: every rank ``full_tensor()`` (an all-gather),
  rank 0 ``put``s the whole model, each worker gets it whole and copies
  its slices out.

``--replicas R`` (R > 1): R replicas of the 2 workers (serving replicas
of one tensor-parallel group: the replicas of a worker rank hold the same
slices), and a fourth sync:

* ``relayed``: every source ``put(plan, fanout=--fanout)``; each worker,
  a relaying receiver, reads its slices from the sources or from a
  replica of its rank that already has them (each rank's link carries
  each distinct slice set ``fanout`` times instead of ``R``).

``--snapshot false``: the planned puts (``sharded``, ``relayed``,
``unsharded``, ``unsharded-own``) are ``snapshot=False``: nothing is packed, the workers read
the sources' tensors (shm, tcp).

Reported as ratios of the same run (medians): each worker's received bytes
against its share (target 1.00x) and each source's sent bytes;
``sharded`` against ``unsharded-own`` (target at most 1.3x; against
``unsharded`` too); ``gather``
against ``sharded`` (time; target at least 3x on hosts with their own
links) and rank 0's peak RSS growth in each (target: no more than its
shards plus its pool). Transport tcp by default (``--transport``).

``--hosts``: every rank and worker on a host of its own (a network
namespace on a bridge, ``tests/_hosts.py``, each link ``--rate`` both
ways; run as root): each process enters its host's namespace first thing
(``setns``; the queues to the controller are pipes, which cross
namespaces), gloo and tensorferry then use the host's address. Adds the
sync's time against each worker's share over its link rate (target at
most 1.3x). Every namespace is removed on exit, also on failure.

Run: ``.venv/bin/python benchmarks/bench_sharded.py`` (``--nbytes 64``:
MiB, for a loaded machine; ``--hosts --nbytes 256``). Writes
``benchmarks/results/bench_sharded.json`` (``bench_sharded_hosts.json``).
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import argparse
import ctypes
import math
import resource
import multiprocessing as mp
import socket
import time
import traceback
from typing import Any

from _common import MIB, environment, interleaved, log, med, reset_peak_rss, results_dir, status_nbytes, write_result

SOURCES, WORKERS = 4, 2  # workers: tensor-parallel ranks of one replica
TARGET_BYTES_VS_SHARE = 1.0
TARGET_SHARDED_VS_UNSHARDED = 1.3
TARGET_GATHER_VS_SHARDED = 3.0
TARGET_SHARDED_VS_LINK = 1.3
TOKEN = "bench-sharded-token"  # servers off loopback need one (16 bytes at least)
_CLONE_NEWNET = 0x40000000


def enter_host(where: tuple[str, str] | None) -> str:
    """Move this (still single-threaded) process into host ``(namespace,
    address)``; returns the address to listen on (loopback without hosts)."""
    if where is None:
        return "127.0.0.1"
    name, address = where
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    return address


def values(k: int, rows: slice, cols: slice, d: int) -> Any:
    """Global matrix ``k``'s block ``[rows, cols]``: element (i, j) is
    ``(k * 7919 + i * d + j) % 1000003`` (any block is made without the rest)."""
    import torch

    i = torch.arange(rows.start, rows.stop, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(cols.start, cols.stop, dtype=torch.int64).unsqueeze(0)
    return ((k * 7919 + i * d + j) % 1000003).to(torch.float32)


def worker_box(k: int, w: int, d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Worker ``w``'s slice of matrix ``k``: (offsets, sizes)."""
    half = d // 2
    return ((w * half, 0), (half, d)) if k % 2 == 0 else ((0, w * half), (d, half))


def source_main(rank: int, port: int, d: int, count: int, transport: str, cmds: Any, out: Any, where: Any, master: str, readers: int,
                fanout: int, snapshot: bool) -> None:
    try:
        here = enter_host(where)
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        import tensorferry as tf

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=SOURCES, init_method=f"tcp://{master}:{port}")
        mesh = init_device_mesh("cpu", (SOURCES,))
        rows = d // SOURCES
        sd = {f"w{k}": DTensor.from_local(values(k, slice(rank * rows, (rank + 1) * rows), slice(0, d), d), mesh, [Shard(0)], run_check=False)
              for k in range(count)}
        shard_nbytes = count * rows * d * 4
        # Ranks 0 and 1: worker ``rank``'s share as a plain object (the unsharded peers).
        share = {f"w{k}": values(k, *(slice(o, o + n) for o, n in zip(*worker_box(k, rank, d))), d) for k in range(count)} if rank < WORKERS else None
        full_nbytes = count * d * d * 4
        # Pools: this rank's shards (sharded), plus a worker's share (ranks 0
        # and 1: the unsharded peers), plus the whole model (rank 0's
        # gather); apart so each sync's memory is its own.
        kw = {"host": here, "token": TOKEN}
        s = tf.Sender(transport, capacity_nbytes=shard_nbytes + MIB, **kw)
        peer = tf.Sender(transport, capacity_nbytes=full_nbytes // 2 + MIB, **kw) if rank < WORKERS else None
        whole = tf.Sender(transport, capacity_nbytes=full_nbytes + MIB, **kw) if rank == 0 else None
        plan = s.plan(sd)
        peer_plan = peer.plan(share) if peer is not None else None
        # What the trainer holds before any sync: its shards, plans, libraries.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        baseline = status_nbytes("VmRSS")
        out.put(("ready", rank, None))
        while True:
            cmd = cmds.get()
            if cmd is None:
                break
            base = reset_peak_rss()
            t0 = time.perf_counter()
            sent0 = {n: x.stats()["bytes_sent"] for n, x in (("s", s), ("peer", peer), ("whole", whole)) if x is not None}
            if cmd in ("sharded", "relayed"):
                ticket = s.put(plan, readers=readers, snapshot=snapshot, fanout=fanout if cmd == "relayed" else None).to_bytes()
            elif cmd == "unsharded":
                ticket = peer.put(peer_plan, readers=readers, snapshot=snapshot).to_bytes() if rank == 0 else None
            elif cmd == "unsharded-own":  # read by the replicas of worker rank `rank`
                ticket = peer.put(peer_plan, readers=readers // WORKERS, snapshot=snapshot).to_bytes() if rank < WORKERS else None
            else:
                full = {k: v.full_tensor() for k, v in sd.items()}
                ticket = whole.put(full, readers=readers).to_bytes() if rank == 0 else None
            put_seconds = time.perf_counter() - t0
            out.put(("ticket", rank, ticket))
            done = cmds.get()  # the workers are done
            assert done == "done"
            if cmd == "gather":
                del full
            peak = status_nbytes("VmHWM")
            # Freed memory back to the system, so the next mode's baseline
            # is not this one's leftovers (glibc keeps freed heap otherwise).
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            sent = sum(x.stats()["bytes_sent"] for n, x in (("s", s), ("peer", peer), ("whole", whole)) if x is not None) - sum(sent0.values())
            out.put(("stats", rank, {"peak_growth_nbytes": peak - base, "peak_nbytes": peak, "over_baseline_nbytes": peak - baseline, "sent_nbytes": sent, "put_seconds": put_seconds,
                                     "shard_nbytes": shard_nbytes}))
        for x in (s, peer, whole):
            if x is not None:
                x.close()
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def worker_main(w: int, d: int, count: int, transport: str, cmds: Any, out: Any, where: Any) -> None:
    try:
        here = enter_host(where)
        import torch

        import tensorferry as tf

        torch.set_num_threads(1)
        tp = w % WORKERS  # its rank in its replica
        boxes = {f"w{k}": tf.Box(torch.zeros(worker_box(k, tp, d)[1]), worker_box(k, tp, d)[0], (d, d)) for k in range(count)}
        share = sum(b.tensor.numel() * 4 for b in boxes.values())
        r = tf.Receiver(transport, token=TOKEN)
        # The relayed sync's receiver passes on what it receives (listening on its host's address).
        relay = tf.Receiver(transport, token=TOKEN, relay=True, host=here) if transport != "shm" else None
        whole = {k: b.tensor for k, b in boxes.items()}  # the unsharded peers' targets: the same memory
        plans: dict[str, Any] = {}  # each planned sync's plan, made on its first round
        out.put(("ready", 100 + w, None))  # apart from the source ranks' numbers
        while True:
            cmd = cmds.get()
            if cmd is None:
                break
            mode, tickets = cmd
            before = r.bytes_received + (relay.bytes_received if relay is not None else 0)
            relayed_before = _from_relays(relay)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            if mode != "gather":
                receiver = relay if mode == "relayed" else r
                if mode in ("sharded", "relayed"):
                    ticket, into = tickets, boxes
                else:  # unsharded: worker 0's share, read by every worker; unsharded-own: this worker's own
                    ticket, into = tickets[tp if mode == "unsharded-own" else 0], whole
                if mode not in plans:
                    plans[mode] = receiver.plan(ticket, into=into)
                receiver.get(ticket, into=plans[mode])
            else:
                got = r.get(tickets[0])
                for k, b in boxes.items():
                    (o0, o1), (n0, n1) = b.offsets, b.tensor.shape
                    b.tensor.copy_(got[k][o0 : o0 + n0, o1 : o1 + n1])
                del got
            seconds = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults  # page faults of the get (all threads)
            end = time.monotonic()  # one clock for every process of the host: the sync's end
            received = r.bytes_received + (relay.bytes_received if relay is not None else 0) - before
            out.put(("got", w, {"received_nbytes": received, "share_nbytes": share, "seconds": seconds, "end": end,
                                "faults": faults, "from_relays_nbytes": _from_relays(relay) - relayed_before}))
            # The values are checked once every worker's get returned: a
            # check (hundreds of ms of CPU) must not slow the gets still running.
            assert cmds.get() == "check"
            ok = None
            if mode != "unsharded":  # its bytes are worker 0's share for both: not this worker's slices
                ok = all(torch.equal(b.tensor, values(int(k[1:]), *(slice(o, o + n) for o, n in zip(b.offsets, b.tensor.shape)), d))
                         for k, b in boxes.items())
                for b in boxes.values():
                    b.tensor.zero_()
            out.put(("checked", w, ok))
        r.close()
        if relay is not None:
            relay.close()
    except BaseException:
        out.put(("error", w, traceback.format_exc()))


def _from_relays(r: Any) -> int:
    """Bytes receiver ``r`` took from relays, any way (0: none, or no receiver)."""
    if r is None:
        return 0
    s = r.stats()
    return s["relay_memory_read_nbytes"] + s["relay_stream_nbytes"] + s["relay_nixl_read_nbytes"]


def _take(q: Any, kind: str, n: int, timeout: float = 600.0) -> dict[int, Any]:
    got: dict[int, Any] = {}
    while len(got) < n:
        k, who, item = q.get(timeout=timeout)
        if k == "error":
            raise RuntimeError(f"rank {who} failed:\n{item}")
        assert k == kind, (k, kind)
        got[who] = item
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nbytes", type=int, default=1024, help="model size in MiB (fp32)")
    ap.add_argument("--tensors", type=int, default=16, help="square matrices in the model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmups", type=int, default=1)
    ap.add_argument("--transport", default="tcp", choices=("shm", "tcp", "nixl"))
    ap.add_argument("--hosts", action="store_true", help="a network-namespace host per rank and worker (root)")
    ap.add_argument("--rate", default="1gbit", help="with --hosts: every link's rate, as tc writes it")
    ap.add_argument("--replicas", type=int, default=1, help="replicas of the 2 tensor-parallel workers (over 1: adds the relayed sync)")
    ap.add_argument("--fanout", type=int, default=1, help="the relayed sync's put(fanout=)")
    ap.add_argument("--snapshot", default="true", choices=("true", "false"), help="the planned puts' snapshot=")
    ap.add_argument("--modes", default="", help="only these syncs, comma-separated (ratios that need others are left out)")
    args = ap.parse_args()
    if args.replicas > 1 and args.transport == "shm":
        ap.error("--replicas needs a transport that relays (tcp or nixl)")
    if args.hosts:
        from _harness import namespace_hosts

        with namespace_hosts()[0].Hosts(SOURCES + WORKERS * args.replicas, rate=args.rate) as hosts:
            run_all(args, hosts)
    else:
        run_all(args, None)


def run_all(args: Any, hosts: Any) -> None:
    # Side a multiple of 8 (4 source rows, 2 worker halves) within the size.
    d = int(math.sqrt(args.nbytes * MIB / 4 / args.tensors)) // 8 * 8
    count = args.tensors
    total = count * d * d * 4
    workers = WORKERS * args.replicas
    modes = ("sharded", "unsharded", "unsharded-own", "gather") + (("relayed",) if args.replicas > 1 else ())
    if args.modes:
        modes = tuple(m for m in modes if m in args.modes.split(","))
    snapshot = args.snapshot == "true"
    log(f"{count} matrices of {d} x {d} fp32: {total / MIB:.0f} MiB on {SOURCES} ranks (Shard(0)) to {args.replicas} x {WORKERS} TP workers, "
        f"{args.transport}, snapshot={snapshot}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    src_cmds = [ctx.Queue() for _ in range(SOURCES)]
    wrk_cmds = [ctx.Queue() for _ in range(workers)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    where = [None] * (SOURCES + workers) if hosts is None else [(hosts.namespace(i), hosts.address(i)) for i in range(SOURCES + workers)]
    master = "127.0.0.1" if hosts is None else hosts.address(0)
    procs = [ctx.Process(target=source_main, args=(k, port, d, count, args.transport, src_cmds[k], out, where[k], master, workers, args.fanout, snapshot))
             for k in range(SOURCES)]
    procs += [ctx.Process(target=worker_main, args=(w, d, count, args.transport, wrk_cmds[w], out, where[SOURCES + w])) for w in range(workers)]
    for p in procs:
        p.start()
    try:
        _take(out, "ready", SOURCES + workers)

        def run(i: int, _round: int) -> dict:
            mode = modes[i]
            t0 = time.monotonic()
            for q in src_cmds:
                q.put(mode)
            tickets = _take(out, "ticket", SOURCES)
            listed = [tickets[k] for k in range(SOURCES) if tickets[k] is not None]
            for q in wrk_cmds:
                q.put((mode, listed))
            got = _take(out, "got", workers)
            # Until the last worker's get returned (the check of the values after is not timed).
            seconds = max(g["end"] for g in got.values()) - t0
            for q in wrk_cmds:
                q.put("check")
            for w, ok in _take(out, "checked", workers).items():
                got[w]["ok"] = ok
            for q in src_cmds:
                q.put("done")
            stats = _take(out, "stats", SOURCES)
            return {"seconds": seconds, "workers": got, "sources": stats}

        runs = interleaved(len(modes), args.warmups, args.repeats, run)
    finally:
        for q in src_cmds + wrk_cmds:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    res: dict[str, Any] = {}
    for mode, r in zip(modes, runs):
        recs = r["records"]
        res[mode] = {
            "seconds_median": med([x["seconds"] for x in recs]),
            "worker_received_vs_share": [med([x["workers"][w]["received_nbytes"] / x["workers"][w]["share_nbytes"] for x in recs]) for w in range(workers)],
            "worker_from_relays_vs_share": [med([x["workers"][w]["from_relays_nbytes"] / x["workers"][w]["share_nbytes"] for x in recs])
                                            for w in range(workers)],
            "source_sent_nbytes": [med([x["sources"][k]["sent_nbytes"] for x in recs]) for k in range(SOURCES)],
            "rank0_peak_growth_nbytes": med([x["sources"][0]["peak_growth_nbytes"] for x in recs]),
            "rank0_peak_rss_nbytes": med([x["sources"][0]["peak_nbytes"] for x in recs]),
            "max_rank_peak_rss_nbytes": med([max(x["sources"][k]["peak_nbytes"] for k in range(SOURCES)) for x in recs]),
            "rank0_over_baseline_nbytes": med([x["sources"][0]["over_baseline_nbytes"] for x in recs]),
            # Ranks 2 and 3 hold only their shards' sender (ranks 0 and 1 also the unsharded peers' pools).
            "other_ranks_over_baseline_nbytes": med([max(x["sources"][k]["over_baseline_nbytes"] for k in range(WORKERS, SOURCES)) for x in recs]),
            "max_rank_peak_growth_nbytes": med([max(x["sources"][k]["peak_growth_nbytes"] for k in range(SOURCES)) for x in recs]),
            "verified": all(x["workers"][w]["ok"] is not False for x in recs for w in range(workers)),
            "first_seconds": r["first"]["seconds"],
            "worker_get_seconds_median": med([max(x["workers"][w]["seconds"] for w in range(workers)) for x in recs]),
            # Minor page faults during a worker's get (its mappings of the sources' pools, its targets).
            "worker_get_faults_median": med([max(x["workers"][w]["faults"] for w in range(workers)) for x in recs]),
            "source_put_seconds_median": med([max(x["sources"][k]["put_seconds"] for k in range(SOURCES)) for x in recs]),
        }
    shard_nbytes = runs[0]["records"][0]["sources"][0]["shard_nbytes"]
    share = runs[0]["records"][0]["workers"][0]["share_nbytes"]
    sec = {m: x["seconds_median"] for m, x in res.items()}
    ratios: dict[str, float] = {}

    def ratio(name: str, needs: tuple[str, ...], value: Any) -> None:
        """``ratios[name] = value()`` where every mode it needs ran (``--modes``)."""
        if all(m in res for m in needs):
            ratios[name] = value()

    ratio("sharded_worker_bytes_vs_share", ("sharded",), lambda: max(res["sharded"]["worker_received_vs_share"]))
    ratio("sharded_vs_unsharded_time", ("sharded", "unsharded"), lambda: sec["sharded"] / sec["unsharded"])
    # Against the peer that packs and moves the same bytes in all (each worker its own share, from a rank of its own).
    ratio("sharded_vs_unsharded_own_time", ("sharded", "unsharded-own"), lambda: sec["sharded"] / sec["unsharded-own"])
    ratio("gather_vs_sharded_time", ("sharded", "gather"), lambda: sec["gather"] / sec["sharded"])
    # Memory beyond what a trainer holds before syncing: rank 0 of a gather
    # (the whole model, its pool) against any rank of a sharded sync (its pool).
    ratio("gather_rank0_vs_sharded_rank_over_baseline", ("sharded", "gather"),
          lambda: res["gather"]["rank0_over_baseline_nbytes"] / res["sharded"]["other_ranks_over_baseline_nbytes"])
    ratio("sharded_rank_over_baseline_vs_shard", ("sharded",), lambda: res["sharded"]["other_ranks_over_baseline_nbytes"] / shard_nbytes)
    # What each source's link carried, against its shard: R x without relays (tcp counts what a sender sent itself).
    ratio("sharded_source_sent_vs_shard", ("sharded",), lambda: max(res["sharded"]["source_sent_nbytes"]) / shard_nbytes)
    # The two halves of a sync apart: the workers' gets (the same bytes a
    # worker) and, with snapshot=True, the rate the sources pack at (the
    # sharded sync packs the whole model over its ranks, the unsharded one a
    # worker's share on one rank: twice the bytes, at the same rate where
    # memory bandwidth is the limit).
    ratio("sharded_vs_unsharded_get_time", ("sharded", "unsharded"),
          lambda: res["sharded"]["worker_get_seconds_median"] / res["unsharded"]["worker_get_seconds_median"])
    if snapshot:
        ratio("sharded_vs_unsharded_pack_rate", ("sharded", "unsharded"),
              lambda: (SOURCES * shard_nbytes / res["sharded"]["source_put_seconds_median"]) / (share / res["unsharded"]["source_put_seconds_median"]))
    ratio("relayed_source_sent_vs_shard", ("relayed",), lambda: max(res["relayed"]["source_sent_nbytes"]) / shard_nbytes)
    ratio("relayed_vs_sharded_time", ("relayed", "sharded"), lambda: sec["relayed"] / sec["sharded"])
    ratio("relayed_worker_bytes_vs_share", ("relayed",), lambda: max(res["relayed"]["worker_received_vs_share"]))
    if hosts is not None:
        link = share / hosts.rate_bytes_per_second
        ratio("sharded_vs_worker_link", ("sharded",), lambda: sec["sharded"] / link)
        ratio("relayed_vs_worker_link", ("relayed",), lambda: sec["relayed"] / link)
    print(f"\n{'mode':<13} {'median s':>9} {'worker get s':>12} {'get faults':>10} {'worker bytes/share':>20} "
          f"{'rank0 / ranks 2-3 over baseline MiB':>36} {'sent per source MiB':>22} {'from relays/share':>18} ok")
    for mode in modes:
        x = res[mode]
        print(f"{mode:<13} {x['seconds_median']:>9.3f} {x['worker_get_seconds_median']:>12.3f} {x['worker_get_faults_median']:>10.0f} {' '.join(f'{v:.2f}' for v in x['worker_received_vs_share']):>20} "
              f"{x['rank0_over_baseline_nbytes'] / MIB:>22.0f} / {x['other_ranks_over_baseline_nbytes'] / MIB:<9.0f} "
              f"{' '.join(f'{v / MIB:.0f}' for v in x['source_sent_nbytes']):>22} "
              f"{' '.join(f'{v:.1f}' for v in x['worker_from_relays_vs_share']):>18} {x['verified']}")
    print(f"\nshard per rank {shard_nbytes / MIB:.0f} MiB; targets: bytes/share {TARGET_BYTES_VS_SHARE}, sharded/unsharded-own <= {TARGET_SHARDED_VS_UNSHARDED}, "
          f"gather/sharded >= {TARGET_GATHER_VS_SHARDED} (on hosts with their own links)")
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}")
    doc = {"benchmark": "bench_sharded", "environment": environment(), "args": vars(args), "model_nbytes": total, "side": d,
           "hosts": "one host (loopback)" if hosts is None else f"{SOURCES + workers} namespace hosts, links {hosts.rate} both ways",
           "results": res}
    name = "bench_sharded" + ("" if hosts is None else "_hosts") + (f"_r{args.replicas}" if args.replicas > 1 else "") + ("" if snapshot else "_nosnap")
    path = write_result(results_dir() / f"{name}.json", doc, ratios)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
