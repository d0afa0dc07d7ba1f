"""The CUDA worker's path: a round lands in pinned host tensors and goes to
the device in chunks, each copy overlapped with loading the chunk before.

Needs a CUDA device (none is lent to this project's machines: skipped
here, with the reason). Proves: every tensor ``load_weights`` receives is
on the device and equal to the received one, chunks are loaded in order
(several when ``chunk_nbytes`` is small), and the device copies are held
until ``release`` (vLLM's ``finish_weight_update``).
"""

from __future__ import annotations

import pytest
import torch

import _vllm_support

_vllm_support.skip_without_vllm()

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device: the pinned host-to-device path of a CUDA vLLM worker", allow_module_level=True)


def test_device_stager_loads_every_tensor_on_the_device_in_chunks() -> None:
    from tensorferry.vllm._device import DeviceStager
    from tensorferry.vllm._targets import checkpoint_targets

    device = torch.device("cuda", torch.cuda.current_device())
    names = [f"layers.{i}.weight" for i in range(8)]
    host = {name: torch.randn(256, 256).pin_memory() for name in names}
    loads: list[list[tuple[str, torch.Tensor]]] = []
    stager = DeviceStager(device, chunk_nbytes=3 * 256 * 256 * 4)
    stager.load(host.items(), lambda chunk: loads.append(list(chunk)))
    torch.cuda.synchronize()
    assert [len(chunk) for chunk in loads] == [3, 3, 2]
    got = [pair for chunk in loads for pair in chunk]
    assert [name for name, _ in got] == names
    for name, tensor in got:
        assert tensor.device == device
        assert torch.equal(tensor.cpu(), host[name])
    assert len(stager._held) == len(names)
    stager.release()
    assert not stager._held


def test_targets_of_a_cuda_worker_are_pinned() -> None:
    import tensorferry as tf
    from tensorferry.vllm._targets import checkpoint_targets

    with tf.Sender("shm") as sender:
        ticket = sender.put({"a": torch.randn(4, 4), "b": torch.randn(3)})
        layout = tf.Ticket.from_bytes(ticket.to_bytes()).layout
        sender.discard(ticket)
    targets = checkpoint_targets([layout], pin_memory=True)
    assert sorted(targets) == ["a", "b"]
    assert all(t.is_pinned() for t in targets.values())
