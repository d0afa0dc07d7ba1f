"""Streamed copies against libc memcpy, by where the two sides lie in their pages.

A CPU core makes a load wait behind a store still in flight to the same
place in a page (the same low 12 address bits, "4K aliasing"). A streamed
copy whose destination lies a little past its source within a page hits
that on every line unless its loop is built around it, and the distance is
set by where the allocator put the two sides: torch places every large
tensor 64 bytes into a page, so a 41 MB weight and its place in a pool
often lie 0-256 bytes apart. Two sections, medians of interleaved rounds:

* ``distance``: one 256 MiB run through tensorferry's copy loop (one
  thread, streamed), at distances 0 to 4032 bytes within a page, against
  libc's memcpy (``np.copyto``) of the same bytes at the same distance and
  at 2048 bytes (the copy limit of this machine: no aliasing there);
* ``get``: a kept plan's shm get of 24 separately allocated float32
  tensors of 41 MiB (1 GiB, each where torch put it) against libc's
  memcpy of the same bytes on as many threads as the copy uses.

Run: ``.venv/bin/python benchmarks/bench_copy.py`` (``--quick``: 64 MiB
runs, 256 MiB get, 5 rounds). Writes ``benchmarks/results/bench_copy.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import copy_threads, environment, interleaved, log, med, results_dir, write_result  # noqa: E402
from _harness import private  # noqa: E402

COPY = ("tensorferry.copy", "tensorferry._copy")
PAGE = 4096
DISTANCES = (0, 64, 128, 256, 512, 1024, 2048, 4032)
LIMIT_DISTANCE = 2048
WEIGHT_NBYTES = 41 << 20
WARMUPS = 1


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _page_aligned(nbytes: int) -> tuple[torch.Tensor, int]:
    """A touched buffer with room for ``nbytes`` past a page boundary plus
    a page, and that boundary's address."""
    buf = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    buf.fill_(1)
    return buf, (buf.data_ptr() + PAGE - 1) // PAGE * PAGE


def distance_section(nbytes: int, rounds: int) -> dict:
    """tensorferry's streamed copy and libc memcpy of one run at each
    distance, one thread each, interleaved round by round."""
    memmove_runs = private(COPY, "memmove_runs")
    src, s_at = _page_aligned(nbytes)
    dst, d_at = _page_aligned(nbytes)
    flat_d = dst.numpy()
    flat_s = src.numpy()
    s_off = s_at - src.data_ptr()
    d_off = d_at - dst.data_ptr()
    variants: list[tuple[str, int, Callable[[], None]]] = []
    for k in DISTANCES:
        runs = (np.array([d_at + k], dtype=np.int64), np.array([s_at], dtype=np.int64), np.array([nbytes], dtype=np.int64))
        variants.append(("tensorferry", k, lambda r=runs: memmove_runs(*r)))
        d_view, s_view = flat_d[d_off + k : d_off + k + nbytes], flat_s[s_off : s_off + nbytes]
        variants.append(("memcpy", k, lambda d=d_view, s=s_view: np.copyto(d, s, casting="no")))
    out = interleaved(len(variants), WARMUPS, rounds, lambda i, r: {"seconds": _timed(variants[i][2])})
    times: dict[str, dict[int, float]] = {"tensorferry": {}, "memcpy": {}}
    for (who, k, _), o in zip(variants, out):
        times[who][k] = med([rec["seconds"] for rec in o["records"]])
    # The last copy at each distance left its bytes: check one.
    memmove_runs(np.array([d_at], dtype=np.int64), np.array([s_at], dtype=np.int64), np.array([nbytes], dtype=np.int64))
    verified = bool(np.array_equal(flat_d[d_off : d_off + nbytes], flat_s[s_off : s_off + nbytes]))
    return {"nbytes": nbytes, "seconds": times, "verified": verified}


def get_section(total_nbytes: int, rounds: int) -> dict:
    """A kept plan's shm get into separately allocated large tensors
    against libc memcpy of the same bytes on the copy's threads."""
    import tensorferry as tf

    count = max(1, total_nbytes // WEIGHT_NBYTES)
    numel = WEIGHT_NBYTES // 4
    gen = torch.Generator().manual_seed(0)
    src = [torch.empty(numel).uniform_(-1, 1, generator=gen) for _ in range(count)]
    dst = [torch.zeros(numel) for _ in range(count)]
    nbytes = count * WEIGHT_NBYTES
    threads = copy_threads()
    flat_s = torch.empty(nbytes, dtype=torch.uint8).fill_(1).numpy()
    flat_d = torch.empty(nbytes, dtype=torch.uint8).fill_(0).numpy()
    cuts = [nbytes * i // threads for i in range(threads + 1)]
    from concurrent.futures import ThreadPoolExecutor

    with tf.Sender("shm", capacity_nbytes=nbytes + (64 << 20)) as sender, tf.Receiver("shm") as receiver, \
            ThreadPoolExecutor(threads) as pool:
        plan = sender.plan(src)
        ticket = sender.put(plan, readers=WARMUPS + rounds + 1)
        into = receiver.plan(ticket, into=dst)
        receiver.get(ticket, into=into)

        def memcpy() -> None:
            for f in [pool.submit(np.copyto, flat_d[a:b], flat_s[a:b], casting="no") for a, b in zip(cuts, cuts[1:])]:
                f.result()

        variants = [lambda: receiver.get(ticket, into=into), memcpy]
        out = interleaved(2, WARMUPS, rounds, lambda i, r: {"seconds": _timed(variants[i])})
        sender.discard(ticket)
    verified = all(torch.equal(a, b) for a, b in zip(src, dst))
    offsets = sorted({t.data_ptr() % PAGE for t in dst})
    get_s, memcpy_s = (med([rec["seconds"] for rec in o["records"]]) for o in out)
    return {"tensors": count, "nbytes": nbytes, "threads": threads, "page_offsets": offsets,
            "seconds": {"get": get_s, "memcpy": memcpy_s}, "verified": verified}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="64 MiB runs, a 256 MiB get, 5 rounds")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 5 if args.quick else args.rounds
    run_nbytes, get_nbytes = (64 << 20, 256 << 20) if args.quick else (256 << 20, 1 << 30)
    ratios: dict[str, float | None] = {}

    # One thread: the loop itself against libc's, not two cores' bandwidth.
    before = os.environ.get("TENSORFERRY_COPY_THREADS")
    os.environ["TENSORFERRY_COPY_THREADS"] = "1"
    try:
        log(f"distance: one {run_nbytes >> 20} MiB run at each distance within a page, one thread")
        dist = distance_section(run_nbytes, rounds)
    finally:
        if before is None:
            os.environ.pop("TENSORFERRY_COPY_THREADS", None)
        else:
            os.environ["TENSORFERRY_COPY_THREADS"] = before
    limit = dist["seconds"]["memcpy"][LIMIT_DISTANCE]
    print(f"  {'distance':>8} {'tensorferry':>12} {'memcpy':>9} {'tf/limit':>9} {'memcpy/limit':>13}")
    for k in DISTANCES:
        tf_s, mc_s = dist["seconds"]["tensorferry"][k], dist["seconds"]["memcpy"][k]
        ratios[f"distance {k}: tensorferry/limit"] = tf_s / limit
        ratios[f"distance {k}: memcpy/limit"] = mc_s / limit
        print(f"  {k:>8} {tf_s * 1e3:>9.1f} ms {mc_s * 1e3:>6.1f} ms {tf_s / limit:>8.2f}x {mc_s / limit:>12.2f}x")
    worst = max(ratios[f"distance {k}: tensorferry/limit"] or 0.0 for k in DISTANCES)
    ratios["distance: worst tensorferry/limit"] = worst
    print(f"  limit: libc memcpy {LIMIT_DISTANCE} bytes apart, {limit * 1e3:.1f} ms; worst tensorferry distance {worst:.2f}x")

    log(f"get: a kept plan's shm get of {get_nbytes >> 20} MiB as 41 MiB tensors")
    get = get_section(get_nbytes, rounds)
    g = get["seconds"]
    ratios["get 41 MiB tensors / memcpy"] = g["get"] / g["memcpy"]
    print(f"  {get['tensors']} tensors (page offsets {get['page_offsets']}): get {g['get'] * 1e3:.1f} ms, memcpy on "
          f"{get['threads']} threads {g['memcpy'] * 1e3:.1f} ms: {g['get'] / g['memcpy']:.2f}x")
    ok = dist["verified"] and get["verified"]
    if not ok:
        print("  VERIFICATION FAILED: the copied bytes differ")
    doc = {"environment": environment(), "settings": {"rounds": rounds, "warmups": WARMUPS, "quick": args.quick,
                                                      "distances": DISTANCES, "limit_distance": LIMIT_DISTANCE},
           "distance": dist, "get": get, "verified": ok}
    path = write_result(results_dir() / "bench_copy.json", doc, ratios)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
