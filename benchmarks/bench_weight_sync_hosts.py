"""WeightSync across namespace hosts (issue 16): 4 workers on each of 2 hosts
against 1 worker on one other host, every link shaped to the same rate.

Hosts are network namespaces on a bridge (``tests/_hosts.py``), every link
``--rate`` both ways. A Ray cluster runs inside them: the head (GCS and a
raylet) in host 0, one raylet in each of hosts 1 and 2, each started with
``ip netns exec HOST ray start --block --node-ip-address=<its address>``
and its own ``--temp-dir``; each raylet's environment names its host's
address (``TENSORFERRY_RAY_HOST``) and a shared ``TENSORFERRY_TOKEN``, which
its workers inherit. The driver (this script with ``--driver``) runs in host
0 too. Nothing leaves the namespaces: the controller in the machine's own
namespace only starts processes and reads the driver's one JSON line. On
exit every process in the namespaces is ended by pid (``Hosts``) and the
temp dir removed.

Actors: a trainer in host 0 holding a model of ``--nbytes`` (8 float32
matrices, no biases: 8 x 4096 x 4096 x 4 B = 512 MiB by default), and
``--per-host`` workers in each of hosts 1 and 2 holding the same shapes.
Two ``tensorferry.ray.WeightSync(trainer, workers, fanout=1)``:

* ``one``: one worker of host 1;
* ``all``: every worker of hosts 1 and 2.

With ``fanout=1`` the trainer sends one copy; a worker of each host takes
it over its link (host 1's from the trainer, host 2's from a relay of host
1), the other workers of a host are placed below a relay of their own host
and copy it out of its memory. Each round changes the trainer's weights in
place (``add_(1)``) and syncs once per configuration, interleaved; the time
is ``SyncReport.seconds`` (the publish and every worker's in-place update,
as the driver sees it). One warm-up round first (plans, pools, caches,
connections). After the last round every worker's parameters are hashed
(BLAKE2b) and compared with the trainer's; the trainer's ``bytes_sent`` per
sync gives the copies it sent.

Target (issue 16): ``all`` in at most 1.3x the time of ``one``.

Run as root: ``.venv/bin/python benchmarks/bench_weight_sync_hosts.py``
(default 1gbit, 512 MiB, 4 per host, 3 rounds); writes
``benchmarks/results/bench_weight_sync_hosts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import log, write_json
from _harness import namespace_hosts

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MIB = 1 << 20
MATRICES = 8
# The machine is shared: below this much available memory the run ends
# itself (every process in its hosts killed) rather than let the kernel's
# OOM killer pick someone else's process.
MIN_AVAILABLE_NBYTES = 1536 * MIB
GCS_PORT = 6379
TARGET_ALL_VS_ONE = 1.3


# -- the driver (inside host 0) ----------------------------------------------------------


def driver(args: argparse.Namespace) -> None:
    import ray
    import torch

    import tensorferry.ray as tfr

    side = int((args.nbytes // 4 // MATRICES) ** 0.5)

    class Model(torch.nn.Module):
        def __init__(self, seed: int | None) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed) if seed is not None else None
            self.w = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(side, side, generator=g) if g is not None else torch.zeros(side, side), requires_grad=False)
                for _ in range(MATRICES))

    def digest(model: torch.nn.Module) -> str:
        import hashlib

        h = hashlib.blake2b(digest_size=16)
        for p in model.parameters():
            h.update(memoryview(p.detach().contiguous().view(torch.uint8).numpy()))
        return h.hexdigest()

    @ray.remote(num_cpus=0)
    class Trainer:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self.model = Model(seed=16)

        def step(self) -> None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)

        def digest(self) -> str:
            return digest(self.model)

        def bytes_sent(self) -> int:
            from tensorferry.ray import _weights

            return _weights._PUBLISHER.sender.stats()["bytes_sent"]

        def where(self) -> str:
            return os.environ.get("TENSORFERRY_RAY_HOST", "")

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self.model = Model(seed=None)

        def digest(self) -> str:
            return digest(self.model)

        def where(self) -> str:
            return os.environ.get("TENSORFERRY_RAY_HOST", "")

        def reads(self) -> dict:
            from tensorferry.ray import _weights

            s = _weights._RECEIVER.stats()
            return {k: s.get(k, 0) for k in ("relay_memory_read_nbytes", "relay_stream_nbytes", "relay_bytes_sent", "relay_bytes_lent")}

    t0 = time.monotonic()
    ray.init(address=f"{args.head}:{GCS_PORT}", _node_ip_address=args.head, log_to_driver=False)
    while len([n for n in ray.nodes() if n["Alive"]]) < 3:
        if time.monotonic() - t0 > 180:
            raise RuntimeError(f"only {[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]} of 3 raylets joined in 180 s")
        time.sleep(0.5)
    trainer = Trainer.options(resources={"h0": 1}).remote()
    workers = {h: [Worker.options(resources={f"h{h}": 1}).remote() for _ in range(args.per_host)] for h in (1, 2)}
    everyone = [*workers[1], *workers[2]]
    where = {"trainer": ray.get(trainer.where.remote()), **{f"h{h}": sorted(set(ray.get([w.where.remote() for w in ws]))) for h, ws in workers.items()}}
    syncs = {"one": tfr.WeightSync(trainer, workers[1][:1], fanout=1), "all": tfr.WeightSync(trainer, everyone, fanout=1)}
    rounds: dict[str, list[dict]] = {k: [] for k in syncs}
    up = time.monotonic() - t0
    for rep in range(args.repeats + 1):  # round 0: warm-up
        for name in (("one", "all") if rep % 2 else ("all", "one")):
            ray.get(trainer.step.remote())
            before = ray.get(trainer.bytes_sent.remote()) if rep else 0
            report = syncs[name].sync()
            r = {"seconds": report.seconds, "worker_seconds": report.worker_seconds, "pack_seconds": report.pack_seconds}
            if rep:
                r["trainer_copies"] = (ray.get(trainer.bytes_sent.remote()) - before) / (report.nbytes / report.num_workers)
                rounds[name].append(r)
            print(json.dumps({"progress": f"{'warm-up ' if not rep else ''}{name}: {report.seconds:.2f} s"}), flush=True)
            if rep == args.repeats:
                want = ray.get(trainer.digest.remote())
                got = ray.get([w.digest.remote() for w in syncs[name].workers])
                r["verified"] = all(d == want for d in got)
    reads = ray.get([w.reads.remote() for w in everyone])
    print(json.dumps({"rounds": rounds, "where": where, "cluster_up_seconds": up, "reads": reads,
                      "nbytes": sum(p.numel() * 4 for p in Model(seed=None).parameters())}), flush=True)
    ray.shutdown()


# -- the controller ------------------------------------------------------------------------


def _available_nbytes() -> int:
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _guard(hosts: Any, errors: list[str], stop: threading.Event) -> None:
    """Kill this run's processes (all inside its namespaces, by pid) if the
    machine's available memory falls below MIN_AVAILABLE_NBYTES."""
    low = 1 << 62
    while not stop.wait(0.2):
        low = min(low, _available_nbytes())
        if low < MIN_AVAILABLE_NBYTES:
            errors.append(f"stopped: the machine's available memory fell to {low / MIB:,.0f} MiB "
                          f"(limit {MIN_AVAILABLE_NBYTES / MIB:,.0f} MiB); use a smaller --nbytes or --per-host")
            for name in hosts.names:
                pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return
    lowest_available.append(low)


lowest_available: list[int] = []  # the least available memory the guard saw, in bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit", help="every link's rate, as tc writes it")
    ap.add_argument("--nbytes", type=int, default=512 * MIB, help="the model's bytes (8 square float32 matrices)")
    ap.add_argument("--per-host", type=int, default=4, help="workers in each of hosts 1 and 2")
    ap.add_argument("--repeats", type=int, default=3, help="timed syncs per configuration (median)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--head", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver:
        driver(args)
        return 0

    hosts_module, reason = namespace_hosts("bench_weight_sync_hosts")
    if reason is not None:
        return 1
    Hosts, parse_rate = hosts_module.Hosts, hosts_module.parse_rate
    ray_bin = str(Path(sys.executable).with_name("ray"))
    started, load_start = time.monotonic(), os.getloadavg()[0]
    token = secrets.token_hex(16)
    tmp = Path(tempfile.mkdtemp(prefix="tfray-", dir="/tmp"))
    result: dict[str, Any] = {}
    errors: list[str] = []
    try:
        with Hosts(3, rate=args.rate) as hosts:
            stop_guard = threading.Event()
            guard = threading.Thread(target=_guard, args=(hosts, errors, stop_guard), daemon=True)
            guard.start()
            head = hosts.address(0)
            logs = []

            def env_of(i: int) -> dict[str, str]:
                env = dict(os.environ)
                env.pop("RAY_ADDRESS", None)
                env.update({
                    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
                    "TENSORFERRY_RAY_HOST": hosts.address(i), "TENSORFERRY_TOKEN": token,
                    "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
                    "GLOO_SOCKET_IFNAME": "eth0", "UCX_NET_DEVICES": "lo",
                })
                return env

            def ray_start(i: int, *extra: str) -> None:
                out = open(tmp / f"ray-start-h{i}.log", "w")
                logs.append(out)
                (tmp / f"h{i}").mkdir()
                hosts.run(i, [ray_bin, "start", "--block", f"--node-ip-address={hosts.address(i)}", f"--temp-dir={tmp / f'h{i}'}",
                              "--num-cpus=2", f'--resources={{"h{i}": 16}}', "--disable-usage-stats",
                              f"--object-store-memory={128 * MIB}", *extra],
                          env=env_of(i), stdout=out, stderr=subprocess.STDOUT)

            ray_start(0, "--head", f"--port={GCS_PORT}", "--include-dashboard=false")
            # The others join once the GCS answers (checked from inside host 1).
            probe = hosts.python(1, "-c", f"import socket,time\nfor _ in range(600):\n try: socket.create_connection(({head!r},{GCS_PORT}),1).close(); break\n"
                                          " except OSError: time.sleep(0.2)\nelse: raise SystemExit(1)")
            if probe.wait(timeout=180) != 0:
                raise RuntimeError(f"the head's GCS did not answer at {head}:{GCS_PORT}: {(tmp / 'ray-start-h0.log').read_text()[-2000:]}")
            for i in (1, 2):
                ray_start(i, f"--address={head}:{GCS_PORT}")
            log(f"ray started in 3 hosts at {args.rate}; driver in host 0; load {load_start:.2f}")
            drv = hosts.python(0, str(Path(__file__).resolve()), "--driver", "--head", head, "--nbytes", str(args.nbytes),
                               "--per-host", str(args.per_host), "--repeats", str(args.repeats),
                               env=env_of(0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for line in drv.stdout:
                fact = json.loads(line)
                if "progress" in fact:
                    log(fact["progress"])
                else:
                    result = fact
            if drv.wait(timeout=60) != 0 or not result:
                errors.append(f"driver exit {drv.returncode}: {drv.stderr.read()[-4000:]}")
            for out in logs:
                out.close()
            stop_guard.set()
            guard.join(timeout=5)
    except Exception as exc:  # recorded and reported; the hosts are gone already
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {"env": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rate": args.rate, "nbytes": args.nbytes,
                   "per_host": args.per_host, "repeats": args.repeats,
                   "min_available_mib": round(lowest_available[0] / MIB) if lowest_available else None,
                   "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
                   "wall_seconds": round(time.monotonic() - started, 1)},
           **result, "errors": errors}
    if result:
        one = statistics.median(r["seconds"] for r in result["rounds"]["one"])
        everyone = statistics.median(r["seconds"] for r in result["rounds"]["all"])
        doc["summary"] = {
            "one_seconds": one, "all_seconds": everyone, "all_vs_one": everyone / one,
            "one_copy_at_line_seconds": result["nbytes"] * 8 / parse_rate(args.rate),
            "trainer_copies_all": statistics.median(r["trainer_copies"] for r in result["rounds"]["all"]),
            "verified": all(r.get("verified", True) for rs in result["rounds"].values() for r in rs),
            "target": TARGET_ALL_VS_ONE, "met": everyone / one <= TARGET_ALL_VS_ONE,
        }
        s = doc["summary"]
        print(f"WeightSync of {result['nbytes'] / MIB:,.0f} MiB, links {args.rate}, medians of {args.repeats}, load {doc['env']['loadavg_1min_start_end']}")
        print(f"  1 worker on host 1:                 {s['one_seconds']:.2f} s  {[round(r['seconds'], 2) for r in result['rounds']['one']]}")
        print(f"  {2 * args.per_host} workers ({args.per_host} on each of 2 hosts): {s['all_seconds']:.2f} s  "
              f"{[round(r['seconds'], 2) for r in result['rounds']['all']]}")
        print(f"  ratio {s['all_vs_one']:.2f}x (target at most {TARGET_ALL_VS_ONE}x: {'met' if s['met'] else 'not met'}); "
              f"one copy at the line rate {s['one_copy_at_line_seconds']:.2f} s; trainer copies per sync {s['trainer_copies_all']:.2f}; "
              f"verified {s['verified']}")
    for e in errors:
        print(f"error: {e}")
    path = write_json(args.out / "bench_weight_sync_hosts.json", doc)
    log(f"wrote {path}")
    return 1 if errors or not result else 0


if __name__ == "__main__":
    sys.exit(main())
