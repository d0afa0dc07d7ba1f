"""Two raylets on this one machine: the cross-node path (tcp) for real."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from conftest import worker_runtime_env  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

# Before the classes below: Ray checks the transport name at class definition.
tfr.register()


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 8}})
    cluster.add_node(num_cpus=2, resources={"node_b": 8})
    try:
        ray.init(address=cluster.address, runtime_env=worker_runtime_env(), log_to_driver=False)
        tfr.register()
        yield cluster
    finally:
        ray.shutdown()
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
