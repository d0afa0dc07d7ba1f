"""WeightSync on a real single-node Ray cluster: one trainer, several workers.

Every actor digests its own state dict (sha256 over every tensor's bytes, in
order) and the driver compares the digests, so a single flipped bit in any
worker fails the test. The trainer's pool is read inside the trainer.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import _ray_helpers as H  # noqa: E402
import tensorferry.ray as tfr  # noqa: E402
from tensorferry.errors import LayoutMismatchError, PoolExhaustedError  # noqa: E402

pytestmark = pytest.mark.ray

NUM_WORKERS = 3
NUM_VERSIONS = 5


class Net(torch.nn.Module):
    """About 1 MiB of float32 in six tensors, a bfloat16 parameter and two
    int64 buffers (one 0-dim)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(256, 512)
        self.norm = torch.nn.LayerNorm(512)
        self.out = torch.nn.Linear(512, 256)
        self.scale = torch.nn.Parameter(torch.zeros(33, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))
        self.register_buffer("epoch", torch.zeros((), dtype=torch.int64))


def _state_nbytes() -> int:
    return sum(t.numel() * t.element_size() for t in Net().state_dict().values())


_digest = H.state_digest


@ray.remote
class Trainer:
    def __init__(self) -> None:
        self.model = Net()

    def step(self, version: int) -> str:
        """New weights for ``version``, all of them, from its seed."""
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
            self.model.steps.fill_(version)
            self.model.epoch.fill_(-version)
        return _digest(self.model)

    def digest(self) -> str:
        return _digest(self.model)


@ray.remote
class Worker:
    def __init__(self) -> None:
        self.model = Net()

    def digest(self) -> str:
        return _digest(self.model)

    def data_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.model.state_dict().values()]


def _publisher_stats(actor_self):
    from tensorferry.ray import _weights

    return None if _weights._PUBLISHER is None else _weights._PUBLISHER.sender.stats()


@pytest.fixture(scope="module")
def workers(local_ray):
    ws = [Worker.remote() for _ in range(NUM_WORKERS)]
    ray.get([w.digest.remote() for w in ws])
    return ws


def _assert_all_equal(trainer, workers, expected_digest):
    assert ray.get(trainer.digest.remote()) == expected_digest
    assert ray.get([w.digest.remote() for w in workers]) == [expected_digest] * len(workers)


@pytest.mark.timeout(120)
def test_sync_three_workers_across_five_versions_and_a_late_joiner(workers):
    trainer = Trainer.remote()
    nbytes = _state_nbytes()
    num_tensors = len(Net().state_dict())
    ptrs = ray.get([w.data_ptrs.remote() for w in workers])
    sync = tfr.WeightSync(trainer, workers)
    digests = []
    for version in range(1, NUM_VERSIONS + 1):
        expected = ray.get(trainer.step.remote(version))
        assert expected not in digests  # every version really changes the weights
        digests.append(expected)
        report = sync.sync()
        assert report.version == version == sync.version
        assert report.num_workers == NUM_WORKERS and len(report.worker_seconds) == NUM_WORKERS
        assert report.nbytes == nbytes * NUM_WORKERS
        assert report.seconds >= max(report.worker_seconds) > 0
        # Each version's digest is its own: equal digests are that version.
        _assert_all_equal(trainer, workers, expected)
    # In place: the workers' parameters are the same memory they started with.
    assert ray.get([w.data_ptrs.remote() for w in workers]) == ptrs

    late = Worker.remote()
    assert ray.get(late.digest.remote()) != digests[-1]
    seconds = sync.add_worker(late)
    assert isinstance(seconds, float) and seconds > 0
    assert ray.get(late.digest.remote()) == digests[-1]  # the latest version's, no other
    assert len(sync.workers) == NUM_WORKERS + 1

    # Only the latest version is held: the four before it were retired and
    # freed once their readers finished.
    stats = ray.get(trainer.__ray_call__.remote(_publisher_stats))
    assert stats["live_tickets"] == 1, stats
    assert nbytes <= stats["used_nbytes"] <= nbytes + 16 * num_tensors, stats

    # The next version reaches the late joiner too.
    expected = ray.get(trainer.step.remote(NUM_VERSIONS + 1))
    report = sync.sync()
    assert report.version == NUM_VERSIONS + 1 and report.num_workers == NUM_WORKERS + 1
    _assert_all_equal(trainer, [*workers, late], expected)
    ray.kill(late)
    ray.kill(trainer)


@pytest.mark.timeout(120)
def test_add_worker_before_any_version_returns_none(workers):
    trainer = Trainer.remote()
    sync = tfr.WeightSync(trainer, [])
    assert sync.add_worker(workers[0]) is None
    assert sync.workers == [workers[0]]
    expected = ray.get(trainer.step.remote(40))
    assert sync.sync().version == 1
    assert ray.get(workers[0].digest.remote()) == expected
    ray.kill(trainer)


@pytest.mark.timeout(120)
def test_pool_that_fits_one_version_retires_the_old_one(workers):
    nbytes = _state_nbytes()
    trainer = Trainer.remote()
    sync = tfr.WeightSync(trainer, workers, capacity_nbytes=nbytes + 4096)
    for version in range(1, 5):
        expected = ray.get(trainer.step.remote(100 + version))
        report = sync.sync()
        assert report.version == version
        _assert_all_equal(trainer, workers, expected)
        stats = ray.get(trainer.__ray_call__.remote(_publisher_stats))
        # Room for one version only, so each publish had to retire the last.
        assert stats["capacity_nbytes"] < 2 * nbytes, stats
        assert stats["live_tickets"] == 1 and stats["used_nbytes"] >= nbytes, stats
    ray.kill(trainer)


@pytest.mark.timeout(120)
def test_pool_smaller_than_one_version_fails_with_the_numbers(workers):
    nbytes = _state_nbytes()
    trainer = Trainer.remote()
    sync = tfr.WeightSync(trainer, workers, capacity_nbytes=nbytes // 2)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        sync.sync()
    assert isinstance(info.value, PoolExhaustedError), repr(info.value)
    assert "pool cannot hold" in str(info.value) and "capacity_nbytes" in str(info.value)
    assert sync.version == 0
    ray.kill(trainer)


@pytest.mark.timeout(120)
def test_the_trainers_pool_is_made_when_the_weight_sync_is_created(workers):
    import time

    nbytes = _state_nbytes()
    trainer = Trainer.remote()
    assert ray.get(trainer.__ray_call__.remote(_publisher_stats)) is None
    sync = tfr.WeightSync(trainer, workers)
    # Made in the background on the trainer, before any version: room for two.
    deadline = time.monotonic() + 60
    stats = ray.get(trainer.__ray_call__.remote(_publisher_stats))
    while stats is None and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = ray.get(trainer.__ray_call__.remote(_publisher_stats))
    assert stats is not None and stats["capacity_nbytes"] >= 2 * nbytes and stats["used_nbytes"] == 0, stats
    assert sync.version == 0
    expected = ray.get(trainer.step.remote(7))
    assert sync.sync().version == 1
    _assert_all_equal(trainer, workers, expected)
    ray.kill(trainer)


def _plan_ids(actor_self):
    """(the trainer's SendPlan, the worker's RecvPlan) ids in this actor's process."""
    from tensorferry.ray import _weights

    return (
        None if _weights._PUBLISHER is None or _weights._PUBLISHER.plan is None else id(_weights._PUBLISHER.plan),
        None if _weights._RECV_PLAN is None else id(_weights._RECV_PLAN),
    )


def _reassign(actor_self):
    """Replace every parameter and buffer object (as load_state_dict(assign=True) does)."""
    state = {k: v.clone() for k, v in actor_self.model.state_dict().items()}
    actor_self.model.load_state_dict(state, assign=True)


@ray.remote
class HalfWorker:
    def __init__(self) -> None:
        self.model = Net().to(torch.bfloat16)

    def digest(self) -> str:
        return _digest(self.model)


@pytest.mark.timeout(180)
def test_plans_are_kept_across_syncs_and_made_again_when_parameters_are_replaced(workers):
    trainer = Trainer.remote()
    sync = tfr.WeightSync(trainer, workers)
    ids = []
    for version in range(1, 4):
        expected = ray.get(trainer.step.remote(200 + version))
        sync.sync()
        _assert_all_equal(trainer, workers, expected)
        ids.append((ray.get(trainer.__ray_call__.remote(_plan_ids))[0], ray.get([w.__ray_call__.remote(_plan_ids) for w in workers])))
    assert ids[0][0] is not None and None not in [r[1] for r in ids[0][1]]
    assert ids[0] == ids[1] == ids[2]  # the same plans replayed, both sides

    # The trainer's and one worker's parameters are replaced: their plans are
    # made again (a stale plan would send, or write, the old tensors).
    ray.get([trainer.__ray_call__.remote(_reassign), workers[0].__ray_call__.remote(_reassign)])
    expected = ray.get(trainer.step.remote(300))
    sync.sync()
    _assert_all_equal(trainer, workers, expected)
    assert ray.get(trainer.__ray_call__.remote(_plan_ids))[0] != ids[-1][0]
    assert ray.get(workers[0].__ray_call__.remote(_plan_ids))[1] != ids[-1][1][0][1]
    ray.kill(trainer)


@pytest.mark.timeout(180)
def test_dtype_sends_bf16_weights_to_bf16_workers(local_ray):
    trainer = Trainer.remote()
    halves = [HalfWorker.remote() for _ in range(2)]
    sync = tfr.WeightSync(trainer, halves, dtype=torch.bfloat16)
    for version in (1, 2):
        ray.get(trainer.step.remote(500 + version))
        report = sync.sync()
        assert report.nbytes < _state_nbytes() * len(halves)  # float32 sent as bfloat16: fewer bytes
        want = ray.get(trainer.__ray_call__.remote(lambda a: _digest(_half(a.model))))
        assert ray.get([w.digest.remote() for w in halves]) == [want, want]
    with pytest.raises(Exception, match="floating-point"):
        tfr.WeightSync(trainer, halves, dtype=torch.int8)
    for actor in (trainer, *halves):
        ray.kill(actor)


@pytest.mark.timeout(120)
def test_workers_of_another_dtype_get_a_weight_sync_error_naming_tensor_dtypes_and_fix(local_ray):
    trainer = Trainer.remote()
    half = HalfWorker.remote()
    sync = tfr.WeightSync(trainer, [half])  # fp32 sent as it is, to a bf16 worker
    with pytest.raises(LayoutMismatchError) as info:
        sync.sync()
    message = str(info.value)
    assert "WeightSync" in message and "'inp.weight'" in message and "into= does not match" not in message
    assert "torch.float32" in message and "torch.bfloat16" in message
    assert "dtype=torch.bfloat16" in message  # the fix: send bf16
    for actor in (trainer, half):
        ray.kill(actor)


def _half(model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of ``model`` (integer buffers stay as they are)."""
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)
