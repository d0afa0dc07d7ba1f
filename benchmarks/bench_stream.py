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

import argparse
import gc
import sys
import time
from typing import Any

from _common import GIB, MIB, available_transports, environment, log, med, results_dir, write_result
from _pair import Peer, Workers, case_label, job, limits_again, measure_limits, print_limits, print_targets, verify, \
    views_of

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
    pool_nbytes = nbytes // POOL_FRACTION
    for transport in transports:
        try:
            w.run({"job": "tf_open", "transport": transport, "capacity_nbytes": pool_nbytes})
        except Exception as exc:
            doc["errors"].append(f"{transport}: open: {exc}")
            continue
        for case in CASES:
            name = f"{transport}:stream:{case['mode']}:{case_label(case).replace(' ', '-')}"
            try:
                s, r = w.run({"job": "stream", **case, "warmup": 1, "repeats": repeats})
            except Exception as exc:
                doc["errors"].append(f"{name}: {exc}")
                log(f"{name}: FAILED {exc}")
                w.reopen(transport)
                continue
            doc["stream"].append({"id": name, "transport": transport, **case, "sender": s, "receiver": r})
            log(f"{name}: {med([x['end_to_end_seconds'] for x in r['records']]):.3f} s "
                f"(put returned after {med([x['put_seconds'] for x in s['records']]):.3f}) verified {r['verified']}")
        w.run({"job": "tf_close"})


def summarize(doc: dict, nbytes: int) -> dict[str, float | None]:
    """Rows and ratios (memcpy time / streamed time)."""
    if not doc.get("stream"):
        return {}
    lim = {k: med(v["seconds"]) for k, v in doc["limits"].items() if v and v.get("seconds") and k in LIMITS}
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
    bad = [f"{r['id']}: {r['problem']}" for r in rows if not r["verified"]]
    doc.setdefault("targets", []).append({
        "target": f"every streamed put (object {POOL_FRACTION}x the free pool) verified bit-exact after timing",
        "required": "all", "measured": None, "unit": "", "met": not bad, "note": "; ".join(bad) or "all equal"})
    return ratios


def print_table(con: Any, doc: dict) -> None:
    from rich.table import Table

    if not doc.get("stream_rows"):
        return
    t = Table(title=f"streamed put: a fresh put of an object {POOL_FRACTION}x the sender's free pool, put … get returned")
    cols = ("case", "pool MiB", "e2e ms", "GB/s", "vs memcpy_libc", "vs memcpy_parallel", "put returned ms",
            "runs ms", "verified")
    for col in cols:
        t.add_column(col, justify="left" if col == "case" else "right")
    for r in doc["stream_rows"]:
        t.add_row(r["id"], f"{r['pool_nbytes'] / MIB:,.0f}", f"{r['end_to_end_seconds'] * 1e3:,.0f}", f"{r['gbps']:.2f}",
                  f"{r['vs_memcpy_libc']:.2f}x" if "vs_memcpy_libc" in r else "-",
                  f"{r['vs_memcpy_parallel']:.2f}x" if "vs_memcpy_parallel" in r else "-",
                  f"{r['put_seconds'] * 1e3:,.0f}", " ".join(f"{x * 1e3:.0f}" for x in r["end_to_end_all_seconds"]),
                  "yes" if r["verified"] else f"[red]NO {r['problem']}[/]")
    con.print(t)


def main() -> int:
    from rich.console import Console

    from bench_transports import common_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    args = ap.parse_args()
    nbytes = 64 * MIB if args.quick else GIB
    repeats = 2 if args.quick else args.repeats
    transports = args.transports if args.transports is not None else available_transports()
    doc: dict[str, Any] = {"limits": {}, "stream": [], "errors": []}
    started = time.monotonic()
    env = environment(nbytes=nbytes, repeats=repeats, torch_threads=args.threads, transports=transports,
                      pool_nbytes=nbytes // POOL_FRACTION)
    w = Workers(nbytes, args.threads, ["bench_stream"])
    try:
        measure_limits(w, doc["limits"], LIMITS, max(3, repeats))
        measure(w, doc, nbytes, transports, repeats)
        limits_again(w, doc["limits"], max(3, repeats))
    finally:
        w.close()
    doc["env"] = {**env, "loadavg_1min_end": round(os.getloadavg()[0], 2), "wall_seconds": time.monotonic() - started}
    ratios = summarize(doc, nbytes)
    con = Console(width=200)
    print_limits(con, doc["limits"], lambda k: nbytes, "limits (start and end pooled)")
    print_table(con, doc)
    print_targets(con, doc["targets"])
    log(f"wrote {write_result(results_dir(args.out) / 'bench_stream.json', doc, ratios)}")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
