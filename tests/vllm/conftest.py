"""vLLM on this CPU-only machine, for the tests in this folder.

vLLM 0.33 installs here with ``pip install --no-deps`` (``make test`` does
it; its metadata pins CUDA builds of torch). Without a CUDA device vLLM
needs ``VLLM_TARGET_DEVICE=cpu`` to pick its CPU platform, set here before
anything imports vLLM, so every worker process spawned by a test inherits
it. Every test module here starts with ``_vllm_support.skip_without_vllm()``:
where vLLM cannot be imported they are skipped, with the import error as
the reason.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
