"""Peers benchmark: what a user would do instead of tensorferry, the same
float32 data between two processes, against one libc memcpy measured in the
same run.

* a ``torch.multiprocessing`` queue of the tensors (fresh, not yet shared
  tensors each time: the queue moves them to shared memory, the receiver
  maps them), as 1 and as 10k views;
* ``torch.save`` of a state dict into a buffer, sent over a loopback socket
  (the one socket tuning of ``_common.tune``), ``torch.load`` on the other
  side, as 1, 10k and 100k tensors (100k costs about a minute a round trip
  at 1 GiB: one timed run, no warm-up);
* Mooncake's transfer engine (``mooncake-transfer-engine-non-cuda``: its
  Python ``TransferEngine``, tcp, loopback, a P2P handshake), the peer
  checkpoint-engine uses for host-to-host moves: the receiver registers
  one destination buffer (once, outside the timing, as a user keeps it)
  and reads the sender's registered tensors one-sided, as 100 and 10k
  segments (``batch_transfer_sync_read`` in batches of at most
  ``MOONCAKE_BATCH`` segments: one batch of 10k fails over tcp with "TCP
  lane queue-full") and as one contiguous read of the same bytes
  (``transfer_sync_read``). Skipped, with the reason in the JSON, where
  its wheel does not import (it needs the system's ``libibverbs.so.1``).

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
MOONCAKE_COUNTS = (100, 10_000)
# Segments per batch_transfer_sync_read: 10k in one fail over tcp ("TCP
# lane queue-full"); 1,000 go through.
MOONCAKE_BATCH = 1000
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


def mooncake_missing() -> str | None:
    """Why Mooncake's engine cannot be used here, or None."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # an ImportError, or an OSError of a missing libibverbs.so.1
        return f"mooncake.engine does not import ({type(exc).__name__}: {exc}); pip install mooncake-transfer-engine-non-cuda (needs libibverbs.so.1)"
    return None


def _mooncake_engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake TransferEngine.initialize(127.0.0.1, P2PHANDSHAKE, tcp) failed")
    return engine


@job
def mooncake(p: Peer, job: dict) -> dict:
    """Mooncake's transfer engine: the receiver reads the sender's
    registered tensors one-sided into its registered buffer, as
    ``count`` segments (``job["contiguous"]``: one read of the same bytes)."""
    import torch

    count, total = job["count"], job["warmup"] + job["repeats"]
    engine = _mooncake_engine()
    if p.sends:
        src = p.data.view(torch.uint8)
        if engine.register_memory(src.data_ptr(), src.numel()) != 0:
            raise RuntimeError("Mooncake register_memory of the sender's tensors failed")
        p.send((f"127.0.0.1:{engine.get_rpc_port()}", src.data_ptr()))
        if p.recv() != "done":
            raise RuntimeError("out of step with the receiver")
        engine.unregister_memory(src.data_ptr())
        return {}
    peer, base = p.recv()
    ref = views_of(p.data, count)
    dest = torch.empty_like(p.data)
    here = dest.view(torch.uint8)
    if engine.register_memory(here.data_ptr(), here.numel()) != 0:
        raise RuntimeError("Mooncake register_memory of the receiver's buffer failed")
    got = views_of(dest, count)
    offsets = [t.data_ptr() - p.data.data_ptr() for t in ref]
    lengths = [t.numel() * t.element_size() for t in ref]
    times, growths, problem = [], [], "not verified"
    try:
        for r in range(total):
            here.zero_()  # every read writes every byte anew (faulted in: not timed)
            gc.collect()
            reset = reset_peak_rss()
            t0 = time.monotonic()
            if job["contiguous"]:
                rc = engine.transfer_sync_read(peer, here.data_ptr(), base, here.numel())
            else:
                rc = 0
                for lo in range(0, count, MOONCAKE_BATCH):
                    part = slice(lo, lo + MOONCAKE_BATCH)
                    rc = rc or engine.batch_transfer_sync_read(peer, [here.data_ptr() + o for o in offsets[part]],
                                                               [base + o for o in offsets[part]], lengths[part])
            times.append(time.monotonic() - t0)
            growths.append(peak_rss() - reset)
            if rc != 0:
                raise RuntimeError(f"Mooncake read returned {rc}")
            if r == total - 1:
                problem = verify(got, ref)
    finally:
        engine.unregister_memory(here.data_ptr())
        p.send("done")
    w = job["warmup"]
    return {"seconds": times[w:], "receiver_rss_growth_nbytes": growths[w:], "verified": problem is None, "problem": problem}


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
    missing = mooncake_missing()
    if missing is not None:
        doc.setdefault("skipped", {})["mooncake"] = missing
        log(f"Mooncake skipped: {missing}")
        return
    for count in MOONCAKE_COUNTS:
        for contiguous in (False, True):
            _, r = w.run({"job": "mooncake", "count": count, "contiguous": contiguous, "warmup": 1, "repeats": repeats}, timeout=900)
            name = "Mooncake one contiguous read" if contiguous else f"Mooncake batch read ({MOONCAKE_BATCH} segments a batch)"
            doc["peers"].append({"peer": name, "count": count, "kind": "views", **r})
            log(f"{name} {count}: {med(r['seconds']):.3f} s verified {r['verified']}")


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
    for name, why in doc.get("skipped", {}).items():
        con.print(f"peer {name} skipped: {why}")
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
