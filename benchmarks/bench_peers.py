"""Peers benchmark: what a user would do instead of tensorferry, the same
float32 data between two processes, against one libc memcpy measured in the
same run.

* a ``torch.multiprocessing`` queue of the tensors (fresh, not yet shared
  tensors each time: the queue moves them to shared memory, the receiver
  maps them), as 1 and as 10k views;
* ``torch.save`` of a state dict into a buffer, sent over a loopback socket
  (the one socket tuning of ``_common.tune``), ``torch.load`` on the other
  side, as 1, 10k and 100k tensors (100k costs about a minute a round trip
  at 1 GiB: one timed run, no warm-up).

Timed from the sender's first step to the receiver holding the tensors;
the last run of each is verified bit for bit; the receiver's peak RSS growth
is recorded. Run alone: ``.venv/bin/python benchmarks/bench_peers.py``
(``--quick``: 64 MiB). Writes ``benchmarks/results/bench_peers.json``.
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"

import gc
import io
import struct
import sys
import time
from typing import Any

from _common import MIB, environment, log, med, peak_rss, recv_exact, reset_peak_rss
from _harness import finish, limit_medians, out_path, run_in_pair, sizes, table, transfer_parser, verified_cell, \
    verified_target
from _pair import Peer, Workers, job, verify, views_of

QUEUE_COUNTS = (1, 10_000)
SAVE_COUNTS = (1, 10_000, 100_000)
LIMITS = ("memcpy_libc",)


@job
def tmpq(p: Peer, job: dict) -> dict:
    """A ``torch.multiprocessing`` queue of fresh tensors."""
    count, total = job["count"], job["warmup"] + job["repeats"]
    if p.sends:
        for _ in range(total):
            if p.recv() != "ready":
                raise RuntimeError("out of step with the receiver")
            fresh = p.data.clone()
            obj = views_of(fresh, count)
            gc.collect()
            p.queue.put((time.monotonic(), obj))
            if p.recv() != "done":  # the tensors live until the receiver is done with them
                raise RuntimeError("out of step with the receiver")
            del obj, fresh
        return {}
    ref = views_of(p.data, count)
    times, growths, problem = [], [], "not verified"
    for r in range(total):
        gc.collect()
        base = reset_peak_rss()
        p.send("ready")
        t0, obj = p.queue.get(timeout=600)
        times.append(time.monotonic() - t0)
        growths.append(peak_rss() - base)
        if r == total - 1:
            problem = verify(obj, ref)
        del obj
        p.send("done")
    w = job["warmup"]
    return {"seconds": times[w:], "receiver_rss_growth_nbytes": growths[w:], "verified": problem is None,
            "problem": problem}


@job
def tsave(p: Peer, job: dict) -> dict:
    """``torch.save`` into a buffer, a loopback socket, ``torch.load``."""
    import torch

    count, total = job["count"], job["warmup"] + job["repeats"]
    if p.sends:
        sock = p.connect_tuned()
        state = {f"layers.{i}.weight": v for i, v in enumerate(views_of(p.data, count))}
        for _ in range(total):
            if sock.recv(1) != b"G":
                raise ConnectionError("torch.save peer: the receiver went away")
            gc.collect()
            t0 = time.monotonic()
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getbuffer()
            sock.sendall(struct.pack("<dQ", t0, len(data)))
            sock.sendall(data)
            del data, buf
        sock.close()
        return {}
    ref = views_of(p.data, count)
    sock = p.accept_tuned()
    times, growths, problem = [], [], "not verified"
    for r in range(total):
        gc.collect()
        base = reset_peak_rss()
        sock.sendall(b"G")
        t0, n = struct.unpack("<dQ", recv_exact(sock, 16))
        data = bytearray(n)
        view = memoryview(data)
        got = 0
        while got < n:
            got += sock.recv_into(view[got:])
        del view
        state = torch.load(io.BytesIO(data), weights_only=True)
        times.append(time.monotonic() - t0)
        del data
        growths.append(peak_rss() - base)
        if r == total - 1:
            problem = verify(list(state.values()), ref)
        del state
    sock.close()
    w = job["warmup"]
    return {"seconds": times[w:], "receiver_rss_growth_nbytes": growths[w:], "verified": problem is None,
            "problem": problem}


def measure(w: Workers, doc: dict, repeats: int) -> None:
    for count in QUEUE_COUNTS:
        _, r = w.run({"job": "tmpq", "count": count, "warmup": 1, "repeats": repeats})
        doc["peers"].append({"peer": "torch.multiprocessing queue", "count": count, "kind": "views", **r})
        log(f"torch mp queue {count}: {med(r['seconds']):.3f} s verified {r['verified']}")
    for count in SAVE_COUNTS:
        slow = count == 100_000
        _, r = w.run({"job": "tsave", "count": count, "warmup": 0 if slow else 1, "repeats": 1 if slow else repeats},
                     timeout=900)
        doc["peers"].append({"peer": "torch.save/socket/torch.load", "count": count, "kind": "views", **r})
        log(f"torch.save {count}: {med(r['seconds']):.3f} s verified {r['verified']}")


def summarize(doc: dict, nbytes: int) -> dict[str, float | None]:
    """Each peer's median, GB/s and ratio against one libc memcpy (limit / peer)."""
    if not doc.get("peers"):
        return {}
    lim = limit_medians(doc["limits"], LIMITS).get("memcpy_libc")
    ratios: dict[str, float | None] = {}
    for p in doc["peers"]:
        p["median_seconds"] = med(p["seconds"])
        p["gbps"] = nbytes / p["median_seconds"] / 1e9
        if lim:
            p["vs_memcpy"] = lim / p["median_seconds"]
        ratios[f"peers:{p['peer']}:{p['count']} vs memcpy_libc"] = p.get("vs_memcpy")
    verified_target(doc, "every peer case verified bit-exact after timing",
                    [f"{p['peer']} {p['count']}: {p['problem']}" for p in doc["peers"] if not p.get("verified")])
    return ratios


def print_table(con: Any, doc: dict) -> None:
    if not doc["peers"]:
        return
    con.print(table("peers (what a user would otherwise do), the same bytes, separate processes",
                    ("peer", "tensors", "median ms", "GB/s", "vs memcpy", "rx RSS +MiB", "runs", "verified"),
                    ((p["peer"], f"{p['count']:,}", f"{p['median_seconds'] * 1e3:,.0f}", f"{p['gbps']:.2f}",
                      f"{p.get('vs_memcpy', float('nan')):.2f}x", f"{max(p['receiver_rss_growth_nbytes']) / MIB:,.1f}",
                      str(len(p["seconds"])), verified_cell(p)) for p in doc["peers"])))


def main() -> int:
    ap = transfer_parser(__doc__)
    args = ap.parse_args()
    nbytes, repeats, _ = sizes(args)
    doc: dict[str, Any] = {"limits": {}, "peers": [], "errors": []}
    env = environment(nbytes=nbytes, repeats=repeats, torch_threads=args.threads)
    run_in_pair(["bench_peers"], doc, env, nbytes, args.threads, lambda w: measure(w, doc, repeats),
                limits=LIMITS, limit_repeats=max(3, repeats))
    ratios = summarize(doc, nbytes)
    log(f"wrote {finish(doc, ratios, out_path(args, 'bench_peers'), nbytes, [print_table])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
