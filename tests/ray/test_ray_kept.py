"""The source actor's kept plan: the same tensors returned again replay it;
anything else takes the fresh path. Real Senders and a Receiver in this
process for the decisions, then an actor on a real Ray cluster returning
its weights after each step."""

from __future__ import annotations

import gc
import pickle

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from tensorferry import Receiver, Sender  # noqa: E402
from tensorferry.ray._kept import KeptPlan  # noqa: E402
from tensorferry.ray._segments import Segments  # noqa: E402
from tensorferry.ray._transport import TensorMeta  # noqa: E402

import _ray_helpers as H  # noqa: E402

ray.cloudpickle.register_pickle_by_value(H)

pytestmark = pytest.mark.ray

tfr.register()

MIB = 1 << 20


@pytest.fixture
def segments():
    segs = Segments(lambda n: Sender("shm", capacity_nbytes=n), 8 * MIB)
    try:
        yield segs
    finally:
        segs.close()


def _roundtrip(kept: KeptPlan, segments: Segments, receiver: Receiver, tensors: list) -> list:
    """Put through ``kept`` as the transport does, read it back, discard it."""
    sender, ticket = kept.put(segments, tensors)
    try:
        return list(receiver.get(ticket))
    finally:
        segments.discard(sender, ticket)


def _weights(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(4096, generator=g)
    return [flat[:1024].view(32, 32), flat[1024:3072], torch.arange(10), torch.randn(3, 5, generator=g).t()]


def test_the_same_tensors_are_planned_on_the_second_put_and_replayed_with_their_new_contents(segments):
    kept = KeptPlan()
    weights = _weights(1)
    with Receiver() as receiver:
        for step in range(5):
            with torch.no_grad():
                weights[1].add_(1.0)
                weights[3].mul_(-1.0)
            got = _roundtrip(kept, segments, receiver, list(weights))  # a fresh list each call, as Ray hands it
            assert H.mismatches(got, weights) == []
            assert kept.plans_made == (0 if step == 0 else 1)
            assert kept.plan_puts == step  # the first put is fresh; every later one by the plan


def test_fresh_tensors_at_recycled_addresses_never_make_a_plan(segments):
    kept = KeptPlan()
    with Receiver() as receiver:
        for seed in range(6):
            tensors = [torch.full((2048,), float(seed)) for _ in range(8)]
            assert H.mismatches(_roundtrip(kept, segments, receiver, tensors), tensors) == []
            del tensors
            gc.collect()  # their memory is free for the next call's tensors
    assert kept.plans_made == 0 and kept.plan_puts == 0


def test_another_shape_or_order_of_the_same_memory_is_never_sent_by_the_plan(segments):
    kept = KeptPlan()
    base = torch.arange(64, dtype=torch.float32)

    def send(t: torch.Tensor) -> None:
        got = _roundtrip(kept, segments, receiver, [t])
        assert got[0].shape == t.shape and torch.equal(got[0], t)

    with Receiver() as receiver:
        for _ in range(2):
            send(base.view(8, 8))
        assert (kept.plans_made, kept.plan_puts) == (1, 1)
        # The same address and element count, another shape: not the plan's layout.
        send(base.view(4, 16))
        assert kept.plan_puts == 1
        send(base.view(8, 8))  # the plan stayed for the object it was made of
        assert kept.plan_puts == 2
        # Another order of the same bytes: the memory of a recent fresh put,
        # so it gets a plan of its own, and the plain view no longer matches.
        send(base.view(8, 8).t())
        assert (kept.plans_made, kept.plan_puts) == (2, 3)
        send(base.view(8, 8))
        assert kept.plan_puts == 3


def test_a_plan_survives_other_objects_between_its_sends_until_another_is_sent_twice(segments):
    kept = KeptPlan()
    weights = _weights(5)
    with Receiver() as receiver:
        for step in range(4):
            _roundtrip(kept, segments, receiver, list(weights))
            fresh = [torch.full((100,), float(step))]
            assert H.mismatches(_roundtrip(kept, segments, receiver, fresh), fresh) == []
        assert kept.plans_made == 1 and kept.plan_puts == 3  # the weights: fresh, then by the plan
        other = _weights(6)
        for _ in range(2):
            assert H.mismatches(_roundtrip(kept, segments, receiver, list(other)), other) == []
        assert kept.plans_made == 2 and kept.plan.source[0] is other[0]


def test_a_moved_tensor_drops_the_plan_and_is_sent_as_it_is_now(segments):
    kept = KeptPlan()
    weights = _weights(2)
    with Receiver() as receiver:
        for _ in range(3):
            _roundtrip(kept, segments, receiver, list(weights))
        weights[1] = weights[1].clone() + 7  # the model's parameter replaced
        got = _roundtrip(kept, segments, receiver, list(weights))
        assert H.mismatches(got, weights) == [] and kept.plan_puts == 2
        # Sent again as it is now: planned again, then replayed.
        for _ in range(2):
            assert H.mismatches(_roundtrip(kept, segments, receiver, list(weights)), weights) == []
        assert kept.plans_made == 2 and kept.plan_puts == 4


def test_held_objects_that_fill_the_first_segment_send_the_next_fresh_and_keep_the_plan(segments):
    kept = KeptPlan()
    weights = [torch.ones(MIB)]  # 4 MiB: the 8 MiB first segment holds two
    with Receiver() as receiver:
        for _ in range(2):
            _roundtrip(kept, segments, receiver, weights)
        held = [kept.put(segments, weights) for _ in range(3)]  # refs Ray still holds
        assert segments.figures().segments >= 2  # the third went to a new segment
        for sender, ticket in held:
            assert torch.equal(receiver.get(ticket)[0], weights[0])
            segments.discard(sender, ticket)
        assert kept.plan is not None


def test_kept_plans_off_sends_every_object_fresh(segments):
    kept = KeptPlan(enabled=False)
    weights = _weights(3)
    with Receiver() as receiver:
        for _ in range(3):
            assert H.mismatches(_roundtrip(kept, segments, receiver, list(weights)), weights) == []
    assert kept.plans_made == 0


def test_tensor_meta_is_ray_shapes_and_dtypes_and_pickles_as_the_layout():
    tensors = _weights(4) + [torch.zeros(2, 3, dtype=torch.bfloat16), torch.tensor(True)]
    with Sender("shm", capacity_nbytes=MIB) as sender:
        ticket = sender.put(tensors)
        meta = TensorMeta(ticket.layout_bytes, len(tensors))
        sender.discard(ticket)
    want = [(t.shape, t.dtype) for t in tensors]
    assert len(meta) == len(want) and bool(meta)
    again = pickle.loads(pickle.dumps(meta))
    assert list(again) == want and again[2] == want[2] and again == want
    assert len(pickle.dumps(meta)) < len(pickle.dumps(want))


# -- through Ray -------------------------------------------------------------------------


@ray.remote(enable_tensor_transport=True)
class Model:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))

    def step(self, k: int) -> None:
        with torch.no_grad():
            for p in self.net.parameters():
                p.add_(k)

    @ray.method(tensor_transport="tensorferry")
    def weights(self) -> dict:
        return self.net.state_dict()  # fresh detached tensors each call, the same memory

    def expected(self) -> dict:  # an OrderedDict, as state_dict()
        sd = self.net.state_dict()
        return type(sd)((k, v.clone()) for k, v in sd.items())

    def replace(self) -> None:
        self.net[0].weight = torch.nn.Parameter(self.net[0].weight.detach() * 2)

    def kept(self) -> tuple[int, int]:
        from tensorferry.ray._transport import _process

        k = _process().kept
        return k.plans_made, k.plan_puts


@ray.remote(enable_tensor_transport=True)
class Reader:
    def differences(self, got: dict, want: dict) -> list:
        return H.mismatches(got, want)


@pytest.mark.timeout(180)
def test_an_actor_returning_its_weights_after_each_step_replays_its_plan(local_ray):
    model, reader = Model.remote(), Reader.remote()
    for k in range(1, 5):
        ray.get(model.step.remote(k))
        ref = model.weights.remote()
        assert ray.get(reader.differences.remote(ref, model.expected.remote())) == []
        del ref
    assert ray.get(model.kept.remote()) == (1, 3)  # planned on the second call, replayed since
    ray.get(model.replace.remote())  # a parameter replaced: sent as it is now, planned again later
    for _ in range(2):
        ref = model.weights.remote()
        assert ray.get(reader.differences.remote(ref, model.expected.remote())) == []
        del ref
    assert ray.get(model.kept.remote()) == (2, 4)
    for actor in (model, reader):
        ray.kill(actor)
