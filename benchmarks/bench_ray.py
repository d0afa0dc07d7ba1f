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
(``tensorferry._synthetic.synthetic_state_dict``: half the float32 weights
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
import gc
import threading
import hashlib
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import _ray_share  # benchmarks/_ray_share.py: the share and repeat sections
# benchmarks/_common.py (this script's folder): the one peak-RSS helper of every benchmark.
from _common import package_version, peak_rss as vm_hwm, results_dir

GIB = 1 << 30
MIB = 1 << 20
TOTAL_NBYTES = GIB
MANY = 10_000
# 1 GiB / 10k floats is 26,843.5; an even count keeps every tensor a whole
# number of int64 words for the checksum (10k x 26,842 floats = 0.99994 GiB).
MANY_NUMEL = 26_842
# Each source's tensorferry pool: the 1 GiB case plus room for per-tensor
# alignment padding of 10k tensors (a memfd: only written pages cost memory).
TF_POOL_NBYTES = GIB + 64 * MIB
# Ray's NIXL pool must hold one object; the same headroom.
NIXL_POOL_NBYTES = GIB + 64 * MIB
# Plasma holds one 1 GiB object at a time, plus one still being freed.
OBJECT_STORE_NBYTES = 3 * GIB
SYNC_NBYTES = GIB
SYNC_TENSORS = 2_000
SYNC_WORKERS = 3
REPEATS = 3
# The trainer's tensorferry pool holds two versions (the next packs while the
# last is read), so the first two syncs each fault in half of it; every
# method gets the same two warm-up syncs and the timing is the steady state.
SYNC_WARMUPS = 2
# A peer whose warm-up call took longer than this gets 2 timed calls (keeps
# the run near 10 minutes on 2 cores); marked in the table and the JSON.
SLOW_SECONDS = 12.0
CALL_TIMEOUT_SECONDS = 300.0
# Real model shapes for the weight sync (see the module docstring). Two
# workers, not three: the 24-layer GPT-2 is 1.6 GB in every process, plus the
# trainer's tensorferry pool of two versions, on a shared 24 GiB machine.
MODELS = ("gpt2", "gpt2-24", "moe")
MODEL_SYNC_WORKERS = 2
# The trainer's pool is made and prefaulted when the WeightSync is created,
# so one warm-up (connections, the workers' first mapping) is enough.
MODEL_SYNC_WARMUPS = 1
# The object store last: its plasma memory (OBJECT_STORE_NBYTES) stays
# resident after its objects are freed, which leaves less for what runs next.
MODEL_SYNC_METHODS = (("nixl", "Ray nixl"), ("tf", "tensorferry WeightSync"), ("objstore", "Ray object store"))
RESULTS_DIR = results_dir(Path(__file__).resolve().parent / "results")
# The consumer's prefaulted receive pool for "tensorferry + receive pool" (the
# counterpart of Ray's NIXL memory pool on the producer): room for one 1 GiB
# object plus alignment.
RECV_POOL_NBYTES = TOTAL_NBYTES + (64 << 20)
LO_ENV = {"UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}


@dataclass(frozen=True)
class Transport:
    """One way to move the producer's tensors to the consumer."""

    key: str
    label: str
    method: str  # producer method that returns the tensors
    env: dict = field(default_factory=dict)  # runtime_env env_vars of both actors
    nixl_pool: bool = False
    gloo_group: bool = False
    views_as_separate: bool = False  # the "10k views" case sends separate tensors
    ours: bool = False


TRANSPORTS = (
    Transport("tf", "tensorferry", "make_tf", ours=True),
    Transport("tf_pool", "tensorferry + receive pool", "make_tf",
              env={"TENSORFERRY_RAY_RECV_POOL_BYTES": str(RECV_POOL_NBYTES)}, ours=True),
    Transport("tf_zc", "tensorferry zero-copy", "make_tf", env={"TENSORFERRY_RAY_ZERO_COPY": "1"}, ours=True),
    Transport("objstore", "Ray object store", "make_plain", views_as_separate=True),
    Transport("objstore_zc", "Ray object store zero-copy", "make_plain",
              env={"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}),
    Transport("gloo", "Ray gloo", "make_gloo", gloo_group=True),
    Transport("nixl", "Ray nixl", "make_nixl"),
    Transport("nixl_pool", "Ray nixl + pool", "make_nixl", nixl_pool=True),
)
CASES = (
    ("one", "1 tensor"),
    ("many", "{many} tensors"),
    ("views", "{many} views"),
)
# The reference peer for the targets is the issue's "nixl with its memory
# pool"; the ratio against plain nixl (its faster setting here) is reported
# beside it.
TARGETS = (
    ("one", "e2e 1 tensor vs Ray nixl + pool", "nixl_pool", 3.0),
    ("many", "e2e 10k tensors vs Ray nixl + pool", "nixl_pool", 10.0),
    ("sync", "weight sync, 3 workers, vs Ray nixl + pool", "nixl_pool", 3.0),
)


# -- what runs in the actors ----------------------------------------------------


def checksum(tensors: list[torch.Tensor]) -> int:
    """Sum of every tensor's bytes as int64 words, modulo 2**64.

    Reads every byte once (as fast as a float32 sum) and is exact and
    independent of summation order, so sender and receiver agree bit for bit.
    """
    total = 0
    for t in tensors:
        total += int(t.reshape(-1).view(torch.int64).sum())
    return total % (1 << 64)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def case_tensors(case: str, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if case == "one":
        return [torch.rand(TOTAL_NBYTES // 4, generator=gen)]
    if case == "many":
        return [torch.rand(MANY_NUMEL, generator=gen) for _ in range(MANY)]
    if case == "views":
        flat = torch.rand(MANY * MANY_NUMEL, generator=gen)
        return list(flat.split(MANY_NUMEL))
    raise ValueError(f"unknown case {case!r}")


def model_state_dict(name: str, *, seed: int | None) -> dict[str, torch.Tensor]:
    """The state dict of model ``name`` (see MODELS), built from its config.

    ``seed`` None: the weights are zeros (a worker's copy, to be overwritten);
    otherwise uniform random from that seed. The tensors are the model's own
    parameters and buffers (or views of them), so writing into them updates it.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

    if name == "gpt2":
        model_cls, cfg = GPT2LMHeadModel, GPT2Config()
    elif name == "gpt2-24":
        model_cls, cfg = GPT2LMHeadModel, GPT2Config(n_layer=24, n_embd=1024, n_head=16)
    elif name == "moe":
        # Small experts, many of them: ~9k per-expert views in ~0.6 GB.
        model_cls, cfg = MixtralForCausalLM, MixtralConfig(
            vocab_size=32_000, hidden_size=128, intermediate_size=128, num_hidden_layers=48,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=64, num_experts_per_tok=2,
            max_position_embeddings=512)
    else:
        raise ValueError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    # Built on the meta device and materialized empty: random init of 355M
    # parameters would cost seconds per actor, and the values are ours to set.
    with torch.device("meta"):
        model = model_cls(cfg)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(seed or 0)
    with torch.no_grad():
        for t in model.state_dict().values():
            if seed is None or not t.is_floating_point():
                t.zero_()
            else:
                t.uniform_(-0.05, 0.05, generator=gen)
    sd = model.state_dict()
    if name != "moe":
        return sd
    out: dict[str, torch.Tensor] = {}
    for key, t in sd.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key[: -len("mlp.experts.gate_up_proj")] + "block_sparse_moe.experts"
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.w3.weight"] = t[e, inter:]
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("mlp.experts.down_proj")] + "block_sparse_moe.experts"
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = t[e]
        else:
            out[key] = t
    return out


def quick_sizes() -> None:
    global TOTAL_NBYTES, MANY, MANY_NUMEL, TF_POOL_NBYTES, NIXL_POOL_NBYTES, SYNC_NBYTES, SYNC_TENSORS
    TOTAL_NBYTES, MANY, MANY_NUMEL = 64 * MIB, 1_000, 16_384
    TF_POOL_NBYTES = NIXL_POOL_NBYTES = 96 * MIB
    SYNC_NBYTES, SYNC_TENSORS = 64 * MIB, 200


def instrument_tf() -> None:
    """Time tensorferry's two Ray hooks in this actor process (diagnostics).

    Wraps ``extract_tensor_transport_metadata`` (source: the pack) and
    ``recv_multiple_tensors`` (destination: the get) of the registered class,
    recording wall seconds and the process's minor page faults; the records
    live on the module and are drained by ``tf_records``. Costs two
    ``getrusage`` calls per hook.
    """
    import resource

    from tensorferry.ray import _transport as tft

    if getattr(tft, "_bench_records", None) is not None:
        return
    tft._bench_records = []
    cls = tft.TensorferryTransport

    def wrap(name: str) -> None:
        orig = getattr(cls, name)

        def timed(*a: Any, **k: Any) -> Any:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                tft._bench_records.append({"hook": name, "seconds": time.perf_counter() - t0,
                                           "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0})

        setattr(cls, name, timed)

    wrap("extract_tensor_transport_metadata")
    wrap("recv_multiple_tensors")


def tf_records() -> list:
    from tensorferry.ray import _transport as tft

    recs = list(getattr(tft, "_bench_records", None) or [])
    if recs:
        tft._bench_records.clear()
    return recs


def define_actors(ray: Any) -> tuple[Any, Any, Any, Any]:
    """The actor classes; defined after ``tensorferry.ray.register()``."""

    def held(pool_expected: bool) -> dict:
        """What the transports in this process still hold (settle step)."""
        out: dict = {}
        try:
            from tensorferry.ray import _transport as tft

            proc = tft._PROCESS
            if proc is not None and proc.segments is not None:
                out["tensorferry_pool_used_nbytes"] = proc.segments.stats()["used_nbytes"]
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            out["tensorferry_error"] = repr(exc)
        if pool_expected:
            from ray.experimental.rdt.util import get_tensor_transport_manager

            pool = get_tensor_transport_manager("NIXL")._memory_pool
            out["nixl_pool_objects"] = len(pool._allocated_by_obj)
        return out

    @ray.remote(enable_tensor_transport=True)
    class Producer:
        def __init__(self, nixl_pool_nbytes: int = 0) -> None:
            self.tensors: list[torch.Tensor] = []
            self.nixl_pool = bool(nixl_pool_nbytes)
            if nixl_pool_nbytes:
                from ray.experimental import register_nixl_memory_pool

                register_nixl_memory_pool(nixl_pool_nbytes, torch.device("cpu"))

        def info(self) -> dict:
            return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}

        def set_case(self, case: str) -> dict:
            self.tensors = []
            gc.collect()
            self.tensors = case_tensors(case)
            return {"checksum": checksum(self.tensors), "num_tensors": len(self.tensors),
                    "nbytes": sum(t.numel() * t.element_size() for t in self.tensors),
                    "storages": len({t.untyped_storage().data_ptr() for t in self.tensors})}

        def drop(self) -> None:
            self.tensors = []
            gc.collect()

        def instrument(self) -> None:
            instrument_tf()

        def records(self) -> list:
            return tf_records()

        def make_plain(self) -> list:
            return self.tensors

        @ray.method(tensor_transport="tensorferry")
        def make_tf(self) -> list:
            return self.tensors

        @ray.method(tensor_transport="gloo")
        def make_gloo(self) -> list:
            return self.tensors

        @ray.method(tensor_transport="nixl")
        def make_nixl(self) -> list:
            return self.tensors

        def settle(self, timeout: float) -> dict:
            deadline = time.monotonic() + timeout
            while True:
                gc.collect()
                h = held(self.nixl_pool)
                if (not h.get("tensorferry_pool_used_nbytes") and not h.get("nixl_pool_objects")) \
                        or time.monotonic() > deadline:
                    return h
                time.sleep(0.01)

    @ray.remote(enable_tensor_transport=True)
    class Consumer:
        def info(self) -> dict:
            return {"pid": os.getpid(), "torch_threads": torch.get_num_threads()}

        def instrument(self) -> None:
            instrument_tf()

        def records(self) -> list:
            return tf_records()

        def consume(self, tensors: list) -> dict:
            t0 = time.perf_counter()
            s = checksum(tensors)
            return {"checksum": s, "num_tensors": len(tensors), "touch_seconds": time.perf_counter() - t0}

    def build_state_dict(spec: dict, seed: int | None) -> dict:
        if spec["kind"] == "synthetic":
            from tensorferry._synthetic import synthetic_state_dict

            return synthetic_state_dict(spec["nbytes"], spec["num_tensors"], seed=1 if seed is None else seed)
        return model_state_dict(spec["kind"], seed=seed)

    @ray.remote(enable_tensor_transport=True)
    class Trainer:
        def __init__(self, spec: dict, nixl_pool_nbytes: int = 0) -> None:
            self.sd = build_state_dict(spec, 0)
            self.plain: list = []
            if nixl_pool_nbytes:
                from ray.experimental import register_nixl_memory_pool

                register_nixl_memory_pool(nixl_pool_nbytes, torch.device("cpu"))

        def meta(self) -> dict:
            ts = list(self.sd.values())
            return {"num_tensors": len(ts), "nbytes": sum(t.numel() * t.element_size() for t in ts),
                    "storages": len({t.untyped_storage().data_ptr() for t in ts}),
                    "views": sum(1 for t in ts if t.numel() * t.element_size() < t.untyped_storage().nbytes()),
                    "dtypes": sorted({str(t.dtype) for t in ts})}

        def state_dict(self) -> dict:
            return self.sd

        def use_plain(self) -> int:
            """What the object store sends: the tensors, views as separate
            copies (pickling a view serializes its whole storage). Returns
            how many had to be copied."""
            ts = list(self.sd.values())
            self.plain = [t.clone() if t.numel() * t.element_size() < t.untyped_storage().nbytes() else t for t in ts]
            return sum(1 for a, b in zip(self.plain, ts) if a is not b)

        def step(self) -> None:
            # A new version: change one tensor (cheap), outside the timing.
            with torch.no_grad():
                first = next(iter(self.sd.values()))
                first.add_(1.0)
                if self.plain and self.plain[0] is not first:
                    self.plain[0].copy_(first)

        def weights_plain(self) -> list:
            return self.plain

        @ray.method(tensor_transport="nixl")
        def weights_nixl(self) -> list:
            return list(self.sd.values())

        def digest(self) -> str:
            return digest(list(self.sd.values()))

        def settle(self, timeout: float) -> dict:
            deadline = time.monotonic() + timeout
            while True:
                gc.collect()
                try:
                    from ray.experimental.rdt.util import get_tensor_transport_manager

                    pool = get_tensor_transport_manager("NIXL")._memory_pool
                    n = 0 if pool is None else len(pool._allocated_by_obj)
                except Exception:  # noqa: BLE001 - no NIXL in this process yet
                    n = 0
                if n == 0 or time.monotonic() > deadline:
                    return {"nixl_pool_objects": n}
                time.sleep(0.01)

    @ray.remote(enable_tensor_transport=True)
    class Worker:
        def __init__(self, spec: dict) -> None:
            # Same shapes and dtypes, other contents: a sync has to move them.
            # ``worker_inference``: made under torch.inference_mode(), as an
            # inference engine may hold its weights (no version counters).
            with torch.inference_mode(spec.get("worker_inference", False)):
                self.sd = build_state_dict(spec, None)

        def ready(self) -> bool:
            return True

        def state_dict(self) -> dict:
            return self.sd

        def load(self, tensors: list) -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                for dst, src in zip(self.sd.values(), tensors, strict=True):
                    dst.copy_(src)
            return time.perf_counter() - t0

        def digest(self) -> str:
            return digest(list(self.sd.values()))

    return Producer, Consumer, Trainer, Worker


# -- driver ---------------------------------------------------------------------


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
        env["TENSORFERRY_RAY_POOL_BYTES"] = str(TF_POOL_NBYTES)
    opts = {"runtime_env": {"env_vars": env}}
    actors: list = []
    group = None
    try:
        t0 = time.monotonic()
        producer = Producer.options(**opts).remote(NIXL_POOL_NBYTES if tr.nixl_pool else 0)
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
            label = label.format(many=f"{MANY // 1000}k")
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

    spec = spec or {"kind": "synthetic", "nbytes": SYNC_NBYTES, "num_tensors": SYNC_TENSORS}
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
                    trainer = Trainer.options(**opts).remote(spec, NIXL_POOL_NBYTES if key == "nixl_pool" else 0)
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
PLANS_TARGET = 1.2  # time(100k tensors) / time(100 tensors), from the second sync on


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
                spec = {"kind": "synthetic", "nbytes": SYNC_NBYTES, "num_tensors": count, "worker_inference": inference}
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


def print_plans_report(plans: dict) -> None:
    if not plans:
        return
    print(f"\nWeightSync with plans: {SYNC_NBYTES / MIB:,.0f} MiB float32 to {SYNC_WORKERS} workers, medians after "
          f"{SYNC_WARMUPS} warm-ups, 100 and 100k interleaved round by round")
    for key, out in plans["cases"].items():
        count, _, inference = key.partition("-")
        m = out["methods"].get("tf", {})
        first = ", ".join(f"{r['seconds']:.3f}" for r in m.get("warmup", []))
        state = "ok" if m.get("ok") else f"FAILED {m.get('error', 'workers differ')}"
        runs = m.get("runs", [])
        # Where a sync goes: the trainer's put (the workers wait for it), then
        # the workers' gets, which run at once on the same cores.
        put = statistics.median(r["pack_seconds"] for r in runs) if runs else float("nan")
        get = statistics.median(s for r in runs for s in r["worker_seconds"]) if runs else float("nan")
        print(f"  {int(count):>7,} tensors{' (workers in inference_mode)' if inference else ''}: {m.get('seconds', float('nan')):.3f} s (trainer put {put:.3f} s, worker get {get:.3f} s; "
              f"load {m.get('loadavg_1min', float('nan')):.1f}; warm-ups incl. the planning sync: {first} s) {state}")
    r = plans.get("ratio")
    print(f"  100k / 100 tensors: {r:.2f}x (target <= {plans['target']}x: {'met' if plans['met'] else 'NOT met'})" if r else "  ratio: n/a")
    ri = plans.get("ratio_inference")
    if ri:
        print(f"  100k / 100 tensors, workers' weights made under inference_mode (no version counters to mark): {ri:.2f}x")


# -- report -----------------------------------------------------------------------


def compute_ratios(results: dict, sync: dict) -> tuple[list, dict]:
    def e2e(tkey: str, case: str) -> float | None:
        c = results.get(tkey, {}).get("cases", {}).get(case, {})
        return c.get("e2e_s") if c.get("ok") else None

    def sync_s(key: str) -> float | None:
        m = sync.get("methods", {}).get(key, {})
        return m.get("seconds") if m.get("ok") else None

    ratios: dict = {}
    for case, _ in CASES:
        for mine in ("tf", "tf_pool", "tf_zc"):
            ours = e2e(mine, case)
            for tr in TRANSPORTS:
                if tr.ours:
                    continue
                peer = e2e(tr.key, case)
                if ours and peer:
                    ratios[f"{case}:{mine}/{tr.key}"] = peer / ours
    ours = sync_s("tf")
    for key in ("nixl", "nixl_pool"):
        if ours and sync_s(key):
            ratios[f"sync:tf/{key}"] = sync_s(key) / ours
    targets = []
    for case, desc, peer, need in TARGETS:
        value = ratios.get(f"{case}:tf/{peer}")
        alt = ratios.get(f"{case}:tf/nixl")
        zc = ratios.get(f"{case}:tf_zc/{peer}")
        pooled = ratios.get(f"{case}:tf_pool/{peer}")
        note = []
        if pooled is not None:
            note.append(f"with a receive pool {pooled:.2f}x")
        if alt is not None:
            note.append(f"vs plain nixl {alt:.2f}x")
        if zc is not None:
            note.append(f"zero-copy vs nixl + pool {zc:.2f}x")
        targets.append({"case": case, "target": desc, "required": f">= {need:g}x",
                        "measured": value, "met": value is not None and value >= need,
                        "met_vs_plain_nixl_too": alt is not None and alt >= need, "note": "; ".join(note)})
    return targets, ratios


def print_report(results: dict, sync: dict, targets: list, env: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=220)
    con.print(f"[bold]tensorferry Ray benchmark[/] — {env['date']} — {env['machine']}")
    con.print("seconds, median; e2e = producer .remote() -> consumer's result (ratios use it); "
              "consume = consumer .remote() -> result; GB/s = bytes / e2e")
    t = Table(title=f"actor to actor, ~{TOTAL_NBYTES / GIB:g} GiB float32 on one node")
    t.add_column("transport")
    for case, label in CASES:
        label = label.format(many=f"{MANY // 1000}k")
        for col in ("e2e", "consume", "GB/s"):
            t.add_column(f"{label}\n{col}", justify="right")
    t.add_column("runs", justify="right")
    t.add_column("ok")
    for tr in TRANSPORTS:
        r = results[tr.key]
        row = [tr.label]
        oks, reps = [], []
        for case, _ in CASES:
            c = r.get("cases", {}).get(case, {})
            if "e2e_s" in c:
                mark = " *" if c.get("sent_as") != case else ""
                row += [f"{c['e2e_s']:.3f}{mark}", f"{c['consume_s']:.3f}", f"{c['nbytes'] / c['e2e_s'] / 1e9:.2f}"]
                oks.append(c["ok"])
                reps.append(str(c["repeats"]))
            else:
                row += ["[red]failed[/]", "-", "-"]
                oks.append(False)
        row += ["/".join(reps) or "-", "yes" if all(oks) else "[red]NO[/]"]
        t.add_row(*row)
    con.print(t)
    con.print(f"* the plain object store gets {MANY:,} separate tensors in the views case (pickling a view "
              f"serializes its whole storage: {MANY:,} views of one 1 GiB storage run out of memory)")

    t = Table(title="where tensorferry's e2e goes (medians, seconds; page faults of the get x 4 KiB = fresh memory touched)")
    for col in ("mode", "case", "e2e", "pack (source)", "get (destination)", "get page faults", "touch", "Ray rest"):
        t.add_column(col, justify="left" if col in ("mode", "case") else "right")
    for tr in TRANSPORTS:
        if not tr.ours:
            continue
        for case, label in CASES:
            c = results[tr.key].get("cases", {}).get(case, {})
            b = c.get("breakdown")
            if not b:
                continue
            t.add_row(tr.label, label.format(many=f"{MANY // 1000}k"), f"{c['e2e_s']:.3f}", f"{b['tf_pack_s']:.3f}",
                      f"{b['tf_recv_s']:.3f}", f"{b['tf_recv_minflt']:,.0f} ({b['tf_recv_minflt'] * 4096 / MIB:,.0f} MiB)",
                      f"{b['touch_s']:.3f}", f"{b['ray_overhead_s']:.3f}")
    con.print(t)

    t = Table(title=f"weight sync: ~{SYNC_NBYTES / GIB:g} GiB, {sync.get('state_dict', {}).get('num_tensors', '?')}"
                    f" tensors, 1 trainer -> {SYNC_WORKERS} workers")
    for col in ("method", "seconds", "GB/s (all workers)", "warm-ups", "runs", "verified", "detail (medians)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    nbytes = sync.get("state_dict", {}).get("nbytes", 0)
    for key, m in sync.get("methods", {}).items():
        if "seconds" in m:
            t.add_row(m["label"], f"{m['seconds']:.3f}", f"{SYNC_WORKERS * nbytes / m['seconds'] / 1e9:.2f}",
                      ", ".join(f"{r['seconds']:.2f}" for r in m["warmup"]), str(m["repeats"]), "yes" if m["ok"] else "[red]NO[/]",
                      sync_detail(m))
        else:
            t.add_row(m["label"], "[red]failed[/]", "-", "-", "-", m.get("error", ""))
    con.print(t)

    t = Table(title="targets (tensorferry copy mode; ratio = peer seconds / tensorferry seconds)")
    for col in ("target", "required", "measured", "met", "note"):
        t.add_column(col)
    for tg in targets:
        v = "n/a" if tg["measured"] is None else f"{tg['measured']:.2f}x"
        t.add_row(tg["target"], tg["required"], v, "[green]yes[/]" if tg["met"] else "[red]no[/]", tg["note"])
    con.print(t)


def print_model_report(models: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    if not models:
        return
    con = Console(width=220)
    t = Table(title=f"weight sync of model state dicts, 1 trainer -> {MODEL_SYNC_WORKERS} workers "
                    "(seconds, median; ratio = peer seconds / tensorferry seconds)")
    for col in ("state dict", "tensors", "views", "GB", "tensorferry", "Ray nixl", "Ray object store", "runs",
                "verified", "tensorferry detail (medians)"):
        t.add_column(col, justify="left" if col in ("state dict", "tensorferry detail (medians)") else "right")
    for name, out in models.items():
        if "error" in out and not out.get("methods"):
            t.add_row(name, "-", "-", "-", f"[red]{out['error']}[/]", "-", "-", "-", "-", "")
            continue
        sd = out.get("state_dict", {})
        methods = out.get("methods", {})
        ours = methods.get("tf", {})

        def cell(key: str) -> str:
            m = methods.get(key, {})
            if "seconds" not in m:
                return "[red]failed[/]" if m else "-"
            mark = " *" if m.get("views_sent_as_copies") else ""
            if key == "tf" or not ours.get("seconds"):
                return f"{m['seconds']:.3f}{mark}"
            return f"{m['seconds']:.3f}{mark} ({m['seconds'] / ours['seconds']:.2f}x)"

        detail = sync_detail(ours) if ours.get("runs") else ""
        if "pool_setup_seconds" in ours:
            detail += f"; pool made at WeightSync creation {ours['pool_setup_seconds']:.2f} s"
        t.add_row(name, f"{sd.get('num_tensors', '?'):,}" if sd else "?", f"{sd.get('views', 0):,}",
                  f"{sd.get('nbytes', 0) / 1e9:.2f}", cell("tf"), cell("nixl"), cell("objstore"),
                  "/".join(str(m.get("repeats", "-")) for m in methods.values()),
                  "yes" if methods and all(m.get("ok") for m in methods.values()) else "[red]NO[/]", detail)
    con.print(t)
    con.print("* views sent to the object store as separate copies (pickling a view serializes its whole storage)")


def sync_detail(m: dict) -> str:
    runs = m.get("runs") or []
    if runs and "pack_seconds" in runs[0]:
        pack = statistics.median(r["pack_seconds"] for r in runs)
        slowest = statistics.median(max(r["worker_seconds"]) for r in runs)
        return f"trainer pack {pack:.3f} s; slowest worker's get (into=) {slowest:.3f} s"
    if runs and "worker_copy_seconds" in runs[0]:
        slowest = statistics.median(max(r["worker_copy_seconds"]) for r in runs)
        return f"slowest worker's copy_ into its tensors {slowest:.3f} s (after its NIXL read)"
    return ""


def plot(results: dict, sync: dict, path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = [label.format(many=f"{MANY // 1000}k") for _, label in CASES] + [f"weight sync\n{SYNC_WORKERS} workers"]
    series = []
    for tr in TRANSPORTS:
        vals = []
        for case, _ in CASES:
            c = results[tr.key].get("cases", {}).get(case, {})
            vals.append(c.get("e2e_s") if c.get("ok") else None)
        skey = {"tf": "tf", "nixl": "nixl", "nixl_pool": "nixl_pool"}.get(tr.key)
        m = sync.get("methods", {}).get(skey, {}) if skey else {}
        vals.append(m.get("seconds") if m.get("ok") else None)
        series.append((tr, vals))
    colors = {"tf": "tab:blue", "tf_pool": "tab:purple", "tf_zc": "tab:cyan", "objstore": "tab:gray", "objstore_zc": "tab:olive",
              "gloo": "tab:green", "nixl": "tab:orange", "nixl_pool": "tab:red"}
    fig, ax = plt.subplots(figsize=(13, 5.8))
    width = 0.8 / len(series)
    for i, (tr, vals) in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        for gi, (x, v) in enumerate(zip(xs, vals)):
            if v is None:
                continue
            separate = tr.views_as_separate and gi < len(CASES) and CASES[gi][0] == "views"
            ax.bar(x, v, width * 0.95, color=colors[tr.key], hatch="//" if separate else None,
                   edgecolor="white" if separate else None)
            ax.annotate(f"{v:.2f}", (x, v), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=6.5, rotation=90)
    handles = [Patch(color=colors[tr.key], label=tr.label) for tr, _ in series]
    handles.append(Patch(facecolor="tab:gray", hatch="//", edgecolor="white", label="sent as separate tensors"))
    ax.legend(handles=handles, fontsize=8, ncol=4, loc="upper left")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_yscale("log")
    ax.set_ylabel("seconds, median (log): producer .remote() -> consumer result")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    present = [v for _, vals in series for v in vals if v]
    ax.set_ylim(min(present, default=0.1) / 2, max(present, default=1.0) * 8)
    ax.set_title(f"~{TOTAL_NBYTES / GIB:g} GiB float32 actor to actor, Ray {env['ray']} — {env['date']}, {env['machine']}\n"
                 "(hatched: the plain object store sends separate tensors in the views case; "
                 "weight sync: tensorferry WeightSync vs Ray nixl, 1 trainer -> 3 workers)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem_gib:.0f} GiB",
        "cpus": len(os.sched_getaffinity(0)),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "ray": package_version("ray"),
        "nixl": package_version("nixl"),
        "tensorferry": package_version("tensorferry"),
    }


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

    # The share section's actors call its module's functions; workers cannot import it.
    ray.cloudpickle.register_pickle_by_value(_ray_share)
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
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "environment": env,
        "settings": {
            "total_nbytes": TOTAL_NBYTES, "many": MANY, "many_numel": MANY_NUMEL,
            "tf_pool_nbytes": TF_POOL_NBYTES, "nixl_pool_nbytes": NIXL_POOL_NBYTES,
            "object_store_nbytes": OBJECT_STORE_NBYTES, "sync_nbytes": SYNC_NBYTES,
            "sync_tensors": SYNC_TENSORS, "sync_workers": SYNC_WORKERS, "repeats": args.repeats,
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
    (args.out / "bench_ray.json").write_text(json.dumps(doc, indent=1, default=str))
    plot(results, sync, args.out / "bench_ray.png", env)
    print(f"wrote {args.out / 'bench_ray.json'} and {args.out / 'bench_ray.png'} ({doc['wall_seconds']:.0f} s)")
    return 0 if doc["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
