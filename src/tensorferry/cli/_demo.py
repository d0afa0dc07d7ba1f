"""``tensorferry demo``: a synthetic ~1 GiB state dict, packed and verified.

The pool scenario runs everywhere: pack into a MemoryPool, encode the layout
to bytes and back (what a receiver gets), rebuild zero-copy views, compare
every tensor with its source.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ..errors import ConfigurationError, TransferError
from ..wire import TRANSPORTS
from ._synthetic import verify_same

__all__ = ["run_demo", "check_demo_args"]

# The scenarios -t accepts; "pool" runs in-process, the rest are transports.
_SCENARIOS = ("pool", *TRANSPORTS)
# A synthetic layer is 4 tensors, at least a 4x4 float32 weight (64 bytes)
# plus its bias, norm and step (~100 bytes): more than one tensor per 64
# bytes and the state dict outgrows --size-mib.
_MIN_NBYTES_PER_TENSOR = 64


def check_demo_args(args: argparse.Namespace) -> None:
    """Reject option values the demo cannot run with, before it builds anything.

    Sets ``args.transport_list`` to the transports to run (``pool`` aside).

    Raises:
        ConfigurationError: names the option, its value, and what would work.
    """
    from ..transports import available
    from ..wire import MAX_TENSORS

    if args.size_mib < 1:
        raise ConfigurationError(f"--size-mib {args.size_mib}: the state dict needs at least 1 MiB")
    total = args.size_mib << 20
    host_nbytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if total > host_nbytes:
        raise ConfigurationError(
            f"--size-mib {args.size_mib}: {total:,} bytes exceed this host's {host_nbytes:,} bytes of memory; "
            f"choose at most {host_nbytes >> 20} MiB (the demo holds several copies: a quarter of that is safer)"
        )
    most = min(MAX_TENSORS, total // _MIN_NBYTES_PER_TENSOR)
    if not 4 <= args.tensors <= most:
        raise ConfigurationError(
            f"--tensors {args.tensors}: choose from 4 (one synthetic layer) to {most:,} "
            f"(one tensor per {_MIN_NBYTES_PER_TENSOR} bytes of --size-mib {args.size_mib})"
        )
    if args.repeats < 1:
        raise ConfigurationError(f"--repeats {args.repeats}: run at least 1 sync per scenario")
    if args.transports.strip() == "auto":
        args.transport_list = available()
        return
    names = [t.strip() for t in args.transports.split(",")]
    unknown = [t for t in names if t not in _SCENARIOS]
    if unknown:
        raise ConfigurationError(
            f"--transports {args.transports!r}: unknown scenario {unknown[0]!r}; "
            f"give a comma-separated list of {', '.join(_SCENARIOS)}, or auto"
        )
    here = available()
    missing = [t for t in names if t != "pool" and t not in here]
    if missing:
        raise ConfigurationError(
            f"--transports {args.transports!r}: {', '.join(missing)} is not available on this machine "
            f"(available: pool, {', '.join(here)}); see `tensorferry info`"
        )
    args.transport_list = list(dict.fromkeys(t for t in names if t != "pool"))


def _pool_scenario(sd: dict, repeats: int, progress: Any) -> dict:
    from ..memory import MemoryPool, unpack
    from ..wire import Layout

    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    times = []
    with MemoryPool(nbytes + (1 << 20), prefault=True) as pool:
        task = progress.add_task("pool: pack + unpack", total=repeats)
        for _ in range(repeats):
            t0 = time.perf_counter()
            packed = pool.pack(sd)
            times.append(time.perf_counter() - t0)
            wire = packed.layout.to_bytes()
            layout = Layout.from_bytes(wire)
            blocks = [pool.view(b).clone() for b in packed.blocks]  # what a receiver holds
            got = unpack(blocks, layout)
            verify_same(sd, got)
            stats = packed
            packed.release()
            progress.advance(task)
        left = pool.stats().used_nbytes
        if left:
            raise TransferError(f"pool: {left:,} bytes still in use after every Packed was released")
    best = sorted(times)[len(times) // 2]
    return {
        "scenario": "pool (pack+unpack)",
        "tensors": stats.num_tensors,
        "nbytes": stats.nbytes,
        "blocks": len(stats.blocks),
        "copy_runs": stats.copy_runs,
        "seconds": best,
        "layout_bytes": len(wire),
        "verified": True,
    }


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from ._synthetic import synthetic_state_dict

    # Wide enough for the table even when stdout is not a terminal.
    console = Console(width=max(Console().width, 100))
    total = args.size_mib << 20
    console.print(f"building a synthetic state dict: ~{args.size_mib} MiB in ~{args.tensors} tensors")
    sd = synthetic_state_dict(total, args.tensors)
    rows = []
    with Progress(console=console, disable=args.no_progress, transient=True) as progress:
        rows.append(_pool_scenario(sd, args.repeats, progress))
        try:
            from ._demo_transfer import transfer_scenarios
        except ImportError:
            transfer_scenarios = None
        if transfer_scenarios is not None:
            rows.extend(transfer_scenarios(sd, args, progress))
    table = Table(title="tensorferry demo (median of repeats)")
    for col in ("scenario", "tensors", "GB/s", "ms/sync", "blocks", "copy runs", "ticket B", "verified"):
        table.add_column(col, justify="right" if col not in ("scenario",) else "left", no_wrap=True)
    for r in rows:
        table.add_row(
            r["scenario"],
            f"{r['tensors']:,}",
            f"{r['nbytes'] / r['seconds'] / 1e9:.2f}",
            f"{r['seconds'] * 1e3:.1f}",
            str(r["blocks"]),
            str(r.get("copy_runs", "-")),
            f"{r['layout_bytes']:,}",
            "yes" if r["verified"] else "NO",
        )
    console.print(table)
    console.print("GB/s counts the bytes every worker received; ticket B is the size of the layout (pool) or ticket.")
    return 0
