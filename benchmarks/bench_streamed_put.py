"""Streamed-put benchmark: a fresh ``put`` of an object four times the free
pool, end to end, against one memcpy of the same bytes in the same run.

Two processes (multiprocessing ``spawn``): a SENDER whose pool holds a
quarter of the object (so ``put`` streams it in pieces of half the pool,
each packed as the receiver frees the one before), and a RECEIVER that
``get(ticket, into=targets)`` into touched tensors. The ticket bytes go over
a ``multiprocessing.Pipe``. Timed (``time.monotonic()``, one clock for both
processes on the host):

* ``put_seconds``: the ``put`` call alone (it returns the ticket at once;
  what it costs is the inspection of the object);
* ``end_to_end_seconds``: from the sender calling ``put`` to the receiver
  holding the data (``get`` returned);
* ``sender_seconds``: the sender's share alone, in the sender process: from
  ``put`` until every piece was packed, with a reader that takes and gives
  back each piece's slot at once (a receiver-side channel speaking the
  protocol, moving no bytes), so the time is the sender's inspection and
  its packing of the pieces (each one copy of its bytes into the pool);
* the limit: one libc ``memcpy`` (``np.copyto``) of the object's bytes into
  touched memory, in the sender process, between the cases. Streaming moves
  every byte at least twice (into the pool, out of it), so an end-to-end
  ratio of about 2 is the floor; the sender's share copies each byte once,
  so about 1.

Objects: a list of float32 tensors totalling ``--nbytes``: 1 tensor, and
100k views of one flat buffer (half of them 2-D), where a per-piece cost
that grows with the number of tensors shows. Each case runs one untimed
warm-up, then ``--repeats`` timed puts (median reported); the last one is
verified bit for bit against the source.

torch runs with one intra-op thread in each process (the machine is small
and shared; see bench_transfer.py). Run:
``.venv/bin/python benchmarks/bench_streamed_put.py`` (``--transport tcp``
for tcp). Writes ``benchmarks/results/bench_streamed_put.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

COUNTS = (1, 100_000)


def views_of(flat, count: int) -> list:
    """``count`` views of ``flat`` covering it, half of them 2-D."""
    n = flat.numel()
    size = n // count
    out, at = [], 0
    for i in range(count):
        k = size if i < count - 1 else n - at
        v = flat[at : at + k]
        if i % 2 and k % 2 == 0:
            v = v.view(2, k // 2)
        out.append(v)
        at += k
    return out


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(repeats + 1):
        t = time.monotonic()
        np.copyto(dst, src)
        times.append(time.monotonic() - t)
    return statistics.median(times[1:])


def sender_main(conn, result, args: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from tensorferry import Sender
    from tensorferry.transports import channel_class

    nbytes = args["nbytes"]
    flat = torch.arange(nbytes // 4, dtype=torch.float32)
    out: dict[str, Any] = {"cases": {}, "memcpy_seconds": [], "sender_seconds": {}}
    with Sender(args["transport"], capacity_nbytes=nbytes // 4, prefault=True) as sender:
        for count in COUNTS:
            out["memcpy_seconds"].append(memcpy_seconds(nbytes, 3))
            recs = []
            for r in range(args["repeats"] + 1):
                obj = views_of(flat, count)
                assert conn.recv() == "ready"
                gc.collect()
                t0 = time.monotonic()
                ticket = sender.put(obj)
                t_put = time.monotonic()
                conn.send((ticket.to_bytes(), count, t0))
                sender.wait_released(ticket, timeout=600)
                t_end = conn.recv()
                if r:
                    recs.append({"put_seconds": t_put - t0, "end_to_end_seconds": t_end - t0, "pieces": ticket.num_pieces})
            out["cases"][str(count)] = recs
        out["memcpy_seconds"].append(memcpy_seconds(nbytes, 3))
        ch = channel_class(sender.transport)(sender.address, timeout=60.0)
        for count in COUNTS:
            times = []
            for r in range(args["repeats"] + 1):
                obj = views_of(flat, count)
                gc.collect()
                t0 = time.monotonic()
                ticket = sender.put(obj)
                for piece in range(ticket.num_pieces):
                    ch.acquire(ticket.id, piece, timeout=60.0, digest=ticket.digest)
                    ch.release(ticket.id, piece, timeout=60.0)
                times.append(time.monotonic() - t0)
                sender.wait_released(ticket, timeout=60)
            out["sender_seconds"][str(count)] = times[1:]
        ch.close()
        out["memcpy_seconds"].append(memcpy_seconds(nbytes, 3))
    conn.send(None)
    result.send(out)


def receiver_main(conn, args: dict) -> None:
    import torch

    torch.set_num_threads(1)
    from tensorferry import Receiver

    nbytes = args["nbytes"]
    ref = torch.arange(nbytes // 4, dtype=torch.float32)
    with Receiver(args["transport"]) as receiver:
        for count in COUNTS:
            flat = torch.zeros(nbytes // 4, dtype=torch.float32)
            targets = views_of(flat, count)
            for r in range(args["repeats"] + 1):
                if r == args["repeats"]:
                    flat.zero_()
                conn.send("ready")
                tb, c, _ = conn.recv()
                receiver.get(tb, into=targets, timeout=600)
                conn.send(time.monotonic())
            if not torch.equal(flat, ref):
                raise SystemExit(f"verification failed for {count} tensors")
    conn.recv()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nbytes", type=int, default=256 << 20, help="object size (the pool holds a quarter)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transport", default="shm")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    s_conn, r_conn = ctx.Pipe(duplex=True)
    mine, theirs = ctx.Pipe(duplex=False)
    args = {"nbytes": a.nbytes, "repeats": a.repeats, "transport": a.transport}
    procs = [ctx.Process(target=sender_main, args=(s_conn, theirs, args)), ctx.Process(target=receiver_main, args=(r_conn, args))]
    for proc in procs:
        proc.start()
    out = mine.recv() if mine.poll(1800) else None
    for proc in procs:
        proc.join(timeout=60)
    if out is None or procs[1].exitcode:
        print("benchmark failed (receiver exit", procs[1].exitcode, ")")
        return 1
    memcpy = statistics.median(out["memcpy_seconds"])
    print(f"object {a.nbytes / 2**20:.0f} MiB, pool {a.nbytes / 4 / 2**20:.0f} MiB, {a.transport}; memcpy {memcpy * 1e3:.1f} ms")
    print(f"{'tensors':>8} {'pieces':>6} {'put ms':>8} {'end-to-end ms':>14} {'x memcpy':>9} {'sender ms':>10} {'x memcpy':>9}")
    table = {}
    for count, recs in out["cases"].items():
        put = statistics.median(r["put_seconds"] for r in recs)
        e2e = statistics.median(r["end_to_end_seconds"] for r in recs)
        snd = statistics.median(out["sender_seconds"][count])
        table[count] = {"put_seconds": put, "end_to_end_seconds": e2e, "ratio_to_memcpy": e2e / memcpy, "pieces": recs[0]["pieces"],
                        "sender_seconds": snd, "sender_ratio_to_memcpy": snd / memcpy}
        print(f"{count:>8} {recs[0]['pieces']:>6} {put * 1e3:>8.1f} {e2e * 1e3:>14.1f} {e2e / memcpy:>9.2f} {snd * 1e3:>10.1f} {snd / memcpy:>9.2f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with open(Path(a.out) / "bench_streamed_put.json", "w") as f:
        json.dump({"args": args, "memcpy_seconds": memcpy, "cases": table, "raw": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
