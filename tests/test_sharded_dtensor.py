"""DTensor trainers to DTensor workers, with real process groups: 4 source
ranks on a (2, 2) gloo CPU mesh (mixed Shard/Replicate placements, uneven
sizes, tied embeddings, a 0-d tensor) to 2 worker ranks on a (2,) mesh
(vocab-, column-, row-parallel and replicated targets), over every
transport; a second sync after the sources changed their shards in place
replays the plans; a third casts to bf16. Workers' processes in
``_sharded_workers.py``."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _sharded_workers as W  # noqa: E402

pytest.importorskip("torch.distributed")

_TIMEOUT_SECONDS = 240.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _take(q, deadline: float):
    item = q.get(timeout=max(deadline - time.monotonic(), 0.1))
    if item[1] == -1 or item[0] == "error":
        raise AssertionError(f"a rank failed:\n{item[2]}")
    return item


def test_dtensor_sources_to_dtensor_workers_every_transport():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["UCX_NET_DEVICES"] = "lo"
    transports = ("tcp", "shm") + (("nixl",) if importlib.util.find_spec("nixl") else ())
    ctx = mp.get_context("spawn")
    out, results = ctx.Queue(), ctx.Queue()
    gos = [ctx.Queue() for _ in range(4)]
    to_workers = [ctx.Queue() for _ in range(2)]
    src_port, dst_port = _port(), _port()
    procs = [ctx.Process(target=W.source_main, args=(k, src_port, transports, 2 * len(transports), out, gos[k])) for k in range(4)]
    procs += [ctx.Process(target=W.worker_main, args=(k, dst_port, transports, to_workers[k], results)) for k in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    reports = {}
    try:
        for sync in (1, 2, 3):
            by_rank = {}
            while len(by_rank) < 4:
                rank, got_sync, tickets = _take(out, deadline)
                assert got_sync == sync
                by_rank[rank] = tickets
            for q in to_workers:
                q.put((sync, by_rank))
            if sync < 3:
                for _ in range(2):
                    _take(results, deadline)
            else:
                while len(reports) < 2:
                    kind, rank, report = _take(results, deadline)
                    if kind == "report":
                        reports[rank] = report
            for q in gos:
                q.put(True)
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
            assert p.exitcode == 0
    except queue.Empty:
        pytest.fail("the ranks did not finish in time")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for rank, report in reports.items():
        assert report["bad"] == {k: [] for k in report["bad"]}, f"worker {rank}: wrong shards {report['bad']}"
        assert set(report["bad"]) == {f"{tr}-{n}" for tr in transports for n in (1, 2)} | {"bf16"}
        # Each worker received exactly its own shards' bytes (the tied
        # embedding once), over every transport.
        for tr in transports:
            assert report["received"][f"{tr}-1"] == report["share"], (rank, tr, report)
