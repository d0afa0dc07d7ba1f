"""vLLM's own model class as the worker's model: ``Qwen2ForCausalLM``, built by vLLM's loader.

vLLM's ``initialize_model`` (what its model loader calls, which records
the layerwise-reload metadata) builds vLLM's Qwen2 from a small Hugging
Face config (no weights, nothing downloaded) in each worker process of a
tensor-parallel group of 2 (gloo). The trainer is ``transformers``'
``Qwen2ForCausalLM`` of the same config (random weights) behind
``ModuleSource``. Proves: vLLM's own ``load_weights`` of a real model class
receives the rounds (checkpoint names, fused and sliced by its loaders)
inside vLLM's layerwise reload, every parameter of each TP rank is exact,
and the reload copies back into the same parameter memory every round.
"""

from __future__ import annotations

import pytest
import torch

import _vllm_support

_vllm_support.skip_without_vllm()

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402

from _vllm_model import Spec, expected_qwen2_params, perturb, save_hf_config  # noqa: E402
from _vllm_workers import HttpFront, Workers  # noqa: E402

import tensorferry.vllm as tv  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SPEC = Spec()
TP = 2


def test_vllm_qwen2_on_tp2_loads_every_round_exactly(tmp_path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    save_hf_config(SPEC, str(tmp_path))
    torch.manual_seed(0)
    trainer_model = Qwen2ForCausalLM(Qwen2Config.from_pretrained(str(tmp_path))).float()
    params = dict(trainer_model.named_parameters())
    group = Workers(SPEC, tp=TP, hf_dir=str(tmp_path))
    front = HttpFront(group)
    engine = WeightTransferTrainerFactory.trainer_init(tv.TensorferryTrainerInitInfo(rank=0), client=front.client(),
                                                       source=ModuleSource(trainer_model))
    try:
        addresses = []
        for r in range(2):
            with torch.no_grad():
                ckpt = {n: p.detach() for n, p in params.items()}
                perturb(ckpt, r, 0.05)  # in place: the trainer's own parameters
            engine.send_weights()
            for rank in range(TP):
                want = expected_qwen2_params({n: p.detach() for n, p in params.items()}, SPEC, rank, TP, torch.float32)
                got = group.params(rank)
                assert sorted(got) == sorted(want)
                for name, (tensor, _) in got.items():
                    assert torch.equal(tensor, want[name]), f"TP rank {rank}: {name} differs"
            addresses.append({name: ptr for name, (_, ptr) in group.params(0).items()})
        assert addresses[0] == addresses[1]
        assert [(s["rounds"], s["layerwise_sessions"]) for s in group.call("stats")] == [(2, 2)] * TP
    finally:
        engine.shutdown()
        front.close()
        group.close()
