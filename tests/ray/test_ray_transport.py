"""tensorferry as Ray's tensor transport, on a real single-node Ray cluster.

The receiving actor regenerates what it expects from a seed and compares bit
for bit; the driver asserts the booleans, mismatch lists and pool figures
that come back. Pool figures are read inside the source actor.
"""

from __future__ import annotations

import gc
import random
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from tensorferry.errors import PeerGoneError, PoolExhaustedError, UnsupportedTensorError  # noqa: E402

import _ray_helpers as H  # noqa: E402

# Workers cannot import this folder's modules by name: ship the helpers by value.
ray.cloudpickle.register_pickle_by_value(H)

pytestmark = pytest.mark.ray

# Registration must precede the classes below: @ray.method checks the name
# when the class is defined. A second call must change nothing.
tfr.register()
tfr.register()

BIG_NUMEL = 64 << 20  # 256 MiB of float32: long enough to be killed mid-read
SMALL_POOL_NBYTES = 4 << 20


@ray.remote(enable_tensor_transport=True)
class Source:
    @ray.method(tensor_transport="tensorferry")
    def nested(self, seed):
        return H.make_nested(seed)

    @ray.method(tensor_transport="tensorferry")
    def many(self, n, seed):
        return H.make_many(n, seed)

    @ray.method(tensor_transport="tensorferry")
    def views(self):
        self._storage, views = H.make_views()
        return views

    @ray.method(tensor_transport="tensorferry")
    def numbered(self, i):
        return H.make_numbered(i)

    @ray.method(tensor_transport="tensorferry")
    def ones(self, numel):
        return torch.ones(numel, dtype=torch.float32)

    @ray.method(tensor_transport="tensorferry")
    def sparse(self):
        return {"ok": torch.ones(3), "bad": torch.eye(4).to_sparse()}

    def ready(self):
        return True


@ray.remote(enable_tensor_transport=True)
class Sink:
    def check_nested(self, obj, seed):
        return H.mismatches(obj, H.make_nested(seed))

    def check_many(self, obj, n, seed):
        want = H.make_many(n, seed)
        bad = H.mismatches(obj, want)
        return len(obj), bad[:5], len(bad)

    def check_views(self, obj):
        _, want = H.make_views()
        return H.mismatches(obj, [v.contiguous() for v in want])

    def check_numbered(self, obj, i):
        return i, H.mismatches(obj, H.make_numbered(i))

    def summary(self, t):
        return t.numel(), float(t.min()), float(t.max())

    def ready(self):
        return True


@pytest.fixture(scope="module")
def actors(local_ray):
    src, sink, sink2 = Source.remote(), Sink.remote(), Sink.remote()
    ray.get([src.ready.remote(), sink.ready.remote(), sink2.ready.remote()])
    return src, sink, sink2


def _stats(actor):
    return ray.get(actor.__ray_call__.remote(H.sender_stats))


def _wait_empty(actor, seconds=20.0):
    return H.wait_until(lambda: _stats(actor), H.pool_is_empty, seconds=seconds)


def _gets(actor):
    return ray.get(actor.__ray_call__.remote(H.gets_by_transport))


@pytest.mark.timeout(120)
def test_register_twice_is_a_no_op(local_ray):
    from ray.experimental.rdt import util

    tfr.register()
    assert tfr.NAME.upper() in util.transport_manager_info


@pytest.mark.timeout(120)
def test_nested_output_arrives_intact_at_two_actors_over_shm(actors):
    src, sink, sink2 = actors
    before = _gets(sink).get("shm", 0)
    ref = src.nested.remote(11)
    # One ref, two readers: the ticket serves any number until it is freed.
    assert ray.get([sink.check_nested.remote(ref, 11), sink2.check_nested.remote(ref, 11)]) == [[], []]
    # A different seed really differs: the comparison can fail.
    assert ray.get(sink.check_nested.remote(ref, 12)) != []
    gets = _gets(sink)
    assert gets.get("shm", 0) >= before + 1 and "tcp" not in gets  # same node: shm


@pytest.mark.timeout(120)
def test_driver_ray_get_of_rdt_ref(actors):
    src, _, _ = actors
    before = H.gets_by_transport().get("shm", 0)
    obj = ray.get(src.nested.remote(5))
    assert H.mismatches(obj, H.make_nested(5)) == []
    assert H.gets_by_transport()["shm"] == before + 1


@pytest.mark.timeout(120)
def test_driver_put_with_tensorferry_reaches_an_actor(actors):
    _, sink, _ = actors
    ref = ray.put(H.make_nested(21), _tensor_transport="tensorferry")
    assert ray.get(sink.check_nested.remote(ref, 21)) == []


@pytest.mark.timeout(120)
def test_ten_thousand_small_tensors(actors):
    src, sink, _ = actors
    n = 10_000
    ref = src.many.remote(n, 3)
    count, bad, num_bad = ray.get(sink.check_many.remote(ref, n, 3))
    assert (count, bad, num_bad) == (n, [], 0)
    stats = _stats(src)
    assert stats["live_tickets"] >= 1


@pytest.mark.timeout(120)
def test_views_move_only_their_own_bytes(actors):
    src, sink, _ = actors
    assert H.pool_is_empty(_wait_empty(src))
    storage, views = H.make_views()
    want = H.view_nbytes(views)
    moved_before = _stats(src)["bytes_moved"] if _stats(src) else 0
    ref = src.views.remote()
    assert ray.get(sink.check_views.remote(ref)) == []
    stats = _stats(src)
    storage_nbytes = storage.numel() * storage.element_size()
    # Each view's own bytes, 16-byte block alignment at most per tensor; never
    # the 16 MiB storage they point into.
    assert want <= stats["used_nbytes"] <= want + 16 * len(views)
    assert stats["used_nbytes"] < storage_nbytes // 100
    assert stats["live_tickets"] == 1
    assert want <= stats["bytes_moved"] - moved_before <= want + 16 * len(views)
    del ref
    gc.collect()
    assert H.pool_is_empty(_wait_empty(src))


@pytest.mark.timeout(120)
def test_fifty_transfers_in_flight_consumed_out_of_order(actors):
    src, sink, sink2 = actors
    refs = [src.numbered.remote(i) for i in range(50)]
    order = list(range(50))
    random.Random(7).shuffle(order)
    checks = [(sink if k % 2 else sink2).check_numbered.remote(refs[i], i) for k, i in enumerate(order)]
    # Collected in yet another order than they were sent and consumed in.
    results = [ray.get(c) for c in reversed(checks)]
    assert sorted(results) == [(i, []) for i in range(50)]
    # The driver reads a few of them too, last first.
    for i in (49, 0, 31):
        assert H.mismatches(ray.get(refs[i]), H.make_numbered(i)) == []
    assert _stats(src)["live_tickets"] >= 50


@pytest.mark.timeout(120)
def test_source_pool_is_empty_after_refs_are_freed(actors):
    src, sink, _ = actors
    refs = [src.numbered.remote(i) for i in range(20)]
    ray.get([sink.check_numbered.remote(refs[i], i) for i in range(0, 20, 2)])  # half consumed
    ray.get(refs[1])  # one read by the driver; the rest never read
    stats = _stats(src)
    assert stats["used_nbytes"] > 0 and stats["live_tickets"] >= 20
    del refs
    gc.collect()
    stats = _wait_empty(src)
    assert stats["used_nbytes"] == 0 and stats["live_tickets"] == 0, stats


@pytest.mark.timeout(120)
def test_unsupported_leaf_fails_with_tensorferrys_message(actors):
    src, sink, _ = actors
    ref = src.sparse.remote()
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(ref)
    assert isinstance(info.value, UnsupportedTensorError)
    assert "sparse_coo" in str(info.value) and "call .to_dense() first" in str(info.value)
    # A consumer of the failed ref sees the same error, and stays usable.
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(sink.summary.remote(ref))
    assert "call .to_dense() first" in str(info.value)
    assert ray.get(sink.check_nested.remote(src.nested.remote(1), 1)) == []


@pytest.mark.timeout(120)
def test_object_over_the_pool_cap_fails_clearly(local_ray, actors):
    _, sink, _ = actors
    env = tfr.runtime_env(pool_nbytes=SMALL_POOL_NBYTES, pool_max_nbytes=2 * SMALL_POOL_NBYTES)
    small = Source.options(runtime_env=env).remote()
    fits = small.ones.remote(SMALL_POOL_NBYTES // 8)
    assert ray.get(sink.summary.remote(fits)) == (SMALL_POOL_NBYTES // 8, 1.0, 1.0)
    # Twice the pool: a second segment of 8 MiB would break the 8 MiB cap.
    # It must fail at once with the numbers and the remedy, not hang the
    # reader until Ray's fetch timeout.
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(sink.summary.remote(small.ones.remote(SMALL_POOL_NBYTES // 2)), timeout=60)
    assert isinstance(info.value, PoolExhaustedError)
    msg = str(info.value)
    assert f"cannot grow to hold an object of {SMALL_POOL_NBYTES * 2:,} bytes" in msg
    assert f"TENSORFERRY_RAY_POOL_MAX_BYTES caps its segments at {SMALL_POOL_NBYTES * 2:,} bytes" in msg
    assert f"raise the cap to at least {SMALL_POOL_NBYTES * 3:,} bytes" in msg
    # `fits` is alive, so its bytes are named as held; without it the
    # message would not tell the user to free refs.
    assert "refs are still alive hold" in msg
    del fits
    ray.kill(small)


def _assert_others_keep_working(actors, seed):
    src, sink, sink2 = actors
    ref = src.nested.remote(seed)
    assert ray.get([sink.check_nested.remote(ref, seed), sink2.check_nested.remote(ref, seed)]) == [[], []]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_source_killed_before_the_transfer(actors, transport):
    _, sink, _ = actors
    victim = Source.options(runtime_env={"env_vars": tfr.env_vars(transport=transport)}).remote()
    ref = victim.ones.remote(1 << 20)
    ray.wait([ref], fetch_local=False, timeout=60)
    ray.kill(victim)
    time.sleep(0.5)
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(sink.summary.remote(ref), timeout=60)
    assert isinstance(info.value, (PeerGoneError, ray.exceptions.ActorDiedError)), repr(info.value)
    if isinstance(info.value, PeerGoneError):
        assert "no sender listens" in str(info.value) or "cannot connect to the sender" in str(info.value)
    _assert_others_keep_working(actors, 31)


@pytest.mark.timeout(120)
def test_source_killed_mid_transfer(actors):
    _, sink, _ = actors
    # tcp: the bytes stream from the living source (over shm a reader that
    # mapped the pool would finish the copy after the source died).
    victim = Source.options(runtime_env={"env_vars": tfr.env_vars(transport="tcp")}).remote()
    ref = victim.ones.remote(BIG_NUMEL)
    ray.wait([ref], fetch_local=False, timeout=60)
    result = sink.summary.remote(ref)
    # Kill once the sink has connected: it is acquiring or reading now.
    conns = H.wait_until(lambda: ray.get(victim.__ray_call__.remote(H.sender_connections)), lambda c: c.get("tcp", 0) > 0, seconds=30, every=0.002)
    assert conns.get("tcp", 0) > 0
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(result, timeout=60)
    assert isinstance(info.value, (PeerGoneError, ray.exceptions.ActorDiedError)), repr(info.value)
    assert str(info.value)
    del ref
    _assert_others_keep_working(actors, 32)


@pytest.mark.timeout(120)
def test_destination_killed_mid_transfer_leaves_nothing_held(actors):
    src, sink, _ = actors
    assert H.pool_is_empty(_wait_empty(src))
    victim = Sink.remote()
    ray.get(victim.ready.remote())
    ref = src.ones.remote(BIG_NUMEL)
    ray.wait([ref], fetch_local=False, timeout=60)

    def connections():
        return sum(ray.get(src.__ray_call__.remote(H.sender_connections)).values())

    before = connections()  # other actors' idle connections
    result = victim.summary.remote(ref)
    assert H.wait_until(connections, lambda n: n > before, seconds=30, every=0.002) > before
    ray.kill(victim)
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(result, timeout=60)
    assert isinstance(info.value, ray.exceptions.RayActorError), repr(info.value)
    # The source still serves the object to a live reader.
    assert ray.get(sink.summary.remote(ref), timeout=60) == (BIG_NUMEL, 1.0, 1.0)
    del ref
    gc.collect()
    stats = _wait_empty(src)
    assert stats["used_nbytes"] == 0 and stats["live_tickets"] == 0, stats
    _assert_others_keep_working(actors, 33)
