"""An FSDP2 trainer (2 gloo ranks, ``fully_shard``) into the tensor-parallel (TP=2) server.

Each rank puts only its own shards (their boxes read from torch's DTensor
placements on vLLM 0.32, from ``ParamMeta`` on 0.33); the server's two
workers read each checkpoint tensor's pieces from both ranks. After each
round the server's answer matches ``transformers``' forward of the whole
model changed the same way.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest

from _engine import free_port, load_model, max_diff, perturb, reference_logprobs

pytestmark = pytest.mark.timeout(900)

FP32_TOLERANCE = 1e-3
MOVED_AT_LEAST = 0.1
ROUNDS = 2


def test_fsdp2_ranks_put_their_own_shards_into_tp2_engine(servers, checkpoint):
    from _fsdp_trainer import rank_main

    server = servers["tp2"]
    ctx = mp.get_context("spawn")
    results, checked = ctx.Queue(), ctx.Barrier(3)
    port = free_port()
    ranks = [
        ctx.Process(target=rank_main, args=(r, port, str(checkpoint), server.url, "tensorferry-fsdp-engine-token", ROUNDS, results, checked))
        for r in range(2)
    ]
    whole = load_model(checkpoint)
    total_nbytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    try:
        for proc in ranks:
            proc.start()
        previous = server.logprobs()
        for r in range(ROUNDS):
            reports = sorted(results.get(timeout=600) for _ in ranks)
            errors = [rep for rep in reports if rep[1] == "error"]
            assert not errors, errors
            put = [nbytes for _, _, nbytes, _ in reports]
            assert sum(put) == total_nbytes, f"the ranks put {put} B, the model is {total_nbytes} B"
            assert max(put) < 0.6 * total_nbytes, f"each rank puts only its shards: {put} of {total_nbytes} B"
            perturb(whole, 50 + r)
            got = server.logprobs()
            want = reference_logprobs(checkpoint, dict(whole.state_dict()))
            assert max_diff(got, want) < FP32_TOLERANCE, f"round {r + 1}: {max_diff(got, want):.2e} off the trainer's weights"
            assert max_diff(got, previous) > MOVED_AT_LEAST
            previous = got
            checked.wait(timeout=600)
        for proc in ranks:
            proc.join(timeout=120)
            assert proc.exitcode == 0
    finally:
        checked.abort()
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
                proc.join(30)
