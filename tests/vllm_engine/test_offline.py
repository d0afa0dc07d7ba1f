"""An offline ``vllm.LLM`` with the trainer in the same process, through ``LLMClient``.

A bf16 engine fed by an fp32 trainer (``dtype="bfloat16"``: the cast happens
on the trainer, half the bytes move) with deltas on, over tcp: the first
round whole, the second 1% of the elements changed (a delta of a few percent
of the bytes, all the worker reads), the third every weight changed. After every round the engine's prompt
log-probabilities match ``transformers``' forward of the trainer's weights
cast to bf16, and have moved from the previous round's.
"""

from __future__ import annotations

import psutil
import pytest
import torch

from _engine import MAX_MODEL_LEN, PROMPT, load_model, max_diff, perturb, reference_logprobs

pytestmark = pytest.mark.timeout(900)

# bf16 keeps 8 bits of mantissa (a relative step of 0.4%): the engine's
# kernels and transformers' sum in other orders, so a log-probability of -13
# was seen 0.12 apart (0.9%); each round moves the answers by whole nats.
BF16_ABS, BF16_REL = 0.05, 0.02
MOVED_AT_LEAST = 0.5


def _bf16_gap(got: list[float], want: list[float]) -> float:
    """The worst position's distance over its bf16 tolerance (at most 1 passes)."""
    return max(abs(g - w) / (BF16_ABS + BF16_REL * abs(w)) for g, w in zip(got, want))


def _engine_logprobs(llm) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [row[token].logprob for row, token in zip(out.prompt_logprobs[1:], PROMPT[1:])]


def test_offline_llm_bf16_engine_three_rounds_one_a_sparse_delta(checkpoint):
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from tensorferry.vllm import LLMClient, TensorferryTrainerInitInfo

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = engine = None
    try:
        llm = LLM(model=str(checkpoint), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                  weight_transfer_config=WeightTransferConfig(backend="tensorferry"))  # fmt: skip
        model = load_model(checkpoint)
        # tcp: on one host a shm sender offers only deltas under 1% of the bytes (docs/delta.md)
        info = TensorferryTrainerInitInfo(rank=0, transport="tcp", dtype="bfloat16", delta=True)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=ModuleSource(model))
        previous = _engine_logprobs(llm)
        for r in range(3):
            if r != 1:
                perturb(model, 40 + r)
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        p.view(-1)[::100] += 0.5  # 1% of the elements
            engine.send_weights()
            report = engine.last_round
            assert report.nbytes == sum(p.numel() for p in model.parameters()) * 2, "bf16 on the wire: 2 bytes an element"
            if r == 1:
                assert 0 < report.delta_nbytes < report.nbytes / 5, f"a 1% change is a small delta: {report}"
                assert report.bytes_sent == report.delta_nbytes, f"the worker read the delta only: {report}"
            got = _engine_logprobs(llm)
            want = reference_logprobs(checkpoint, dict(model.state_dict()), torch.bfloat16)
            assert _bf16_gap(got, want) <= 1.0, f"round {r + 1}: {max_diff(got, want):.3f} off the bf16 model ({_bf16_gap(got, want):.2f}x the tolerance)"
            assert max_diff(got, previous) > MOVED_AT_LEAST, f"round {r + 1}: the answer did not move"
            previous = got
    finally:
        if engine is not None:
            engine.shutdown()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for proc in psutil.Process().children(recursive=True):  # nothing this test started outlives it
            if proc.pid not in before:
                proc.kill()
