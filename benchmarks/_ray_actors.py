"""bench_ray's sizes, cases and transports, and what runs in its Ray actors:
the tensors a producer returns (``case_tensors``), the model state dicts a
trainer syncs (``model_state_dict``), the checks (``checksum``, ``digest``)
and the actor classes (``define_actors``).

The driver registers this module (and ``_harness``) to be pickled by value:
the actors' processes cannot import the benchmarks folder. ``quick_sizes``
changes the sizes here, so the driver's modules read them as ``A.NAME``.
"""

from __future__ import annotations

import gc
import hashlib
import os
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch

from _harness import SYNTHETIC, private

from tensorferry.transports._nixl_load import ucx_environment

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
# The consumer's prefaulted receive pool for "tensorferry + receive pool" (the
# counterpart of Ray's NIXL memory pool on the producer): room for one 1 GiB
# object plus alignment.
RECV_POOL_NBYTES = TOTAL_NBYTES + (64 << 20)
# Ray's own nixl transport loads the UCX of nixl's wheel in the actors:
# ucx_environment() keeps its EFA module out, or every actor crashed at exit
# on a host with rdma-core (see tensorferry.transports._nixl_load).
LO_ENV = {"UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo", **ucx_environment()}


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


def settled(read: Callable[[], Any], timeout: float, idle: Callable[[Any], bool] = lambda x: not x,
            interval_seconds: float = 0.01) -> Any:
    """``read()`` after a garbage collection, again every ``interval_seconds``
    until ``idle`` of it or ``timeout`` seconds: what a transport in this actor
    still holds once the driver has dropped the ref (the settle step,
    outside the timing). Returns the last read."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        got = read()
        if idle(got) or time.monotonic() > deadline:
            return got
        time.sleep(interval_seconds)


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
            return settled(lambda: held(self.nixl_pool), timeout,
                           lambda h: not h.get("tensorferry_pool_used_nbytes") and not h.get("nixl_pool_objects"))

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
            synthetic_state_dict = private(SYNTHETIC, "synthetic_state_dict")

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
            def objects() -> dict:
                try:
                    from ray.experimental.rdt.util import get_tensor_transport_manager

                    pool = get_tensor_transport_manager("NIXL")._memory_pool
                    return {"nixl_pool_objects": 0 if pool is None else len(pool._allocated_by_obj)}
                except Exception:  # noqa: BLE001 - no NIXL in this process yet
                    return {"nixl_pool_objects": 0}

            return settled(objects, timeout, lambda h: h["nixl_pool_objects"] == 0)

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
