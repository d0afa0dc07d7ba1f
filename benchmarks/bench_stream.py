"""Streamed-put benchmark: a fresh ``put`` of an object four times the free
pool, streamed in pieces, against one libc memcpy of the same bytes measured
in the same run.

The sender's pool holds a quarter of the object (``Sender(capacity_nbytes=
nbytes // 4, prefault=True)``, empty before every put), so ``put`` cuts the
object into pieces (half the pool each, by default) that are packed as the
receiver frees them. Timed from the sender calling ``put`` on the object (a
fresh put: no plan) to the receiver's ``get`` returned, for 1 tensor and for
10k views of one buffer, received ``into=`` existing, touched tensors (the
memcpy limit copies into touched memory too) and, for 1 tensor, into new
memory. Ratio: memcpy time / streamed time (a streamed transfer copies the
bytes at least twice, pack and get, so 0.5 is what two serial copies reach;
above it the pieces overlap). The last transfer of each case is verified
bit for bit after its timing (targets zeroed first).

Run alone: ``.venv/bin/python benchmarks/bench_stream.py`` (``--quick``:
64 MiB through a 16 MiB pool). ``bench_transfer.py`` runs it too. Writes
``benchmarks/results/bench_stream.json``.
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"

import gc
import sys
import time
from typing import Any

from _common import MIB, environment, log, med
from _harness import finish, limit_medians, out_path, run_cases, run_in_pair, sizes, table, transfer_parser, \
    verified_cell, verified_target
from _pair import Peer, Workers, case_label, job, verify, views_of

# The object is this many times the sender's (empty) pool.
POOL_FRACTION = 4
CASES = (dict(count=1, mode="into"), dict(count=10_000, mode="into"), dict(count=1, mode="new"))
LIMITS = ("memcpy_libc", "memcpy_parallel")


@job
def stream(p: Peer, job: dict) -> dict:
    """``warmup`` + ``repeats`` fresh puts of ``count`` tensors (the whole
    data) through the sender's small pool; the receiver gets each ``into=``
    touched targets or into new memory."""
    import torch

    count, total = job["count"], job["warmup"] + job["repeats"]
    recs = []
    if p.sends:
        for r in range(total):
            p.await_ready()
            obj = views_of(p.data, count)
            gc.collect()
            t0 = time.monotonic()
            ticket = p.sender.put(obj)
            t_put = time.monotonic()
            p.send(("ticket", ticket.to_bytes(), t0))
            p.sender.wait_released(ticket, timeout=600)
            if r >= job["warmup"]:
                recs.append({"put_seconds": t_put - t0, "released_after_seconds": time.monotonic() - t0})
            del obj
        return {"records": recs, "pool_nbytes": p.sender.pool.capacity_nbytes}
    ref = views_of(p.data, count)
    rx = p.receiver("plain")
    flat = torch.zeros(p.data.numel()) if job["mode"] == "into" else None
    targets = views_of(flat, count) if flat is not None else None
    problem: str | None = "not verified"
    for r in range(total):
        if r == total - 1 and flat is not None:
            flat.zero_()
        gc.collect()
        p.send(("ready",))
        _, tb, t0 = p.recv()
        t_got = time.monotonic()
        res = rx.get(tb, into=targets) if targets is not None else rx.get(tb)
        t1 = time.monotonic()
        if r == total - 1:
            problem = "into= did not return the targets" if targets is not None and res is not targets else verify(res, ref)
        del res
        if r >= job["warmup"]:
            recs.append({"end_to_end_seconds": t1 - t0, "get_seconds": t1 - t_got})
    return {"records": recs, "verified": problem is None, "problem": problem}


def measure(w: Workers, doc: dict, nbytes: int, transports: list[str], repeats: int) -> None:
    """Every case of every transport, the sender's pool a quarter of the data."""

    def cases(transport: str) -> list[tuple[str, dict]]:
        return [(f"{transport}:stream:{case['mode']}:{case_label(case).replace(' ', '-')}",
                 {"job": "stream", **case, "warmup": 1, "repeats": repeats}) for case in CASES]

    def record(name: str, spec: dict, s: dict, r: dict) -> None:
        doc["stream"].append({"id": name, "transport": name.split(":")[0], "count": spec["count"],
                              "mode": spec["mode"], "sender": s, "receiver": r})
        log(f"{name}: {med([x['end_to_end_seconds'] for x in r['records']]):.3f} s "
            f"(put returned after {med([x['put_seconds'] for x in s['records']]):.3f}) verified {r['verified']}")

    run_cases(w, doc, transports, cases, record, open_job={"capacity_nbytes": nbytes // POOL_FRACTION})


def summarize(doc: dict, nbytes: int) -> dict[str, float | None]:
    """Rows and ratios (memcpy time / streamed time)."""
    if not doc.get("stream"):
        return {}
    lim = limit_medians(doc["limits"], LIMITS)
    ratios: dict[str, float | None] = {}
    rows = []
    for c in doc["stream"]:
        e2e = med([x["end_to_end_seconds"] for x in c["receiver"]["records"]])
        row = {"id": c["id"], "transport": c["transport"], "mode": c["mode"], "label": case_label(c),
               "pool_nbytes": c["sender"]["pool_nbytes"], "end_to_end_seconds": e2e,
               "end_to_end_all_seconds": [x["end_to_end_seconds"] for x in c["receiver"]["records"]],
               "put_seconds": med([x["put_seconds"] for x in c["sender"]["records"]]),
               "get_seconds": med([x["get_seconds"] for x in c["receiver"]["records"]]),
               "gbps": nbytes / e2e / 1e9, "verified": c["receiver"]["verified"], "problem": c["receiver"]["problem"]}
        for k, v in lim.items():
            row[f"vs_{k}"] = v / e2e
        ratios[f"stream:{c['id']} vs memcpy_libc"] = row.get("vs_memcpy_libc")
        rows.append(row)
    doc["stream_rows"] = rows
    verified_target(doc, f"every streamed put (object {POOL_FRACTION}x the free pool) verified bit-exact after timing",
                    [f"{r['id']}: {r['problem']}" for r in rows if not r["verified"]])
    return ratios


def print_table(con: Any, doc: dict) -> None:
    if not doc.get("stream_rows"):
        return
    def ratio(r: dict, k: str) -> str:
        return f"{r[k]:.2f}x" if k in r else "-"

    con.print(table(f"streamed put: a fresh put of an object {POOL_FRACTION}x the sender's free pool, put … get returned",
                    ("case", "pool MiB", "e2e ms", "GB/s", "vs memcpy_libc", "vs memcpy_parallel", "put returned ms",
                     "runs ms", "verified"),
                    ((r["id"], f"{r['pool_nbytes'] / MIB:,.0f}", f"{r['end_to_end_seconds'] * 1e3:,.0f}",
                      f"{r['gbps']:.2f}", ratio(r, "vs_memcpy_libc"), ratio(r, "vs_memcpy_parallel"),
                      f"{r['put_seconds'] * 1e3:,.0f}", " ".join(f"{x * 1e3:.0f}" for x in r["end_to_end_all_seconds"]),
                      verified_cell(r)) for r in doc["stream_rows"])))


def main() -> int:
    ap = transfer_parser(__doc__)
    args = ap.parse_args()
    nbytes, repeats, transports = sizes(args)
    doc: dict[str, Any] = {"limits": {}, "stream": [], "errors": []}
    env = environment(nbytes=nbytes, repeats=repeats, torch_threads=args.threads, transports=transports,
                      pool_nbytes=nbytes // POOL_FRACTION)
    run_in_pair(["bench_stream"], doc, env, nbytes, args.threads, lambda w: measure(w, doc, nbytes, transports, repeats),
                limits=LIMITS, limit_repeats=max(3, repeats))
    ratios = summarize(doc, nbytes)
    log(f"wrote {finish(doc, ratios, out_path(args, 'bench_stream'), nbytes, [print_table])}")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
