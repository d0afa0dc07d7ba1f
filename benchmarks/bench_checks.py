"""Per-tensor work of a put and of a kept plan's checks, in one process.

For 10k and 100k float32 tensors (separate allocations, as a producer's
fresh outputs or a model's parameters), over shm, medians of interleaved
rounds:

* ``inspect``: a fresh put's flatten and inspection of the leaves;
* ``matches``: ``SendPlan.matches`` of a new list of the planned tensors
  (the Ray transport's kept-plan test, ``WeightSync``'s);
* ``check``: a kept plan's watch over its own tensors (every ``put(plan)``);
* ``fresh_put`` and ``plan_put``: a put of the object for any number of
  readers, discarded at once, fresh and by the kept plan.

Peers in the same run: the fresh put for the plan's put, and, where the
tree has ``tensorferry._tensor_meta`` (``tensors._meta``), the same library with its C++ pass
turned off (the Python passes it falls back to) for the first three, and,
where the check reads tensors raw (``tensors/_raw.py``), ``matches`` and
``check`` of a plan made to read them through torch's C shim instead.
``interleave.py`` compares two trees with it. The tensors hold 64 bytes
each (the copy is not what is measured; ``bench_ray.py --share`` has the
256 MiB case).

Run: ``.venv/bin/python benchmarks/bench_checks.py`` (``--rounds``).
Writes ``benchmarks/results/bench_checks.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, interleaved, log, med, results_dir, write_result  # noqa: E402
from _harness import TENSOR_META, TENSORS, private  # noqa: E402

COUNTS = (10_000, 100_000)
NUMEL = 16  # 64 B a tensor
ROUNDS = 9
WARMUPS = 2


def _timed(fn: Callable[[], Any]) -> float:
    import time

    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_count(n: int, rounds: int) -> dict:
    from tensorferry import Sender
    flatten, inspect_leaves = private(TENSORS, "flatten"), private(TENSORS, "inspect_leaves")
    try:
        tm = private(TENSOR_META)
    except ImportError:  # a tree before the C++ pass: its own path only
        tm = None
    tensors = [torch.full((NUMEL,), float(i)) for i in range(n)]
    sender = Sender("shm", capacity_nbytes=64 << 20)
    try:
        def inspect() -> None:
            leaves, ops, counts, keys, _ = flatten(tensors)
            inspect_leaves(tensors, leaves, ops, counts, keys)

        def with_python(fn: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                was, tm.native = tm.native, False
                try:
                    return fn()
                finally:
                    tm.native = was
            return run

        plan = sender.plan(tensors)
        variants: dict[str, Callable[[], Any]] = {
            "inspect": inspect,
            "matches": lambda: plan.matches(list(tensors)),
            "check": lambda: plan.check(plan.owner),
            "fresh_put": lambda: sender.discard(sender.put(tensors, readers=None)),
            "plan_put": lambda: sender.discard(sender.put(plan, readers=None, one_shot=True)),
        }
        if tm is not None and tm.native:
            py_plan = with_python(lambda: sender.plan(tensors))()
            variants["inspect_python"] = with_python(inspect)
            variants["matches_python"] = with_python(lambda: py_plan.matches(list(tensors)))
            variants["check_python"] = lambda: py_plan.check(py_plan.owner)
        if tm is not None and getattr(tm, "_RAW", False):
            # The same checks through torch's C shim, as where raw reads
            # could not be learned (tensors/_raw.py): the plan is made so.
            was, tm._RAW = tm._RAW, False
            try:
                shim_plan = sender.plan(tensors)
            finally:
                tm._RAW = was
            variants["matches_shim"] = lambda: shim_plan.matches(list(tensors))
            variants["check_shim"] = lambda: shim_plan.check(shim_plan.owner)
        names = list(variants)
        recs = interleaved(len(names), WARMUPS, rounds, lambda i, r: {"seconds": _timed(variants[names[i]])})
        return {name: med([x["seconds"] for x in rec["records"]]) for name, rec in zip(names, recs)}
    finally:
        sender.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results: dict = {}
    ratios: dict[str, float | None] = {}
    for n in COUNTS:
        log(f"{n:,} tensors")
        res = results[str(n)] = run_count(n, args.rounds)
        for name, seconds in res.items():
            print(f"  {n:>7,} {name:15s} {seconds * 1e3:8.2f} ms")
        ratios[f"{n}:fresh_put/plan_put"] = res["fresh_put"] / res["plan_put"]
        for k in ("inspect", "matches", "check"):
            py = res.get(f"{k}_python")
            ratios[f"{n}:{k}:python/c++"] = py / res[k] if py is not None else None
            if k != "inspect":
                shim = res.get(f"{k}_shim")
                ratios[f"{n}:{k}:shim/raw"] = shim / res[k] if shim is not None else None
            ratios[f"{n}:{k}:us_per_tensor"] = res[k] * 1e6 / n
    for k, v in ratios.items():
        print(f"  {k:32s} {'n/a' if v is None else f'{v:.2f}'}")
    doc = {"environment": environment(), "settings": {"counts": COUNTS, "numel": NUMEL, "rounds": args.rounds, "warmups": WARMUPS},
           "seconds": results}
    path = write_result(results_dir() / "bench_checks.json", doc, ratios)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
