"""bench_broadcast's summary (ratios and targets), table and plots."""

from __future__ import annotations

from pathlib import Path

from _common import MIB, med

TARGET_CHAIN_VS_ONE = 1.3
# Issue 47: at 16 receivers and more, the chain within 1.1x of one receiver.
TARGET_CHAIN_VS_ONE_AT_16 = 1.1
TARGET_FAULT_VS_FREE = 2.0

# -- summary, table, plot ------------------------------------------------------------------


def summarize(doc: dict) -> None:
    """Rows per strategy and N: medians, ratios to the same strategy's N=1
    and to the star's N=1, the line-rate limits; the fault case; the targets."""
    if "rounds" not in doc:  # a star-only result of the first version
        doc["rounds"], doc["fault"] = {"star": doc.pop("star")}, []
    env = doc["env"]
    line = env["nbytes"] * 8 / env["rate_bits"]
    rows: dict[str, list[dict]] = {}
    star1 = med([r["seconds"] for r in doc["rounds"]["star"]["1"]]) if "1" in doc["rounds"].get("star", {}) else None
    raw1 = med([r["seconds"] for r in doc["raw_star"]["1"]]) if "1" in doc["raw_star"] else None
    for strategy, by_n in doc["rounds"].items():
        one = med([r["seconds"] for r in by_n["1"]]) if "1" in by_n else None
        rows[strategy] = []
        for key in sorted(by_n, key=int):
            n, rounds = int(key), by_n[key]
            s = med([r["seconds"] for r in rounds])
            raw = med([r["seconds"] for r in doc["raw_star"][key]]) if strategy == "star" and key in doc["raw_star"] else None
            rows[strategy].append({
                "receivers": n,
                "seconds": s,
                "seconds_all": [r["seconds"] for r in rounds],
                "put_seconds": med([r["put_seconds"] for r in rounds]),
                "first_done_seconds": med([r["first_done_seconds"] for r in rounds]),
                "vs_one_receiver": s / one if one else None,
                "vs_star_one": s / star1 if star1 else None,
                "line_seconds": line,
                "star_bound_seconds": n * line,
                "vs_line": s / line,
                "sender_copies": med([r.get("sender_copies", n) for r in rounds]),
                "receiver_cpu_seconds_per_gib": med([r["receiver_cpu_seconds_per_gib"] for r in rounds])
                if all("receiver_cpu_seconds_per_gib" in r for r in rounds) else None,
                "raw_star_seconds": raw,
                "raw_vs_one_receiver": raw / raw1 if raw and raw1 else None,
                "verified": all(r.get("verified", True) for r in rounds) and any("verified" in r for r in rounds),
            })
    doc["rows"] = rows
    targets = {}
    for strategy in ("chain", "trees"):
        by_n = {r["receivers"]: r for r in rows.get(strategy, [])}
        if 1 in by_n and len(by_n) > 1:
            n = max(by_n)
            limit = TARGET_CHAIN_VS_ONE_AT_16 if n >= 16 else TARGET_CHAIN_VS_ONE
            targets[f"{strategy}: {n} receivers vs 1 (at most {limit}x)"] = (by_n[n]["vs_one_receiver"], limit)
    for strategy in sorted({r.get("strategy", "chain") for r in doc["fault"]}):
        faults = [r for r in doc["fault"] if r.get("strategy", "chain") == strategy]
        worst = max(r["seconds"] / r["fault_free_seconds"] for r in faults)
        targets[f"{strategy}, relay killed halfway: the others vs fault-free (at most {TARGET_FAULT_VS_FREE}x, worst of {len(faults)})"] = (
            worst, TARGET_FAULT_VS_FREE)
    doc["targets"] = {k: {"ratio": v, "target": t, "met": v <= t} for k, (v, t) in targets.items()}


def ratios(doc: dict) -> dict[str, float | None]:
    """The flat ratios interleave.py compares (after :func:`summarize`):
    each strategy and N against one copy at the line rate and against one
    receiver, and the receivers' CPU a GiB (seconds, not a ratio: B/A of
    it says whether a change costs CPU)."""
    out: dict[str, float | None] = {}
    for strategy, rows in doc["rows"].items():
        for r in rows:
            n = r["receivers"]
            out[f"{strategy} x{n} vs line"] = r["vs_line"]
            if n > 1:
                out[f"{strategy} x{n} vs 1 receiver"] = r["vs_one_receiver"]
            out[f"{strategy} x{n} receiver CPU s/GiB"] = r["receiver_cpu_seconds_per_gib"]
    return out


def repeats_text(env: dict) -> str:
    """``3`` or ``3 (star 1)``: the rounds per strategy."""
    r = env["repeats"]
    if isinstance(r, int):
        return str(r)
    common = max(set(r.values()), key=list(r.values()).count)
    odd = ", ".join(f"{k} {v}" for k, v in r.items() if v != common)
    return f"{common}" + (f" ({odd})" if odd else "")


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    env = doc["env"]
    con = Console(width=200)
    con.print(f"[bold]tensorferry broadcast benchmark[/] — {env['date']} — {env['machine']} — "
              f"{env['nbytes'] / MIB:,.0f} MiB over {env.get('transport', 'tcp')}, every link {env['rate']} ({env['rate_bits'] / 1e6:,.0f} Mbit/s) "
              f"both ways; medians of {repeats_text(env)} after {env['warmup']} warm-up; load {env['loadavg_1min_start_end']}")
    t = Table(title="time from put to the last receiver holding the bytes (s); vs 1: the same strategy's 1 receiver")
    strategies = list(doc["rows"])
    t.add_column("receivers", justify="right")
    for k in strategies:
        t.add_column(f"{k} s", justify="right")
        t.add_column(f"{k} vs 1", justify="right")
        t.add_column(f"{k} sender copies", justify="right")
        t.add_column(f"{k} CPU s/GiB", justify="right")
    t.add_column("one copy at line rate", justify="right")
    t.add_column("N copies (star bound)", justify="right")
    t.add_column("raw TCP star s", justify="right")
    t.add_column("verified", justify="right")
    by_n: dict[int, dict[str, dict]] = {}
    for k, rows in doc["rows"].items():
        for r in rows:
            by_n.setdefault(r["receivers"], {})[k] = r
    for n in sorted(by_n):
        cells = [str(n)]
        for k in strategies:
            r = by_n[n].get(k)
            cpu = r.get("receiver_cpu_seconds_per_gib") if r else None
            cells += [f"{r['seconds']:.2f}", f"{r['vs_one_receiver']:.2f}x" if r["vs_one_receiver"] else "-",
                      f"{r['sender_copies']:.2f}", f"{cpu:.2f}" if cpu is not None else "-"] if r else ["-", "-", "-", "-"]
        any_row = next(iter(by_n[n].values()))
        raw = by_n[n].get("star", {}).get("raw_star_seconds")
        cells += [f"{any_row['line_seconds']:.2f}", f"{any_row['star_bound_seconds']:.2f}", f"{raw:.2f}" if raw else "-",
                  "yes" if all(r["verified"] for r in by_n[n].values()) else "[red]NO[/]"]
        t.add_row(*cells)
    con.print(t)
    if doc["fault"]:
        f = Table(title="a relay SIGKILLed halfway through its receive (the chain's in its middle; the two trees' in host 2)")
        for col in ("round", "layout", "killed host", "seconds (last other receiver)", "fault-free s", "vs fault-free",
                    "sender copies", "verified"):
            f.add_column(col, justify="right")
        for k, r in enumerate(doc["fault"], 1):
            f.add_row(str(k), r.get("strategy", "chain"), str(r["killed_host"]), f"{r['seconds']:.2f}", f"{r['fault_free_seconds']:.2f}",
                      f"{r['seconds'] / r['fault_free_seconds']:.2f}x", f"{r['sender_copies']:.2f}", "yes" if r.get("verified") else "[red]NO[/]")
        con.print(f)
    for name, v in doc.get("targets", {}).items():
        con.print(f"target {name}: {v['ratio']:.2f}x — " + ("[green]met[/]" if v["met"] else "[red]not met[/]"))
    for e in doc["errors"]:
        con.print(f"[red]error:[/] {e}")


def plot(doc: dict, path: Path) -> None:
    """Time against receivers: one line per strategy, the raw TCP star, and
    the line-rate limits (one copy: the ideal of a relay; N copies: the
    star's bound)."""
    names = {"star": "star (every receiver pulls from the sender)", "chain": "chain (fanout=1, relays)",
             "tree": "tree (fanout=2, relays)", "trees": "two trees (trees=True, relays)"}
    rows = doc["rows"]
    strategies = {names.get(k, k): {r["receivers"]: r["seconds"] for r in rs} for k, rs in rows.items()}
    any_rows = next(iter(rows.values()))
    references = {
        "raw TCP star (plain sockets, same links)": {r["receivers"]: r["raw_star_seconds"] for r in rows.get("star", []) if r["raw_star_seconds"]},
        "N copies at the line rate (the star's bound)": {r["receivers"]: r["star_bound_seconds"] for r in any_rows},
        "one copy at the line rate (what a relay approaches)": {r["receivers"]: r["line_seconds"] for r in any_rows},
    }
    plot_strategies(strategies, references, doc["env"], path)


def plot_strategies(strategies: dict[str, dict[int, float]], references: dict[str, dict[int, float]], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.6))
    markers = "osD^v"
    for k, (name, pts) in enumerate(strategies.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], f"{markers[k % len(markers)]}-", lw=2.4, ms=7, label=name)
        for x in xs:
            ax.annotate(f"{pts[x]:.1f} s", (x, pts[x]), textcoords="offset points", xytext=(6, -12), fontsize=8)
    for (name, pts), style in zip(references.items(), ("x--", ":", "-.")):
        if pts:
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], style, color="gray", lw=1.4, label=name)
    ns = sorted({x for pts in strategies.values() for x in pts})
    ax.set_xticks(ns)
    ax.set_xlabel("receivers (each on its own host)")
    ax.set_ylabel("seconds until every receiver holds the object")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8.5, loc="upper left")
    ax.set_title(f"broadcast of {env['nbytes'] / MIB:,.0f} MiB over {env.get('transport', 'tcp')} from one sender, every link {env['rate']} both ways\n"
                 f"{env['date']}, {env['machine']}, medians of {repeats_text(env)}, "
                 f"load {env['loadavg_1min_start_end'][0]}-{env['loadavg_1min_start_end'][1]}", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
