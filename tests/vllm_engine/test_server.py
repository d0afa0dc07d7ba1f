"""The trainer (this process) into ``vllm serve`` processes, through vLLM's ``HTTPVLLMWeightSyncClient``.

After every round the engine's prompt log-probabilities (``/v1/completions``)
are compared with ``transformers``' forward of the trainer's weights: fp32
within :data:`FP32_TOLERANCE`, and each round's answer must have moved
from the previous round's by far more than that, so a round that did not
land cannot pass.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from _engine import PROMPT, load_model, logprobs_of, max_diff, perturb, post, reference_logprobs

pytestmark = pytest.mark.timeout(900)

FP32_TOLERANCE = 1e-3
# Each round moves the weights by 0.05 a parameter (their own scale is ~0.02):
# the answers move by whole nats; a round must move them at least this much.
MOVED_AT_LEAST = 0.1
TOKEN = "tensorferry-engine-tests-token"


def _trainer(client, model, **options):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from tensorferry.vllm import TensorferryTrainerInitInfo

    info = TensorferryTrainerInitInfo(rank=0, **options)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))


def _state(model) -> dict:
    return dict(model.state_dict())


def _check_round(server, checkpoint, model, previous: list[float] | None) -> list[float]:
    want = reference_logprobs(checkpoint, _state(model))
    got = server.logprobs()
    assert max_diff(got, want) < FP32_TOLERANCE, f"{server.name}: the engine's answer is {max_diff(got, want):.2e} off the trainer's weights"
    if previous is not None:
        assert max_diff(got, previous) > MOVED_AT_LEAST, f"{server.name}: the answer did not move from the previous round's"
    return got


def test_rounds_over_tcp_with_a_token_into_tensor_parallel_engine(servers, checkpoint):
    """b, c: 3 rounds over tcp with a token into a TP=2 server; then the trainer's model
    replaced (``load_state_dict(assign=True)``): the next round plans again and lands."""
    server = servers["tp2"]
    model = load_model(checkpoint)
    engine = _trainer(server.client(), model, transport="tcp", token=TOKEN)
    try:
        previous = server.logprobs()
        for r in range(3):
            perturb(model, r)
            engine.send_weights()
            report = engine.last_round
            assert report.planned == (r == 0)
            assert report.bytes_sent >= report.nbytes  # tcp: every byte crossed the socket, to 2 TP workers
            previous = _check_round(server, checkpoint, model, previous)
        replaced = {k: v.clone() + 0.05 for k, v in model.state_dict().items()}
        model.load_state_dict(replaced, assign=True)
        engine.send_weights()
        assert engine.last_round.planned, "a replaced model must be planned again"
        _check_round(server, checkpoint, model, previous)
    finally:
        engine.shutdown()


def test_request_during_a_paused_round_sees_the_new_weights(servers, checkpoint):
    """f: as RL frameworks drive it: ``/pause`` (requests kept), a request arrives, the round,
    ``/resume``: the request completes without error, with the new weights."""
    server = servers["tp2"]
    model = load_model(checkpoint)
    engine = _trainer(server.client(), model)  # shm: the server is on this host
    answers: list = []
    try:
        perturb(model, 10)
        engine.send_weights()
        old = _check_round(server, checkpoint, model, None)
        post(f"{server.url}/pause?mode=keep")
        request = threading.Thread(
            target=lambda: answers.append(post(f"{server.url}/v1/completions", {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}))
        )
        request.start()
        time.sleep(1.0)  # the request is queued behind the pause
        assert not answers, "a request completed while the engine was paused"
        perturb(model, 11)
        engine.send_weights()
        post(f"{server.url}/resume")
        request.join(timeout=120)
        assert answers, "the request sent during the pause did not complete after /resume"
        got = logprobs_of(answers[0])
        assert max_diff(got, reference_logprobs(checkpoint, _state(model))) < FP32_TOLERANCE
        assert max_diff(got, old) > MOVED_AT_LEAST
    finally:
        post(f"{server.url}/resume")
        engine.shutdown()


def test_requests_during_an_unpaused_round_see_old_or_new_never_a_mix(servers, checkpoint):
    """Serving through a round without a pause: vLLM runs the round's ``update_weights`` between
    model steps, so each forward pass sees the old weights or the new ones, never some layers of each."""
    server = servers["tp1"]
    model = load_model(checkpoint)
    engine = _trainer(server.client(), model)
    stop = threading.Event()
    answers: list[list[float]] = []
    errors: list[BaseException] = []

    def traffic() -> None:
        while not stop.is_set():
            try:
                answers.append(server.logprobs())
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    try:
        perturb(model, 20)
        engine.send_weights()
        old = reference_logprobs(checkpoint, _state(model))
        perturb(model, 21)
        new = reference_logprobs(checkpoint, _state(model))
        thread = threading.Thread(target=traffic)
        thread.start()
        time.sleep(0.5)
        engine.send_weights()
        time.sleep(0.5)
        stop.set()
        thread.join(timeout=120)
        assert not errors, f"requests failed during the round: {errors[0]!r}"
        assert len(answers) >= 2
        kinds = ["old" if max_diff(a, old) < FP32_TOLERANCE else "new" if max_diff(a, new) < FP32_TOLERANCE else "mixed" for a in answers]
        assert "mixed" not in kinds, kinds
        assert kinds[-1] == "new", kinds
    finally:
        stop.set()
        engine.shutdown()


def test_two_engines_through_a_relay_chain_and_one_killed_between_rounds(servers, checkpoint):
    """d, f: two servers (TP=2 and TP=1: three worker processes, ``readers=3``) fed with ``fanout=1``
    relays over tcp, deltas on: the trainer's link carries about one copy a round. Then the TP=1 server is
    killed and started again between rounds: it reads the next round whole while the other reads
    its delta, and from the round after that both read deltas (1% of the elements changed)."""
    from tensorferry.vllm import EnginesClient

    first, second = servers["tp2"], servers["tp1"]
    model = load_model(checkpoint)
    engine = _trainer(EnginesClient([first.client(), second.client()]), model, transport="tcp", token=TOKEN, fanout=1, delta=True, readers=3)
    try:
        previous = {s.name: s.logprobs() for s in (first, second)}
        sparse = 0

        def change_one_percent() -> None:
            nonlocal sparse
            with torch.no_grad():
                for p in model.parameters():
                    p.view(-1)[sparse % 100 :: 100] += 0.5
            sparse += 1

        def round_checked() -> object:
            engine.send_weights()
            for s in (first, second):
                previous[s.name] = _check_round(s, checkpoint, model, previous[s.name])
            return engine.last_round

        perturb(model, 30)
        report = round_checked()
        # three worker processes read the round; without relays the trainer would send it three times
        assert 0 < report.bytes_sent < 1.5 * report.nbytes, f"the trainer sent {report.bytes_sent} B of a {report.nbytes} B round"
        change_one_percent()
        report = round_checked()
        assert 0 < report.delta_nbytes < report.nbytes / 5, report
        assert report.bytes_sent < 1.5 * report.delta_nbytes, f"one delta crossed the trainer's link: {report}"
        second.kill()
        second.start().wait()
        second.client().init_weight_transfer_engine(engine.worker_init_info())
        change_one_percent()
        report = round_checked()
        assert report.delta_nbytes > 0, report
        assert report.bytes_sent >= report.nbytes, f"the restarted engine must read the round whole: {report}"
        change_one_percent()
        report = round_checked()
        assert report.bytes_sent < 1.5 * report.delta_nbytes, f"both engines read the delta again: {report}"
    finally:
        engine.shutdown()
