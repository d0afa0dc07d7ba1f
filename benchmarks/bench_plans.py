"""Plans benchmark: ``Sender.plan`` / ``Receiver.plan`` kept across syncs,
between two processes, against a memcpy of the same bytes in the same
rounds; and the schedule every plans benchmark uses (``bench_ray.py
--plans`` calls :func:`sync_rounds` and :func:`count_ratio`).

For each transport: the sender changes the data in place (every element
+1, untimed) before each sync; a sync is ``put(plan)`` until the
receiver's ``get(ticket, into=recv_plan)`` returned. The first sync makes
both plans inside its timing and is reported apart; the median is over the
syncs after it. Groups, each run interleaved (every round runs each variant
once, the order rotated every round): ``own`` (1 tensor, 100k views of one
flat buffer, 100k separate tensors, into the plan's own tensors, plus one
libc memcpy of the same bytes in the sender each round), ``into`` (the same
into existing tensors, planned and as fresh ``put(obj)`` /
``get(into=targets)`` every sync), ``wire`` (100k views planned as float32,
as ``dtype=torch.bfloat16`` and, on tcp, ``snapshot=False``; shm and nixl
refuse it, recorded as not applicable). The planned put alone is held
against the sender's memcpy. The last sync of each case is verified against
the source with +1 added as often as the sender did (same float32
operations, same bits).

Run alone: ``.venv/bin/python benchmarks/bench_plans.py`` (or
``bench_transfer.py --plans``; ``--quick``: 64 MiB; ``--only shm:own
tcp:wire`` selects groups). Writes ``benchmarks/results/bench_plans.json``
(``bench_transfer_plans.json`` through bench_transfer) and a ``.png``.
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"

import cProfile
import gc
import sys
import time
from typing import Any, Callable

from _common import copy_threads, environment, interleaved, log, med, rotated
from _harness import finish, out_path, run_cases, run_in_pair, sizes, transfer_parser
from _pair import Peer, Workers, case_label, job, limits_again, measure_limits, profile_text, verify, views_of

# 100k tensors: the size of a large state dict.
PLAN_COUNT = 100_000
TARGET_PLAN_VIEWS_VS_1 = 1.1
TARGET_PLAN_SEPARATE_VS_1 = 2.0
TARGET_PLAN_PUT_VS_MEMCPY = 1.2
TARGET_PLAN_BF16_VS_FP32 = 0.6
LIMITS = ("memcpy_libc_sender", "memcpy_parallel_sender")
PLAN_HOW = {"plan": "planned", "plan-bf16": "planned, dtype=bfloat16", "plan-nosnap": "planned, snapshot=False",
            "fresh": "fresh put/get"}


# -- the schedule (shared with bench_ray.py --plans) ---------------------------------


def sync_rounds(count: int, warmups: int, repeats: int, sync: Callable[[int, int], dict],
                seconds_key: str = "seconds") -> list[dict]:
    """Sync ``count`` variants in interleaved rounds (``_common.interleaved``:
    the order rotated every round); the first round makes the plans and is
    a warm-up, reported apart. ``sync(i, round)`` returns variant ``i``'s
    record; each variant's result gets the median of ``seconds_key`` over
    its timed records as ``"seconds"``."""
    out = interleaved(count, warmups, repeats, sync)
    for o in out:
        if o["records"] and seconds_key in o["records"][0]:
            o["seconds"] = med([r[seconds_key] for r in o["records"]])
    return out


def count_ratio(few: dict, many: dict) -> float | None:
    """time(many tensors) / time(few) of two verified results of one
    interleaved group (``"seconds"`` and ``"ok"``), else None."""
    if few.get("ok") and many.get("ok") and few.get("seconds"):
        return many["seconds"] / few["seconds"]
    return None


# -- the two halves of a plans group -------------------------------------------------


@job
def plan_refusal(p: Peer, job: dict) -> dict:
    """What ``put(plan, snapshot=False)`` says on this transport (only tcp
    serves a plan's own memory): the error, or None if it was accepted."""
    if not p.sends:
        return {}
    import torch

    from tensorferry import TensorferryError

    plan = p.sender.plan([torch.ones(4)])
    try:
        ticket = p.sender.put(plan, snapshot=False, readers=None)
    except TensorferryError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    p.sender.discard(ticket)
    p.sender.wait_released(ticket, timeout=60)
    return {"refused": None}


def _dtype(v: dict):
    import torch

    return torch.bfloat16 if v["how"] == "plan-bf16" else torch.float32


@job
def plan_group(p: Peer, job: dict) -> dict:
    """A group's variants synced in interleaved rounds (:func:`sync_rounds`).
    Sender: changes the variant's tensors (+1, untimed), plans on the first
    sync (``plan``, ``plan-bf16``, ``plan-nosnap``) or puts the object
    afresh (``fresh``); with ``memcpy``, times one libc memcpy of the same
    bytes before each round's first sync (while the receiver waits, as
    during a put). Receiver: one plain Receiver; ``dest`` ``own``
    (``Receiver.plan(ticket)`` allocates) or ``into`` (existing, touched
    tensors); verifies each variant's last sync right after it."""
    import numpy as np
    import torch

    variants = job["variants"]
    n = len(variants)
    prof = cProfile.Profile() if job.get("profile") else None
    extra: list[dict] = [{} for _ in variants]
    if p.sends:
        flat = p.data.clone()  # the group's own copy: it changes, p.data must not
        sep = [v.clone() for v in views_of(flat, PLAN_COUNT)] if any(v["kind"] == "separate" for v in variants) else None
        changes = {"views": 0, "separate": 0}
        copy_dst = torch.zeros(p.nbytes, dtype=torch.uint8) if job.get("memcpy") else None
        memcpy_seconds: list[float] = []
        plans: list[Any] = [None] * n

        def send(i: int, r: int) -> dict:
            v = variants[i]
            objs = sep if v["kind"] == "separate" else views_of(flat, v["count"])
            p.await_ready()
            if copy_dst is not None and rotated(n, r)[0] == i:
                d, s_ = copy_dst.numpy(), flat.view(torch.uint8).numpy()
                t = time.monotonic()
                np.copyto(d, s_, casting="no")
                if r >= job["warmup"]:
                    memcpy_seconds.append(time.monotonic() - t)
            if v["kind"] == "separate":
                torch._foreach_add_(sep, 1.0)
            else:
                flat.add_(1.0)
            changes[v["kind"]] += 1
            gc.collect()
            if prof is not None and r >= job["warmup"]:
                prof.enable()
            t0 = time.monotonic()
            if plans[i] is None and v["how"] != "fresh":
                plans[i] = p.sender.plan(objs, dtype=_dtype(v) if v["how"] == "plan-bf16" else None)
            t_plan = time.monotonic()
            ticket = p.sender.put(objs) if plans[i] is None else p.sender.put(plans[i], snapshot=v["how"] != "plan-nosnap")
            t_put = time.monotonic()
            tb = ticket.to_bytes()
            t_enc = time.monotonic()
            if prof is not None:
                prof.disable()
            p.send(("ticket", tb, t0, changes[v["kind"]]))
            # Also what snapshot=False needs before the tensors change again.
            p.sender.wait_released(ticket, timeout=300)
            extra[i]["ticket_nbytes"] = len(tb)
            return {"t0": t0, "plan_seconds": t_plan - t0, "put_seconds": t_put - t_plan,
                    "encode_seconds": t_enc - t_put, "released_after_seconds": time.monotonic() - t0}

        out = sync_rounds(n, job["warmup"], job["repeats"], send)
        for o, e, pl in zip(out, extra, plans):
            o.update(e, copy_runs=pl.copy_runs if pl is not None else None)
        return {"variants": out, "memcpy_seconds": memcpy_seconds, "profile_sender": profile_text(prof)}

    rx = p.receiver("plain")
    into: dict = {}
    for v in variants:
        key = (v["kind"], _dtype(v))
        if v["dest"] == "into" and key not in into:
            into[key] = ([torch.zeros(t.shape, dtype=key[1]) for t in views_of(p.data, PLAN_COUNT)]
                         if v["kind"] == "separate" else torch.zeros(p.data.numel(), dtype=key[1]))
    targets = []
    for v in variants:
        t = into.get((v["kind"], _dtype(v))) if v["dest"] == "into" else None
        targets.append(t if t is None or isinstance(t, list) else views_of(t, v["count"]))
    rplans: list[Any] = [None] * n
    last = job["warmup"] + job["repeats"] - 1
    for e in extra:
        e.update(problem="not verified", returned_planned=True)

    def receive(i: int, r: int) -> dict:
        v, e = variants[i], extra[i]
        gc.collect()
        p.send(("ready",))
        _, tb, t0, changes = p.recv()
        t_got = time.monotonic()
        if prof is not None and r >= job["warmup"]:
            prof.enable()
        plan_seconds = 0.0
        if v["how"] == "fresh":
            res = rx.get(tb, into=targets[i]) if targets[i] is not None else rx.get(tb)
        else:
            if rplans[i] is None:
                rplans[i] = rx.plan(tb, into=targets[i])
                plan_seconds = time.monotonic() - t_got
            res = rx.get(tb, into=rplans[i])
        t1 = time.monotonic()
        if prof is not None:
            prof.disable()
        if targets[i] is not None:
            e["returned_planned"] &= res is targets[i]
        elif rplans[i] is not None:
            e["returned_planned"] &= res is rplans[i].result
        if r == last:  # after the timing: this sync's values, so stale bytes fail
            e["problem"] = verify(res, _synced(p, v["count"], _dtype(v), changes))
            if e["problem"] is None and not e["returned_planned"]:
                e["problem"] = "a get did not return the planned destinations (into= or the plan's own tensors)"
        del res
        return {"t0": t0, "end_to_end_seconds": t1 - t0, "ticket_transit_seconds": t_got - t0,
                "receiver_plan_seconds": plan_seconds, "get_seconds": t1 - t_got - plan_seconds}

    out = sync_rounds(n, job["warmup"], job["repeats"], receive, "end_to_end_seconds")
    for o, e in zip(out, extra):
        o.update(e, verified=e["problem"] is None)
    for held in (rplans, targets, into):  # the received tensors go before the next group
        held.clear()
    gc.collect()
    return {"variants": out, "profile_receiver": profile_text(prof)}


def _synced(p: Peer, count: int, dtype: Any, syncs: int) -> list:
    """What the sender sent at its ``syncs``-th put: the source with +1
    added ``syncs`` times (the same float32 operations, so the same bits),
    then converted to ``dtype``."""
    exp = p.data.clone()
    for _ in range(syncs):
        exp.add_(1.0)
    return views_of(exp if exp.dtype == dtype else exp.to(dtype), count)


# -- orchestration -------------------------------------------------------------------


def plan_groups(transport: str, repeats: int) -> list[dict]:
    """The groups; each runs its variants interleaved."""
    objects = ((1, "views"), (PLAN_COUNT, "views"), (PLAN_COUNT, "separate"))
    groups = [
        dict(group="own", memcpy=True, variants=[dict(how="plan", count=c, kind=k, dest="own") for c, k in objects]),
        dict(group="into", variants=[dict(how=h, count=c, kind=k, dest="into") for h in ("plan", "fresh") for c, k in objects]),
        dict(group="wire", variants=[dict(how=h, count=PLAN_COUNT, kind="views", dest="own")
                                     for h in ("plan", "plan-bf16") + (("plan-nosnap",) if transport == "tcp" else ())]),
    ]
    for g in groups:
        g.update(job="plan_group", transport=transport, warmup=1, repeats=repeats)
    return groups


def plan_case_id(c: dict) -> str:
    """A plans case's name, e.g. ``tcp:into:plan:100k-separate``."""
    return f"{c['transport']}:{c['group']}:{c['how']}:{case_label(c).replace(' ', '-')}"


def measure(w: Workers, doc: dict, transports: list[str], repeats: int, only: list[str] | None, profile: bool) -> None:
    """The sender's memcpy limits (before and after, pooled), then every
    group of every transport (``only``: groups as ``shm:own``, ``tcp:wire``)."""
    plans = doc.setdefault("plans", {"cases": [], "not_applicable": {}, "limits": {}, "memcpy_rounds": {}})
    measure_limits(w, plans["limits"], LIMITS, max(3, repeats))

    def opened(transport: str) -> None:
        refused = w.run({"job": "plan_refusal"})[0]["refused"]
        if refused is not None:
            plans["not_applicable"][f"{transport} snapshot=False"] = refused

    def cases(transport: str) -> list[tuple[str, dict]]:
        groups = [(f"{transport}:{g['group']}", {**g, "profile": profile}) for g in plan_groups(transport, repeats)]
        return [(gid, g) for gid, g in groups if not only or gid in only]

    def variants(group: dict) -> list[dict]:
        return [{**v, "group": group["group"], "transport": group["transport"], "repeats": group["repeats"]}
                for v in group["variants"]]

    def failed(group: dict, exc: Exception) -> None:
        plans["cases"].extend({**c, "id": plan_case_id(c), "error": str(exc)} for c in variants(group))

    def record(gid: str, group: dict, s: dict, r: dict) -> None:
        if s["memcpy_seconds"]:
            plans["memcpy_rounds"][gid] = s["memcpy_seconds"]
        for k, (c, sv, rv) in enumerate(zip(variants(group), s["variants"], r["variants"])):
            c["id"] = plan_case_id(c)
            # The group's profiles (all its variants together) go with its first.
            sv["profile_sender"] = s["profile_sender"] if k == 0 else None
            rv["profile_receiver"] = r["profile_receiver"] if k == 0 else None
            plans["cases"].append({**c, "sender": sv, "receiver": rv})
            log(f"{c['id']}: sync {rv['seconds']:.3f} s, put {med([x['put_seconds'] for x in sv['records']]):.3f}, "
                f"first sync {rv['first']['end_to_end_seconds']:.3f}, verified {rv['verified']}")

    run_cases(w, doc, transports, cases, record, opened=opened, failed=failed, timeout=1200)
    limits_again(w, plans["limits"], max(3, repeats))


def summarize(doc: dict, nbytes: int) -> dict[str, float | None]:
    """Rows of the plans section, their ratios (each against a variant of
    the same interleaved group), and its targets (appended to
    ``doc["targets"]``). Returns the ratios: every case's sync against the
    sender's memcpy of the same bytes (in the own group's rounds; limit /
    sync), and each target's ratio."""
    plans = doc.get("plans")
    if not plans:
        return {}
    lim = {k: med(v["seconds"]) for k, v in plans["limits"].items() if v and v.get("seconds")}
    plans["limits_summary"] = {k: {"median_seconds": v, "gbps": nbytes / v / 1e9} for k, v in lim.items()}
    rows = []
    for c in plans["cases"]:
        if "error" in c:
            continue
        s, r = c["sender"], c["receiver"]
        sync = med([x["end_to_end_seconds"] for x in r["records"]])
        rows.append({
            "id": c["id"], "transport": c["transport"], "group": c["group"], "how": c["how"], "count": c["count"],
            "kind": c["kind"], "dest": c["dest"], "label": case_label(c),
            "sync_seconds": sync,
            "sync_all_seconds": [x["end_to_end_seconds"] for x in r["records"]],
            "put_seconds": med([x["put_seconds"] for x in s["records"]]),
            "get_seconds": med([x["get_seconds"] for x in r["records"]]),
            "released_after_seconds": med([x["released_after_seconds"] for x in s["records"]]),
            # The first sync: sender.plan + put + receiver.plan + get.
            "first_sync_seconds": r["first"]["end_to_end_seconds"],
            "first_sender_plan_seconds": s["first"]["plan_seconds"],
            "first_put_seconds": s["first"]["put_seconds"],
            "first_receiver_plan_seconds": r["first"]["receiver_plan_seconds"],
            "first_get_seconds": r["first"]["get_seconds"],
            "gbps": nbytes / sync / 1e9,  # of the float32 source, whatever went on the wire
            "ticket_nbytes": s["ticket_nbytes"],
            "copy_runs": s["copy_runs"],
            "repeats": len(r["records"]),
            "verified": r["verified"],
            "problem": r["problem"],
        })
    idx = {(r["transport"], r["group"], r["how"], r["count"], r["kind"]): r for r in rows}
    for row in rows:
        t, g = row["transport"], row["group"]
        ref = idx.get((t, g, "plan", 1, "views")) or idx.get((t, g, "plan", PLAN_COUNT, "views"))
        if ref is not None and ref is not row:
            row["vs_ref"] = row["sync_seconds"] / ref["sync_seconds"]
            row["ref"] = PLAN_HOW[ref["how"]] + " " + ref["label"]
    plans["memcpy_rounds_median"] = {g: med(x) for g, x in plans.get("memcpy_rounds", {}).items()}
    plans["rows"] = rows
    targets = doc.setdefault("targets", [])
    ratios: dict[str, float | None] = {}
    for row in rows:
        paired = plans["memcpy_rounds_median"].get(f"{row['transport']}:own") or lim.get("memcpy_libc_sender")
        ratios[f"plans:{row['id']} vs memcpy_libc_sender"] = paired / row["sync_seconds"] if paired else None

    def add(name: str, required: str, measured: float | None, met: bool | None, note: str = "", unit: str = "x") -> None:
        targets.append({"target": name, "required": required, "measured": measured, "unit": unit, "met": met,
                        "note": note, "section": "plans"})
        if unit == "x" and measured is not None:
            ratios[f"plans:{name}"] = measured

    def ms(x: float) -> str:
        return f"{x * 1e3:,.0f} ms"

    dest_name = {"own": "into the plan's own tensors", "into": "into= existing tensors"}
    for t in [t for t in ("shm", "tcp", "nixl") if any(r["transport"] == t for r in rows)]:
        fresh1 = idx.get((t, "into", "fresh", 1, "views"))
        for kind, limit in (("views", TARGET_PLAN_VIEWS_VS_1), ("separate", TARGET_PLAN_SEPARATE_VS_1)):
            fresh = idx.get((t, "into", "fresh", PLAN_COUNT, kind))
            beside = ""
            if fresh and fresh1:
                beside = (f"; fresh put/get(into=) of the same: {ms(fresh['sync_seconds'])} vs "
                          f"{ms(fresh1['sync_seconds'])} ({fresh['sync_seconds'] / fresh1['sync_seconds']:.2f}x)")
            for g in ("own", "into"):
                a, b = idx.get((t, g, "plan", 1, "views")), idx.get((t, g, "plan", PLAN_COUNT, kind))
                if a and b:
                    what = "views of one buffer" if kind == "views" else "separately allocated"
                    ratio = b["sync_seconds"] / a["sync_seconds"]
                    add(f"{t} planned sync, 100k {what} / 1 tensor, {dest_name[g]}", f"<= {limit}x", ratio,
                        ratio <= limit, f"{ms(b['sync_seconds'])} (put {ms(b['put_seconds'])}, get {ms(b['get_seconds'])}) vs "
                        f"{ms(a['sync_seconds'])} (put {ms(a['put_seconds'])}, get {ms(a['get_seconds'])})"
                        + (beside if g == "into" else ""))
        put = idx.get((t, "own", "plan", PLAN_COUNT, "views"))
        paired = plans["memcpy_rounds_median"].get(f"{t}:own")
        if put and paired:
            ratio = put["put_seconds"] / paired
            other = idx.get((t, "into", "plan", PLAN_COUNT, "views"))
            one = idx.get((t, "own", "plan", 1, "views"))
            par = lim.get("memcpy_parallel_sender")
            add(f"{t} planned put(snapshot=True) of 100k views / one memcpy (sender)", f"<= {TARGET_PLAN_PUT_VS_MEMCPY}x",
                ratio, ratio <= TARGET_PLAN_PUT_VS_MEMCPY,
                f"put {ms(put['put_seconds'])}" + (f" ({ms(other['put_seconds'])} in the into= group)" if other else "")
                + (f", of 1 tensor {ms(one['put_seconds'])}" if one else "")
                + f"; libc memcpy in the same rounds {ms(paired)}"
                + (f" (before/after the section {ms(lim['memcpy_libc_sender'])})" if "memcpy_libc_sender" in lim else "")
                + (f", on {copy_threads()} threads {ms(par)}" if par else ""))
        fp32, bf16 = idx.get((t, "wire", "plan", PLAN_COUNT, "views")), idx.get((t, "wire", "plan-bf16", PLAN_COUNT, "views"))
        if fp32 and bf16:
            ratio = bf16["sync_seconds"] / fp32["sync_seconds"]
            add(f"{t} planned sync, dtype=bfloat16 / float32 (100k views)", f"<= {TARGET_PLAN_BF16_VS_FP32}x", ratio,
                ratio <= TARGET_PLAN_BF16_VS_FP32,
                f"{ms(bf16['sync_seconds'])} vs {ms(fp32['sync_seconds'])}; put {ms(bf16['put_seconds'])} vs "
                f"{ms(fp32['put_seconds'])}, get {ms(bf16['get_seconds'])} vs {ms(fp32['get_seconds'])}")
        nosnap = idx.get((t, "wire", "plan-nosnap", PLAN_COUNT, "views"))
        refused = plans["not_applicable"].get(f"{t} snapshot=False")
        if fp32 and nosnap:
            saved = fp32["sync_seconds"] - nosnap["sync_seconds"]
            add(f"{t} planned sync, snapshot=False / snapshot=True (100k views)", "report",
                nosnap["sync_seconds"] / fp32["sync_seconds"], None,
                f"{ms(nosnap['sync_seconds'])} vs {ms(fp32['sync_seconds'])}: saves {ms(saved)} a sync "
                f"({saved / fp32['sync_seconds']:.0%}); put {nosnap['put_seconds'] * 1e3:.1f} ms vs {ms(fp32['put_seconds'])}")
        elif refused:
            add(f"{t} planned sync, snapshot=False", "report", None, None, f"not applicable: {refused.split(';')[0]}")
    bad = [f"{r['id']}: {r['problem']}" for r in rows if not r["verified"]]
    bad += [f"{c['id']}: {c['error']}" for c in plans["cases"] if "error" in c]
    add("every plans case verified bit-exact after timing (values changed every sync)", "all", None, not bad,
        "; ".join(bad) or "all equal", "")
    return ratios


def print_table(con: Any, doc: dict) -> None:
    from rich.table import Table

    plans = doc.get("plans") or {}
    if not plans.get("rows"):
        return
    lim = plans.get("limits_summary", {})
    extra = ", ".join(f"{k} {v['median_seconds'] * 1e3:,.0f} ms" for k, v in lim.items())
    rounds = ", ".join(f"{g} {v * 1e3:,.0f} ms" for g, v in plans.get("memcpy_rounds_median", {}).items())
    t = Table(title="plans: sync = sender's put(plan) … receiver's get(into=plan) returned, 2nd sync on (the 1st, "
                    "which makes both plans, apart); a group's variants interleaved; the data changes before every sync. "
                    f"Sender memcpy before/after: {extra}; in the own groups' rounds: {rounds}")
    cols = ("transport", "group", "case", "tensors", "sync ms", "syncs ms", "put ms", "get ms",
            "vs group ref", "1st sync ms (tx plan, rx plan)", "copy runs", "ticket B", "verified")
    for col in cols:
        t.add_column(col, justify="left" if col in ("transport", "group", "case", "tensors") else "right")
    for r in plans["rows"]:
        t.add_row(r["transport"], r["group"], PLAN_HOW[r["how"]], r["label"],
                  f"{r['sync_seconds'] * 1e3:,.0f}", " ".join(f"{x * 1e3:.0f}" for x in r["sync_all_seconds"]),
                  f"{r['put_seconds'] * 1e3:,.1f}", f"{r['get_seconds'] * 1e3:,.0f}",
                  f"{r['vs_ref']:.2f}x {r['ref']}" if "vs_ref" in r else "(ref)",
                  f"{r['first_sync_seconds'] * 1e3:,.0f} ({r['first_sender_plan_seconds'] * 1e3:,.0f}, "
                  f"{r['first_receiver_plan_seconds'] * 1e3:,.0f})",
                  "-" if r["copy_runs"] is None else f"{r['copy_runs']:,}", f"{r['ticket_nbytes']:,}",
                  "yes" if r["verified"] else f"[red]NO {r['problem']}[/]")
    con.print(t)
    for k, v in plans.get("not_applicable", {}).items():
        con.print(f"  {k}: not applicable — {v}")


def main(argv: list[str] | None = None, *, name: str = "bench_plans") -> int:
    """Run the plans benchmark alone (``name``: its results' file name)."""
    from _plots import plot_plans

    ap = transfer_parser(__doc__)
    ap.add_argument("--only", nargs="*", default=None, metavar="TRANSPORT:GROUP", help="only these groups (shm:own tcp:wire)")
    args, _ = ap.parse_known_args(argv)
    nbytes, repeats, transports = sizes(args)
    doc: dict[str, Any] = {"errors": [], "targets": []}
    env = environment(nbytes=nbytes, repeats=repeats, torch_threads=args.threads, transports=transports,
                      copy_threads=copy_threads())
    run_in_pair(["bench_plans"], doc, env, nbytes, args.threads,
                lambda w: measure(w, doc, transports, repeats, args.only, args.profile))
    ratios = summarize(doc, nbytes)
    path = finish(doc, ratios, out_path(args, name), nbytes, [print_table])
    if doc["plans"].get("rows"):
        plot_plans(doc, path.with_suffix(".png"))
    log(f"wrote {path} and .png")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
