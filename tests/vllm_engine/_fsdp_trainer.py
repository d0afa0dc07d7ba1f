"""One rank of an FSDP2 trainer (``fully_shard`` on a gloo mesh of 2) feeding a vLLM server.

Run by ``test_fsdp.py`` in two spawned processes. Each rank loads the
checkpoint, shards it, changes its own shards each round exactly as
``_engine.perturb`` changes the whole model (the same seeded noise, its
local box of it), and calls ``send_weights``; rank 0 drives the server's
HTTP routes. Every rank reports what it put each round, then waits at
``checked`` (a barrier with the test) until the test has read the engine.
"""

from __future__ import annotations

import os
from typing import Any


def _perturb_local(model: Any, round_index: int, scale: float = 0.05) -> None:
    import torch

    from tensorferry.shards import local_box

    generator = torch.Generator().manual_seed(1000 + round_index)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=generator) * scale  # the whole tensor's noise, as _engine.perturb draws it
            local, _, offsets = local_box(p)
            piece = noise[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))]
            local.add_(piece)


def rank_main(rank: int, port: int, checkpoint: str, url: str, token: str, rounds: int, results: Any, checked: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

        from _engine import load_model

        from tensorferry.vllm import TensorferryTrainerInitInfo

        model = load_model(checkpoint)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        info = TensorferryTrainerInitInfo(rank=rank, world_size=2, transport="tcp", token=token)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
        try:
            for r in range(rounds):
                _perturb_local(model, 50 + r)
                engine.send_weights()
                report = engine.last_round
                results.put((rank, r, report.nbytes, report.bytes_sent))
                checked.wait(timeout=600)  # the test reads the engine's answer before the next round
        finally:
            engine.shutdown()
    except BaseException as exc:
        results.put((rank, "error", f"{type(exc).__name__}: {exc}", None))
        raise
    finally:
        dist.destroy_process_group()
