"""Ray benchmark: tensorferry's Ray transport against Ray 2.60's own, actor to actor.

One local Ray cluster, one run, every transport on the same data:

* tensorferry's transport, ``@ray.method(tensor_transport="tensorferry")``,
  in copy mode (the default) and in zero-copy mode
  (``TENSORFERRY_RAY_ZERO_COPY=1`` in the actors' ``runtime_env``);
* Ray's default object store, plain and with
  ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1`` (set in the actors' ``runtime_env``
  so both worker processes serialize with it);
* Ray's ``gloo`` transport (a ``torch_gloo`` collective group of the two
  actors, ``ray.experimental.collective.create_collective_group``);
* Ray's ``nixl`` transport (UCX on loopback), plain and with its memory pool
  (``ray.experimental.register_nixl_memory_pool`` in the producer).

Cases: 1 GiB of float32 as 1 tensor, as 10k separate tensors, and as 10k
views of one storage. The plain object store gets 10k SEPARATE tensors in the
views case: pickling a torch view serializes its whole storage, so 10k views
of one 1 GiB storage would pickle 10 TiB (it runs out of memory). That cell is
marked in the table and the JSON.

What is timed (``time.monotonic`` in the driver), for every transport alike:

* ``e2e``: from the producer's ``.remote()`` to the consumer's result: the
  producer's ``.remote()``, a ``ray.wait(fetch_local=False)`` for its return
  (for the RDT transports this includes Ray's metadata extraction, i.e.
  tensorferry's pack and NIXL's pool copy or registration; for the object
  store the serialization into plasma), then the consumer's ``.remote()``
  with the ref and ``ray.get`` of its result. The ratios use this.
* ``consume``: the second half alone, from the consumer's ``.remote()`` to
  its result (the transfer into the consumer plus the touch).

The producer builds its tensors once per case and returns the same tensors on
every call (a trainer returning its weights). The consumer touches every
byte: an int64 wrap-around sum over each tensor's bytes, which costs the same
as a float32 sum here (0.12 s for 1 GiB) but is exact and independent of
summation order, so it is compared bit for bit with the producer's. Each case
gets one warm-up call (first-use costs: connections, agents, pools; reported
separately) and ``--repeats`` timed calls (default 3; 2 for a peer whose
warm-up took longer than ``SLOW_SECONDS``). Between calls the ref is dropped
and the driver waits until the producer's transport has released the object
(tensorferry's pool empty, NIXL's pool empty), outside the timing.

Weight sync: a ~1 GiB, ~2,000-tensor state dict
(tensorferry's ``synthetic_state_dict``, ``_harness.SYNTHETIC``: half the float32 weights
are views of one flat buffer) on one trainer actor, 3 worker actors holding
their own copy of the same shapes. ``tensorferry.ray.WeightSync.sync()``
against the same done with Ray's nixl transport (plain, and with its pool): a
trainer method with ``tensor_transport="nixl"`` returns the tensors as a list,
each worker gets the ref and ``copy_``s into its own tensors in place, and the
driver waits for all 3. Timed from the driver's first call to the last
worker's result. Before each sync the trainer changes one tensor; after the
last, every worker's tensors are hashed (blake2b) and compared with the
trainer's.

Weight sync of real model shapes (``--models``, default all; needs the
``bench`` extra, ``pip install -e '.[bench]'``, for ``transformers``): state
dicts of models built in code from ``transformers`` configs with random
weights, nothing downloaded (``HF_HUB_OFFLINE=1``):

* ``gpt2``: GPT-2 small (12 layers, 768 wide; ``lm_head.weight`` tied to
  ``transformer.wte.weight``, so the state dict holds that storage twice);
* ``gpt2-24``: GPT-2 with 24 layers, 1024 wide, 16 heads (GPT-2 medium's
  shape, ~1.6 GB in its state dict with the tied pair);
* ``moe``: a Mixtral-style mixture of experts whose experts are stored
  fused (``transformers`` 5: ``experts.gate_up_proj`` [E, 2I, H] and
  ``experts.down_proj`` [E, H, I]) and published per expert, as checkpoints
  name them (``block_sparse_moe.experts.{e}.w1/w3/w2.weight``): each a view
  of the fused tensor, ~9k tensors.

One trainer and ``MODEL_SYNC_WORKERS`` workers holding the same model (their
own weights, zeroed); per version the trainer changes one tensor. Methods,
in one run: tensorferry ``WeightSync``; Ray nixl (a ``tensor_transport="nixl"``
method returns the tensors, each worker ``copy_``s them into its own); Ray's
object store (the same through a plain method; the MoE's per-expert views go
as separate tensors, since pickling a view serializes its whole storage).
``MODEL_SYNC_WARMUPS`` warm-up syncs, then ``--repeats`` timed; medians;
every worker's weights are hashed and compared with the trainer's after.

The transport's share of a transfer and repeated sends of the same
tensors (``--share`` alone; part of a full run): see
``benchmarks/_ray_share.py``.

This script is the driver; ``_ray_actors.py`` holds the sizes, the cases
and what runs in the actors, ``_ray_runs.py`` the runs in the cluster,
``_ray_report.py`` the ratios, tables and plot.

Run: ``.venv/bin/python benchmarks/bench_ray.py`` (``--quick`` for a small
smoke run; ``--no-transports --repeats 2`` for the weight syncs alone).
Writes ``benchmarks/results/bench_ray.json`` and ``.png``.
"""

from __future__ import annotations

import os

# Before Ray starts: keep UCX (NIXL) and gloo on loopback; the raylet and its
# workers inherit these, and the runtime_env repeats them.
os.environ["UCX_NET_DEVICES"] = "lo"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
# The models are built from configs: never look for anything online.
os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
import sys
import time
from pathlib import Path

import _harness
import _ray_actors as A
import _ray_share  # benchmarks/_ray_share.py: the share and repeat sections
from _common import environment, results_dir, write_result
from _ray_actors import LO_ENV, MODEL_SYNC_METHODS, MODEL_SYNC_WARMUPS, MODEL_SYNC_WORKERS, MODELS, \
    OBJECT_STORE_NBYTES, REPEATS, SLOW_SECONDS, SYNC_WORKERS, TRANSPORTS, define_actors, quick_sizes
from _ray_report import compute_ratios, plot, print_model_report, print_plans_report, print_report
from _ray_runs import MemWatch, run_plans, run_transport, run_weight_sync

RESULTS_DIR = results_dir(Path(__file__).resolve().parent / "results")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per cell (after one warm-up)")
    ap.add_argument("--quick", action="store_true", help="64 MiB and 1k tensors: a smoke run")
    ap.add_argument("--only", default="", help="comma-separated transport keys (development)")
    ap.add_argument("--no-sync", action="store_true", help="skip the synthetic weight sync")
    ap.add_argument("--no-transports", action="store_true", help="skip the actor-to-actor cases")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"weight sync of these model state dicts ({', '.join(MODELS)}; 'none' to skip; needs the bench extra)")
    ap.add_argument("--plans", action="store_true",
                    help="only the plans section: WeightSync of the same bytes as 100 and as 100k tensors")
    ap.add_argument("--share", action="store_true",
                    help="only the share section: what each transport adds to 10k fresh tensors, and the same tensors sent again")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.quick:
        quick_sizes()
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    import ray

    import tensorferry.ray as tfr

    # The actors call these modules' functions; their processes cannot import them.
    for module in (_ray_share, A, _harness):
        ray.cloudpickle.register_pickle_by_value(module)
    env = environment()
    env["loadavg_start"] = os.getloadavg()[0]
    ray.init(num_cpus=8, include_dashboard=False, object_store_memory=OBJECT_STORE_NBYTES,
             log_to_driver=False, runtime_env={"env_vars": dict(LO_ENV)})
    results: dict = {}
    sync: dict = {}
    models: dict = {}
    plans: dict = {}
    share: dict = {}
    repeat: dict = {}
    mem = MemWatch()
    try:
        tfr.register()
        Producer, Consumer, Trainer, Worker = define_actors(ray)
        if args.plans:
            args.no_transports, args.no_sync, args.models = True, True, "none"
            plans = run_plans(ray, Trainer, Worker, args.repeats, log, mem)
        if args.share:
            args.no_transports, args.no_sync, args.models = True, True, "none"
        if args.share or not (args.no_transports or args.plans):
            log("share: 10k fresh tensors, every transport in turn")
            share = _ray_share.run_share(ray, log, env=LO_ENV)
            log("repeat: the same tensors again, kept plan against the fresh path")
            repeat = _ray_share.run_repeat(ray, log, env=LO_ENV)
        only = set(filter(None, args.only.split(",")))
        for tr in TRANSPORTS:
            if args.no_transports or (only and tr.key not in only):
                results[tr.key] = {"label": tr.label, "cases": {}, "error": "skipped (--only)"}
                continue
            log(f"{tr.label}")
            results[tr.key] = run_transport(ray, tr, Producer, Consumer, args.repeats, log, mem)
        if not args.no_sync:
            log("weight sync")
            sync = run_weight_sync(ray, Trainer, Worker, args.repeats, log, mem)
        for name in filter(None, args.models.split(",")):
            if name == "none":
                break
            log(f"weight sync: {name}")
            try:
                import transformers  # noqa: F401 - in the driver first: a clear skip, not a dead actor
            except ImportError:
                models[name] = {"error": "transformers is missing: pip install -e '.[bench]'"}
                log(f"  {name}: skipped, {models[name]['error']}")
                continue
            models[name] = run_weight_sync(
                ray, Trainer, Worker, args.repeats, log, mem, spec={"kind": name}, methods=MODEL_SYNC_METHODS,
                num_workers=MODEL_SYNC_WORKERS, warmups=MODEL_SYNC_WARMUPS, fresh_trainer=True)
    finally:
        ray.shutdown()
        mem.stop()
    env["loadavg_end"] = os.getloadavg()[0]
    env["min_mem_available_nbytes"] = mem.lowest()
    targets, ratios = compute_ratios(results, sync)
    ratios.update(plans.get("ratios", {}))
    if sync or any(r.get("cases") for r in results.values()):
        print_report(results, sync, targets, env)
    else:
        print(f"tensorferry Ray benchmark — {env['date']} — {env['machine']}")
    print_model_report(models)
    print_plans_report(plans)
    _ray_share.print_share_report(share, repeat)
    doc = {
        "environment": env,
        "settings": {
            "total_nbytes": A.TOTAL_NBYTES, "many": A.MANY, "many_numel": A.MANY_NUMEL,
            "tf_pool_nbytes": A.TF_POOL_NBYTES, "nixl_pool_nbytes": A.NIXL_POOL_NBYTES,
            "object_store_nbytes": OBJECT_STORE_NBYTES, "sync_nbytes": A.SYNC_NBYTES,
            "sync_tensors": A.SYNC_TENSORS, "sync_workers": SYNC_WORKERS, "repeats": args.repeats,
            "slow_seconds": SLOW_SECONDS, "quick": args.quick,
            "timed": "e2e: driver time.monotonic from producer .remote() to the consumer's result "
                     "(producer call, ray.wait(fetch_local=False), consumer call, ray.get); "
                     "consume: consumer .remote() to its result",
            "touch": "consumer: int64 wrap-around sum of every tensor's bytes, compared exactly",
            "object_store_views": "the plain object store sends 10k separate tensors in the views case",
        },
        "transports": results,
        "weight_sync": sync,
        "weight_sync_models": models,
        "weight_sync_plans": plans,
        "share": share,
        "repeat": repeat,
        "ratios": ratios,
        "targets": targets,
        "all_checks_ok": all(c.get("ok", False) for r in results.values() if "skipped" not in r.get("error", "")
                             for c in r.get("cases", {}).values())
                         and all(m.get("ok", False) for m in sync.get("methods", {}).values())
                         and all(m.get("ok", False) for out in models.values() for m in out.get("methods", {}).values())
                         and all(m.get("ok", False) for out in plans.get("cases", {}).values() for m in out.get("methods", {}).values())
                         and share.get("ok", True) and all(r["ok"] for r in repeat.values()),
        "wall_seconds": time.monotonic() - t_start,
    }
    write_result(args.out / "bench_ray.json", doc, ratios, default=str)
    plot(results, sync, args.out / "bench_ray.png", env)
    print(f"wrote {args.out / 'bench_ray.json'} and {args.out / 'bench_ray.png'} ({doc['wall_seconds']:.0f} s)")
    return 0 if doc["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
