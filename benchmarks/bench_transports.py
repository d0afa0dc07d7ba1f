"""Transport benchmark: tensorferry put→held between two processes, every
transport and receive mode, against the limits measured in the same run.

For each transport in ``tensorferry.transports.available()``: the object is
a list of 1, 10k or 100k float32 tensors totalling 1 GiB (10k and 100k are
views of one flat buffer, half of them 2-D; "10k separate" are 10k tensors
with their own storage). Receiver modes: ``pool`` (copy mode: a Receiver
with a prefaulted receive ``MemoryPool``, the fast path), ``new`` (copy mode
into new memory: a fresh Receiver without a pool for each case; its warm-up
get, the receiver's first, is reported apart as the first get), ``into``
(``get(into=...)`` existing, touched tensors) and, for shm, ``zero_copy``
(views of the sender's pool; not touched inside the timing). The sender's
pool is prefaulted. Time: from the sender calling ``put`` to the receiver's
``get`` returned.

Limits (start and end of the run, pooled): one memcpy of the bytes into
touched memory in the receiver, as torch ``copy_`` and as libc ``memcpy``
(shm's ratio is taken against libc's: tensorferry copies with it), and libc
memcpy in as many slices on as many threads as tensorferry's copy uses
(``memcpy_parallel``); raw loopback TCP between the two workers (tcp's
bound); a raw NIXL READ of one descriptor (nixl's bound, ``_raw_nixl.py``).
The 100k pool case also times the ticket's encode and decode.

Each case runs one warm-up, then ``--repeats`` timed transfers (median).
The LAST is verified after its timing against the receiver's own copy of
the source (pools and targets zeroed before it, so stale bytes fail). Peak
RSS growth: VmHWM after a clear_refs reset, in the receiver around each get
and in the sender from put until the release.

Run alone: ``.venv/bin/python benchmarks/bench_transports.py`` (``--quick``:
64 MiB; ``--only shm:pool:100k ...``; ``--profile``). ``bench_transfer.py``
runs it with the other transfer benchmarks in one pair of workers.
Writes ``benchmarks/results/bench_transports.json`` (and ``.png``).
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"  # NIXL/UCX on loopback, here and in every child

import cProfile
import gc
import statistics
import sys
import time
from typing import Any

from _common import GIB, MIB, environment, log, med, minor_faults, peak_rss, reset_peak_rss
from _harness import finish, out_path, run_cases, run_in_pair, sizes, transfer_parser
from _pair import Peer, Workers, case_label, job, measure_raw_nixl, profile_text, verify, views_of

COUNTS = (1, 10_000, 100_000)
LIMITS = ("memcpy", "memcpy_libc", "memcpy_parallel", "raw_tcp")
# What the issues ask for, as ratios measured in this run.
TARGET_SHM_VS_MEMCPY = 0.7
TARGET_TCP_VS_RAW = 0.7
TARGET_NIXL_VS_RAW = 0.8
TARGET_100K_VS_1 = 1.5
TARGET_TICKET_NBYTES = 1_000_000
TARGET_TICKET_SECONDS = 0.020
TARGET_RX_RSS_NEW_NBYTES = int(1.1 * GIB)
TARGET_RX_RSS_ZERO_COPY_NBYTES = 64 * MIB
TARGET_TX_RSS_NBYTES = 64 * MIB
LIMIT_FOR = {"shm": "memcpy_libc", "tcp": "raw_tcp", "nixl": "raw_nixl"}
TARGET_FOR = {"shm": TARGET_SHM_VS_MEMCPY, "tcp": TARGET_TCP_VS_RAW, "nixl": TARGET_NIXL_VS_RAW}


@job
def tf_case(p: Peer, job: dict) -> dict:
    """One case: ``warmup`` + ``repeats`` transfers of ``count`` tensors,
    the sender's put and release, the receiver's get in mode ``mode``."""
    import torch

    count, total = job["count"], job["warmup"] + job["repeats"]
    prof = cProfile.Profile() if job.get("profile") else None
    recs: list[dict] = []
    if p.sends:
        separate = [v.clone() for v in views_of(p.data, count)] if job["kind"] == "separate" else None
        for r in range(total):
            p.await_ready()
            obj = separate[:] if separate is not None else views_of(p.data, count)
            if r == total - 1:
                p.sender.pool.buffer.zero_()  # stale bytes cannot pass the check
            gc.collect()
            base, flt = reset_peak_rss(), minor_faults()
            if prof is not None and r >= job["warmup"]:
                prof.enable()
            t0 = time.monotonic()
            ticket = p.sender.put(obj)
            t_put = time.monotonic()
            tb = ticket.to_bytes()
            t_enc = time.monotonic()
            if prof is not None:
                prof.disable()
            p.send(("ticket", tb, t0))
            p.sender.wait_released(ticket, timeout=300)
            rec = {"t0": t0, "put_seconds": t_put - t0, "encode_seconds": t_enc - t_put,
                   "released_after_seconds": time.monotonic() - t0, "sender_rss_growth_nbytes": peak_rss() - base,
                   "sender_minor_faults": minor_faults() - flt}
            del obj
            if r >= job["warmup"]:
                recs.append(rec)
        out = {"records": recs, "ticket_nbytes": len(tb), "blocks": len(ticket.blocks), "profile_sender": profile_text(prof)}
        if job.get("ticket_timing"):
            out.update(_ticket_timing(p, count))
        return out

    mode = job["mode"]
    ref = views_of(p.data, count)
    rx = p.receiver("pool" if mode == "pool" else "plain", fresh=mode == "new")
    targets_flat = targets = None
    if mode == "into":
        targets_flat = torch.zeros(p.data.numel())
        targets = views_of(targets_flat, count)
    problem: str | None = "not verified"
    first_get = None
    for r in range(total):
        if r == total - 1:
            if mode == "pool":
                rx.pool.buffer.zero_()
            elif mode == "into":
                targets_flat.zero_()
        gc.collect()
        base = reset_peak_rss()
        p.send(("ready",))
        _, tb, t0 = p.recv()
        t_got = time.monotonic()
        flt = minor_faults()
        if prof is not None and r >= job["warmup"]:
            prof.enable()
        res = rx.get(tb, into=targets) if mode == "into" else rx.get(tb, zero_copy=mode == "zero_copy")
        t1 = time.monotonic()
        if prof is not None:
            prof.disable()
        rec = {"t0": t0, "end_to_end_seconds": t1 - t0, "ticket_transit_seconds": t_got - t0,
               "get_seconds": t1 - t_got, "receiver_rss_growth_nbytes": peak_rss() - base,
               "receiver_minor_faults": minor_faults() - flt}
        if r == total - 1:
            problem = "into= did not return the targets" if mode == "into" and res is not targets else verify(res, ref)
        del res  # a real loop drops the last result before the next get
        if r == 0:
            first_get = t1 - t_got
        if r >= job["warmup"]:
            recs.append(rec)
    del targets, targets_flat
    gc.collect()
    if job.get("ticket_timing"):
        # Verified and collected: idle while the sender times tickets.
        if p.recv() != ("ticket_timing_ready",):
            raise RuntimeError("out of step with the sender's ticket timing")
        p.send(("receiver_idle",))
    return {"records": recs, "verified": problem is None, "problem": problem, "first_get_seconds": first_get,
            "profile_receiver": profile_text(prof)}


def _ticket_timing(p: Peer, count: int) -> dict:
    """Ticket encode/decode of a ``count``-tensor object, timed while the
    receiver is idle (after its last transfer it verifies the data, which
    would share the cores with these timings)."""
    from tensorferry import Ticket

    p.send(("ticket_timing_ready",))
    if p.recv() != ("receiver_idle",):
        raise RuntimeError("out of step with the receiver")
    ticket = p.sender.put(views_of(p.data, count), readers=None)
    try:
        enc, dec, lenc = [], [], []
        for _ in range(7):
            t = time.perf_counter()
            b = ticket.to_bytes()
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            lay = Ticket.from_bytes(b).layout
            dec.append(time.perf_counter() - t)
            if lay.num_tensors != count:
                raise RuntimeError(f"the decoded ticket holds {lay.num_tensors} tensors, not {count}")
        for _ in range(7):  # the layout encoding put() does (to_bytes only frames it)
            t = time.perf_counter()
            lay.to_bytes()
            lenc.append(time.perf_counter() - t)
        return {"ticket_encode_seconds": statistics.median(enc), "ticket_decode_seconds": statistics.median(dec),
                "layout_encode_seconds": statistics.median(lenc)}
    finally:
        p.sender.discard(ticket)
        p.sender.wait_released(ticket, timeout=60)


def tf_cases(transport: str, repeats: int) -> list[dict]:
    """pool cases first (the receiver frees its pool before the others)."""
    cases = [dict(mode="pool", count=c, kind="views") for c in COUNTS]
    cases.append(dict(mode="pool", count=10_000, kind="separate"))
    for mode in ("new", "into") + (("zero_copy",) if transport == "shm" else ()):
        cases += [dict(mode=mode, count=1, kind="views"), dict(mode=mode, count=100_000, kind="views")]
        if mode == "new":  # the plain repeated get the receive cache is for
            cases.append(dict(mode=mode, count=10_000, kind="views"))
    for c in cases:
        c.update(job="tf_case", transport=transport, warmup=1, repeats=repeats,
                 ticket_timing=c["mode"] == "pool" and c["count"] == 100_000)
    return cases


def measure(w: Workers, doc: dict, transports: list[str], repeats: int, only: list[str] | None, profile: bool) -> None:
    """Every case of every transport into ``doc["cases"]``."""

    def cases(transport: str) -> list[tuple[str, dict]]:
        named = [(f"{transport}:{case['mode']}:{case_label(case)}", {**case, "profile": profile})
                 for case in tf_cases(transport, repeats)]
        return [(name, case) for name, case in named if not only or name in only]

    def record(name: str, case: dict, s: dict, r: dict) -> None:
        doc["cases"].append({**case, "sender": s, "receiver": r})
        e2e = med([x["end_to_end_seconds"] for x in r["records"]])
        log(f"{name}: {e2e:.3f} s put {med([x['put_seconds'] for x in s['records']]):.3f} "
            f"get {med([x['get_seconds'] for x in r['records']]):.3f} verified {r['verified']}")

    run_cases(w, doc, transports, cases, record,
              failed=lambda case, exc: doc["cases"].append({**case, "error": str(exc)}))


def summarize(doc: dict, nbytes: int) -> dict[str, float | None]:
    """Rows, targets (into ``doc``) and the ratios of this benchmark."""
    limit_s = {k: med(v["seconds"]) for k, v in doc["limits"].items() if v and v.get("seconds")}
    rows = []
    for c in doc["cases"]:
        if "error" in c:
            continue
        s, r = c["sender"]["records"], c["receiver"]["records"]
        e2e = med([x["end_to_end_seconds"] for x in r])
        row = {"transport": c["transport"], "mode": c["mode"], "count": c["count"], "kind": c["kind"],
               "label": case_label(c), "end_to_end_seconds": e2e,
               "end_to_end_all_seconds": [x["end_to_end_seconds"] for x in r],
               "put_seconds": med([x["put_seconds"] for x in s]), "get_seconds": med([x["get_seconds"] for x in r]),
               "gbps": nbytes / e2e / 1e9,
               "receiver_rss_growth_nbytes": max(x["receiver_rss_growth_nbytes"] for x in r),
               "sender_rss_growth_nbytes": max(x["sender_rss_growth_nbytes"] for x in s),
               "receiver_minor_faults": med([x["receiver_minor_faults"] for x in r]),
               "ticket_nbytes": c["sender"]["ticket_nbytes"], "blocks": c["sender"]["blocks"],
               "verified": c["receiver"]["verified"], "problem": c["receiver"]["problem"],
               "first_get_seconds": c["receiver"].get("first_get_seconds")}
        lk = LIMIT_FOR.get(c["transport"])
        if lk in limit_s:
            row["vs_limit"] = limit_s[lk] / e2e
            row["get_vs_limit"] = limit_s[lk] / row["get_seconds"]
        rows.append(row)
    doc["rows"] = rows
    doc["limits_summary"] = {k: {"median_seconds": v, "gbps": nbytes / v / 1e9} for k, v in limit_s.items()}
    idx = {(r["transport"], r["mode"], r["count"], r["kind"]): r for r in rows}
    ratios: dict[str, float | None] = {}
    for r in rows:
        ratios[f"transports:{r['transport']}:{r['mode']}:{r['label'].replace(' ', '-')} vs {LIMIT_FOR[r['transport']]}"] = \
            r.get("vs_limit")
    targets = doc.setdefault("targets", [])

    def add(name: str, required: str, measured: float | None, met: bool | None, note: str = "", unit: str = "x") -> None:
        targets.append({"target": name, "required": required, "measured": measured, "unit": unit, "met": met, "note": note})

    for t in sorted({r["transport"] for r in rows}):
        lk = LIMIT_FOR[t]
        one = idx.get((t, "pool", 1, "views"))
        if one is not None and lk in limit_s:
            if t == "shm" and "memcpy_parallel" in limit_s:
                par = limit_s["memcpy_parallel"] / one["end_to_end_seconds"]
                ratios["transports:shm:pool:1 vs memcpy_parallel"] = par
                add(f"{t} copy (pool, 1 tensor) vs memcpy_parallel, put→held", f">= {TARGET_FOR[t]}x", par,
                    par >= TARGET_FOR[t], f"libc memcpy on tensorferry's copy threads, {limit_s['memcpy_parallel'] * 1e3:.0f} ms")
            extra = f"; vs torch copy_: {limit_s['memcpy'] / one['end_to_end_seconds']:.2f}x" if t == "shm" and "memcpy" in limit_s else ""
            add(f"{t} copy (pool, 1 tensor) vs {lk}, put→held", f">= {TARGET_FOR[t]}x", one["vs_limit"],
                one["vs_limit"] >= TARGET_FOR[t], f"put {one['put_seconds'] * 1e3:.0f} ms + get "
                f"{one['get_seconds'] * 1e3:.0f} ms; limit {limit_s[lk] * 1e3:.0f} ms{extra}")
            add(f"{t} copy (pool, 1 tensor) vs {lk}, get alone", f">= {TARGET_FOR[t]}x", one["get_vs_limit"],
                one["get_vs_limit"] >= TARGET_FOR[t], "the receiver's get only")
        elif lk not in limit_s:
            add(f"{t} copy vs {lk}", f">= {TARGET_FOR[t]}x", None, None, f"{lk} not measured")
        for mode in ("pool", "new", "into", "zero_copy"):
            a, b = idx.get((t, mode, 1, "views")), idx.get((t, mode, 100_000, "views"))
            if a and b:
                ratio = b["end_to_end_seconds"] / a["end_to_end_seconds"]
                add(f"{t} {mode}: time(100k) / time(1)", f"<= {TARGET_100K_VS_1}x", ratio, ratio <= TARGET_100K_VS_1,
                    f"{b['end_to_end_seconds'] * 1e3:.0f} ms vs {a['end_to_end_seconds'] * 1e3:.0f} ms")
        new10k = idx.get((t, "new", 10_000, "views"))
        if t == "shm" and new10k and "get_vs_limit" in new10k:
            first = new10k["first_get_seconds"]
            add(f"{t} new 10k, repeated plain gets vs {lk}, get alone", f">= {TARGET_SHM_VS_MEMCPY}x",
                new10k["get_vs_limit"], new10k["get_vs_limit"] >= TARGET_SHM_VS_MEMCPY,
                f"gets 2.. of one Receiver: {new10k['get_seconds'] * 1e3:.0f} ms; its first get {first * 1e3:.0f} ms" if first else "")
        for mode, cap, need in (("new", TARGET_RX_RSS_NEW_NBYTES, "<= 1.1 GiB"), ("zero_copy", TARGET_RX_RSS_ZERO_COPY_NBYTES, "<= 64 MiB")):
            for cnt in (1, 100_000):
                rr = idx.get((t, mode, cnt, "views"))
                if rr:
                    g = rr["receiver_rss_growth_nbytes"]
                    add(f"{t} receiver peak RSS growth, {mode}, {rr['label']}", need, g / MIB, g <= cap, "", " MiB")
        worst = max((r for r in rows if r["transport"] == t), key=lambda r: r["sender_rss_growth_nbytes"])
        add(f"{t} sender peak RSS growth beyond its pool (worst case)", "<= 64 MiB", worst["sender_rss_growth_nbytes"] / MIB,
            worst["sender_rss_growth_nbytes"] <= TARGET_TX_RSS_NBYTES, f"worst: {worst['mode']} {worst['label']}", " MiB")
    tk = next((c["sender"] for c in doc["cases"] if c.get("ticket_timing") and "error" not in c), None)
    if tk is not None:
        add("ticket bytes, list of 100k tensors", "< 1 MB", tk["ticket_nbytes"] / 1e6,
            tk["ticket_nbytes"] < TARGET_TICKET_NBYTES, f"{tk['ticket_nbytes']:,} bytes", " MB")
        enc_dec = tk["ticket_encode_seconds"] + tk["ticket_decode_seconds"]
        add("ticket to_bytes + from_bytes + .layout, 100k", "< 20 ms", enc_dec * 1e3, enc_dec < TARGET_TICKET_SECONDS,
            f"encode {tk['ticket_encode_seconds'] * 1e3:.1f} ms, decode+layout {tk['ticket_decode_seconds'] * 1e3:.1f} ms; "
            f"Layout.to_bytes inside put {tk['layout_encode_seconds'] * 1e3:.1f} ms", " ms")
        ratios["transports:ticket encode+decode 100k vs 20 ms"] = TARGET_TICKET_SECONDS / enc_dec
    bad = [f"{r['transport']} {r['mode']} {r['label']}: {r['problem']}" for r in rows if not r["verified"]]
    bad += [f"limit {k}" for k, v in doc["limits"].items() if v and v.get("verified") is False]
    add("every transport case verified bit-exact after timing", "all", None, not bad, "; ".join(bad) or "all equal", "")
    return ratios


def print_table(con: Any, doc: dict) -> None:
    from rich.table import Table

    t = Table(title="tensorferry: put→held end to end (sender's put … receiver's get returned), separate processes")
    cols = ("transport", "mode", "tensors", "e2e ms", "GB/s", "vs limit", "put ms", "get ms", "get vs limit",
            "blocks", "ticket B", "rx RSS +MiB", "tx RSS +MiB", "rx faults", "verified")
    for col in cols:
        t.add_column(col, justify="left" if col in ("transport", "mode", "tensors") else "right")
    for r in doc["rows"]:
        t.add_row(r["transport"], r["mode"], r["label"], f"{r['end_to_end_seconds'] * 1e3:,.0f}", f"{r['gbps']:.2f}",
                  f"{r['vs_limit']:.2f}x" if "vs_limit" in r else "-", f"{r['put_seconds'] * 1e3:,.0f}",
                  f"{r['get_seconds'] * 1e3:,.0f}", f"{r['get_vs_limit']:.2f}x" if "get_vs_limit" in r else "-",
                  str(r["blocks"]), f"{r['ticket_nbytes']:,}", f"{r['receiver_rss_growth_nbytes'] / MIB:,.1f}",
                  f"{r['sender_rss_growth_nbytes'] / MIB:,.1f}", f"{r['receiver_minor_faults']:,.0f}",
                  "yes" if r["verified"] else f"[red]NO {r['problem']}[/]")
    if doc["rows"]:
        con.print(t)


def main() -> int:
    ap = transfer_parser(__doc__)
    ap.add_argument("--only", nargs="*", default=None, metavar="TRANSPORT:MODE:TENSORS",
                    help="run only these cases (e.g. shm:pool:100k tcp:into:1)")
    args = ap.parse_args()
    nbytes, repeats, transports = sizes(args)
    doc: dict[str, Any] = {"limits": {}, "cases": [], "errors": []}
    env = environment(nbytes=nbytes, repeats=repeats, torch_threads=args.threads, transports=transports)

    def measure_all(w: Workers) -> None:
        if "nixl" in transports:
            measure_raw_nixl(doc["limits"], nbytes, max(3, repeats), doc["errors"])
        measure(w, doc, transports, repeats, args.only, args.profile)

    info = run_in_pair(["bench_transports"], doc, env, nbytes, args.threads, measure_all, limits=LIMITS,
                       limit_repeats=max(3, repeats))
    doc["env"]["peak_reset_works"] = {k: v["peak_reset_works"] for k, v in info.items()}
    ratios = summarize(doc, nbytes)
    path = finish(doc, ratios, out_path(args, "bench_transports"), nbytes, [print_table])
    if doc["rows"]:
        from _plots import plot_transports

        plot_transports(doc, nbytes, path.with_suffix(".png"))
    log(f"wrote {path} and .png")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
