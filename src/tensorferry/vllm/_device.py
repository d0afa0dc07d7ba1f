"""Worker side, a CUDA worker only: received host tensors to the device, in
chunks, each chunk's copy overlapped with ``load_weights`` of the one before.

UNTESTED here: no GPU is lent to this project's machines (docs/vllm.md,
"What is verified"); ``tests/vllm/test_cuda.py`` runs it where CUDA is.

The round lands in pinned host tensors (``checkpoint_targets(pin_memory=
True)``), so each chunk's host-to-device copy is a DMA on a side stream
that runs while the compute stream loads the chunk before it. The device
copies are kept until :meth:`DeviceStager.release` (the engine's
``finish_weight_update``): vLLM's layerwise reload may hold the tensors it
was handed until it finalizes.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..errors import ConfigurationError

__all__ = ["DeviceStager", "CHUNK_NBYTES"]

# Bytes a chunk copies before its load: large enough that a copy's launch
# and event cost is noise against its transfer (~10 ms at 25 GB/s), small
# enough that the first load starts early and two chunks in flight are a
# small fraction of a device's memory.
CHUNK_NBYTES = 256 << 20


class DeviceStager:
    """Copies ``(name, host tensor)`` pairs to ``device`` a chunk at a time and loads them."""

    def __init__(self, device: torch.device, chunk_nbytes: int = CHUNK_NBYTES) -> None:
        self.device = device
        self.chunk_nbytes = chunk_nbytes
        self._held: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None

    def load(self, items: Iterable[tuple[str, torch.Tensor]], load_weights: Callable) -> None:
        """Copy every chunk on a side stream and call ``load_weights`` on each
        once its copy is done (on the current stream), the next chunk's copy
        running meanwhile. Copies each tensor once, host to device."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        compute = torch.cuda.current_stream(self.device)
        pending: tuple[list, torch.cuda.Event] | None = None
        chunk: list[tuple[str, torch.Tensor]] = []
        nbytes = 0
        for name, tensor in items:
            chunk.append((name, tensor))
            nbytes += tensor.numel() * tensor.element_size()
            if nbytes >= self.chunk_nbytes:
                pending = self._flush(chunk, pending, compute, load_weights)
                chunk, nbytes = [], 0
        if chunk:
            pending = self._flush(chunk, pending, compute, load_weights)
        if pending is not None:
            compute.wait_event(pending[1])
            load_weights(pending[0])

    def _flush(self, chunk: list, pending: tuple | None, compute: torch.cuda.Stream, load_weights: Callable) -> tuple:
        stream = self._stream
        if stream is None:  # load() makes it before the first chunk; a stager used after close() has none
            raise ConfigurationError("the CUDA stager has no copy stream: it was closed; make a new engine (init_transfer_engine)")
        with torch.cuda.stream(stream):
            on_device = [(name, t.to(self.device, non_blocking=True)) for name, t in chunk]
            done = torch.cuda.Event()
            done.record(stream)
        self._held.extend(t for _, t in on_device)
        if pending is not None:
            compute.wait_event(pending[1])
            load_weights(pending[0])
        return on_device, done

    def release(self) -> None:
        """Drop the device copies of the last round (after vLLM finalized it)."""
        self._held.clear()
