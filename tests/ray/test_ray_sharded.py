"""WeightSync from a sharded trainer (a list of trainer actors, one per
rank, each publishing its shards) to tensor-parallel workers, on a real
single-node Ray cluster. The trainers hold row shards as ``Box``es; the
workers hold column slices and a replicated norm; every worker's values
are compared with the global tensors' slices, across versions changed in
place on the trainers."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from tensorferry import Box  # noqa: E402

pytestmark = pytest.mark.ray

RANKS, WORKERS = 2, 2
SHAPE = (10, 6)  # rows split unevenly over the trainer ranks: 5 / 5; columns 3 / 3 over the workers


def glob(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + version)
    return {"w": torch.randn(SHAPE, generator=g), "norm": torch.randn(4, generator=g), "step": torch.tensor(float(version))}


@ray.remote
class Trainer:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        rows = SHAPE[0] // RANKS
        self.lo, self.hi = rank * rows, (rank + 1) * rows
        g = glob(0)
        self.state = {"w": Box(g["w"][self.lo : self.hi].clone(), (self.lo, 0), SHAPE), "norm": g["norm"].clone(), "step": g["step"].clone()}

    def step(self, version: int) -> None:
        """The weights of ``version``, in place (the plan's memory)."""
        g = glob(version)
        self.state["w"].tensor.copy_(g["w"][self.lo : self.hi])
        self.state["norm"].copy_(g["norm"])
        self.state["step"].copy_(g["step"])


@ray.remote
class Worker:
    def __init__(self, w: int) -> None:
        cols = SHAPE[1] // WORKERS
        self.lo = w * cols
        self.targets = {"w": Box(torch.zeros(SHAPE[0], cols), (0, self.lo), SHAPE), "norm": torch.zeros(4), "step": torch.zeros(())}

    def matches(self, version: int) -> bool:
        g = glob(version)
        t = self.targets
        cols = t["w"].tensor.shape[1]
        return bool(torch.equal(t["w"].tensor, g["w"][:, self.lo : self.lo + cols]) and torch.equal(t["norm"], g["norm"])
                    and torch.equal(t["step"], g["step"]))


@pytest.mark.timeout(180)
def test_sharded_trainer_actors_to_tensor_parallel_workers(local_ray):
    trainers = [Trainer.remote(k) for k in range(RANKS)]
    workers = [Worker.remote(w) for w in range(WORKERS)]
    sync = tfr.WeightSync(trainers, workers, state_dict=lambda self: self.state, targets=lambda self: self.targets)
    for version in (1, 2, 3):
        ray.get([t.step.remote(version) for t in trainers])
        report = sync.sync()
        assert report.version == version == sync.version
        assert ray.get([w.matches.remote(version) for w in workers]) == [True] * WORKERS
    late = Worker.remote(1)
    assert sync.add_worker(late) > 0
    assert ray.get(late.matches.remote(3))


def test_a_list_of_trainers_refuses_an_empty_list(local_ray):
    from tensorferry.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="at least one trainer"):
        tfr.WeightSync([], [])


DELTA_SHAPE = (256, 512)  # fp32 rows over the ranks, column halves to the workers


@ray.remote
class DeltaTrainer:
    def __init__(self, rank: int) -> None:
        rows = DELTA_SHAPE[0] // RANKS
        self.lo = rank * rows
        g = torch.Generator().manual_seed(7)
        self.state = {"w": Box(torch.randn(DELTA_SHAPE, generator=g)[self.lo : self.lo + rows].clone(), (self.lo, 0), DELTA_SHAPE)}
        self.g = torch.Generator().manual_seed(rank)

    def step(self) -> torch.Tensor:
        """0.1% of the elements changed in place (on one node, shm: deltas
        under 1% of the bytes are sent); its rows as they are now."""
        flat = self.state["w"].tensor.view(-1)
        flat[torch.randint(0, flat.numel(), (flat.numel() // 1000,), generator=self.g)] += 1.0
        return self.state["w"].tensor.clone()


@ray.remote
class DeltaWorker:
    def __init__(self, w: int) -> None:
        cols = DELTA_SHAPE[1] // WORKERS
        self.lo = w * cols
        self.targets = {"w": Box(torch.zeros(DELTA_SHAPE[0], cols), (0, self.lo), DELTA_SHAPE)}

    def received(self) -> int:
        from tensorferry.ray import _weights

        return _weights._RECEIVER.bytes_received

    def matches(self, rows: list) -> bool:
        full = torch.cat(rows)
        t = self.targets["w"].tensor
        return bool(torch.equal(t, full[:, self.lo : self.lo + t.shape[1]]))


@pytest.mark.timeout(180)
def test_sharded_trainers_with_delta_send_each_worker_only_its_changes(local_ray):
    """WeightSync([rank0, rank1], workers, delta=True): the first sync
    reads each worker's whole share, every later one (0.1% changed on each
    rank) the deltas' records of its columns: at most 5% of its share, and
    every worker is exact after each sync; a worker that joins late reads
    its whole share."""
    trainers = [DeltaTrainer.remote(k) for k in range(RANKS)]
    workers = [DeltaWorker.remote(w) for w in range(WORKERS)]
    share = DELTA_SHAPE[0] * DELTA_SHAPE[1] // WORKERS * 4
    sync = tfr.WeightSync(trainers, workers, delta=True, state_dict=lambda self: self.state, targets=lambda self: self.targets)
    for version in (1, 2, 3, 4):
        rows = ray.get([t.step.remote() for t in trainers])
        before = ray.get([w.received.remote() for w in workers]) if version > 1 else [0] * WORKERS
        report = sync.sync()
        after = ray.get([w.received.remote() for w in workers])
        assert ray.get([w.matches.remote(rows) for w in workers]) == [True] * WORKERS
        got = [a - b for a, b in zip(after, before)]
        if version == 1:
            assert got == [share] * WORKERS and report.delta_nbytes == 0
        else:
            assert 0 < report.delta_nbytes < 0.05 * report.nbytes, report
            assert all(0 < x <= 0.05 * share for x in got), (version, got, share)
    late = DeltaWorker.remote(1)
    assert sync.add_worker(late) > 0
    assert ray.get(late.received.remote()) == share and ray.get(late.matches.remote(rows))
