"""bench_pool's report: its targets, tables and plot (bench_pool.py measures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _common import MIB
from _harness import print_targets

__all__ = ["TARGETS", "compute_targets", "pack_copy_targets", "print_pack_copy", "print_tables", "plot"]

TARGETS = (
    # (key, description, required ratio, how the ratio reads)
    ("pack_10k_vs_ray", "pack 10k views vs Ray allocate_group", 4.0, "Ray / tensorferry >= 4"),
    ("pack_10k_vs_copy", "pack 10k views vs one plain copy", 2.5, "tensorferry / copy <= 2.5"),
    ("pack_100k_vs_ray", "pack 100k views vs Ray allocate_group", 10.0, "Ray / tensorferry >= 10"),
    ("pack_100k_vs_copy", "pack 100k views vs one plain copy", 1.2, "tensorferry / copy <= 1.2"),
    ("layout_100k_vs_ray", "offsets + grouping, 100k tensors vs Ray pair", 20.0, "Ray / tensorferry >= 20"),
    ("rss_256mib_1", "peak RSS growth, first pack of 256 MiB as 1 tensor", 5.0, "<= 5 % of packed bytes"),
    ("rss_256mib_100k", "peak RSS growth, first pack of 256 MiB as 100k views", 5.0, "<= 5 % of packed bytes"),
)


def ms(s: float) -> str:
    return f"{s * 1e3:,.2f}" if s < 10 else f"{s * 1e3:,.0f}"


def med(case: Any, key: str) -> float:
    return case.results[key]["median_s"]


def fastest_copy(case: Any) -> tuple[float, str]:
    """The faster of the two plain copies of the same bytes (torch's
    ``copy_`` or libc's memcpy by ``np.copyto``), and its name: the pack
    targets are judged against it, the stricter peer."""
    return min((med(case, "copy"), "copy_"), (med(case, "memcpy"), "memcpy"))


def _vs_copy(case: Any) -> tuple[float, str]:
    best, name = fastest_copy(case)
    return med(case, "tf_pack") / best, (f"vs {name}, the faster plain copy; vs copy_ {med(case, 'tf_pack') / med(case, 'copy'):.2f}x, "
                                         f"vs memcpy {med(case, 'tf_pack') / med(case, 'memcpy'):.2f}x")


def compute_targets(cases: dict[str, Any], layout_only: dict[str, Any], memory: dict[str, Any]) -> list[dict[str, Any]]:
    c10k, c100k = cases["views_10000"], cases["views_100000"]

    measured = {
        "pack_10k_vs_ray": med(c10k, "ray_alloc") / med(c10k, "tf_pack"),
        "pack_10k_vs_copy": _vs_copy(c10k)[0],
        "pack_100k_vs_ray": med(c100k, "ray_alloc") / med(c100k, "tf_pack"),
        "pack_100k_vs_copy": _vs_copy(c100k)[0],
        "layout_100k_vs_ray": med(c100k, "ray_layout") / med(c100k, "tf_layout"),
        "rss_256mib_1": memory["views_1"]["tensorferry"]["cold"]["peak_growth_pct"],
        "rss_256mib_100k": memory["views_100000"]["tensorferry"]["cold"]["peak_growth_pct"],
    }
    warm_100k = memory["views_100000"]["tensorferry"]["warm"]["peak_growth_pct"]
    ray_100k = memory["views_100000"]["ray"]["cold"]["peak_growth_pct"]
    extra = {
        "pack_10k_vs_copy": _vs_copy(c10k)[1],
        "pack_100k_vs_copy": _vs_copy(c100k)[1],
        "rss_256mib_100k": f"second pack {warm_100k:.2f} %; Ray's first {ray_100k:.2f} %",
        "layout_100k_vs_ray": (
            "mixed dtypes (with padding): "
            f"{layout_only['ray_layout']['median_s'] / layout_only['tf_layout']['median_s']:.1f}x"
        ),
    }
    out = []
    for key, desc, need, reads in TARGETS:
        value = measured[key]
        met = value <= need if key.endswith("_vs_copy") or key.startswith("rss_") else value >= need
        out.append({"key": key, "target": desc, "required": reads, "measured": value, "met": bool(met),
                    "note": extra.get(key, "")})
    return out


def pack_copy_targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """The pack-against-copy targets of ``--only pack-copy`` (the full run's keys)."""
    out = []
    for key, desc, need, reads in TARGETS:
        if key.endswith("_vs_copy"):
            c = cases["views_10000" if key.startswith("pack_10k") else "views_100000"]
            value, note = _vs_copy(c)
            out.append({"key": key, "target": desc, "required": reads, "measured": value, "met": bool(value <= need), "note": note})
    return out


def print_pack_copy(cases: list[Any], targets: list[dict[str, Any]], env: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    con.print(f"[bold]tensorferry pool benchmark, pack against one plain copy[/] — {env['date']} — {env['machine']} — "
              f"commit {env['git_commit'][:7]}{' (pool sources modified)' if env['src_modified'] else ''}")
    con.print(f"medians in ms of calls interleaved round by round; torch threads {env['torch_threads']}; "
              f"load average {env['loadavg_1min_start_end']} (start, end)")
    t = Table(title="pack: copy the views' bytes into a pool")
    for col in ("case", "tensors", "runs", "rounds", "plain copy_", "memcpy", "tf pack", "tf/copy_", "tf/memcpy", "ok"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for c in cases:
        r = c.results
        t.add_row(c.label, f"{r['num_tensors']:,}", f"{r['tf_copy_runs']:,}", f"{r['tf_pack']['repeats']}",
                  ms(med(c, "copy")), ms(med(c, "memcpy")), ms(med(c, "tf_pack")),
                  f"{med(c, 'tf_pack') / med(c, 'copy'):.2f}x", f"{med(c, 'tf_pack') / med(c, 'memcpy'):.2f}x",
                  "yes" if r["ok"] else "[red]NO[/]")
    con.print(t)
    print_targets(con, targets)


def print_tables(cases: list[Any], layout_only: dict[str, Any], memory: dict[str, Any],
                 targets: list[dict[str, Any]], env: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    con.print(f"[bold]tensorferry pool benchmark[/] — {env['date']} — {env['machine']} — "
              f"commit {env['git_commit'][:7]}{' (pool sources modified)' if env['src_modified'] else ''}")
    con.print(f"medians in ms; pack excludes release (timed separately); pools and destinations pre-touched; "
              f"torch threads {env['torch_threads']}; load average {env['loadavg_1min_start_end']} (start, end)")

    t = Table(title="pack: copy the views' bytes into a pool")
    for col in ("case", "tensors", "MiB", "runs", "plain copy_", "memcpy", "tf pack", "Ray alloc_group",
                "Ray/tf", "tf/copy_", "tf/memcpy", "tf GB/s", "tf release", "Ray free", "ok"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for c in cases:
        r = c.results
        t.add_row(
            c.label, f"{r['num_tensors']:,}", f"{c.nbytes / MIB:,.1f}", f"{r['tf_copy_runs']:,}",
            ms(med(c, "copy")), ms(med(c, "memcpy")), ms(med(c, "tf_pack")), ms(med(c, "ray_alloc")),
            f"{med(c, 'ray_alloc') / med(c, 'tf_pack'):.2f}x", f"{med(c, 'tf_pack') / med(c, 'copy'):.2f}x",
            f"{med(c, 'tf_pack') / med(c, 'memcpy'):.2f}x",
            f"{c.nbytes / med(c, 'tf_pack') / 1e9:.2f}", ms(med(c, "tf_release")), ms(med(c, "ray_free")),
            "yes" if r["ok"] else "[red]NO[/]",
        )
    con.print(t)

    t = Table(title="receiver side: offsets + grouping (layout math), and unpack (views)")
    for col in ("case", "tensors", "tf offsets+group", "Ray pair", "Ray/tf", "tf unpack", "unpack/copy"):
        t.add_column(col, justify="left" if col == "case" else "right")
    for c in cases:
        r = c.results
        t.add_row(c.label, f"{r['num_tensors']:,}", ms(med(c, "tf_layout")), ms(med(c, "ray_layout")),
                  f"{med(c, 'ray_layout') / med(c, 'tf_layout'):.1f}x", ms(med(c, "tf_unpack")),
                  f"{med(c, 'tf_unpack') / med(c, 'copy'):.2f}x")
    lo = layout_only
    t.add_row(f"{lo['num_tensors']:,} mixed dtypes (metadata only)", f"{lo['num_tensors']:,}",
              ms(lo["tf_layout"]["median_s"]), ms(lo["ray_layout"]["median_s"]),
              f"{lo['ray_layout']['median_s'] / lo['tf_layout']['median_s']:.1f}x", "-", "-")
    con.print(t)

    t = Table(title="peak RSS growth during one pack beyond the touched pool and sources "
              "(fresh process each; VmHWM after a clear_refs reset; KiB)")
    for col in ("case", "MiB packed", "impl", "cold peak", "cold %", "cold sampled", "cold retained",
                "warm peak", "warm %"):
        t.add_column(col, justify="left" if col in ("case", "impl") else "right")
    by_key = {c.key: c for c in cases}
    for key in [k for k in memory if k != "hwm_reset_works"]:  # measure_memory's cases, in its order
        for impl in ("tensorferry", "ray"):
            cold, warm = memory[key][impl]["cold"], memory[key][impl]["warm"]
            t.add_row(by_key[key].label, f"{cold['packed_nbytes'] / MIB:,.1f}", impl,
                      f"{cold['peak_growth_nbytes'] / 1024:,.0f}", f"{cold['peak_growth_pct']:.2f}",
                      f"{cold['sampled_peak_growth_nbytes'] / 1024:,.0f}",
                      f"{cold['retained_growth_nbytes'] / 1024:,.0f}",
                      f"{warm['peak_growth_nbytes'] / 1024:,.0f}", f"{warm['peak_growth_pct']:.2f}")
    con.print(t)
    if not memory["hwm_reset_works"]:
        con.print("[red]warning: resetting VmHWM through /proc/self/clear_refs did not work here[/]")

    print_targets(con, targets, unit_of=lambda tg: " %" if tg["key"].startswith("rss_") else "x")


def plot(cases: list[Any], path: Path, env: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    views = [c for c in cases if c.num_views is not None]
    x = [c.num_views for c in views]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.4))
    ser = lambda key: [med(c, key) * 1e3 for c in views]  # noqa: E731
    ax1.plot(x, ser("tf_pack"), "o-", color="tab:blue", lw=2, label="tensorferry pack")
    ax1.plot(x, ser("ray_alloc"), "s-", color="tab:red", lw=2, label="Ray MemoryPoolManager.allocate_group")
    ax1.plot(x, ser("copy"), "--", color="black", lw=1.5, label="one plain copy of the same 256 MiB")
    ax1.plot(x, ser("memcpy"), ":", color="gray", lw=1.5, label="memcpy of the same 256 MiB (np.copyto)")
    ax1.set_title("sender: pack 256 MiB split into N float32 views")
    ax2.plot(x, ser("tf_layout"), "o-", color="tab:blue", lw=2, label="tensorferry packed_offsets + group_by_block")
    ax2.plot(x, ser("ray_layout"), "s-", color="tab:red", lw=2, label="Ray packed_offsets + group_tensors_by_desc")
    ax2.plot(x, ser("tf_unpack"), "^-", color="tab:green", lw=2, label="tensorferry unpack (build N views)")
    ax2.plot(x, ser("copy"), "--", color="black", lw=1.5, label="one plain copy of the same 256 MiB")
    ax2.set_title("receiver: layout math and views for N tensors")
    # Ray / tensorferry ratio at each point, next to Ray's marker.
    for ax, ray_key, tf_key in ((ax1, "ray_alloc", "tf_pack"), (ax2, "ray_layout", "tf_layout")):
        for xi, r, t in zip(x, ser(ray_key), ser(tf_key)):
            ax.annotate(f"{r / t:.1f}x", (xi, r), textcoords="offset points", xytext=(-6, 7), ha="right",
                        fontsize=8, color="tab:red",
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("number of views N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    ax1.set_ylabel("median time per call (ms, log)")
    fig.text(0.5, 0.005, "red labels: Ray time / tensorferry time", ha="center", fontsize=8, color="tab:red")
    fig.suptitle(f"tensorferry vs Ray 2.60 pool — {env['date']}, {env['machine']}, torch threads {env['torch_threads']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
