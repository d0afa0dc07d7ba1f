"""Two raylets on this one machine: the cross-node path (tcp) for real."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from conftest import shutdown_ray, worker_runtime_env  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

# Before the classes below: Ray checks the transport name at class definition.
tfr.register()


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # An actor pinned by a custom resource also holds one CPU for its whole
    # life: logical CPUs, enough for every actor of this module at once.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "resources": {"node_a": 8}})
    cluster.add_node(num_cpus=8, resources={"node_b": 8})
    try:
        ray.init(address=cluster.address, runtime_env=worker_runtime_env(), log_to_driver=False)
        tfr.register()
        yield cluster
    finally:
        shutdown_ray()
        cluster.shutdown()


def _make(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(1 << 16, generator=g)
    return {
        "views": list(flat[: 1 << 15].split(1 << 10)),
        "ints": torch.arange(1000, dtype=torch.int64) * seed,
        "pair": (torch.randn(7, 3, generator=g).to(torch.bfloat16), torch.tensor(seed, dtype=torch.float64)),
    }


@ray.remote(enable_tensor_transport=True)
class Source:
    @ray.method(tensor_transport="tensorferry")
    def make(self, seed: int) -> dict:
        return _make(seed)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(enable_tensor_transport=True)
class Sink:
    def check(self, obj: dict, seed: int) -> bool:
        want = _make(seed)
        leaves_got = [*obj["views"], obj["ints"], *obj["pair"]]
        leaves_want = [*want["views"], want["ints"], *want["pair"]]
        return len(leaves_got) == len(leaves_want) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(leaves_got, leaves_want)
        )

    def paths(self) -> dict:
        from tensorferry.ray._transport import _process

        return dict(_process().gets_by_transport)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_actors_on_two_nodes_move_tensors_over_tcp(two_nodes):
    src = Source.options(resources={"node_a": 1}).remote()
    far = Sink.options(resources={"node_b": 1}).remote()
    near = Sink.options(resources={"node_a": 1}).remote()
    assert ray.get(src.node.remote()) != ray.get(far.node.remote())
    assert ray.get(src.node.remote()) == ray.get(near.node.remote())
    for seed in (1, 2, 3):
        ref = src.make.remote(seed)
        assert ray.get(far.check.remote(ref, seed))
        assert ray.get(near.check.remote(ref, seed))
    assert ray.get(far.paths.remote()) == {"tcp": 3}
    assert ray.get(near.paths.remote()) == {"shm": 3}
    for actor in (src, far, near):
        ray.kill(actor)


@ray.remote
class Trainer:
    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))

    def step(self, version: int) -> list:
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return [t.clone() for t in self.model.state_dict().values()]


@ray.remote
class Worker:
    def __init__(self) -> None:
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))

    def weights(self) -> list:
        return [t.clone() for t in self.model.state_dict().values()]

    def paths(self) -> list:
        # Which transports this worker's weight receiver has connections for.
        from tensorferry.ray import _weights

        return sorted({transport for transport, _ in _weights._RECEIVER._channels.idle_keys()})


def test_weight_sync_reaches_a_worker_on_the_other_node_over_tcp(two_nodes):
    trainer = Trainer.options(resources={"node_a": 1}).remote()
    far = Worker.options(resources={"node_b": 1}).remote()
    near = Worker.options(resources={"node_a": 1}).remote()
    sync = tfr.WeightSync(trainer, [far, near])
    for version in (1, 2, 3):
        want = ray.get(trainer.step.remote(version))
        assert sync.sync().version == version
        for w in (far, near):
            got = ray.get(w.weights.remote())
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert ray.get(far.paths.remote()) == ["tcp"]
    assert ray.get(near.paths.remote()) == ["shm"]
    for actor in (trainer, far, near):
        ray.kill(actor)


def _sent_by_trainer(actor_self) -> int:
    from tensorferry.ray import _weights

    return _weights._PUBLISHER.sender.stats()["bytes_sent"]


def _relayed(actor_self) -> int:
    from tensorferry.ray import _weights

    r = _weights._RECEIVER
    return r._relay_server.bytes_sent if r is not None and r._relay_server is not None else -1


def test_weight_sync_relays_between_the_workers_of_the_other_node(two_nodes):
    trainer = Trainer.options(resources={"node_a": 1}).remote()
    far = [Worker.options(resources={"node_b": 1}).remote() for _ in range(3)]
    near = Worker.options(resources={"node_a": 1}).remote()
    sync = tfr.WeightSync(trainer, [*far, near], fanout=1)
    nbytes = 0
    for version in (1, 2, 3):
        want = ray.get(trainer.step.remote(version))
        report = sync.sync()
        nbytes = report.nbytes // len(sync.workers)
        for w in (*far, near):
            got = ray.get(w.weights.remote())
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # The trainer's link carried one copy a version (a chain through the
    # far workers), not three; the near worker read the pool (shm).
    sent = ray.get(trainer.__ray_call__.remote(_sent_by_trainer))
    assert 3 * nbytes <= sent < 4 * nbytes, (sent, nbytes)
    relayed = sorted(ray.get([w.__ray_call__.remote(_relayed) for w in far]))
    assert relayed[0] >= 0 and sum(relayed) >= 2 * 3 * nbytes, relayed  # two of three pass each version on
    assert ray.get(near.paths.remote()) == ["shm"]
    with pytest.raises(Exception, match="fanout"):
        tfr.WeightSync(trainer, far, fanout=0)
    for actor in (trainer, *far, near):
        ray.kill(actor)


def _nudge(actor_self, version: int) -> list:
    """About 1% of every parameter's elements changed, from the version's seed."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in actor_self.model.parameters():
            flat = p.view(-1)
            flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)] += 1.0
    return [t.clone() for t in actor_self.model.state_dict().values()]


def test_weight_sync_relays_deltas_between_the_workers_of_the_other_node(two_nodes):
    trainer = Trainer.options(resources={"node_a": 1}).remote()
    far = [Worker.options(resources={"node_b": 1}).remote() for _ in range(3)]
    near = Worker.options(resources={"node_a": 1}).remote()
    sync = tfr.WeightSync(trainer, [*far, near], fanout=1, delta=True)
    nbytes = 0
    for version in (1, 2, 3):
        want = ray.get(trainer.__ray_call__.remote(_nudge, version))
        report = sync.sync()
        nbytes = report.nbytes // len(sync.workers)
        assert (report.delta_nbytes == 0) if version == 1 else (0 < report.delta_nbytes < nbytes // 10), report
        for w in (*far, near):
            got = ray.get(w.weights.remote())
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # The trainer's link carried the first version once (a chain through
    # the far workers) and then one delta a version.
    sent = ray.get(trainer.__ray_call__.remote(_sent_by_trainer))
    assert nbytes <= sent < nbytes + 2 * (nbytes // 10), (sent, nbytes)
    for actor in (trainer, *far, near):
        ray.kill(actor)


ROWS, COLS = 64, 48  # a weight matrix row-sharded on 2 trainer ranks, column-parallel over 2 workers a replica


def _global(version: int) -> dict:
    g = torch.Generator().manual_seed(200 + version)
    return {"w": torch.randn(ROWS, COLS, generator=g), "norm": torch.randn(COLS, generator=g)}


@ray.remote
class RankTrainer:
    def __init__(self, rank: int) -> None:
        from tensorferry import Box

        self.lo, self.hi = rank * ROWS // 2, (rank + 1) * ROWS // 2
        g = _global(0)
        self.state = {"w": Box(g["w"][self.lo : self.hi].clone(), (self.lo, 0), (ROWS, COLS)), "norm": g["norm"].clone()}

    def step(self, version: int) -> None:
        g = _global(version)
        self.state["w"].tensor.copy_(g["w"][self.lo : self.hi])
        self.state["norm"].copy_(g["norm"])


@ray.remote
class TPWorker:
    def __init__(self, tp_rank: int) -> None:
        from tensorferry import Box

        self.lo = tp_rank * COLS // 2
        self.targets = {"w": Box(torch.zeros(ROWS, COLS // 2), (0, self.lo), (ROWS, COLS)), "norm": torch.zeros(COLS)}

    def matches(self, version: int) -> bool:
        g = _global(version)
        return bool(torch.equal(self.targets["w"].tensor, g["w"][:, self.lo : self.lo + COLS // 2]) and torch.equal(self.targets["norm"], g["norm"]))


def test_sharded_weight_sync_relays_each_slice_set_between_the_replicas_on_the_other_node(two_nodes):
    """Two trainer ranks on one node; two replicas of a 2-way
    tensor-parallel group on the other. With fanout=1 each rank sends each
    worker rank's slices once a version (the other replica's worker of that
    rank takes them from the first), not once a replica."""
    trainers = [RankTrainer.options(resources={"node_a": 1}).remote(k) for k in range(2)]
    workers = [TPWorker.options(resources={"node_b": 1}).remote(tp) for _ in range(2) for tp in range(2)]
    sync = tfr.WeightSync(trainers, workers, fanout=1, state_dict=lambda self: self.state, targets=lambda self: self.targets)
    for version in (1, 2):
        ray.get([t.step.remote(version) for t in trainers])
        assert sync.sync().version == version
        assert ray.get([w.matches.remote(version) for w in workers]) == [True] * len(workers)
    # Each rank holds half the rows of w; the norm is read once per worker
    # rank, from one of the two ranks.
    shard = ROWS // 2 * COLS * 4
    sent = ray.get([t.__ray_call__.remote(_sent_by_trainer) for t in trainers])
    assert sum(sent) == 2 * (2 * shard + 2 * COLS * 4), sent
    relayed = ray.get([w.__ray_call__.remote(_relayed) for w in workers])
    assert sum(relayed) == 2 * (2 * shard + 2 * COLS * 4), relayed  # one replica passes each version on
    for actor in (*trainers, *workers):
        ray.kill(actor)
