"""WeightSync on a real local Ray cluster: one trainer, workers updated in place."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 48)
        self.b = torch.nn.Linear(48, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.norm = torch.nn.Parameter(torch.zeros(33, dtype=torch.bfloat16))


@ray.remote
class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Net()

    def step(self, version: int) -> None:
        # Deterministic per version, so workers are checked against exact values.
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.state_dict().values():
                if p.dtype.is_floating_point:
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
                else:
                    p.fill_(version)

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def pool_stats(self) -> dict:
        from tensorferry.ray._weights import _PUBLISHER

        return _PUBLISHER.sender.stats()


@ray.remote
class Worker:
    def __init__(self) -> None:
        torch.manual_seed(123)  # different initial weights from the trainer
        self.model = Net()
        # Keep the parameter objects: the update must be in place.
        self.ids = {k: v.data_ptr() for k, v in self.model.state_dict().items()}

    def weights(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def same_storage(self) -> bool:
        return self.ids == {k: v.data_ptr() for k, v in self.model.state_dict().items()}

    def version(self) -> int:
        return getattr(self, "_tensorferry_weight_version", 0)


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def cluster(local_ray):
    tfr.register()
    yield local_ray


def test_weight_sync_to_three_workers_across_five_versions(cluster):
    trainer = Trainer.remote()
    workers = [Worker.remote() for _ in range(3)]
    sync = tfr.WeightSync(trainer, workers)
    nbytes = None
    for version in range(1, 6):
        ray.get(trainer.step.remote(version))
        report = sync.sync()
        assert report.version == version
        assert report.num_workers == 3 and len(report.worker_seconds) == 3
        assert report.seconds > 0 and all(s > 0 for s in report.worker_seconds)
        want = ray.get(trainer.weights.remote())
        nbytes = sum(t.numel() * t.element_size() for t in want.values())
        assert report.nbytes == 3 * nbytes
        for w in workers:
            assert _equal(ray.get(w.weights.remote()), want)
            assert ray.get(w.same_storage.remote()), "the update must be in place"
            assert ray.get(w.version.remote()) == version
    # Only the latest version stays packed in the trainer's pool.
    stats = ray.get(trainer.pool_stats.remote())
    assert stats["live_tickets"] == 1
    assert 0 < stats["used_nbytes"] < 2 * nbytes + 16 * 64

    late = Worker.remote()
    seconds = sync.add_worker(late)
    assert seconds is not None and seconds > 0
    assert _equal(ray.get(late.weights.remote()), ray.get(trainer.weights.remote()))
    assert ray.get(late.version.remote()) == 5
    for actor in [trainer, late, *workers]:
        ray.kill(actor)


def test_late_worker_before_any_version_gets_nothing(cluster):
    trainer = Trainer.remote()
    sync = tfr.WeightSync(trainer, [])
    w = Worker.remote()
    assert sync.add_worker(w) is None
    assert ray.get(w.version.remote()) == 0
    ray.kill(trainer)
    ray.kill(w)


def test_pool_with_room_for_one_version_retires_the_old_one(cluster):
    """Backpressure: the next version waits for the last one's readers."""
    probe = Net()
    nbytes = sum(t.numel() * t.element_size() for t in probe.state_dict().values())
    trainer = Trainer.remote()
    workers = [Worker.remote() for _ in range(2)]
    sync = tfr.WeightSync(trainer, workers, capacity_nbytes=nbytes + 4096)
    for version in range(1, 4):
        ray.get(trainer.step.remote(version))
        assert sync.sync().version == version
        want = ray.get(trainer.weights.remote())
        for w in workers:
            assert _equal(ray.get(w.weights.remote()), want)
    stats = ray.get(trainer.pool_stats.remote())
    assert stats["capacity_nbytes"] < 2 * nbytes  # really only room for one
    for actor in [trainer, *workers]:
        ray.kill(actor)
