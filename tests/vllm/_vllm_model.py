"""A small decoder in both of its forms, for the vLLM backend's tests.

* The trainer's form: a plain module whose parameters carry checkpoint
  (Hugging Face) names: ``model.layers.0.self_attn.q_proj.weight``, ...
* The worker's form (:class:`WorkerModel`): vLLM's own parallel layers
  (``VocabParallelEmbedding``, ``QKVParallelLinear``,
  ``MergedColumnParallelLinear``, ``RowParallelLinear``), whose parameters
  are fused (``qkv_proj``, ``gate_up_proj``) and sliced for tensor
  parallelism; its ``load_weights`` maps checkpoint names onto them in the
  way vLLM's Llama-family models do, so vLLM's weight loaders do the work.

:func:`expected_worker_params` computes what a worker rank must hold after
loading a checkpoint, from the checkpoint alone, for the exactness checks.
Build :class:`WorkerModel` inside ``set_current_vllm_config`` after vLLM's
parallel state is initialised (``init_worker_dist``).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch


class Spec(NamedTuple):
    """Sizes of the decoder (vocab a multiple of 64 x TP: vLLM pads vocab to 64 a rank)."""

    vocab: int = 256
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    layers: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def checkpoint_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape, in the order a trainer's module holds them."""
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (spec.intermediate, h),
            p + "mlp.up_proj.weight": (spec.intermediate, h),
            p + "mlp.down_proj.weight": (h, spec.intermediate),
        })
    shapes["model.norm.weight"] = (h,)
    return shapes


def checkpoint(spec: Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random fp32 checkpoint (a generator of its own: the same in every process)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in checkpoint_shapes(spec).items()}


def perturb(state: dict[str, torch.Tensor], round_: int, fraction: float) -> None:
    """Change ``fraction`` of each tensor's elements in place, the same in every process for a round."""
    gen = torch.Generator().manual_seed(1000 + round_)
    for name in sorted(state):
        t = state[name].view(-1)
        k = max(1, int(t.numel() * fraction))
        idx = torch.randperm(t.numel(), generator=gen)[:k]
        t[idx] += torch.randn(k, generator=gen)


def module_of(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module whose parameters are ``state``'s tensors under their dotted names (copies them)."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    return root


def init_worker_dist(rank: int, world: int, rendezvous: str) -> None:
    """vLLM's parallel state over gloo (tensor parallel over ``world`` ranks), met at
    the file ``rendezvous`` (no port to race other processes of a shared machine for)."""
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"file://{rendezvous}", local_rank=rank, backend="gloo"
    )
    initialize_model_parallel(tensor_model_parallel_size=world)


class _Layer(torch.nn.Module):
    def __init__(self, spec: Spec, dtype: torch.dtype, prefix: str) -> None:
        from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        super().__init__()
        h = spec.hidden
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.zeros(h, dtype=dtype), requires_grad=False)
        self.input_layernorm.weight.weight_loader = default_weight_loader
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(h, spec.head_dim, spec.heads, spec.kv_heads, bias=True, params_dtype=dtype,
                                                    prefix=prefix + "self_attn.qkv_proj")
        self.self_attn.o_proj = RowParallelLinear(h, h, bias=False, params_dtype=dtype, prefix=prefix + "self_attn.o_proj")
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(h, [spec.intermediate] * 2, bias=False, params_dtype=dtype,
                                                           prefix=prefix + "mlp.gate_up_proj")
        self.mlp.down_proj = RowParallelLinear(spec.intermediate, h, bias=False, params_dtype=dtype, prefix=prefix + "mlp.down_proj")


# (fused parameter, checkpoint part, shard id): how vLLM's Llama-family
# models route checkpoint names to their fused layers' weight loaders.
_STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


class WorkerModel(torch.nn.Module):
    """The decoder as a vLLM worker holds it: vLLM's parallel layers, fused and TP-sliced."""

    def __init__(self, spec: Spec, dtype: torch.dtype = torch.float32) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(spec.vocab, spec.hidden, params_dtype=dtype, prefix="model.embed_tokens")
        self.model.layers = torch.nn.ModuleList(_Layer(spec, dtype, f"model.layers.{i}.") for i in range(spec.layers))
        self.model.norm = torch.nn.Module()
        self.model.norm.weight = torch.nn.Parameter(torch.zeros(spec.hidden, dtype=dtype), requires_grad=False)
        self.model.norm.weight.weight_loader = default_weight_loader
        for p in self.parameters():
            p.requires_grad_(False)
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for fused, part, shard_id in _STACKED:
                if part in name:
                    target = name.replace(part, fused)
                    param = params[target]
                    param.weight_loader(param, tensor, shard_id)
                    break
            else:
                target = name
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        self.loaded = sorted(loaded)
        return loaded


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def expected_worker_params(ckpt: dict[str, torch.Tensor], spec: Spec, rank: int, world: int,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What tensor-parallel rank ``rank`` of ``world`` holds after loading ``ckpt`` (cast to ``dtype``)."""
    c = {k: v.to(dtype) for k, v in ckpt.items()}
    out = {"model.embed_tokens.weight": _rows(c["model.embed_tokens.weight"], rank, world), "model.norm.weight": c["model.norm.weight"]}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[p + "input_layernorm.weight"] = c[p + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            out[a + f"qkv_proj.{kind}"] = torch.cat([_rows(c[a + f"{x}_proj.{kind}"], rank, world) for x in "qkv"])
        out[a + "o_proj.weight"] = _rows(c[a + "o_proj.weight"].t(), rank, world).t()
        out[m + "gate_up_proj.weight"] = torch.cat([_rows(c[m + "gate_proj.weight"], rank, world), _rows(c[m + "up_proj.weight"], rank, world)])
        out[m + "down_proj.weight"] = _rows(c[m + "down_proj.weight"].t(), rank, world).t()
    return out


def save_hf_config(spec: Spec, path: str) -> None:
    """A Qwen2 config of ``spec``'s sizes at ``path`` (no weights: vLLM builds its model class from it)."""
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate, vocab_size=spec.vocab,
                tie_word_embeddings=False, max_position_embeddings=128, torch_dtype="float32").save_pretrained(path)


def expected_qwen2_params(ckpt: dict[str, torch.Tensor], spec: Spec, rank: int, world: int,
                          dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What vLLM's Qwen2ForCausalLM holds on TP rank ``rank`` after loading ``ckpt``: the
    decoder's parameters, the second norm of each layer, and the vocabulary-parallel head."""
    out = expected_worker_params(ckpt, spec, rank, world, dtype)
    for i in range(spec.layers):
        name = f"model.layers.{i}.post_attention_layernorm.weight"
        out[name] = ckpt[name].to(dtype)
    out["lm_head.weight"] = _rows(ckpt["lm_head.weight"].to(dtype), rank, world)
    return out
