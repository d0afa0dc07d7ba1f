"""The source actor's growing pool: the growth decision, segments with real
Senders in this process, and an object three times the first segment through
a real Ray cluster."""

from __future__ import annotations

import gc
import pickle

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from tensorferry import Receiver, Sender  # noqa: E402
from tensorferry.errors import PoolExhaustedError  # noqa: E402
from tensorferry.ray._segments import (
    SEGMENT_ALIGNMENT,
    PoolFigures,
    PoolGrowthError,
    Segments,
    available_memory,
    plan_segment,
)

import _ray_helpers as H  # noqa: E402

ray.cloudpickle.register_pickle_by_value(H)

pytestmark = pytest.mark.ray

tfr.register()

MIB = 1 << 20
FIRST_NBYTES = 4 * MIB
EMPTY = PoolFigures(capacity_nbytes=FIRST_NBYTES, used_nbytes=0, largest_free_nbytes=FIRST_NBYTES, segments=1)
PLENTY = 1 << 40


# -- the decision, alone --------------------------------------------------------------


def test_a_new_segment_is_at_least_the_first_and_holds_the_object():
    assert plan_segment(MIB, first_nbytes=FIRST_NBYTES, figures=EMPTY, cap_nbytes=0, available_nbytes=PLENTY) == FIRST_NBYTES
    size = plan_segment(3 * FIRST_NBYTES + 5, first_nbytes=FIRST_NBYTES, figures=EMPTY, cap_nbytes=0, available_nbytes=PLENTY)
    assert size >= 3 * FIRST_NBYTES + 5 and size % SEGMENT_ALIGNMENT == 0


def test_the_cap_trims_a_new_segment_to_what_it_leaves():
    need = FIRST_NBYTES + 100
    cap = FIRST_NBYTES + need
    assert plan_segment(need, first_nbytes=FIRST_NBYTES, figures=EMPTY, cap_nbytes=cap, available_nbytes=PLENTY) == need


def test_over_the_cap_with_an_empty_pool_gives_the_cap_to_set_and_no_talk_of_refs():
    need = 3 * FIRST_NBYTES
    with pytest.raises(PoolGrowthError) as info:
        plan_segment(need, first_nbytes=FIRST_NBYTES, figures=EMPTY, cap_nbytes=2 * FIRST_NBYTES, available_nbytes=PLENTY)
    err = info.value
    assert isinstance(err, PoolExhaustedError) and isinstance(err, MemoryError)
    assert (err.limit, err.limit_nbytes, err.requested_nbytes) == ("cap", 2 * FIRST_NBYTES, need)
    msg = str(err)
    assert f"object of {need:,} bytes" in msg
    assert f"TENSORFERRY_RAY_POOL_MAX_BYTES caps its segments at {2 * FIRST_NBYTES:,} bytes" in msg
    assert f"raise the cap to at least {FIRST_NBYTES + need:,} bytes" in msg
    assert "refs" not in msg and "release" not in msg


def test_over_the_cap_while_objects_are_held_says_how_much_they_hold():
    held = PoolFigures(capacity_nbytes=FIRST_NBYTES, used_nbytes=3 * MIB, largest_free_nbytes=MIB, segments=1)
    with pytest.raises(PoolGrowthError) as info:
        plan_segment(2 * MIB, first_nbytes=FIRST_NBYTES, figures=held, cap_nbytes=FIRST_NBYTES + MIB, available_nbytes=PLENTY)
    assert f"objects whose refs are still alive hold {3 * MIB:,} bytes" in str(info.value)
    assert "freeing refs you no longer need" in str(info.value)


def test_over_the_machines_memory_says_so_with_the_numbers():
    need = 3 * FIRST_NBYTES
    with pytest.raises(PoolGrowthError) as info:
        plan_segment(need, first_nbytes=FIRST_NBYTES, figures=EMPTY, cap_nbytes=0,
                     available_nbytes=need - 1, available_source="MemAvailable in /proc/meminfo")
    err = info.value
    assert (err.limit, err.limit_nbytes) == ("memory", need - 1)
    msg = str(err)
    assert f"this machine has {need - 1:,} bytes available (MemAvailable in /proc/meminfo)" in msg
    assert "TENSORFERRY_RAY_POOL_MAX_BYTES" not in msg and "refs" not in msg


def test_growth_error_pickles_with_its_fields_and_message():
    with pytest.raises(PoolGrowthError) as info:
        plan_segment(3 * FIRST_NBYTES, first_nbytes=FIRST_NBYTES, figures=EMPTY, cap_nbytes=2 * FIRST_NBYTES, available_nbytes=PLENTY)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is PoolGrowthError
    assert (back.limit, back.limit_nbytes, back.figures, str(back)) == ("cap", 2 * FIRST_NBYTES, EMPTY, str(info.value))


def test_available_memory_is_a_positive_figure_with_its_source():
    nbytes, source = available_memory()
    assert nbytes > 0 and source


# -- segments with real Senders, in this process --------------------------------------------


def _make_sender(capacity_nbytes: int) -> Sender:
    return Sender("shm", capacity_nbytes=capacity_nbytes)


def test_segments_grow_for_a_large_object_and_release_it_when_idle():
    segments = Segments(_make_sender, FIRST_NBYTES, idle_release_seconds=0.2)
    big = torch.arange(3 * FIRST_NBYTES // 4, dtype=torch.float32)  # three times the first segment
    small = torch.ones(1000)
    try:
        s_small, t_small = segments.put(small)
        s_big, t_big = segments.put(big)
        assert s_small is segments.first and s_big is not segments.first
        assert segments.stats()["segments"] == 2
        with Receiver() as rx:
            assert torch.equal(rx.get(t_big), big)
            assert torch.equal(rx.get(t_small), small)
            segments.discard(s_big, t_big)
            stats = H.wait_until(segments.stats, lambda s: s["segments"] == 1, seconds=20)
            assert stats["segments"] == 1 and stats["released"] == 1, stats
            # The first segment stays, still serving what it holds.
            assert torch.equal(rx.get(t_small), small)
    finally:
        segments.close()


def test_segments_under_a_cap_give_up_idle_segments_before_refusing():
    # A long grace: only the cap's need can release the idle segment here.
    six, ten = 6 * MIB, 10 * MIB
    segments = Segments(_make_sender, FIRST_NBYTES, cap_nbytes=FIRST_NBYTES + ten, idle_release_seconds=3600)
    try:
        sender, ticket = segments.put(torch.zeros(six // 4))
        assert segments.stats()["segments"] == 2
        segments.discard(sender, ticket)
        H.wait_until(lambda: sender.stats()["live_tickets"], lambda n: n == 0, seconds=20)
        # Ten MiB fit in no segment, and a third would break the cap: the
        # idle six-MiB segment is given up for it.
        sender2, ticket2 = segments.put(torch.ones(ten // 4))
        assert sender2 is not sender and segments.released == 1
        assert segments.stats()["segments"] == 2 and segments.stats()["capacity_nbytes"] == FIRST_NBYTES + ten
        with pytest.raises(PoolGrowthError) as info:
            segments.put(torch.zeros(ten // 4))  # the live one is not given up
        assert info.value.limit == "cap" and f"refs are still alive hold {ten:,} bytes" in str(info.value)
        with Receiver() as rx:
            assert torch.equal(rx.get(ticket2), torch.ones(ten // 4))
    finally:
        segments.close()


# -- through Ray ------------------------------------------------------------------------------


@ray.remote(enable_tensor_transport=True)
class Source:
    @ray.method(tensor_transport="tensorferry")
    def numbered(self, i):
        return H.make_numbered(i)

    @ray.method(tensor_transport="tensorferry")
    def big(self, numel, seed):
        g = torch.Generator().manual_seed(seed)
        return {"big": torch.randn(numel, generator=g), "seed": torch.tensor(seed)}


@ray.remote(enable_tensor_transport=True)
class Sink:
    def check_big(self, obj, numel, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.equal(obj["big"], torch.randn(numel, generator=g)) and int(obj["seed"]) == seed


@pytest.mark.timeout(120)
def test_object_three_times_the_first_segment_goes_through_and_its_segment_is_released(local_ray):
    env = tfr.runtime_env(pool_nbytes=FIRST_NBYTES)
    src, sink = Source.options(runtime_env=env).remote(), Sink.remote()
    numel = 3 * FIRST_NBYTES // 4
    small = src.numbered.remote(3)  # stays alive in the first segment
    ref = src.big.remote(numel, 7)
    assert ray.get(sink.check_big.remote(ref, numel, 7)) is True
    assert ray.get(sink.check_big.remote(ref, numel, 8)) is False  # the check can fail
    # The driver reads it too.
    got = ray.get(ref)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(got["big"], torch.randn(numel, generator=g))
    stats = ray.get(src.__ray_call__.remote(H.sender_stats))
    assert stats["segments"] == 2 and stats["capacity_nbytes"] >= FIRST_NBYTES + 3 * FIRST_NBYTES, stats
    del ref, got
    gc.collect()
    stats = H.wait_until(lambda: ray.get(src.__ray_call__.remote(H.sender_stats)), lambda s: s["segments"] == 1, seconds=60, every=0.25)
    assert stats["segments"] == 1 and stats["released"] == 1, stats
    assert stats["live_tickets"] == 1  # the small object, still served
    assert H.mismatches(ray.get(small), H.make_numbered(3)) == []
    ray.kill(src)
    ray.kill(sink)

