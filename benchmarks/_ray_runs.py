"""bench_ray's runs in a local Ray cluster: one transport's actor-to-actor
cases (``run_transport``), a weight sync by each method (``run_weight_sync``)
and the plans section (``run_plans``), with the machine's free memory
watched throughout (``MemWatch``)."""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
import traceback
from typing import Any

import _ray_actors as A
from _common import peak_rss as vm_hwm
from _ray_actors import CALL_TIMEOUT_SECONDS, CASES, LO_ENV, SLOW_SECONDS, SYNC_WARMUPS, SYNC_WORKERS, Transport

class MemWatch:
    """Samples the machine's MemAvailable; ``mark()`` gives the minimum since the last mark."""

    def __init__(self, interval_seconds: float = 0.25) -> None:
        self._min = self._lowest = self.available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_seconds,), daemon=True)
        self._thread.start()

    @staticmethod
    def available() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            a = self.available()
            self._min = min(self._min, a)
            self._lowest = min(self._lowest, a)

    def mark(self) -> int:
        m, self._min = self._min, self.available()
        return m

    def lowest(self) -> int:
        return self._lowest

    def stop(self) -> None:
        self._stop.set()


def _kill(ray: Any, actors: list) -> None:
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone
            pass
    gc.collect()
    time.sleep(1.0)  # let the worker processes exit and return their memory


def _err(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: " + (" | ".join(lines[-4:]) if lines else "")


def run_transport(ray: Any, tr: Transport, Producer: Any, Consumer: Any, repeats: int, log: Any,
                  mem: MemWatch) -> dict:
    """Every case for one transport, on one fresh producer/consumer pair."""
    out: dict = {"label": tr.label, "cases": {}}
    env = {**LO_ENV, **tr.env}
    if tr.ours:
        env["TENSORFERRY_RAY_POOL_BYTES"] = str(A.TF_POOL_NBYTES)
    opts = {"runtime_env": {"env_vars": env}}
    actors: list = []
    group = None
    try:
        t0 = time.monotonic()
        producer = Producer.options(**opts).remote(A.NIXL_POOL_NBYTES if tr.nixl_pool else 0)
        consumer = Consumer.options(**opts).remote()
        actors = [producer, consumer]
        out["producer"], out["consumer"] = ray.get([producer.info.remote(), consumer.info.remote()],
                                                   timeout=CALL_TIMEOUT_SECONDS)
        if tr.ours:
            ray.get([producer.instrument.remote(), consumer.instrument.remote()], timeout=CALL_TIMEOUT_SECONDS)
        if tr.gloo_group:
            from ray.experimental.collective import create_collective_group

            group = create_collective_group(actors, backend="torch_gloo")
        out["setup_seconds"] = time.monotonic() - t0
        method = getattr(producer, tr.method)
        for case, label in CASES:
            label = label.format(many=f"{A.MANY // 1000}k")
            src_case = "many" if (case == "views" and tr.views_as_separate) else case
            res: dict = {"sent_as": src_case, "loadavg_1min": os.getloadavg()[0]}
            out["cases"][case] = res
            mem.mark()
            try:
                exp = ray.get(producer.set_case.remote(src_case), timeout=CALL_TIMEOUT_SECONDS)
                res.update(num_tensors=exp["num_tensors"], nbytes=exp["nbytes"], storages=exp["storages"])
                runs = []
                n_calls = 1 + repeats
                i = 0
                while i < n_calls:
                    t_a = time.monotonic()
                    ref = method.remote()
                    ray.wait([ref], fetch_local=False, timeout=CALL_TIMEOUT_SECONDS)
                    t_b = time.monotonic()
                    got = ray.get(consumer.consume.remote(ref), timeout=CALL_TIMEOUT_SECONDS)
                    t_c = time.monotonic()
                    del ref
                    ok = got["checksum"] == exp["checksum"] and got["num_tensors"] == exp["num_tensors"]
                    runs.append({"e2e_s": t_c - t_a, "produce_s": t_b - t_a, "consume_s": t_c - t_b,
                                 "touch_s": got["touch_seconds"], "ok": ok})
                    gc.collect()
                    runs[-1]["held_after"] = ray.get(producer.settle.remote(30.0), timeout=CALL_TIMEOUT_SECONDS)
                    if tr.ours:
                        prec, crec = ray.get([producer.records.remote(), consumer.records.remote()],
                                             timeout=CALL_TIMEOUT_SECONDS)
                        pack = sum(r["seconds"] for r in prec if r["hook"].startswith("extract"))
                        recv = [r for r in crec if r["hook"].startswith("recv")]
                        r = runs[-1]
                        r["tf_pack_s"] = pack
                        r["tf_recv_s"] = sum(x["seconds"] for x in recv)
                        r["tf_recv_minflt"] = sum(x["minflt"] for x in recv)
                        # Everything else in e2e: Ray's scheduling, metadata and argument handling.
                        r["ray_overhead_s"] = r["e2e_s"] - pack - r["tf_recv_s"] - r["touch_s"]
                    if i == 0 and runs[0]["e2e_s"] > SLOW_SECONDS and repeats > 2:
                        n_calls = 1 + 2
                    i += 1
                warm, timed = runs[0], runs[1:]
                res.update(
                    warmup=warm, runs=timed, repeats=len(timed),
                    e2e_s=statistics.median(r["e2e_s"] for r in timed),
                    consume_s=statistics.median(r["consume_s"] for r in timed),
                    produce_s=statistics.median(r["produce_s"] for r in timed),
                    touch_s=statistics.median(r["touch_s"] for r in timed),
                    ok=all(r["ok"] for r in runs),
                    min_mem_available_nbytes=mem.mark(),
                    breakdown={k: statistics.median(r[k] for r in timed)
                               for k in ("tf_pack_s", "tf_recv_s", "tf_recv_minflt", "touch_s", "ray_overhead_s")
                               if k in timed[0]},
                    peak_rss_nbytes={"producer": vm_hwm(out["producer"]["pid"]),
                                     "consumer": vm_hwm(out["consumer"]["pid"])},
                )
                log(f"  {tr.label:28s} {label:12s} e2e {res['e2e_s']:7.3f} s  consume {res['consume_s']:7.3f} s"
                    f"  (warm-up {warm['e2e_s']:.2f} s, {len(timed)} runs){'' if res['ok'] else '  CHECKSUM MISMATCH'}")
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not hidden
                res["error"] = _err(exc)
                res["traceback"] = traceback.format_exc()
                log(f"  {tr.label:28s} {label:12s} FAILED: {res['error']}")
                if isinstance(exc, (ray.exceptions.ActorDiedError, ray.exceptions.GetTimeoutError)):
                    break
            finally:
                try:
                    ray.get(producer.drop.remote(), timeout=60)
                except Exception:  # noqa: BLE001 - the producer may be dead
                    pass
    except Exception as exc:  # noqa: BLE001
        out["error"] = _err(exc)
        out["traceback"] = traceback.format_exc()
        log(f"  {tr.label}: FAILED to set up: {out['error']}")
    finally:
        if group is not None:
            try:
                from ray.experimental.collective import destroy_collective_group

                destroy_collective_group(group)
            except Exception:  # noqa: BLE001 - killing the actors frees it anyway
                pass
        _kill(ray, actors)
    return out


def _timed_sync(sync: Any) -> dict:
    """One ``WeightSync.sync()``, timed here, with what its report says."""
    t0 = time.monotonic()
    rep = sync.sync()
    return {"seconds": time.monotonic() - t0, "report_seconds": rep.seconds, "pack_seconds": rep.pack_seconds,
            "worker_seconds": list(rep.worker_seconds), "version": rep.version}


def _digests_equal(ray: Any, trainer: Any, workers: list) -> list[bool]:
    """Per worker: its weights hash as the trainer's do."""
    want = ray.get(trainer.digest.remote(), timeout=CALL_TIMEOUT_SECONDS)
    return [g == want for g in ray.get([w.digest.remote() for w in workers], timeout=CALL_TIMEOUT_SECONDS)]


def run_weight_sync(ray: Any, Trainer: Any, Worker: Any, repeats: int, log: Any, mem: MemWatch, *,
                    spec: dict | None = None, methods: tuple = (("nixl", "Ray nixl"), ("tf", "tensorferry WeightSync"),
                                                              ("nixl_pool", "Ray nixl + pool")),
                    num_workers: int = SYNC_WORKERS, warmups: int = SYNC_WARMUPS, fresh_trainer: bool = False) -> dict:
    """Sync one trainer's state dict to ``num_workers`` workers by each method in turn.

    ``spec``: ``{"kind": "synthetic", "nbytes", "num_tensors"}`` (default) or
    ``{"kind": <a MODELS name>}``. A trainer is reused across methods, except
    that ``nixl_pool`` gets a fresh one with Ray's NIXL pool registered, and
    every method does with ``fresh_trainer`` (no method's memory, such as
    tensorferry's pool of two versions, burdens the next).
    """
    import tensorferry.ray as tfr

    spec = spec or {"kind": "synthetic", "nbytes": A.SYNC_NBYTES, "num_tensors": A.SYNC_TENSORS}
    out: dict = {"spec": spec, "num_workers": num_workers, "warmups": warmups, "methods": {}}
    opts = {"runtime_env": {"env_vars": dict(LO_ENV)}}
    t0 = time.monotonic()
    workers = [Worker.options(**opts).remote(spec) for _ in range(num_workers)]
    trainer = None
    try:
        ray.get([w.ready.remote() for w in workers], timeout=CALL_TIMEOUT_SECONDS)
        out["workers_setup_seconds"] = time.monotonic() - t0
        for key, label in methods:
            res: dict = {"label": label, "loadavg_1min": os.getloadavg()[0]}
            out["methods"][key] = res
            mem.mark()
            try:
                if trainer is None or key == "nixl_pool" or fresh_trainer:
                    if trainer is not None:
                        _kill(ray, [trainer])
                    trainer = Trainer.options(**opts).remote(spec, A.NIXL_POOL_NBYTES if key == "nixl_pool" else 0)
                    out["state_dict"] = ray.get(trainer.meta.remote(), timeout=CALL_TIMEOUT_SECONDS)
                if key == "objstore":
                    res["views_sent_as_copies"] = ray.get(trainer.use_plain.remote(), timeout=CALL_TIMEOUT_SECONDS)
                runs = []
                sync = None
                if key == "tf":
                    t_c = time.monotonic()
                    sync = tfr.WeightSync(trainer, workers)
                    # Creating it has the trainer make and prefault its pool:
                    # timed apart (the first sync would wait for it).
                    ray.get(sync._prepared, timeout=CALL_TIMEOUT_SECONDS)
                    res["pool_setup_seconds"] = time.monotonic() - t_c
                for i in range(warmups + repeats):
                    ray.get(trainer.step.remote(), timeout=CALL_TIMEOUT_SECONDS)
                    if sync is not None:
                        runs.append(_timed_sync(sync))
                    else:
                        t0 = time.monotonic()
                        ref = (trainer.weights_plain if key == "objstore" else trainer.weights_nixl).remote()
                        copy_s = ray.get([w.load.remote(ref) for w in workers], timeout=CALL_TIMEOUT_SECONDS)
                        t1 = time.monotonic()
                        del ref
                        runs.append({"seconds": t1 - t0, "worker_copy_seconds": copy_s})
                        gc.collect()
                        runs[-1]["held_after"] = ray.get(trainer.settle.remote(30.0), timeout=CALL_TIMEOUT_SECONDS)
                equal = _digests_equal(ray, trainer, workers)
                timed = runs[warmups:]
                res.update(warmup=runs[:warmups], runs=timed, repeats=len(timed),
                           seconds=statistics.median(r["seconds"] for r in timed),
                           ok=all(equal), digests_equal=equal, min_mem_available_nbytes=mem.mark())
                warm_s = ", ".join(f"{r['seconds']:.2f}" for r in runs[:warmups])
                log(f"  weight sync {spec['kind']:9s} {label:26s} {res['seconds']:7.3f} s  (warm-ups {warm_s} s,"
                    f" {len(timed)} runs){'' if res['ok'] else '  WORKERS DIFFER FROM TRAINER'}")
            except Exception as exc:  # noqa: BLE001
                res["error"] = _err(exc)
                res["traceback"] = traceback.format_exc()
                log(f"  weight sync {spec['kind']} {label}: FAILED: {res['error']}")
    finally:
        _kill(ray, [a for a in [trainer, *workers] if a is not None])
    ours = out["methods"].get("tf", {})
    out["ratios"] = {f"tf/{k}": m["seconds"] / ours["seconds"] for k, m in out["methods"].items()
                     if k != "tf" and m.get("ok") and ours.get("ok")}
    return out


# Plans section: the same bytes as few and as many tensors. WeightSync keeps a
# plan on the trainer and on each worker from its first sync on, so from the
# second sync the tensor count should cost (almost) nothing. The schedule and
# the ratio are bench_plans.py's (the plans benchmark between two processes).
PLANS_TENSOR_COUNTS = (100, 100_000)
PLANS_TARGET = 1.1  # time(100k tensors) / time(100 tensors), from the second sync on (issue 36)


def run_plans(ray: Any, Trainer: Any, Worker: Any, repeats: int, log: Any, mem: MemWatch) -> dict:
    """WeightSync of SYNC_NBYTES as 100 and as 100k tensors to SYNC_WORKERS
    workers each, in bench_plans' interleaved rounds: both trainers and
    their workers live at once and each round syncs one then the other (the
    order rotated), so load that drifts over seconds weighs on both alike
    (run one after the other, the same 100-tensor case took 0.14 s in one
    run and 0.18 s in the next). The warm-ups include the first sync, which makes the plans (and waits
    for the trainer's pool). Then the same pair with the workers' weights
    made under ``torch.inference_mode()`` (``-inference`` cases): such
    tensors have no autograd version counter, so a get marks none of them
    written; the target is judged on the plain weights."""
    import bench_plans
    import tensorferry.ray as tfr

    opts = {"runtime_env": {"env_vars": dict(LO_ENV)}}
    cases: dict = {}
    mins: dict = {}  # the least MemAvailable seen, per pass
    for inference in (False, True):
        suffix = "-inference" if inference else ""
        log(f"plans: {' and '.join(f'{c:,}' for c in PLANS_TENSOR_COUNTS)} tensors, interleaved"
            f"{', workers in inference_mode' if inference else ''}")
        setups: list[dict] = []
        mem.mark()
        try:
            for count in PLANS_TENSOR_COUNTS:
                spec = {"kind": "synthetic", "nbytes": A.SYNC_NBYTES, "num_tensors": count, "worker_inference": inference}
                workers = [Worker.options(**opts).remote(spec) for _ in range(SYNC_WORKERS)]
                trainer = Trainer.options(**opts).remote(spec, 0)
                setups.append({"key": f"{count}{suffix}", "spec": spec, "trainer": trainer, "workers": workers})
                ray.get([w.ready.remote() for w in workers], timeout=CALL_TIMEOUT_SECONDS)
                setups[-1]["state_dict"] = ray.get(trainer.meta.remote(), timeout=CALL_TIMEOUT_SECONDS)
                setups[-1]["sync"] = tfr.WeightSync(trainer, workers)

            def sync(i: int, r: int) -> dict:
                st = setups[i]
                ray.get(st["trainer"].step.remote(), timeout=CALL_TIMEOUT_SECONDS)
                return {**_timed_sync(st["sync"]), "loadavg_1min": os.getloadavg()[0]}

            rounds = bench_plans.sync_rounds(len(setups), SYNC_WARMUPS, repeats, sync)
            for st, rr in zip(setups, rounds):
                equal = _digests_equal(ray, st["trainer"], st["workers"])
                res = {"label": "tensorferry WeightSync", "warmup": rr["warmup"], "runs": rr["records"],
                       "repeats": len(rr["records"]), "seconds": rr["seconds"],
                       "loadavg_1min": statistics.median(r["loadavg_1min"] for r in rr["records"]),
                       "ok": all(equal), "digests_equal": equal}
                cases[st["key"]] = {"spec": st["spec"], "num_workers": SYNC_WORKERS, "state_dict": st["state_dict"],
                                    "interleaved": True, "methods": {"tf": res}}
                log(f"  {st['key']:>16}: {res['seconds']:.3f} s{'' if res['ok'] else '  WORKERS DIFFER FROM TRAINER'}")
        except Exception as exc:  # noqa: BLE001
            for st in setups:
                cases.setdefault(st["key"], {"spec": st["spec"], "methods": {"tf": {"error": _err(exc), "ok": False,
                                                                                   "traceback": traceback.format_exc()}}})
            log(f"  plans{suffix}: FAILED: {_err(exc)}")
        finally:
            _kill(ray, [a for st in setups for a in [st["trainer"], *st["workers"]]])
        mins[suffix or "plain"] = mem.mark()

    def ratio_of(suffix: str) -> float | None:
        few, many = (cases.get(f"{c}{suffix}", {}).get("methods", {}).get("tf", {}) for c in PLANS_TENSOR_COUNTS)
        return bench_plans.count_ratio(few, many)

    ratio = ratio_of("")
    return {"cases": cases, "ratio": ratio, "ratio_inference": ratio_of("-inference"), "target": PLANS_TARGET,
            "met": ratio is not None and ratio <= PLANS_TARGET, "min_mem_available_nbytes": mins,
            "ratios": {"plans:WeightSync 100k/100 tensors": ratio,
                       "plans:WeightSync 100k/100 tensors, workers in inference_mode": ratio_of("-inference")}}
