"""Real local Ray clusters for the tests in this folder.

Everything binds to loopback: ``ray.init()`` may advertise the machine's
external address, and gloo/UCX would follow it. The variables are set before
Ray is imported, so the raylet and every worker it starts inherit them.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A transfer that never completes fails after 30 s instead of Ray's 60 s,
# well inside the tests' own timeouts.
os.environ.setdefault("RAY_rdt_fetch_fail_timeout_milliseconds", "30000")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

# Ray may hand a test a running cluster from the environment; these tests
# start their own.
os.environ.pop("RAY_ADDRESS", None)


def worker_runtime_env() -> dict:
    """Workers import this folder's helpers by name: put it on their path."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def shutdown_ray() -> None:
    """``ray.shutdown()``, and a fresh RDT manager for the next cluster.

    Ray 2.60 keeps the driver's RDT manager across ``ray.shutdown()``: the
    transfers it queued for failure monitoring after its monitor thread last
    looked are handed to the next session's monitor thread, whose
    ``ray.wait`` on those dead refs raises ("owner is unknown") and kills it,
    so that session's failed transfers are no longer aborted.
    """
    import ray
    from ray._private import worker

    ray.shutdown()
    worker.global_worker._rdt_manager = None


@pytest.fixture(scope="module")
def local_ray():
    """One single-node Ray cluster per test module, shut down after it."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    if ray.is_initialized():
        ray.shutdown()
    # address="local": always a new cluster of our own, never one that some
    # other process on this machine happens to be running.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=worker_runtime_env())
    try:
        yield ray
    finally:
        shutdown_ray()
