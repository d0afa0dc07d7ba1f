"""TENSORFERRY_RAY_RECV_POOL_BYTES: received tensors are views of a receive pool."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from conftest import worker_runtime_env  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

tfr.register()


@ray.remote(enable_tensor_transport=True)
class Source:
    @ray.method(tensor_transport="tensorferry")
    def make(self, n: int) -> list:
        return [torch.arange(n, dtype=torch.float32) + i for i in range(4)]


@ray.remote(enable_tensor_transport=True)
class Sink:
    def check(self, obj: list, n: int) -> dict:
        from tensorferry.ray._transport import _process

        pool = _process().receiver.pool
        ok = all(torch.equal(t, torch.arange(n, dtype=torch.float32) + i) for i, t in enumerate(obj))
        lo, hi = pool.data_ptr, pool.data_ptr + pool.capacity_nbytes
        inside = all(lo <= t.data_ptr() < hi for t in obj)
        return {"ok": ok, "inside": inside, "used": pool.stats().used_nbytes}

    def used_after_drop(self) -> int:
        import gc

        from tensorferry.ray._transport import _process

        gc.collect()
        return _process().receiver.pool.stats().used_nbytes


def test_received_tensors_live_in_the_receive_pool_until_collected(local_ray):
    env = worker_runtime_env()
    env["env_vars"]["TENSORFERRY_RAY_RECV_POOL_BYTES"] = str(8 << 20)
    src = Source.remote()
    sink = Sink.options(runtime_env=env).remote()
    n = 1 << 16
    got = ray.get(sink.check.remote(src.make.remote(n), n))
    assert got["ok"] and got["inside"]
    assert got["used"] >= 4 * n * 4
    assert ray.get(sink.used_after_drop.remote()) == 0
