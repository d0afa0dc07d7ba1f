"""``tensorferry demo``: a synthetic ~1 GiB state dict, packed and verified.

The pool scenario runs everywhere: pack into a MemoryPool, encode the layout
to bytes and back (what a receiver gets), rebuild zero-copy views, compare
every tensor with its source.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

__all__ = ["run_demo", "verify_same"]


def verify_same(expected: Any, got: Any, path: str = "obj") -> None:
    """Raise AssertionError naming the first tensor that differs."""
    import torch

    if isinstance(expected, dict):
        if not isinstance(got, dict) or list(expected) != list(got):
            raise AssertionError(f"{path}: keys differ")
        for k in expected:
            verify_same(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        if type(expected) is not type(got) or len(expected) != len(got):
            raise AssertionError(f"{path}: {type(expected).__name__} of {len(expected)} became {type(got).__name__}")
        for i, (e, g) in enumerate(zip(expected, got)):
            verify_same(e, g, f"{path}[{i}]")
    else:
        if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype or got.shape != expected.shape:
            raise AssertionError(f"{path}: expected {expected.dtype}{tuple(expected.shape)}, got {got!r:.80}")
        if not torch.equal(got, expected):
            raise AssertionError(f"{path}: values differ")


def _pool_scenario(sd: dict, repeats: int, progress: Any) -> dict:
    import torch

    from .pool import MemoryPool, unpack
    from .layout import Layout

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
        assert pool.stats().used_nbytes == 0
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
