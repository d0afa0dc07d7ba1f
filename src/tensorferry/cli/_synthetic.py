"""A synthetic model state dict for the demo and the benchmarks, and the
check that a received one equals what was sent.

Shaped like a real one: named layers, 2-D weights and 1-D biases, mixed
dtypes (float32, bfloat16, float16, int64 scalars), and a share of the
parameters as views into one flat buffer, as FSDP and RL trainers keep them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ConfigurationError, TransferError

__all__ = ["synthetic_state_dict", "verify_same"]


def synthetic_state_dict(total_nbytes: int, num_tensors: int, *, seed: int = 0, view_fraction: float = 0.5) -> dict[str, torch.Tensor]:
    """About ``total_nbytes`` of tensors in about ``num_tensors`` entries.

    Args:
        total_nbytes: target size of the tensor data.
        num_tensors: target number of tensors (at least 4).
        seed: seed of the random contents.
        view_fraction: share of the float32 weights that are views into one
            flat buffer (the rest are separate tensors).
    """
    if num_tensors < 4:
        raise ConfigurationError(f"num_tensors must be at least 4, got {num_tensors}")
    gen = torch.Generator().manual_seed(seed)
    # Each layer: weight (bulk of the bytes), bias, a bf16 norm, and an int64
    # step counter; 4 tensors a layer.
    layers = max(1, num_tensors // 4)
    per_layer = total_nbytes // layers
    # Weight of d x d float32 takes almost all of a layer's bytes.
    d = max(4, int(math.sqrt(max(per_layer - 64, 16) / 4.0 / 1.01)))
    n_views = int(layers * view_fraction)
    flat = torch.empty(n_views * (d * d + d), dtype=torch.float32)
    flat.uniform_(-1, 1, generator=gen)
    out: dict[str, torch.Tensor] = {}
    pos = 0
    for i in range(layers):
        prefix = f"model.layers.{i}"
        if i < n_views:
            out[f"{prefix}.weight"] = flat[pos : pos + d * d].view(d, d)
            pos += d * d
            out[f"{prefix}.bias"] = flat[pos : pos + d]
            pos += d
        else:
            out[f"{prefix}.weight"] = torch.empty(d, d).uniform_(-1, 1, generator=gen)
            out[f"{prefix}.bias"] = torch.empty(d).uniform_(-1, 1, generator=gen)
        out[f"{prefix}.norm.weight"] = torch.empty(d // 4 + 1, dtype=torch.bfloat16).uniform_(0, 2, generator=gen)
        out[f"{prefix}.steps"] = torch.tensor(i, dtype=torch.int64)
    out["model.embed.weight"] = torch.empty(7, d // 2 + 3, dtype=torch.float16).uniform_(-1, 1, generator=gen)
    return out


def verify_same(expected: Any, got: Any, path: str = "obj") -> None:
    """Raise :class:`TransferError` naming the first tensor that differs."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or list(expected) != list(got):
            raise TransferError(f"verification failed: {path}: keys differ")
        for k in expected:
            verify_same(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        if type(expected) is not type(got) or len(expected) != len(got):
            raise TransferError(
                f"verification failed: {path}: {type(expected).__name__} of {len(expected)} became {type(got).__name__}"
            )
        for i, (e, g) in enumerate(zip(expected, got)):
            verify_same(e, g, f"{path}[{i}]")
    else:
        if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype or got.shape != expected.shape:
            raise TransferError(f"verification failed: {path}: expected {expected.dtype}{tuple(expected.shape)}, got {got!r:.80}")
        if not torch.equal(got, expected):
            raise TransferError(f"verification failed: {path}: values differ")
