"""bench_pool's cases and timing, shared by its full run and its focused
``--only pack-copy`` mode: the 256 MiB storage and its views, the mixed
dtypes, the ``Case`` record, the timed-call helpers, and the pack-against-
one-plain-copy measurement (10k and 100k views, interleaved call by call)."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

import tensorferry

from _common import write_result

MIB = 1 << 20
# 256 MiB of float32: the storage every "views" case slices up.
STORAGE_NBYTES = 256 * MIB
VIEW_COUNTS = (1, 1_000, 10_000, 100_000)
MIXED_COUNT = 10_000
# 64 MiB keeps the mixed case copy-bound yet leaves its 10k per-tensor
# overheads visible; a quarter of the views' storage.
MIXED_NBYTES = 64 * MIB
# Metadata-only case for the layout math: offsets with padding at 100k.
MIXED_LAYOUT_COUNT = 100_000
SUBSET_EVERY = 8
# Views are cut on multiples of 16 elements, so half of them can be 2-D.
VIEW_GRAIN = 16
# Pools hold the largest case plus room for alignment padding.
POOL_NBYTES = STORAGE_NBYTES + MIB
REPEATS = 7
MIN_REPEATS = 3
# Sub-5 ms calls (the layout math, small unpacks) get more repeats: one
# scheduler hiccup on a shared machine is several ms, so a median of 7 such
# short calls is still noisy, and 25 cost nothing.
FAST_SECONDS = 0.005
FAST_REPEATS = 25
# A measurement whose warm-up took long gets fewer repeats: about this many
# seconds of timed calls each, never fewer than MIN_REPEATS.
SLOW_BUDGET_SECONDS = 2.5
MIXED_DTYPES = (
    # (dtype, weight): mostly float32/bfloat16 as in a model, plus every
    # element size from 1 to 8 so the layout needs padding.
    (torch.float32, 40),
    (torch.bfloat16, 20),
    (torch.float16, 10),
    (torch.int64, 8),
    (torch.float64, 5),
    (torch.int32, 5),
    (torch.int8, 5),
    (torch.uint8, 4),
    (torch.bool, 3),
)

# -- cases ---------------------------------------------------------------------


@dataclass
class Case:
    """One set of source tensors, packed by every implementation."""

    key: str
    label: str
    tensors: list[torch.Tensor]
    # Contiguous uint8 with the same byte count, for the plain-copy reference.
    copy_src: torch.Tensor
    num_views: int | None = None  # x position in the plot (views cases only)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.copy_src.numel())


def make_storage() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(STORAGE_NBYTES // 4, generator=gen, dtype=torch.float32)


def make_views(storage: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` adjacent views that tile ``storage``, half 2-D, half 1-D."""
    numel = storage.numel()
    if count == 1:
        side = int(round(numel**0.5))
        return [storage.view(side, numel // side)] if side * (numel // side) == numel else [storage]
    bounds = (np.linspace(0, numel // VIEW_GRAIN, count + 1).round().astype(np.int64) * VIEW_GRAIN).tolist()
    views = []
    for i in range(count):
        v = storage[bounds[i] : bounds[i + 1]]
        views.append(v.view(-1, VIEW_GRAIN) if i % 2 == 0 else v)
    return views


def mixed_sizes(count: int, total_nbytes: int, seed: int) -> tuple[list[torch.dtype], list[int]]:
    """Dtypes and element counts of ``count`` tensors of about ``total_nbytes``."""
    rng = np.random.default_rng(seed)
    dts = [d for d, _ in MIXED_DTYPES]
    w = np.array([w for _, w in MIXED_DTYPES], dtype=np.float64)
    picks = rng.choice(len(dts), size=count, p=w / w.sum())
    # Log-normal sizes: many small tensors (biases, norms), a few large ones.
    raw = rng.lognormal(mean=0.0, sigma=1.5, size=count)
    elem = np.array([torch.empty(0, dtype=dts[p]).element_size() for p in picks], dtype=np.float64)
    numels = np.maximum(1, (raw / (raw * elem).sum() * total_nbytes)).astype(np.int64)
    return [dts[p] for p in picks], numels.tolist()


def make_mixed(count: int, total_nbytes: int) -> list[torch.Tensor]:
    """``count`` separate tensors (own storages) of mixed dtypes, random bytes."""
    dtypes, numels = mixed_sizes(count, total_nbytes, seed=1)
    gen = torch.Generator().manual_seed(2)
    out = []
    for i, (dt, n) in enumerate(zip(dtypes, numels)):
        es = torch.empty(0, dtype=dt).element_size()
        if dt == torch.bool:
            t = torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8).view(torch.bool)
        else:
            t = torch.randint(0, 256, (n * es,), generator=gen, dtype=torch.uint8).view(dt)
        # Every third tensor 2-D when its size allows, as weight matrices are.
        if i % 3 == 0 and n % 8 == 0 and n >= 64:
            t = t.view(-1, 8)
        out.append(t)
    return out


def touched_bytes(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(7)
    return t


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# -- timing --------------------------------------------------------------------


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds one call takes (after a GC pass outside the timing), and its result."""
    gc.collect()
    t0 = time.perf_counter_ns()
    out = fn(*args)
    return (time.perf_counter_ns() - t0) * 1e-9, out


def repeats_for(warm_seconds: float) -> int:
    if warm_seconds < FAST_SECONDS:
        return FAST_REPEATS
    return max(MIN_REPEATS, min(REPEATS, int(SLOW_BUDGET_SECONDS / max(warm_seconds, 1e-9))))


def summary(samples: list[float]) -> dict[str, Any]:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "repeats": len(samples), "samples_s": samples}


# -- focused: pack against one plain copy ---------------------------------------


PACK_COPY_COUNTS = (10_000, 100_000)


def measure_pack_vs_copy(storage: torch.Tensor, pool: tensorferry.MemoryPool, copy_dst: torch.Tensor,
                         rounds: int) -> list[Case]:
    """``--only pack-copy``: a fresh pack of 10k and of 100k views of the
    256 MiB storage against one plain copy (``copy_``) and memcpy of the
    same bytes, interleaved call by call, ``rounds`` of each; no Ray, no
    memory children. Checked after timing: the unpacked views are the
    sources, byte for byte."""
    src = storage.view(torch.uint8)
    dst = copy_dst[: src.numel()]
    dst_np, src_np = dst.numpy(), src.numpy()
    cases = []
    for n in PACK_COPY_COUNTS:
        views = make_views(storage, n)
        case = Case(f"views_{n}", f"{n:,} views of 256 MiB", views, src, num_views=n)
        timed(dst.copy_, src)
        timed(np.copyto, dst_np, src_np)
        timed(pool.pack, views)[1].release()
        samples: dict[str, list[float]] = {"copy": [], "memcpy": [], "tf_pack": []}
        for _ in range(rounds):
            samples["copy"].append(timed(dst.copy_, src)[0])
            samples["memcpy"].append(timed(np.copyto, dst_np, src_np)[0])
            t, p = timed(pool.pack, views)
            samples["tf_pack"].append(t)
            p.release()
        case.results.update({k: summary(v) for k, v in samples.items()})
        p = pool.pack(views)
        out = pool.unpack(p)
        case.results["ok"] = len(out) == n and all(torch.equal(byte_view(o), byte_view(t)) for o, t in zip(out, views))
        case.results["tf_copy_runs"] = p.copy_runs
        case.results["num_tensors"] = n
        del out
        p.release()
        cases.append(case)
    return cases


def main_pack_copy(args: argparse.Namespace, env: dict[str, Any], load_start: tuple[float, ...],
                   storage: torch.Tensor, rounds: int) -> int:
    """``--only pack-copy``: measure, print and write the pack-against-copy ratios."""
    from _pool_report import pack_copy_targets, print_pack_copy

    t_start = time.perf_counter()
    pool = tensorferry.MemoryPool(POOL_NBYTES, prefault=True)
    cases = measure_pack_vs_copy(storage, pool, touched_bytes(STORAGE_NBYTES), rounds)
    env["loadavg_1min_start_end"] = [round(load_start[0], 2), round(os.getloadavg()[0], 2)]
    targets = pack_copy_targets({c.key: c for c in cases})
    print_pack_copy(cases, targets, env)
    doc = {
        "environment": env,
        "settings": {"storage_nbytes": STORAGE_NBYTES, "view_counts": PACK_COPY_COUNTS, "rounds": rounds,
                     "only": "pack-copy", "pretouched": "tensorferry pool prefault=True (MAP_POPULATE); copy dst filled"},
        "cases": {c.key: {"label": c.label, "num_views": c.num_views, **c.results} for c in cases},
        "targets": targets,
        "all_checks_ok": all(c.results["ok"] for c in cases),
        "wall_seconds": time.perf_counter() - t_start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_result(args.out / "bench_pool_pack_copy.json", doc, {f"pool:{t['key']}": t["measured"] for t in targets})
    print(f"wrote {path} ({doc['wall_seconds']:.0f} s)")
    if not doc["all_checks_ok"]:
        print("FAILED: an unpacked view differs from its source", file=sys.stderr)
        return 1
    return 0
