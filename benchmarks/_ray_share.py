"""bench_ray's share and repeat sections: what a transfer adds, and repeated returns.

Share (``bench_ray.py --share``): actor to actor on one node, a producer
method makes ``SHARE_TENSORS`` fresh float32 tensors (``SHARE_NBYTES`` in
all, new tensors on every call) and returns them; a consumer touches every
byte (the int64 wrap-around sum of bench_ray, checked exactly against the
value the driver computes from the seed). Per round, in turn:

* ``none``: the same producer work (it makes the tensors, returns a number
  through Ray's object store) and the same consumer work (the sum over
  tensors of the same shapes it keeps, already faulted in): no transfer;
* ``tf``: tensorferry's transport; ``nixl``: Ray's nixl transport;
  ``objstore``: Ray's object store (a plain method).

Timed in the driver from the producer's ``.remote()`` to the consumer's
result. A transport's share in a round is its time less the ``none`` time of
that round; the figures are medians over rounds, and the ratios are the
peers' median shares over tensorferry's. Tensorferry's share is split by
timing its hooks in the actors (the pack with Ray's metadata, the receive,
the release) and Ray's calls around them; the actors' monotonic stamps of
the producer's return and the consumer method's start put Ray's part on a
timeline (from the return to the pack, the pack to the receive, the
receive to the consumer's method).

Repeat (``--share`` too): the producer keeps ``REPEAT_COUNTS`` tensors of
``SHARE_NBYTES`` and returns the same ones on every call (a model's weights
after each step); the transport replays its kept plan. Against the same
calls with the kept plan turned off in the producer (the fresh path),
interleaved round by round.

Actors are defined after ``tensorferry.ray.register()``; this module is
pickled by value, so workers need not import it.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from _ray_actors import settled

MIB = 1 << 20
SHARE_NBYTES = 256 * MIB
SHARE_TENSORS = 10_000
# 256 MiB / 10k floats is 6,710.9; an even count keeps every tensor a whole
# number of int64 words for the checksum.
SHARE_NUMEL = 6_710
SHARE_ROUNDS = 5
SHARE_WARMUPS = 1
SHARE_METHODS = ("none", "tf", "nixl", "objstore")
SHARE_TARGETS = {"nixl": 15.0, "objstore": 10.0}
REPEAT_COUNTS = (100, 10_000)
CALL_TIMEOUT_SECONDS = 300.0
HOOKS = ("extract_tensor_transport_metadata", "recv_multiple_tensors", "garbage_collect")


def fill_values(seed: int, n: int) -> np.ndarray:
    """The float32 value of each of the ``n`` tensors of call ``seed``."""
    return ((np.arange(n, dtype=np.int64) + seed * 7919) % 100_003).astype(np.float32)


def expected_checksum(seed: int, n: int, numel: int) -> int:
    """bench_ray's checksum of ``fresh_tensors(seed, n, numel)``, from the values alone."""
    pairs = np.repeat(fill_values(seed, n), 2).view(np.int64).astype(object)
    return int(sum(pairs) * (numel // 2)) % (1 << 64)


def fresh_tensors(seed: int, n: int, numel: int) -> list[torch.Tensor]:
    values = fill_values(seed, n).tolist()
    return [torch.empty(numel).fill_(v) for v in values]


def checksum(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        total += int(t.reshape(-1).view(torch.int64).sum())
    return total % (1 << 64)


def instrument() -> None:
    """Time tensorferry's Ray hooks in this process: ``(name, start, end)``
    per call, ``time.monotonic`` (one clock for every process of the machine)."""
    from tensorferry.ray import _transport as tft

    if getattr(tft, "_share_records", None) is not None:
        return
    tft._share_records = []
    cls = tft.TensorferryTransport
    for name in HOOKS:
        orig = getattr(cls, name)

        def timed(*a: Any, _orig: Callable = orig, _name: str = name, **k: Any) -> Any:
            t0 = time.monotonic()
            try:
                return _orig(*a, **k)
            finally:
                tft._share_records.append((_name, t0, time.monotonic()))

        setattr(cls, name, timed)


def mark(name: str) -> None:
    """A moment in this process's records (a method's return, a method's start)."""
    from tensorferry.ray import _transport as tft

    now = time.monotonic()
    tft._share_records.append((name, now, now))


def records() -> dict:
    """This process's records since the last call: seconds per hook (summed),
    and every record as ``(name, start, end)`` under ``"stamps"``."""
    from tensorferry.ray import _transport as tft

    recs = getattr(tft, "_share_records", None) or []
    out: dict = {"stamps": list(recs)}
    for name, t0, t1 in recs:
        out[name] = out.get(name, 0.0) + (t1 - t0)
    recs.clear()
    return out


def gaps(producer: dict, consumer: dict) -> dict:
    """One tf call's timeline from both actors' stamps: what Ray does
    between the producer's return and the pack, between the pack and the
    receive, and between the receive and the consumer's method (seconds)."""
    at = {name: (t0, t1) for name, t0, t1 in producer["stamps"] + consumer["stamps"]}
    need = ("returned", "extract_tensor_transport_metadata", "recv_multiple_tensors", "consume_started")
    if not all(k in at for k in need):
        return {}
    pack, recv = at["extract_tensor_transport_metadata"], at["recv_multiple_tensors"]
    return {"return_to_pack_s": pack[0] - at["returned"][0], "pack_to_recv_s": recv[0] - pack[1],
            "recv_to_consume_s": at["consume_started"][0] - recv[1]}


def define_actors(ray: Any) -> tuple[Any, Any]:
    @ray.remote(enable_tensor_transport=True)
    class ShareProducer:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self.kept: list[torch.Tensor] = []
            instrument()

        def make_none(self, seed: int, n: int, numel: int) -> int:
            return len(fresh_tensors(seed, n, numel))

        @ray.method(tensor_transport="tensorferry")
        def make_tf(self, seed: int, n: int, numel: int) -> list:
            out = fresh_tensors(seed, n, numel)
            mark("returned")
            return out

        @ray.method(tensor_transport="nixl")
        def make_nixl(self, seed: int, n: int, numel: int) -> list:
            return fresh_tensors(seed, n, numel)

        def make_objstore(self, seed: int, n: int, numel: int) -> list:
            return fresh_tensors(seed, n, numel)

        def keep(self, seed: int, n: int, numel: int) -> None:
            self.kept = fresh_tensors(seed, n, numel)

        def keep_plans(self, on: bool) -> None:
            from tensorferry.ray import _transport as tft

            tft._process().kept.enabled = on

        @ray.method(tensor_transport="tensorferry")
        def same_tf(self) -> list:
            return self.kept

        def records(self) -> dict:
            return records()

        def settle(self, timeout: float) -> int:
            """Wait until tensorferry's pool here holds nothing (outside the timing)."""
            from tensorferry.ray import _transport as tft

            def used() -> int:
                proc = tft._PROCESS
                return proc.segments.stats()["used_nbytes"] if proc is not None and proc.segments is not None else 0

            return settled(used, timeout, interval_seconds=0.005)

    @ray.remote(enable_tensor_transport=True)
    class ShareConsumer:
        def __init__(self, n: int, numel: int) -> None:
            torch.set_num_threads(1)
            self.own = fresh_tensors(0, n, numel)  # faulted in by the fill
            instrument()

        def consume(self, tensors: list) -> int:
            mark("consume_started")
            return checksum(tensors)

        def consume_own(self, _n: int) -> int:
            return checksum(self.own)

        def records(self) -> dict:
            return records()

    return ShareProducer, ShareConsumer


def _call(ray: Any, producer: Any, consumer: Any, method: str, args: tuple) -> tuple[float, int]:
    t0 = time.monotonic()
    ref = getattr(producer, method).remote(*args)
    out = ray.get((consumer.consume_own if method == "make_none" else consumer.consume).remote(ref),
                  timeout=CALL_TIMEOUT_SECONDS)
    seconds = time.monotonic() - t0
    del ref
    return seconds, out


def run_share(ray: Any, log: Callable[[str], None], *, rounds: int = SHARE_ROUNDS, env: dict | None = None) -> dict:
    """The share section: every method in turn, round by round, on one actor pair."""
    ShareProducer, ShareConsumer = define_actors(ray)
    n, numel = SHARE_TENSORS, SHARE_NUMEL
    opts = {"runtime_env": {"env_vars": dict(env or {})}}
    producer = ShareProducer.options(**opts).remote()
    consumer = ShareConsumer.options(**opts).remote(n, numel)
    runs: dict[str, list[dict]] = {m: [] for m in SHARE_METHODS}
    ok = True
    try:
        own = ray.get(consumer.consume_own.remote(0), timeout=CALL_TIMEOUT_SECONDS)
        ok &= own == expected_checksum(0, n, numel)
        for r in range(SHARE_WARMUPS + rounds):
            order = SHARE_METHODS if r % 2 == 0 else SHARE_METHODS[::-1]
            for m in order:
                seed = 1 + r * len(SHARE_METHODS) + SHARE_METHODS.index(m)
                seconds, got = _call(ray, producer, consumer, f"make_{m}", (seed, n, numel))
                want = own if m == "none" else expected_checksum(seed, n, numel)
                rec: dict = {"seconds": seconds, "ok": got == want, "loadavg_1min": os.getloadavg()[0]}
                gc.collect()
                ray.get(producer.settle.remote(30.0), timeout=CALL_TIMEOUT_SECONDS)
                if m == "tf":
                    prec, crec = ray.get([producer.records.remote(), consumer.records.remote()], timeout=CALL_TIMEOUT_SECONDS)
                    rec["pack_s"] = prec.get("extract_tensor_transport_metadata", 0.0)
                    rec["release_s"] = prec.get("garbage_collect", 0.0)
                    rec["recv_s"] = crec.get("recv_multiple_tensors", 0.0)
                    rec.update(gaps(prec, crec))
                else:
                    ray.get([producer.records.remote(), consumer.records.remote()], timeout=CALL_TIMEOUT_SECONDS)
                ok &= rec["ok"]
                runs[m].append(rec)
        timed = {m: rs[SHARE_WARMUPS:] for m, rs in runs.items()}
        base = [x["seconds"] for x in timed["none"]]
        out: dict = {"tensors": n, "nbytes": n * numel * 4, "rounds": rounds, "warmups": SHARE_WARMUPS, "ok": ok,
                     "methods": {}}
        for m in SHARE_METHODS:
            secs = [x["seconds"] for x in timed[m]]
            shares = [s - b for s, b in zip(secs, base)]
            out["methods"][m] = {"seconds": statistics.median(secs), "share_s": statistics.median(shares),
                                 "runs": timed[m], "warmup": runs[m][:SHARE_WARMUPS]}
        tf = timed["tf"]
        pack, recv, release = (statistics.median(x[k] for x in tf) for k in ("pack_s", "recv_s", "release_s"))
        share = out["methods"]["tf"]["share_s"]
        out["tf_breakdown"] = {"pack_s": pack, "recv_s": recv, "release_s": release,
                               "ray_s": share - pack - recv}
        for k in ("return_to_pack_s", "pack_to_recv_s", "recv_to_consume_s"):
            if all(k in x for x in tf):
                out["tf_breakdown"][k] = statistics.median(x[k] for x in tf)
        ours = out["methods"]["tf"]
        out["ratios"] = {}
        for m in ("nixl", "objstore"):
            peer = out["methods"][m]
            out["ratios"][m] = {"share": peer["share_s"] / ours["share_s"] if ours["share_s"] > 0 else None,
                                "e2e": peer["seconds"] / ours["seconds"], "target": SHARE_TARGETS[m]}
        for m in SHARE_METHODS:
            x = out["methods"][m]
            log(f"  share {m:9s} e2e {x['seconds']:.3f} s  share {x['share_s']:.3f} s")
        return out
    finally:
        for a in (producer, consumer):
            ray.kill(a)


def run_repeat(ray: Any, log: Callable[[str], None], *, rounds: int = SHARE_ROUNDS, env: dict | None = None) -> dict:
    """Repeated returns of the same tensors: kept plan against the fresh path, interleaved."""
    ShareProducer, ShareConsumer = define_actors(ray)
    opts = {"runtime_env": {"env_vars": dict(env or {})}}
    out: dict = {}
    for n in REPEAT_COUNTS:
        numel = (SHARE_NBYTES // n // 4) & ~1
        producer = ShareProducer.options(**opts).remote()
        consumer = ShareConsumer.options(**opts).remote(1, 2)
        try:
            seed = 3
            ray.get(producer.keep.remote(seed, n, numel), timeout=CALL_TIMEOUT_SECONDS)
            want = expected_checksum(seed, n, numel)
            runs: dict[str, list[dict]] = {"kept": [], "fresh": []}
            for r in range(SHARE_WARMUPS + rounds):
                for mode in (("kept", "fresh") if r % 2 == 0 else ("fresh", "kept")):
                    ray.get(producer.keep_plans.remote(mode == "kept"), timeout=CALL_TIMEOUT_SECONDS)
                    t0 = time.monotonic()
                    ref = producer.same_tf.remote()
                    got = ray.get(consumer.consume.remote(ref), timeout=CALL_TIMEOUT_SECONDS)
                    seconds = time.monotonic() - t0
                    del ref
                    gc.collect()
                    ray.get(producer.settle.remote(30.0), timeout=CALL_TIMEOUT_SECONDS)
                    prec = ray.get(producer.records.remote(), timeout=CALL_TIMEOUT_SECONDS)
                    ray.get(consumer.records.remote(), timeout=CALL_TIMEOUT_SECONDS)
                    runs[mode].append({"seconds": seconds, "pack_s": prec.get("extract_tensor_transport_metadata", 0.0),
                                       "ok": got == want})
            res: dict = {"tensors": n, "nbytes": n * numel * 4, "ok": all(x["ok"] for rs in runs.values() for x in rs)}
            for mode, rs in runs.items():
                timed = rs[SHARE_WARMUPS:]
                res[mode] = {"seconds": statistics.median(x["seconds"] for x in timed),
                             "pack_s": statistics.median(x["pack_s"] for x in timed), "runs": timed}
            res["ratio"] = res["fresh"]["seconds"] / res["kept"]["seconds"]
            res["pack_ratio"] = res["fresh"]["pack_s"] / res["kept"]["pack_s"]
            out[str(n)] = res
            log(f"  repeat {n:>6,} tensors: kept plan {res['kept']['seconds']:.3f} s (pack {res['kept']['pack_s'] * 1e3:.1f} ms), "
                f"fresh {res['fresh']['seconds']:.3f} s (pack {res['fresh']['pack_s'] * 1e3:.1f} ms)")
        finally:
            for a in (producer, consumer):
                ray.kill(a)
    return out


def print_share_report(share: dict, repeat: dict) -> None:
    if share:
        print(f"\nThe transport's share: {share['tensors']:,} fresh float32 tensors, {share['nbytes'] / MIB:.0f} MiB, "
              f"actor to actor, medians of {share['rounds']} interleaved rounds (s){'' if share['ok'] else '  CHECKSUM MISMATCH'}")
        for m, x in share["methods"].items():
            print(f"  {m:9s} e2e {x['seconds']:.3f}  share {x['share_s']:.3f}")
        b = share["tf_breakdown"]
        print(f"  tensorferry's share: pack + metadata {b['pack_s'] * 1e3:.1f} ms, receive {b['recv_s'] * 1e3:.1f} ms, "
              f"release {b['release_s'] * 1e3:.1f} ms (after the result), Ray's calls {b['ray_s'] * 1e3:.1f} ms")
        if "return_to_pack_s" in b:
            print(f"  Ray's calls, from the actors' clocks: producer's return to the pack {b['return_to_pack_s'] * 1e3:.1f} ms, "
                  f"pack to the receive {b['pack_to_recv_s'] * 1e3:.1f} ms, receive to the consumer's method "
                  f"{b['recv_to_consume_s'] * 1e3:.1f} ms (medians)")
        for m, r in share["ratios"].items():
            met = r["share"] is not None and r["share"] >= r["target"]
            s = f"{r['share']:.1f}x" if r["share"] is not None else "n/a"
            print(f"  {m}: share {s} (target >= {r['target']:g}x: {'met' if met else 'NOT met'}), e2e {r['e2e']:.2f}x")
    for n, res in repeat.items():
        print(f"  same {int(n):,} tensors again: kept plan {res['kept']['seconds']:.3f} s, fresh path {res['fresh']['seconds']:.3f} s "
              f"({res['ratio']:.2f}x; the pack {res['pack_ratio']:.1f}x){'' if res['ok'] else '  CHECKSUM MISMATCH'}")
