"""Pool benchmark: tensorferry's pack/unpack and layout math against Ray's pool.

Measures, side by side in one run and on the same tensors:

* ``MemoryPool.pack`` against Ray 2.60's own pool,
  ``ray.experimental.rdt.nixl_memory_pool.MemoryPoolManager.allocate_group``
  (constructed standalone: it is a torch tensor plus a free list, and NIXL
  registration is a separate call Ray makes after construction, which
  ``allocate_group`` never touches);
* ``layout.packed_offsets`` + ``layout.group_by_block`` against Ray's
  pure-Python ``packed_offsets`` + ``group_tensors_by_desc``;
* one plain copy of the same bytes (``dst.copy_(src)``, contiguous uint8,
  into already-touched anonymous memory), the limit a pack can approach, and
  libc ``memcpy`` of the same bytes (``np.copyto``, which tensorferry itself
  uses for large CPU runs), the floor below it;
* ``MemoryPool.unpack`` (building the views) against that same plain copy;
* the process's peak RSS growth during a pack, beyond the touched pool.

Every pool and destination is touched before timing, so page faults are not
measured. Releasing a pack (``Packed.release()``, Ray's ``free_object``) is
timed separately, OUTSIDE the pack timing, for both. Peak RSS is measured in a
fresh process per implementation and case (VmHWM after resetting it through
/proc/self/clear_refs), so memory an earlier pack freed into malloc's free
lists cannot hide an allocation. Results are checked after timing: the
unpacked tensors are byte-for-byte the sources, Ray's returned regions decode
(with Ray's own functions) to the sources, and both layout implementations
give the same offsets and groups.

torch runs with ONE intra-op thread by default (``--threads``). Every
implementation copies with torch's ``copy_``, and on a small shared machine a
parallel copy region stalls for a whole scheduler slice whenever the other
core is busy (measured here: Ray's 1k-view ``allocate_group`` took 0.4-2.7 s
with 2 threads under load, a steady 55 ms with 1); with 2 threads the ratios
would measure the neighbours rather than the code.

Run: ``.venv/bin/python benchmarks/bench_pool.py`` (``--profile`` adds a
cProfile of tensorferry's pack and unpack of 100k views and pack of the mixed
10k; ``--threads 2`` uses both cores for the copies). Writes
``benchmarks/results/bench_pool.json`` and ``benchmarks/results/bench_pool.png``.
"""

from __future__ import annotations

import os

# Nothing here starts a NIXL agent, but importing Ray's RDT package may load
# UCX-aware code; keep it on loopback like the rest of the project.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tensorferry

from ray.experimental.rdt import nixl_memory_pool as ray_pool

from _common import check_peak_reset, environment as common_environment, peak_rss_growth, results_dir, write_result
from _harness import PACKING, private
from _pool_cases import (
    STORAGE_NBYTES,
    VIEW_COUNTS,
    MIXED_COUNT,
    MIXED_NBYTES,
    MIXED_LAYOUT_COUNT,
    SUBSET_EVERY,
    POOL_NBYTES,
    REPEATS,
    MIN_REPEATS,
    FAST_REPEATS,
    MIXED_DTYPES,
    Case,
    make_storage,
    make_views,
    mixed_sizes,
    make_mixed,
    touched_bytes,
    byte_view,
    timed,
    repeats_for,
    summary,
    main_pack_copy,
)
from _pool_report import compute_targets, plot, print_tables

# tensorferry's layout math (packed offsets, blocks), where the tree keeps it.
tf_layout = private(PACKING)
# The pool's sources (for the record of whether they differ from the commit):
# the flat tree's modules, the layered tree's folders.
POOL_SOURCES = ("pool.py", "packing.py", "_tensors.py", "_copy", "layout.py", "memory", "wire", "tensors", "copy")

RESULTS_DIR = results_dir()


def build_cases(storage: torch.Tensor) -> list[Case]:
    cases = []
    storage_bytes = storage.view(torch.uint8)
    views_by_count = {}
    for n in VIEW_COUNTS:
        views = make_views(storage, n)
        views_by_count[n] = views
        label = f"{n:,} view{'s' if n > 1 else ''} of 256 MiB"
        cases.append(Case(f"views_{n}", label, views, storage_bytes, num_views=n))
    mixed = make_mixed(MIXED_COUNT, MIXED_NBYTES)
    mixed_nbytes = sum(t.numel() * t.element_size() for t in mixed)
    cases.append(Case("mixed_10000", f"{MIXED_COUNT:,} separate, mixed dtypes", mixed, touched_bytes(mixed_nbytes)))
    for n in (10_000, 100_000):
        sub = views_by_count[n][::SUBSET_EVERY]
        sub_nbytes = sum(t.numel() * t.element_size() for t in sub)
        cases.append(
            Case(f"subset_{n}", f"1 in {SUBSET_EVERY} of {n:,} views", sub, touched_bytes(sub_nbytes))
        )
    return cases


def measure_case(case: Case, pool: tensorferry.MemoryPool, ray_mgr: Any, copy_dst: torch.Tensor) -> None:
    tensors = case.tensors
    nbytes = case.nbytes
    dst = copy_dst[:nbytes]
    pool_dst = pool.buffer[:nbytes]
    src = case.copy_src
    dst_np, src_np = dst.numpy(), src.numpy()
    res = case.results

    # Metadata both layout implementations start from (built outside the timing,
    # as each side has it before the math: Ray from tensor_meta, tf from Layout).
    lay_nbytes = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
    lay_align = np.array([t.element_size() for t in tensors], dtype=np.int64)
    ray_layouts = [ray_pool.TensorLayout(int(n), int(a)) for n, a in zip(lay_nbytes, lay_align)]

    def tf_layout_math() -> tuple[np.ndarray, int, Any]:
        offsets, total = tf_layout.packed_offsets(lay_nbytes, lay_align)
        groups = tf_layout.group_by_block(lay_nbytes, lay_align, [total])
        return offsets, total, groups

    def ray_layout_math() -> tuple[list[int], int, list[list[int]]]:
        offsets, total = ray_pool.packed_offsets(ray_layouts)
        groups = ray_pool.group_tensors_by_desc(ray_layouts, [total])
        return offsets, total, groups

    # Warm-up (untimed): first-call costs, and how slow each one is.
    warm: dict[str, float] = {}
    warm["copy"], _ = timed(dst.copy_, src)
    warm["copy_pool"], _ = timed(pool_dst.copy_, src)
    warm["memcpy"], _ = timed(np.copyto, dst_np, src_np)
    warm["tf_pack"], p = timed(pool.pack, tensors)
    warm["tf_unpack"], u = timed(pool.unpack, p)
    del u
    p.release()
    warm["ray_alloc"], r = timed(ray_mgr.allocate_group, "bench", tensors)
    del r
    ray_mgr.free_object("bench")
    warm["tf_layout"], _ = timed(tf_layout_math)
    warm["ray_layout"], _ = timed(ray_layout_math)
    reps = {k: repeats_for(v) for k, v in warm.items()}

    samples: dict[str, list[float]] = {k: [] for k in
        ("copy", "copy_pool", "memcpy", "tf_pack", "tf_release", "ray_alloc", "ray_free", "tf_unpack", "tf_layout", "ray_layout")}
    for i in range(max(reps.values())):
        # Interleaved, so drift in the machine's speed hits all alike.
        if i < reps["copy"]:
            samples["copy"].append(timed(dst.copy_, src)[0])
        if i < reps["copy_pool"]:
            samples["copy_pool"].append(timed(pool_dst.copy_, src)[0])
        if i < reps["memcpy"]:
            samples["memcpy"].append(timed(np.copyto, dst_np, src_np)[0])
        if i < reps["tf_pack"]:
            t, p = timed(pool.pack, tensors)
            samples["tf_pack"].append(t)
            if i < reps["tf_unpack"]:
                t, u = timed(pool.unpack, p)
                samples["tf_unpack"].append(t)
                del u
            samples["tf_release"].append(timed(p.release)[0])
            del p
        if i < reps["ray_alloc"]:
            t, r = timed(ray_mgr.allocate_group, "bench", tensors)
            samples["ray_alloc"].append(t)
            del r
            samples["ray_free"].append(timed(ray_mgr.free_object, "bench")[0])
        if i < reps["tf_layout"]:
            samples["tf_layout"].append(timed(tf_layout_math)[0])
        if i < reps["ray_layout"]:
            samples["ray_layout"].append(timed(ray_layout_math)[0])
    for k, v in samples.items():
        res[k] = summary(v)

    # -- checks, after timing ---------------------------------------------------
    checks: dict[str, Any] = {}
    dst.copy_(src)
    checks["copy_equal"] = bool(torch.equal(dst, src))

    p = pool.pack(tensors)
    checks["tf_nbytes"] = p.nbytes == nbytes
    checks["tf_num_tensors"] = p.num_tensors == len(tensors)
    # View-only copy: the pool holds the views' bytes (plus alignment), never
    # the storages behind them.
    used = pool.stats().used_nbytes
    _, packed_total, _ = tf_layout_math()
    checks["tf_pool_used_nbytes"] = used
    checks["tf_used_is_view_bytes"] = (
        used == tf_layout.align_up(packed_total, 16) and packed_total - nbytes < 16 * len(tensors)
    )
    out = pool.unpack(p)
    checks["tf_unpack_equal"] = len(out) == len(tensors) and all(
        o.dtype == t.dtype and o.shape == t.shape and torch.equal(byte_view(o), byte_view(t))
        for o, t in zip(out, tensors)
    )
    res["tf_copy_runs"] = p.copy_runs
    res["tf_strided_copies"] = p.strided_copies
    res["tf_blocks"] = len(p.blocks)
    del out
    p.release()

    regions = ray_mgr.allocate_group("bench", tensors)
    region_nbytes = [int(r.numel()) for r in regions]
    desc_groups = ray_pool.group_tensors_by_desc(ray_layouts, region_nbytes)
    ok = sum(region_nbytes) >= nbytes
    for reg, grp in zip(regions, desc_groups):
        offs, _ = ray_pool.packed_offsets([ray_layouts[j] for j in grp])
        for off, j in zip(offs, grp):
            t = tensors[j]
            n = ray_layouts[j].nbytes
            ok = ok and torch.equal(reg[off : off + n], byte_view(t))
    checks["ray_regions_equal"] = bool(ok)
    res["ray_blocks"] = len(regions)
    del regions
    ray_mgr.free_object("bench")

    tf_off, tf_total, tf_groups = tf_layout_math()
    ray_off, ray_total, ray_groups = ray_layout_math()
    checks["layout_offsets_agree"] = bool(np.array_equal(tf_off, np.asarray(ray_off, dtype=np.int64)))
    checks["layout_totals_agree"] = tf_total == ray_total
    checks["layout_groups_agree"] = tf_groups.bounds.tolist() == [0] + [g[-1] + 1 for g in ray_groups]
    res["checks"] = checks
    res["ok"] = all(v for k, v in checks.items() if isinstance(v, bool))
    res["nbytes"] = nbytes
    res["num_tensors"] = len(tensors)


def measure_layout_only(count: int) -> dict[str, Any]:
    """Offsets + grouping from metadata alone (no tensors): 100k mixed dtypes."""
    dtypes, numels = mixed_sizes(count, MIXED_NBYTES, seed=3)
    es = {d: torch.empty(0, dtype=d).element_size() for d, _ in MIXED_DTYPES}
    align = np.array([es[d] for d in dtypes], dtype=np.int64)
    nb = np.array(numels, dtype=np.int64) * align
    ray_layouts = [ray_pool.TensorLayout(int(n), int(a)) for n, a in zip(nb, align)]

    def tf_math():
        off, total = tf_layout.packed_offsets(nb, align)
        return off, total, tf_layout.group_by_block(nb, align, [total])

    def ray_math():
        off, total = ray_pool.packed_offsets(ray_layouts)
        return off, total, ray_pool.group_tensors_by_desc(ray_layouts, [total])

    timed(tf_math)
    w, _ = timed(ray_math)
    tf_s = [timed(tf_math)[0] for _ in range(FAST_REPEATS)]
    ray_s = [timed(ray_math)[0] for _ in range(repeats_for(w))]
    a, b = tf_math(), ray_math()
    padded = int(a[1]) - int(nb.sum())
    ok = bool(np.array_equal(a[0], np.asarray(b[0]))) and a[1] == b[1]
    return {"tf_layout": summary(tf_s), "ray_layout": summary(ray_s), "ok": ok,
            "num_tensors": count, "padding_nbytes": padded}


# -- memory --------------------------------------------------------------------


MEMORY_CASES = ("views_1", "views_100000", "mixed_10000")


def memory_child(impl: str, case_key: str) -> dict[str, Any]:
    """In a fresh process: RSS growth of the first ("cold") and second pack.

    A fresh process per measurement, so memory freed by an earlier pack and
    still resident in malloc's free lists cannot hide an allocation. The pool
    and the sources are touched before either pack.
    """
    storage = make_storage()
    if case_key.startswith("views_"):
        tensors = make_views(storage, int(case_key.split("_")[1]))
    else:
        del storage
        tensors = make_mixed(MIXED_COUNT, MIXED_NBYTES)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"hwm_reset_works": check_peak_reset()}
    if impl == "tensorferry":
        pool = tensorferry.MemoryPool(POOL_NBYTES, prefault=True)
        for phase in ("cold", "warm"):
            r = peak_rss_growth(lambda: pool.pack(tensors), nbytes)
            r.pop("_out").release()
            out[phase] = r
    else:
        mgr = ray_pool.MemoryPoolManager(POOL_NBYTES, torch.device("cpu"))
        mgr.get_pool_tensor().fill_(0)
        for phase in ("cold", "warm"):
            r = peak_rss_growth(lambda: mgr.allocate_group("bench", tensors), nbytes)
            r.pop("_out")
            mgr.free_object("bench")
            out[phase] = r
    return out


def measure_memory(threads: int) -> dict[str, Any]:
    import subprocess

    out: dict[str, Any] = {}
    for key in MEMORY_CASES:
        out[key] = {}
        for impl in ("tensorferry", "ray"):
            proc = subprocess.run(
                [sys.executable, __file__, "--threads", str(threads), "--memory-child", impl, key],
                capture_output=True, text=True, check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {impl} {key} failed:\n{proc.stderr[-2000:]}")
            out[key][impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["hwm_reset_works"] = all(v[i]["hwm_reset_works"] for v in out.values() for i in v)
    return out


# -- profile -------------------------------------------------------------------


def profile_tf(views: list[torch.Tensor], mixed: list[torch.Tensor], pool: tensorferry.MemoryPool) -> str:
    """cProfile of tensorferry's pack and unpack of ``views``, and pack of ``mixed``."""
    buf = io.StringIO()
    for what, tensors in (("pack", views), ("unpack", views), ("pack", mixed)):
        p = pool.pack(tensors)
        prof = cProfile.Profile()
        if what == "pack":
            p.release()
            prof.enable()
            p = pool.pack(tensors)
            prof.disable()
        else:
            prof.enable()
            u = pool.unpack(p)
            prof.disable()
            del u
        p.release()
        buf.write(f"\n=== cProfile: tensorferry {what} of {len(tensors):,} tensors ===\n")
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


def environment() -> dict[str, Any]:
    """_common's record, plus this checkout's commit and whether the pool's sources differ from it."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=False,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        except OSError:
            return "unknown"

    return common_environment(
        git_commit=git("rev-parse", "HEAD"),
        src_modified=git("status", "--porcelain", "--", *(f"../src/tensorferry/{p}" for p in POOL_SOURCES)) != "",
        torch_threads=torch.get_num_threads(),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", action="store_true", help="also cProfile tensorferry's pack/unpack of 100k views")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; see the module doc)")
    ap.add_argument("--memory-child", nargs=2, metavar=("IMPL", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for bench_pool.json and .png")
    ap.add_argument("--only", choices=("pack-copy",), help="pack-copy: only a pack of 10k and 100k views against one "
                    "plain copy (no Ray, no memory children; writes bench_pool_pack_copy.json)")
    ap.add_argument("--rounds", type=int, default=9, help="--only pack-copy: timed calls of each (median; at least 5)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(*args.memory_child)))
        return 0
    env = environment()
    load_start = os.getloadavg()
    if load_start[0] > 0.5 * env["cpus"]:
        print(f"note: load average {load_start[0]:.2f} on {env['cpus']} cores at the start; "
              "other processes share this machine, expect noise", file=sys.stderr)

    storage = make_storage()
    if args.only == "pack-copy":
        return main_pack_copy(args, env, load_start, storage, max(5, args.rounds))
    cases = build_cases(storage)
    pool = tensorferry.MemoryPool(POOL_NBYTES, prefault=True)
    ray_mgr = ray_pool.MemoryPoolManager(POOL_NBYTES, torch.device("cpu"))
    ray_mgr.get_pool_tensor().fill_(0)  # torch.zeros already wrote it; make sure
    copy_dst = touched_bytes(STORAGE_NBYTES)

    for c in cases:
        t0 = time.perf_counter()
        measure_case(c, pool, ray_mgr, copy_dst)
        print(f"  measured {c.label} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    layout_only = measure_layout_only(MIXED_LAYOUT_COUNT)
    memory = measure_memory(args.threads)
    env["loadavg_1min_start_end"] = [round(load_start[0], 2), round(os.getloadavg()[0], 2)]
    by_key = {c.key: c for c in cases}
    targets = compute_targets(by_key, layout_only, memory)
    print_tables(cases, layout_only, memory, targets, env)

    profile_text = (
        profile_tf(by_key["views_100000"].tensors, by_key["mixed_10000"].tensors, pool) if args.profile else None
    )
    if profile_text:
        print(profile_text)

    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "environment": env,
        "settings": {
            "storage_nbytes": STORAGE_NBYTES, "view_counts": VIEW_COUNTS, "mixed_count": MIXED_COUNT,
            "mixed_nbytes_target": MIXED_NBYTES, "subset_every": SUBSET_EVERY, "pool_nbytes": POOL_NBYTES,
            "repeats": REPEATS, "min_repeats": MIN_REPEATS,
            "release_timing": "outside the pack timing, measured separately (tf_release, ray_free)",
            "pretouched": "tensorferry pool prefault=True (MAP_POPULATE); Ray pool torch.zeros; copy dst filled",
            "ray_pool": "MemoryPoolManager(pool_size, cpu) standalone; allocate_group does not use NIXL",
        },
        "cases": {c.key: {"label": c.label, "num_views": c.num_views, **c.results} for c in cases},
        "layout_only_mixed_100k": layout_only,
        "memory": memory,
        "targets": targets,
        "all_checks_ok": all(c.results["ok"] for c in cases) and layout_only["ok"],
        "wall_seconds": time.perf_counter() - t_start,
    }
    if profile_text:
        doc["profile"] = profile_text
    # Every ratio of the targets reads "tensorferry against Ray or the copy, same run".
    write_result(args.out / "bench_pool.json", doc,
                 {f"pool:{t['key']}": t["measured"] for t in targets if not t["key"].startswith("rss_")})
    plot(cases, args.out / "bench_pool.png", env)
    print(f"wrote {args.out / 'bench_pool.json'} and {args.out / 'bench_pool.png'} "
          f"({doc['wall_seconds']:.0f} s)")
    if not doc["all_checks_ok"]:
        print("FAILED: a result check did not pass (see 'checks' in the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
