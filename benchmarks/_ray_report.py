"""bench_ray's report: the ratios and targets (``compute_ratios``), the
tables of every section and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path

import _ray_actors as A
from _common import GIB, MIB
from _harness import print_targets
from _ray_actors import CASES, MODEL_SYNC_WORKERS, SYNC_WARMUPS, SYNC_WORKERS, TARGETS, TRANSPORTS

def print_plans_report(plans: dict) -> None:
    if not plans:
        return
    print(f"\nWeightSync with plans: {A.SYNC_NBYTES / MIB:,.0f} MiB float32 to {SYNC_WORKERS} workers, medians after "
          f"{SYNC_WARMUPS} warm-ups, 100 and 100k interleaved round by round")
    for key, out in plans["cases"].items():
        count, _, inference = key.partition("-")
        m = out["methods"].get("tf", {})
        first = ", ".join(f"{r['seconds']:.3f}" for r in m.get("warmup", []))
        state = "ok" if m.get("ok") else f"FAILED {m.get('error', 'workers differ')}"
        runs = m.get("runs", [])
        # Where a sync goes: the trainer's put (the workers wait for it), then
        # the workers' gets, which run at once on the same cores.
        put = statistics.median(r["pack_seconds"] for r in runs) if runs else float("nan")
        get = statistics.median(s for r in runs for s in r["worker_seconds"]) if runs else float("nan")
        print(f"  {int(count):>7,} tensors{' (workers in inference_mode)' if inference else ''}: {m.get('seconds', float('nan')):.3f} s (trainer put {put:.3f} s, worker get {get:.3f} s; "
              f"load {m.get('loadavg_1min', float('nan')):.1f}; warm-ups incl. the planning sync: {first} s) {state}")
    r = plans.get("ratio")
    print(f"  100k / 100 tensors: {r:.2f}x (target <= {plans['target']}x: {'met' if plans['met'] else 'NOT met'})" if r else "  ratio: n/a")
    ri = plans.get("ratio_inference")
    if ri:
        print(f"  100k / 100 tensors, workers' weights made under inference_mode (no version counters to mark): {ri:.2f}x")


# -- report -----------------------------------------------------------------------


def compute_ratios(results: dict, sync: dict) -> tuple[list, dict]:
    def e2e(tkey: str, case: str) -> float | None:
        c = results.get(tkey, {}).get("cases", {}).get(case, {})
        return c.get("e2e_s") if c.get("ok") else None

    def sync_s(key: str) -> float | None:
        m = sync.get("methods", {}).get(key, {})
        return m.get("seconds") if m.get("ok") else None

    ratios: dict = {}
    for case, _ in CASES:
        for mine in ("tf", "tf_pool", "tf_zc"):
            ours = e2e(mine, case)
            for tr in TRANSPORTS:
                if tr.ours:
                    continue
                peer = e2e(tr.key, case)
                if ours and peer:
                    ratios[f"{case}:{mine}/{tr.key}"] = peer / ours
    ours = sync_s("tf")
    for key in ("nixl", "nixl_pool"):
        if ours and sync_s(key):
            ratios[f"sync:tf/{key}"] = sync_s(key) / ours
    targets = []
    for case, desc, peer, need in TARGETS:
        value = ratios.get(f"{case}:tf/{peer}")
        alt = ratios.get(f"{case}:tf/nixl")
        zc = ratios.get(f"{case}:tf_zc/{peer}")
        pooled = ratios.get(f"{case}:tf_pool/{peer}")
        note = []
        if pooled is not None:
            note.append(f"with a receive pool {pooled:.2f}x")
        if alt is not None:
            note.append(f"vs plain nixl {alt:.2f}x")
        if zc is not None:
            note.append(f"zero-copy vs nixl + pool {zc:.2f}x")
        targets.append({"case": case, "target": desc, "required": f">= {need:g}x",
                        "measured": value, "met": value is not None and value >= need,
                        "met_vs_plain_nixl_too": alt is not None and alt >= need, "note": "; ".join(note)})
    return targets, ratios


def print_report(results: dict, sync: dict, targets: list, env: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=220)
    con.print(f"[bold]tensorferry Ray benchmark[/] — {env['date']} — {env['machine']}")
    con.print("seconds, median; e2e = producer .remote() -> consumer's result (ratios use it); "
              "consume = consumer .remote() -> result; GB/s = bytes / e2e")
    t = Table(title=f"actor to actor, ~{A.TOTAL_NBYTES / GIB:g} GiB float32 on one node")
    t.add_column("transport")
    for case, label in CASES:
        label = label.format(many=f"{A.MANY // 1000}k")
        for col in ("e2e", "consume", "GB/s"):
            t.add_column(f"{label}\n{col}", justify="right")
    t.add_column("runs", justify="right")
    t.add_column("ok")
    for tr in TRANSPORTS:
        r = results[tr.key]
        row = [tr.label]
        oks, reps = [], []
        for case, _ in CASES:
            c = r.get("cases", {}).get(case, {})
            if "e2e_s" in c:
                mark = " *" if c.get("sent_as") != case else ""
                row += [f"{c['e2e_s']:.3f}{mark}", f"{c['consume_s']:.3f}", f"{c['nbytes'] / c['e2e_s'] / 1e9:.2f}"]
                oks.append(c["ok"])
                reps.append(str(c["repeats"]))
            else:
                row += ["[red]failed[/]", "-", "-"]
                oks.append(False)
        row += ["/".join(reps) or "-", "yes" if all(oks) else "[red]NO[/]"]
        t.add_row(*row)
    con.print(t)
    con.print(f"* the plain object store gets {A.MANY:,} separate tensors in the views case (pickling a view "
              f"serializes its whole storage: {A.MANY:,} views of one 1 GiB storage run out of memory)")

    t = Table(title="where tensorferry's e2e goes (medians, seconds; page faults of the get x 4 KiB = fresh memory touched)")
    for col in ("mode", "case", "e2e", "pack (source)", "get (destination)", "get page faults", "touch", "Ray rest"):
        t.add_column(col, justify="left" if col in ("mode", "case") else "right")
    for tr in TRANSPORTS:
        if not tr.ours:
            continue
        for case, label in CASES:
            c = results[tr.key].get("cases", {}).get(case, {})
            b = c.get("breakdown")
            if not b:
                continue
            t.add_row(tr.label, label.format(many=f"{A.MANY // 1000}k"), f"{c['e2e_s']:.3f}", f"{b['tf_pack_s']:.3f}",
                      f"{b['tf_recv_s']:.3f}", f"{b['tf_recv_minflt']:,.0f} ({b['tf_recv_minflt'] * 4096 / MIB:,.0f} MiB)",
                      f"{b['touch_s']:.3f}", f"{b['ray_overhead_s']:.3f}")
    con.print(t)

    t = Table(title=f"weight sync: ~{A.SYNC_NBYTES / GIB:g} GiB, {sync.get('state_dict', {}).get('num_tensors', '?')}"
                    f" tensors, 1 trainer -> {SYNC_WORKERS} workers")
    for col in ("method", "seconds", "GB/s (all workers)", "warm-ups", "runs", "verified", "detail (medians)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    nbytes = sync.get("state_dict", {}).get("nbytes", 0)
    for key, m in sync.get("methods", {}).items():
        if "seconds" in m:
            t.add_row(m["label"], f"{m['seconds']:.3f}", f"{SYNC_WORKERS * nbytes / m['seconds'] / 1e9:.2f}",
                      ", ".join(f"{r['seconds']:.2f}" for r in m["warmup"]), str(m["repeats"]), "yes" if m["ok"] else "[red]NO[/]",
                      sync_detail(m))
        else:
            t.add_row(m["label"], "[red]failed[/]", "-", "-", "-", m.get("error", ""))
    con.print(t)

    print_targets(con, targets, "targets (tensorferry copy mode; ratio = peer seconds / tensorferry seconds)")


def print_model_report(models: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if not models:
        return
    con = Console(width=220)
    t = Table(title=f"weight sync of model state dicts, 1 trainer -> {MODEL_SYNC_WORKERS} workers "
                    "(seconds, median; ratio = peer seconds / tensorferry seconds)")
    for col in ("state dict", "tensors", "views", "GB", "tensorferry", "Ray nixl", "Ray object store", "runs",
                "verified", "tensorferry detail (medians)"):
        t.add_column(col, justify="left" if col in ("state dict", "tensorferry detail (medians)") else "right")
    for name, out in models.items():
        if "error" in out and not out.get("methods"):
            t.add_row(name, "-", "-", "-", f"[red]{out['error']}[/]", "-", "-", "-", "-", "")
            continue
        sd = out.get("state_dict", {})
        methods = out.get("methods", {})
        ours = methods.get("tf", {})

        def cell(key: str) -> str:
            m = methods.get(key, {})
            if "seconds" not in m:
                return "[red]failed[/]" if m else "-"
            mark = " *" if m.get("views_sent_as_copies") else ""
            if key == "tf" or not ours.get("seconds"):
                return f"{m['seconds']:.3f}{mark}"
            return f"{m['seconds']:.3f}{mark} ({m['seconds'] / ours['seconds']:.2f}x)"

        detail = sync_detail(ours) if ours.get("runs") else ""
        if "pool_setup_seconds" in ours:
            detail += f"; pool made at WeightSync creation {ours['pool_setup_seconds']:.2f} s"
        t.add_row(name, f"{sd.get('num_tensors', '?'):,}" if sd else "?", f"{sd.get('views', 0):,}",
                  f"{sd.get('nbytes', 0) / 1e9:.2f}", cell("tf"), cell("nixl"), cell("objstore"),
                  "/".join(str(m.get("repeats", "-")) for m in methods.values()),
                  "yes" if methods and all(m.get("ok") for m in methods.values()) else "[red]NO[/]", detail)
    con.print(t)
    con.print("* views sent to the object store as separate copies (pickling a view serializes its whole storage)")


def sync_detail(m: dict) -> str:
    runs = m.get("runs") or []
    if runs and "pack_seconds" in runs[0]:
        pack = statistics.median(r["pack_seconds"] for r in runs)
        slowest = statistics.median(max(r["worker_seconds"]) for r in runs)
        return f"trainer pack {pack:.3f} s; slowest worker's get (into=) {slowest:.3f} s"
    if runs and "worker_copy_seconds" in runs[0]:
        slowest = statistics.median(max(r["worker_copy_seconds"]) for r in runs)
        return f"slowest worker's copy_ into its tensors {slowest:.3f} s (after its NIXL read)"
    return ""


def plot(results: dict, sync: dict, path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = [label.format(many=f"{A.MANY // 1000}k") for _, label in CASES] + [f"weight sync\n{SYNC_WORKERS} workers"]
    series = []
    for tr in TRANSPORTS:
        vals = []
        for case, _ in CASES:
            c = results[tr.key].get("cases", {}).get(case, {})
            vals.append(c.get("e2e_s") if c.get("ok") else None)
        skey = {"tf": "tf", "nixl": "nixl", "nixl_pool": "nixl_pool"}.get(tr.key)
        m = sync.get("methods", {}).get(skey, {}) if skey else {}
        vals.append(m.get("seconds") if m.get("ok") else None)
        series.append((tr, vals))
    colors = {"tf": "tab:blue", "tf_pool": "tab:purple", "tf_zc": "tab:cyan", "objstore": "tab:gray", "objstore_zc": "tab:olive",
              "gloo": "tab:green", "nixl": "tab:orange", "nixl_pool": "tab:red"}
    fig, ax = plt.subplots(figsize=(13, 5.8))
    width = 0.8 / len(series)
    for i, (tr, vals) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        for gi, (x, v) in enumerate(zip(xs, vals)):
            if v is None:
                continue
            separate = tr.views_as_separate and gi < len(CASES) and CASES[gi][0] == "views"
            ax.bar(x, v, width * 0.95, color=colors[tr.key], hatch="//" if separate else None,
                   edgecolor="white" if separate else None)
            ax.annotate(f"{v:.2f}", (x, v), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=6.5, rotation=90)
    handles = [Patch(color=colors[tr.key], label=tr.label) for tr, _ in series]
    handles.append(Patch(facecolor="tab:gray", hatch="//", edgecolor="white", label="sent as separate tensors"))
    ax.legend(handles=handles, fontsize=8, ncol=4, loc="upper left")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_yscale("log")
    ax.set_ylabel("seconds, median (log): producer .remote() -> consumer result")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    present = [v for _, vals in series for v in vals if v]
    ax.set_ylim(min(present, default=0.1) / 2, max(present, default=1.0) * 8)
    ax.set_title(f"~{A.TOTAL_NBYTES / GIB:g} GiB float32 actor to actor, Ray {env['ray']} — {env['date']}, {env['machine']}\n"
                 "(hatched: the plain object store sends separate tensors in the views case; "
                 "weight sync: tensorferry WeightSync vs Ray nixl, 1 trainer -> 3 workers)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
