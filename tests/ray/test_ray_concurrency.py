"""Many transfers at once between async actors while the machine is busy.

Ray's own RDT test ``test_out_of_order_actors`` (two async actors,
``max_concurrency=10``, transfers of a 3-element tensor consumed out of
order) once timed out with tensorferry under load. Here: 1,000 such
transfers, the source returning the very same tensor each time (its kept
plan replays) and fresh tensors beside it, while busy-looping processes
started by the test keep every core loaded. Every transfer must arrive,
with its values, and the source's pool must be empty once the refs are
freed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402

import _ray_helpers as H  # noqa: E402

ray.cloudpickle.register_pickle_by_value(H)

pytestmark = pytest.mark.ray

tfr.register()

TRANSFERS = 1_000
# Two busy loops per core: the actors get a share of the CPU, not a core.
LOAD_PROCESSES = 2 * (os.cpu_count() or 2)


@ray.remote(enable_tensor_transport=True, max_concurrency=10)
class AsyncSource:
    def __init__(self) -> None:
        self.tensor = torch.tensor([4, 5, 6])

    @ray.method(tensor_transport="tensorferry")
    async def same(self):
        return self.tensor

    @ray.method(tensor_transport="tensorferry")
    async def fresh(self, i: int):
        return torch.tensor([i, i + 1, i + 2])

    def kept(self) -> tuple[int, int]:
        from tensorferry.ray._transport import _process

        k = _process().kept
        return k.plans_made, k.plan_puts


@ray.remote(enable_tensor_transport=True, max_concurrency=10)
class AsyncSink:
    async def total(self, data):
        return int(data.sum())


@pytest.fixture
def cpu_load():
    """Busy-looping processes on every core for the test's duration, ended by their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(LOAD_PROCESSES)]
    try:
        time.sleep(0.5)
        assert all(p.poll() is None for p in procs)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=30)


@pytest.mark.timeout(240)
def test_a_thousand_out_of_order_transfers_between_async_actors_under_cpu_load(local_ray, cpu_load):
    source, sink = AsyncSource.remote(), AsyncSink.remote()
    ray.get(sink.total.remote(torch.zeros(1)))  # both started before the clock matters
    refs, want = [], 0
    for i in range(TRANSFERS):
        if (i // 100) % 2:  # runs of 100: the same tensor's plan is made and replayed in each
            ref = source.fresh.remote(i)
            want += 3 * i + 3
        else:
            ref = source.same.remote()
            want += 15
        refs.append(sink.total.remote(ref))
        del ref
    assert all(p.poll() is None for p in cpu_load)  # the load ran throughout the submissions
    assert sum(ray.get(refs, timeout=180)) == want
    assert all(p.poll() is None for p in cpu_load)
    plans_made, plan_puts = ray.get(source.kept.remote())
    assert plans_made >= 1 and plan_puts >= 1  # the same tensor went by the kept plan
    stats = H.wait_until(lambda: ray.get(source.__ray_call__.remote(H.sender_stats)), H.pool_is_empty, seconds=30)
    assert H.pool_is_empty(stats), stats
    for actor in (source, sink):
        ray.kill(actor)
