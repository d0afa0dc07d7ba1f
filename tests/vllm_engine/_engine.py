"""Real vLLM engines for the tests in this folder: a checkpoint, servers, and what they answer.

* :func:`write_checkpoint`: a small Qwen2 written by ``transformers``
  (random weights, safetensors; nothing from a hub).
* :class:`Server`: vLLM's OpenAI server as a process of its own
  (``python -m vllm.entrypoints.openai.api_server``, its RL routes mounted
  with ``VLLM_SERVER_DEV_MODE=1``), in a session of its own so that
  stopping it ends its engine core and workers too.
* :func:`engine_logprobs` (a server's ``/v1/completions``) and
  :func:`reference_logprobs` (``transformers``' forward of a state dict):
  the log-probabilities of every prompt token after the first, compared
  after each round.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

# A fixed token prompt: every position's log-probability is compared, so the
# whole model (embedding, every layer, the head) is checked at once.
PROMPT = [3, 17, 101, 250, 7, 400, 33, 64, 128, 5, 311, 90, 12, 477, 2, 200]

# The smallest Qwen2 vLLM's CPU attention runs (its kernels take head
# dimensions of 32 and up; 64 here): 2.6 M parameters, 10 MiB in fp32.
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)

# vLLM's CPU build: a 1 GiB KV cache (its default takes a share of the
# machine's memory), threads not pinned to cores other processes share.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_SERVER_DEV_MODE": "1"}
MAX_MODEL_LEN = 128
START_TIMEOUT_SECONDS = 600.0


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """A Qwen2 of :data:`CONFIG` with random fp32 weights, saved as safetensors under ``path``."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG, torch_dtype="float32"))
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_model(path: Path) -> torch.nn.Module:
    """``transformers``' Qwen2 of the checkpoint, fp32: the trainer's model."""
    import transformers

    return transformers.Qwen2ForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def perturb(model: torch.nn.Module, round_index: int, scale: float = 0.05) -> None:
    """Change every parameter in place (the trainer's kept plan stays valid), seeded by the round."""
    generator = torch.Generator().manual_seed(1000 + round_index)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def reference_logprobs(path: Path, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> list[float]:
    """``transformers``' log-probabilities of :data:`PROMPT` under ``state`` (cast to ``dtype``)."""
    import transformers

    config = transformers.Qwen2Config.from_pretrained(path)
    model = transformers.Qwen2ForCausalLM(config).to(dtype)
    model.load_state_dict({k: v.detach().to(dtype) for k, v in state.items()})
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return [logits[i, PROMPT[i + 1]].item() for i in range(len(PROMPT) - 1)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == len(PROMPT) - 1, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read()
    return json.loads(text) if text else {}


def engine_logprobs(url: str, model: str) -> list[float]:
    """The server's log-probabilities of :data:`PROMPT` (``/v1/completions``, ``prompt_logprobs``)."""
    answer = post(f"{url}/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0})
    return logprobs_of(answer)


def logprobs_of(answer: dict) -> list[float]:
    rows = answer["choices"][0]["prompt_logprobs"][1:]
    return [row[str(token)]["logprob"] for row, token in zip(rows, PROMPT[1:])]


class Server:
    """vLLM's OpenAI server on ``127.0.0.1:port`` with ``backend="tensorferry"``."""

    def __init__(self, checkpoint: Path, log_dir: Path, *, tp: int = 1, dtype: str = "float32", name: str = "engine") -> None:
        self.checkpoint, self.tp, self.dtype, self.name = checkpoint, tp, dtype, name
        self.log_path = log_dir / f"{name}.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> "Server":
        """Start the process (returns at once; :meth:`wait` for it to serve)."""
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.checkpoint),
            "--skip-tokenizer-init", "--dtype", self.dtype, "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
            "--host", "127.0.0.1", "--port", str(self.port), "--tensor-parallel-size", str(self.tp),
            "--weight-transfer-config", json.dumps({"backend": "tensorferry"}),
        ]  # fmt: skip
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENGINE_ENV}, start_new_session=True)
        log.close()
        self.starts += 1
        return self

    def wait(self, timeout: float = START_TIMEOUT_SECONDS) -> "Server":
        """Until ``/health`` answers; the server's log tail in the error where it died or timed out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({None if self.proc is None else self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} did not serve within {timeout:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """A crash: SIGKILL to the server, its engine core and its workers (its whole session)."""
        self._signal(signal.SIGKILL)
        self._reap()

    def stop(self, grace_seconds: float = 30.0) -> None:
        """End it as an operator does (SIGTERM: vLLM shuts its workers down), then SIGKILL what is left of its session."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)  # the server if it hung, and any worker that outlived it
        self._reap()

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=60)
            self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def logprobs(self) -> list[float]:
        return engine_logprobs(self.url, str(self.checkpoint))

    def client(self) -> Any:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(self.url)
