"""WeightSync(delta=True) on a real single-node Ray cluster.

An fp32 trainer changes about 1% of its weights each version and sends
them as bfloat16; bf16 workers read the delta since the version they hold,
a late joiner the whole version. Every worker's bytes are compared with the
trainer's weights cast to bfloat16 (sha256 of every tensor's bytes).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import _ray_helpers as H  # noqa: E402
import tensorferry.ray as tfr  # noqa: E402

pytestmark = pytest.mark.ray

NUM_WORKERS = 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(256, 512)
        self.out = torch.nn.Linear(512, 256)


_digest = H.state_digest


@ray.remote
class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Net()

    def step(self, version: int) -> str:
        """About 1% of every parameter's elements changed, from the version's seed."""
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                flat = p.view(-1)
                idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
                flat[idx] += 0.5
        return _digest({k: v.to(torch.bfloat16) for k, v in self.model.state_dict().items()})


@ray.remote
class Worker:
    def __init__(self) -> None:
        self.model = Net().to(torch.bfloat16)

    def digest(self) -> str:
        return _digest(self.model.state_dict())


@pytest.mark.timeout(180)
def test_delta_syncs_are_exact_and_small_and_a_late_joiner_reads_the_whole(local_ray):
    trainer = Trainer.remote()
    workers = [Worker.remote() for _ in range(NUM_WORKERS)]
    sync = tfr.WeightSync(trainer, workers, dtype=torch.bfloat16, delta=True)
    whole = None
    for version in range(1, 5):
        expected = ray.get(trainer.step.remote(version))
        report = sync.sync()
        assert ray.get([w.digest.remote() for w in workers]) == [expected] * NUM_WORKERS
        whole = report.nbytes // NUM_WORKERS
        if version == 1:
            assert report.delta_nbytes == 0  # nothing to compare with yet: the whole version
        else:
            # About 1% of the elements: a delta of a few percent of the bytes.
            assert 0 < report.delta_nbytes < whole // 10, report
            assert 0 < report.changed < whole // 2 // 20, report
    late = Worker.remote()
    sync.add_worker(late)  # holds no version: reads the whole
    assert ray.get(late.digest.remote()) == expected
    expected = ray.get(trainer.step.remote(5))
    report = sync.sync()
    assert 0 < report.delta_nbytes < whole // 10
    assert ray.get([w.digest.remote() for w in [*workers, late]]) == [expected] * (NUM_WORKERS + 1)
