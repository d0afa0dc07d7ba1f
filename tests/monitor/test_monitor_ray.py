"""The Ray recipe of docs/monitor.md on a real local Ray cluster: ``tensorferry
monitor -k '^ray::'`` beside Ray's own agent, its workers grouped by actor
class, and what each reports for the same processes.

Ray's agent estimates a worker's USS as RSS - shared (psutil's
``memory_info``: RSS less file-backed and shared-memory pages), which is the
monitor's ``anon``; the monitor's USS counts the pages only that process maps:
the two agree for a worker's own heap, and part where a worker alone maps
shared memory (a pool's memfd).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

# Before Ray is imported: the raylet and its workers inherit them.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.pop("RAY_ADDRESS", None)

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
np = pytest.importorskip("numpy")

MIB = 1 << 20


@ray.remote(num_cpus=0)
class Holder:
    """Holds 64 MiB of its own (anonymous) memory."""

    def __init__(self) -> None:
        self.a = np.ones(64 * MIB // 4, dtype=np.float32)

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class Reader:
    """Reads a 64 MiB object from Ray's object store: shared memory, not its own."""

    def __init__(self) -> None:
        self.x = None

    def read(self, refs: list) -> float:
        self.x = ray.get(refs[0])
        return float(self.x[:: 1024].sum())

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class PoolOwner:
    """Writes 64 MiB of a memfd only it maps, as an actor's MemoryPool does (shared memory, yet its own)."""

    def __init__(self) -> None:
        import mmap

        fd = os.memfd_create("pool-like", os.MFD_CLOEXEC)
        os.ftruncate(fd, 64 * MIB)
        self.buf = mmap.mmap(fd, 64 * MIB)
        os.close(fd)
        for off in range(0, 64 * MIB, 4096):
            self.buf[off] = 1

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    """A single-node Ray cluster of our own (address="local"), two Holders and a Reader."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        holders = [Holder.remote() for _ in range(2)]
        reader = Reader.remote()
        owner = PoolOwner.remote()
        obj = ray.put(np.ones(64 * MIB // 4, dtype=np.float32))
        assert ray.get(reader.read.remote([obj])) == 64 * MIB // 4 / 1024
        pids = {"ray::Holder": sorted(ray.get([h.pid.remote() for h in holders])),
                "ray::Reader": [ray.get(reader.pid.remote())],
                "ray::PoolOwner": [ray.get(owner.pid.remote())]}
        yield {"pids": pids, "job": ray.get_runtime_context().get_job_id(),
               "metrics_port": ray._private.worker._global_node.metrics_export_port}
    finally:
        ray.shutdown()


def monitor_json(*args: str) -> dict:
    """The last tick of `tensorferry monitor -j ...` (the recipe's command, as JSON)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-m", "tensorferry", "monitor", "-j", *args],
                         capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def ray_agent_figures(port: int, components: list[str], timeout_seconds: float = 60.0) -> dict[str, dict[str, float]]:
    """Ray's agent's per-component figures (its Prometheus endpoint) once it reports every component."""
    pattern = re.compile(r'^ray_component_(uss|rss)_bytes\{([^}]*)\} (\S+)$', re.M)
    deadline = time.monotonic() + timeout_seconds
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        got: dict[str, dict[str, float]] = {}
        for kind, labels, value in pattern.findall(text):
            comp = re.search(r'Component="([^"]*)"', labels)
            if comp and comp.group(1) in components:
                got.setdefault(comp.group(1), {})[kind] = float(value)
        if all(len(got.get(c, {})) == 2 and got[c]["rss"] > 0 for c in components):
            return got
        assert time.monotonic() < deadline, f"Ray's agent did not report {components} in {timeout_seconds} s"
        time.sleep(1.0)


def test_ray_workers_by_actor_class_beside_rays_agent(cluster) -> None:  # type: ignore[no-untyped-def]
    pids = cluster["pids"]
    # The recipe: Ray's workers, a whole core of budget so every exact figure
    # is read within the run (the default 0.1% takes minutes for these).
    rec = monitor_json("-k", "^ray::", "-b", "1", "-i", "0.5", "-d", "3")
    procs = {p["pid"]: p for p in rec["processes"]}
    groups = {g["name"]: g for g in rec["groups"]}
    for name, members in pids.items():
        assert groups[name]["count"] == len(members)
        assert all(procs[p]["group"] == name and procs[p]["cmdline"][0].startswith(name) for p in members)
        assert all(procs[p]["uss_source"] == "pagemap" for p in members)
    # Only Ray's processes: every one watched is titled ray::.
    assert all(p["cmdline"][0].startswith("ray::") for p in rec["processes"])

    ray_says = ray_agent_figures(cluster["metrics_port"], list(pids))
    # Taken again now, so both figures are of the same moment (the actors idle).
    rec = monitor_json("-k", "^ray::", "-b", "1", "-i", "0.5", "-d", "3")
    procs = {p["pid"]: p for p in rec["processes"]}
    rows = {}
    for name, members in pids.items():
        mine = [procs[p] for p in members]
        rows[name] = {
            "processes": len(members),
            "rss": sum(p["rss_bytes"] for p in mine),
            "anon": sum(p["anon_bytes"] for p in mine),
            "shmem": sum(p["shmem_bytes"] for p in mine),
            "uss": sum(p["uss_bytes"] for p in mine),
            "pss": None if any(p["pss_bytes"] is None for p in mine) else sum(p["pss_bytes"] for p in mine),
            "ray_rss": ray_says[name]["rss"],
            "ray_uss": ray_says[name]["uss"],
        }
    print("\nper actor class, bytes:", json.dumps(rows, indent=1))
    for name, r in rows.items():
        # Ray's "USS" is RSS - shared: the monitor's anon, to within what the
        # idle workers' allocators move between the two reads.
        assert abs(r["ray_uss"] - r["anon"]) <= max(0.05 * r["anon"], 8 * MIB), (name, r)
        assert abs(r["ray_rss"] - r["rss"]) <= max(0.05 * r["rss"], 8 * MIB), (name, r)
    holder, reader, owner = rows["ray::Holder"], rows["ray::Reader"], rows["ray::PoolOwner"]
    # Each Holder's 64 MiB is its own: in both USS figures.
    assert holder["uss"] >= 2 * 64 * MIB and holder["ray_uss"] >= 2 * 64 * MIB
    # The Reader's 64 MiB object is in Ray's shared object store: resident in
    # the Reader (shmem), in neither USS (the raylet maps those pages too).
    assert reader["shmem"] >= 60 * MIB
    assert reader["uss"] < reader["rss"] - 60 * MIB and reader["ray_uss"] < reader["ray_rss"] - 60 * MIB
    # The pool's 64 MiB memfd is shared memory that only its owner maps: the
    # owner's own (USS counts it), missed by RSS - shared.
    assert owner["shmem"] >= 60 * MIB and owner["uss"] >= owner["anon"] + 60 * MIB
    assert owner["ray_uss"] < owner["uss"] - 60 * MIB

