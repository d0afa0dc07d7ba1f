"""The transfer benchmarks' plots: the transports (fast path and receive
modes against their bounds) and the plans section (every case's median
sync beside the sender's memcpy)."""

from __future__ import annotations

from pathlib import Path

from _common import MIB

__all__ = ["plot_transports", "plot_plans"]

PLAN_HOW = {"plan": "planned", "plan-bf16": "planned, dtype=bfloat16", "plan-nosnap": "planned, snapshot=False",
            "fresh": "fresh put/get"}


def plot_plans(doc: dict, path: Path) -> None:
    """One panel per transport: every plans case's median sync (bars, by
    group), the sender's one memcpy in the same rounds as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["plans"]["rows"]
    transports = [t for t in ("shm", "tcp", "nixl") if any(r["transport"] == t for r in rows)]
    color = {"plan": "tab:blue", "plan-bf16": "tab:green", "plan-nosnap": "tab:purple", "fresh": "tab:gray"}
    fig, axes = plt.subplots(1, len(transports), figsize=(5.6 * len(transports), 6.4), squeeze=False)
    for ax, t in zip(axes[0], transports):
        mine = [r for r in rows if r["transport"] == t][::-1]
        ys = range(len(mine))
        vals = [r["sync_seconds"] * 1e3 for r in mine]
        ax.barh(ys, vals, color=[color[r["how"]] for r in mine], alpha=0.85)
        for y, v, r in zip(ys, vals, mine):
            ratio = f"  {r['vs_ref']:.2f}x" if "vs_ref" in r else ""
            ax.text(v, y, f" {v:,.0f} ms{ratio}", va="center", fontsize=7.5)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([f"{r['group']}: {PLAN_HOW[r['how']].replace('planned, ', '')}, {r['label']}" for r in mine],
                           fontsize=7.5)
        paired = doc["plans"].get("memcpy_rounds_median", {}).get(f"{t}:own")
        if paired:
            ax.axvline(paired * 1e3, ls="--", color="black", lw=1, label=f"one libc memcpy (sender), {paired * 1e3:.0f} ms")
            ax.legend(fontsize=7.5, loc="lower right")
        ax.set_xlim(0, max(vals) * 1.35)
        ax.set_xlabel("ms, put(plan) … get(into=plan) returned (median)")
        ax.set_title(t, fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    env = doc["env"]
    fig.suptitle(f"tensorferry plans: {env['nbytes'] / MIB:,.0f} MiB float32 synced between two processes, "
                 f"medians of {env['repeats']} syncs after the first\n{env['date']}, {env['machine']}, "
                 f"load {env['loadavg_1min']}-{env.get('loadavg_1min_end')}; ratios: vs the group's "
                 "planned 1 tensor (own, into) or float32 100k (wire)", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)



def plot_transports(doc: dict, nbytes: int, path: Path) -> None:
    """Left: the fast path, one line per transport, its bound as a dashed
    line of the same colour. Right: the other receive modes and the peers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = doc["env"]
    colors = {"shm": "tab:blue", "tcp": "tab:orange", "nixl": "tab:green"}
    bound = {"shm": "memcpy_libc", "tcp": "raw_tcp", "nixl": "raw_nixl"}
    bound_name = {"memcpy_libc": "one libc memcpy", "raw_tcp": "raw loopback TCP", "raw_nixl": "raw NIXL READ, 1 descriptor"}
    rows = doc["rows"]
    limits = doc["limits_summary"]
    transports = [t for t in ("shm", "tcp", "nixl") if any(r["transport"] == t for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 7.6))

    for t in transports:
        pts = sorted((r["count"], r["gbps"]) for r in rows if r["transport"] == t and r["mode"] == "pool" and r["kind"] == "views")
        if pts:
            ax1.plot(*zip(*pts), "o-", color=colors[t], lw=2.4, ms=7, label=f"{t}: copy into a prefaulted receive pool")
            dx, dy, ha = {"shm": (0, 8, "center"), "nixl": (9, -3, "left"), "tcp": (0, -14, "center")}[t]
            for x, y in pts:
                ax1.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8,
                             color=colors[t], fontweight="bold")
        for r in rows:
            if r["transport"] == t and r["mode"] == "pool" and r["kind"] == "separate":
                ax1.plot([r["count"]], [r["gbps"]], "o", mfc="white", mec=colors[t], mew=2, ms=9,
                         label=f"{t}: 10k separate tensors (own storages)")
        lk = bound[t]
        if lk in limits:
            ax1.axhline(limits[lk]["gbps"], ls="--", color=colors[t], lw=1.4,
                        label=f"{t}'s bound: {bound_name[lk]}, {limits[lk]['gbps']:.1f} GB/s")
    if "memcpy_parallel" in limits:
        ax1.axhline(limits["memcpy_parallel"]["gbps"], ls="-.", color=colors["shm"], lw=1.2,
                    label=f"libc memcpy on {env.get('copy_threads', '?')} threads at once, {limits['memcpy_parallel']['gbps']:.1f} GB/s")
    if "memcpy" in limits:
        ax1.axhline(limits["memcpy"]["gbps"], ls=":", color="gray", lw=1.3,
                    label=f"one torch copy_ of uint8, {limits['memcpy']['gbps']:.1f} GB/s")
    ax1.set_ylim(0, max([v["gbps"] for v in limits.values()] + [r["gbps"] for r in rows if r["mode"] == "pool"]) * 1.12)
    ax1.set_ylabel("GB/s, from put() to the receiver holding the data")
    ax1.set_title("fast path: Receiver with a receive pool (copy mode)", fontsize=10)

    for t in transports:
        for mode, style in (("pool", "o-"), ("new", "s:"), ("into", "^--"), ("zero_copy", "D-.")):
            pts = sorted((r["count"], r["gbps"]) for r in rows
                         if r["transport"] == t and r["mode"] == mode and r["kind"] == "views" and r["count"] in (1, 100_000))
            if pts:
                label = {"pool": "receive pool", "new": "new memory", "into": "into= existing tensors",
                         "zero_copy": "zero_copy (views, untouched)"}[mode]
                ax2.plot(*zip(*pts), style, color=colors[t], lw=2.2 if mode == "pool" else 1.4, ms=6,
                         alpha=1.0 if mode == "pool" else 0.8, label=f"{t}: {label}")
    peer_style = {"torch.multiprocessing queue": ("v-", "tab:purple"), "torch.save/socket/torch.load": ("x-", "tab:red")}
    for name, (style, color) in peer_style.items():
        pts = sorted((p["count"], p["gbps"]) for p in doc.get("peers", []) if p["peer"] == name)
        if pts:
            ax2.plot(*zip(*pts), style, color=color, lw=1.6, ms=7, label=f"peer: {name}")
    if "memcpy_libc" in limits:
        ax2.axhline(limits["memcpy_libc"]["gbps"], ls="--", color="black", lw=1.2,
                    label=f"one libc memcpy, {limits['memcpy_libc']['gbps']:.1f} GB/s")
    ax2.set_yscale("log")
    ax2.set_title("receive modes and what a user would otherwise do (log scale)", fontsize=10)

    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks([1, 10, 100, 1000, 10_000, 100_000])
        ax.set_xticklabels(["1", "10", "100", "1k", "10k", "100k"])
        ax.set_xlim(0.6, 3e5)
        ax.set_xlabel("number of float32 tensors, the same bytes in all (views of one flat buffer)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.suptitle(f"tensorferry: {nbytes / MIB:,.0f} MiB between two processes, medians of {env['repeats']} after a warm-up\n"
                 f"{env['date']}, {env['machine']}, torch threads {env['torch_threads']}, "
                 f"load {env['loadavg_1min']}-{env.get('loadavg_1min_end')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)

