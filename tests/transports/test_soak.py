"""Soak: hundreds of syncs of a kept plan with faults mixed in, and nothing leaks.

One sender (this process) and three receiver processes (``_soak_worker.py``)
run ``SOAK_SYNCS`` syncs (default 500) of a kept plan: each sync changes the
trainer's tensors in place, puts the plan for every receiver, and checks each
receiver's digest of what it got against the sender's, bit for bit. Over shm,
over tcp, and over tcp through a relay chain (``fanout=1``: every receiver a
relay of the next). Mixed in, at seeded random syncs:

* a receiver killed (SIGKILL) at a random point of its get, then restarted
  (in the chain, a relay: its children resume from the sender);
* a receiver stopped (SIGSTOP) mid-get, or before its get, for longer than
  the sender's lease while the others go on syncing (the sender reuses its
  blocks), then resumed: its get must be bit-exact or a typed error, never
  other bytes;
* garbage connections to the sender: random bytes, an HTTP request, or a
  connection that says nothing until the sync is over.

Checked: every completed get is bit-exact; every failed get raised a
TensorferryError; at the end the sender's pool is empty; the sender's and
the long-lived receivers' (relays') RSS, open descriptors and threads are
within a small bound of their values after the first tenth of the run; and
at every fault's aftermath and at the end no abstract socket or memfd of
ours outlives its owner. A report is printed (``-m stress -s`` not needed).

Run: ``pytest -m stress tests/transports/test_soak.py`` (about 10 minutes on
two busy cores); ``SOAK_SYNCS=100`` for a short run.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import queue
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import tensorferry as tf
from tensorferry.errors import TensorferryError

sys.path.insert(0, str(Path(__file__).parent))
from _soak_worker import digest  # noqa: E402

pytestmark = [pytest.mark.stress, pytest.mark.timeout(3600)]

WORKER = Path(__file__).with_name("_soak_worker.py")
SYNCS = int(os.environ.get("SOAK_SYNCS", "500"))
RECEIVERS = 3
# Short enough that a stopped receiver outlives it within a few seconds.
LEASE_SECONDS = 3.0
# A child of a stopped relay asks the sender again after this long.
STALL_SECONDS = 2.0
# Kills and stops land at a random point of a get: within the median time
# from a ticket sent to its answer in the first tenth of the run.
# While one receiver is stopped the others sync every this long (about 10
# syncs that take and free pool blocks before it resumes).
STOPPED_SYNC_PAUSE_SECONDS = 0.4
# Faults per run of SYNCS syncs (scaled down for short runs).
KILLS, STOPS, GARBAGE = 10, 3, 25
# A reply takes milliseconds; a worker's restart (torch's import) seconds.
REPLY_TIMEOUT_SECONDS = 90.0
# Growth allowed between the first tenth and the end. A leak of one object
# per sync would be SYNCS x 1.7 MiB; 16 MiB is allocator slack (glibc's
# arenas, torch's caches). A descriptor or thread per fault would be 38.
MAX_ANON_GROWTH_BYTES = 16 << 20
MAX_FDS_GROWTH = 2
MAX_THREADS_GROWTH = 2

MiB = 1 << 20


# -- the trainer's tensors ---------------------------------------------------------------


def weights() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """48 views of one float32 storage (returned too), bf16 norms, int64
    counters, a uint8 mask: views, several dtypes and alignment padding, 3.8 MiB."""
    flat = torch.zeros(48 * 64 * 320)
    obj = {f"layer{i}.weight": flat[i * 20480 : (i + 1) * 20480].view(64, 320) for i in range(48)}
    obj |= {f"layer{i}.norm": torch.zeros(1000 + i, dtype=torch.bfloat16) for i in range(16)}
    obj |= {f"step{i}": torch.zeros(7, dtype=torch.int64) for i in range(4)}
    obj["mask"] = torch.zeros(333, dtype=torch.uint8)
    return obj, flat


def train_step(obj: dict[str, torch.Tensor], flat: torch.Tensor, version: int) -> None:
    """Change every tensor in place (the kept plan stays valid): every float32
    element differs from every earlier version's."""
    flat.add_(1.0)
    for key, t in obj.items():
        if not key.endswith(".weight"):
            t.fill_(version % 251)


# -- receiver processes ----------------------------------------------------------------------


class WorkerGone(Exception):
    """The worker's stdout ended: it was killed."""


class Worker:
    """A ``_soak_worker.py`` process; its replies arrive on a queue."""

    def __init__(self, transport: str, token: str, relay: bool) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), transport, token, "1" if relay else "0", str(STALL_SECONDS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        )
        self.lines: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid: int = self.reply()["pid"]

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def reply(self) -> dict:
        try:
            got = self.lines.get(timeout=REPLY_TIMEOUT_SECONDS)
        except queue.Empty:
            raise AssertionError(f"worker {self.proc.pid} did not answer within {REPLY_TIMEOUT_SECONDS} s; stderr: {self.errors()}") from None
        if got is None:
            raise WorkerGone(f"worker {self.proc.pid} exited {self.proc.wait()}; stderr: {self.errors()}")
        return got

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-2000:]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="stop")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self.stderr.close()


# -- what a process holds ---------------------------------------------------------------------


class Usage(NamedTuple):
    rss_bytes: int
    anon_bytes: int
    fds: int
    threads: int


def usage(pid: int) -> Usage:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()
    return Usage(int(fields["VmRSS"][0]) * 1024, int(fields["RssAnon"][0]) * 1024,
                 len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"][0]))


_SOCKET_PID = re.compile(r"^@tensorferry-(?:relay-)?(\d+)-")


def tensorferry_sockets() -> list[tuple[str, int]]:
    """tensorferry's abstract sockets in this network namespace, with the pid in their name."""
    out = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        path = line.split()[-1] if len(line.split()) >= 8 else ""
        if m := _SOCKET_PID.match(path):
            out.append((path, int(m[1])))
    return out


def memfds(pid: int) -> tuple[set[int], set[int]]:
    """The inodes of tensorferry's memfds that ``pid`` holds open and that it maps."""
    held, mapped = set(), set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:tensorferry"):
                held.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except FileNotFoundError:  # closed meanwhile
            continue
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split(None, 5)
        if len(f) == 6 and f[5].startswith("/memfd:tensorferry"):
            mapped.add(int(f[4]))
    return held, mapped


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- the run ------------------------------------------------------------------------------------


class Soak:
    """One sender (this process), RECEIVERS workers, the faults and the tallies."""

    def __init__(self, transport: str, chain: bool, rng: random.Random) -> None:
        self.transport, self.chain, self.rng = transport, chain, rng
        self.token = tf.new_token()
        self.obj, self.flat = weights()
        self.nbytes = sum(t.numel() * t.element_size() for t in self.obj.values())
        # Room for the tickets a stopped receiver and a killed one still
        # hold while the others sync: a few objects.
        self.sender = tf.Sender(transport, capacity_nbytes=16 * MiB, token=self.token, lease_seconds=LEASE_SECONDS)
        self.plan = self.sender.plan(self.obj)
        self.workers = [self.start_worker() for _ in range(RECEIVERS)]
        self.pids_ever = {os.getpid(), *(w.pid for w in self.workers)}
        self.version = 0
        self.syncs = 0
        self.wants: dict[int, str] = {}
        self.exact = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.error_examples: dict[str, str] = {}
        self.faults: collections.Counter[str] = collections.Counter()
        self.checkpoints = 0
        self.pool_inodes: set[int] = set()
        self.idle_sockets: list[socket.socket] = []
        self.address = ""
        self.get_times: list[float] = []
        self.stopped_outcomes: collections.Counter[str] = collections.Counter()

    def start_worker(self) -> Worker:
        return Worker(self.transport, self.token, relay=self.chain)

    # -- one sync --

    def put(self, readers: int) -> tuple[int, str]:
        self.version += 1
        train_step(self.obj, self.flat, self.version)
        self.wants[self.version] = digest(self.obj)
        ticket = self.sender.put(self.plan, readers=readers, **({"fanout": 1} if self.chain else {}))
        self.address = ticket.address  # where the sender's server listens
        self.syncs += 1
        return self.version, ticket.to_bytes().hex()

    def check(self, worker: Worker, version: int) -> None:
        got = worker.reply()
        assert got["version"] == version, got
        if "digest" in got:
            assert got["digest"] == self.wants[version], f"sync {version}: worker {worker.pid} got other bytes"
            self.exact += 1
        else:
            assert got["typed"], f"sync {version}: worker {worker.pid} raised {got['error']}, not a TensorferryError: {got['message']}"
            self.errors[got["error"]] += 1
            self.error_examples.setdefault(got["error"], got["message"][:200])

    def sync(self, workers: list[Worker]) -> None:
        version, hexed = self.put(len(workers))
        sent = time.perf_counter()
        for w in workers:
            w.send(cmd="get", ticket=hexed, version=version)
        for w in workers:
            self.check(w, version)
            if self.syncs <= SYNCS // 10:
                self.get_times.append(time.perf_counter() - sent)

    def get_seconds(self) -> float:
        return statistics.median(self.get_times)

    # -- faults --

    def kill_mid_get(self) -> None:
        victim = self.rng.randrange(1, RECEIVERS)  # worker 0 lives the whole run: its growth is measured
        version, hexed = self.put(RECEIVERS)
        for w in self.workers:
            w.send(cmd="get", ticket=hexed, version=version)
        time.sleep(self.rng.uniform(0.0, self.get_seconds()))
        self.workers[victim].kill()
        for i, w in enumerate(self.workers):
            if i != victim:
                self.check(w, version)
        self.workers[victim].stop()
        self.workers[victim] = self.start_worker()
        self.pids_ever.add(self.workers[victim].pid)
        self.faults["receiver killed mid-get" + (" (a relay of the chain)" if self.chain else "")] += 1

    def stop_past_the_lease(self, before_its_get: bool) -> None:
        """Stop a receiver at a random point of its get, or before it reads
        the ticket (its get then starts after the lease ran out)."""
        victim = self.rng.randrange(1, RECEIVERS)
        others = [w for i, w in enumerate(self.workers) if i != victim]
        stopped = self.workers[victim]
        version, hexed = self.put(RECEIVERS)
        if before_its_get:
            os.kill(stopped.pid, signal.SIGSTOP)
        for w in self.workers:
            w.send(cmd="get", ticket=hexed, version=version)
        if not before_its_get:
            time.sleep(self.rng.uniform(0.0, self.get_seconds()))
            os.kill(stopped.pid, signal.SIGSTOP)
        try:
            for w in others:
                self.check(w, version)
            # The others sync on while the lease runs out: the sender may
            # reuse the stopped reader's blocks for their tickets.
            resume_at = time.monotonic() + LEASE_SECONDS + 1.0
            while time.monotonic() < resume_at:
                self.sync(others)
                time.sleep(STOPPED_SYNC_PAUSE_SECONDS)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        exact = self.exact
        self.check(stopped, version)
        when = "before its get" if before_its_get else "mid-get"
        self.stopped_outcomes[f"{'bit-exact' if self.exact > exact else 'typed error'} ({when})"] += 1
        self.faults[f"receiver stopped {when} past the {LEASE_SECONDS:g} s lease, then resumed"] += 1

    def garbage(self, address: str) -> None:
        if address.startswith("@"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect("\0" + address[1:])
        else:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=10)
        kind = self.rng.choice(("random bytes", "an HTTP request", "silence"))
        try:
            if kind == "random bytes":
                sock.sendall(self.rng.randbytes(self.rng.randint(1, 4096)))
            elif kind == "an HTTP request":
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: tensorferry\r\n\r\n")
        except OSError:
            pass  # the sender may hang up first: what it should do
        if kind == "silence":
            self.idle_sockets.append(sock)  # held through the next sync
        else:
            sock.close()
        self.faults[f"garbage connection to the sender ({kind})"] += 1

    # -- leaks --

    def our_processes(self) -> list[int]:
        return [os.getpid(), *(w.pid for w in self.workers)]

    def checkpoint(self) -> None:
        """No abstract socket or memfd of ours outlives its owner."""
        self.checkpoints += 1
        for path, pid in tensorferry_sockets():
            if pid in self.pids_ever:
                assert alive(pid), f"abstract socket {path} outlived its process {pid}"
        held, mapped = set(), set()
        for pid in self.our_processes():
            h, m = memfds(pid)
            held |= h
            mapped |= m
            if pid == os.getpid():
                self.pool_inodes |= h | m
        # A memfd someone maps must be held open by a live owner (the
        # sender's pool, a relay's memory): a dead owner's memory kept
        # mapped by a child would be memory nobody can free.
        assert mapped <= held, f"memfds mapped with no live owner holding them: {sorted(mapped - held)}"

    def usage(self) -> dict[int, Usage]:
        return {pid: usage(pid) for pid in self.our_processes()}


def _schedule(rng: random.Random, syncs: int) -> dict[int, str]:
    """At which sync each fault starts: none in the first tenth (the baseline)."""
    scale = syncs / 500
    kinds = ["kill"] * max(1, round(KILLS * scale)) + ["stop"] * max(2, round(STOPS * scale)) + ["garbage"] * max(1, round(GARBAGE * scale))
    at = rng.sample(range(syncs // 10 + 1, syncs), len(kinds))
    return dict(zip(sorted(at), rng.sample(kinds, len(kinds))))


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


@pytest.mark.parametrize("transport, chain", [("shm", False), ("tcp", False), ("tcp", True)], ids=["shm", "tcp", "tcp-relay-chain"])
def test_soak(transport: str, chain: bool, capsys: pytest.CaptureFixture[str]) -> None:
    torch.set_num_threads(1)
    rng = random.Random(f"soak-{transport}-{chain}")
    schedule = _schedule(rng, SYNCS)
    started = time.monotonic()
    soak = Soak(transport, chain, rng)
    baseline: dict[int, Usage] = {}
    try:
        soak.sync(soak.workers)  # the first sync: connections made, plans kept
        soak.checkpoint()
        while soak.syncs < SYNCS or schedule:
            due = [at for at in schedule if at <= soak.syncs]  # a stop's extra syncs may pass one
            fault = schedule.pop(min(due)) if due else None
            if fault == "kill":
                soak.kill_mid_get()
            elif fault == "stop":
                soak.stop_past_the_lease(before_its_get=sum(soak.stopped_outcomes.values()) % 3 == 1)
            else:
                if fault == "garbage":
                    soak.garbage(soak.address)
                soak.sync(soak.workers)
                for sock in soak.idle_sockets:
                    sock.close()
                soak.idle_sockets.clear()
            if fault is not None:
                soak.checkpoint()
            if not baseline and soak.syncs >= SYNCS // 10:
                baseline = soak.usage()

        def pool_empty() -> bool:
            s = soak.sender.stats()
            return s["used_nbytes"] == 0 and s["live_tickets"] == 0

        deadline = time.monotonic() + LEASE_SECONDS + 30
        while not pool_empty() and time.monotonic() < deadline:
            time.sleep(0.1)
        final_stats = soak.sender.stats()
        assert pool_empty(), f"the sender's pool is not empty at the end: {final_stats}"
        soak.checkpoint()
        end = soak.usage()
    finally:
        for w in soak.workers:
            w.stop()
        soak.sender.close()
    seconds = time.monotonic() - started

    # After the run: the sender's pool memory and every worker's sockets are gone.
    del soak.sender, soak.plan
    gc.collect()
    held, mapped = memfds(os.getpid())
    assert not (held | mapped) & soak.pool_inodes, "the closed sender's pool memfd is still open or mapped"
    leftover = [(path, pid) for path, pid in tensorferry_sockets() if pid in soak.pids_ever]
    assert not leftover, f"abstract sockets left after every owner closed or exited: {leftover}"

    lived = [pid for pid in baseline if pid in end]
    growth = {pid: Usage(*(e - b for e, b in zip(end[pid], baseline[pid]))) for pid in lived}
    ok_gets = soak.exact + sum(soak.errors.values())
    lines = [
        f"soak {transport}{' relay chain' if chain else ''}: {soak.syncs} syncs of a kept plan of {len(soak.obj)} tensors "
        f"({_mib(soak.nbytes)}) to {RECEIVERS} receivers in {seconds:.0f} s",
        f"  gets: {soak.exact} bit-exact, {sum(soak.errors.values())} typed errors"
        + "".join(f"\n    {name} x{n}: {soak.error_examples[name]}" for name, n in soak.errors.most_common()),
        "  faults: " + "; ".join(f"{n} x {kind}" for kind, n in sorted(soak.faults.items())),
        f"  kills and stops at a random point of a get's first {soak.get_seconds() * 1e3:.1f} ms (the median get of the first tenth); "
        "the stopped gets ended: " + ", ".join(f"{n} {how}" for how, n in sorted(soak.stopped_outcomes.items())),
        f"  sender's pool at the end: {final_stats['used_nbytes']} bytes used, {final_stats['live_tickets']} live tickets",
        f"  sockets and memfds checked at {soak.checkpoints} checkpoints: none outlived its owner",
        f"  growth from sync {SYNCS // 10} to the end (RSS, anon, fds, threads):",
    ]
    for pid in lived:
        who = "sender" if pid == os.getpid() else ("relay" if chain else "receiver") + f" {pid}"
        b, e = baseline[pid], end[pid]
        lines.append(f"    {who}: RSS {_mib(b.rss_bytes)} -> {_mib(e.rss_bytes)}, anon {_mib(b.anon_bytes)} -> {_mib(e.anon_bytes)}, "
                     f"fds {b.fds} -> {e.fds}, threads {b.threads} -> {e.threads}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))

    assert ok_gets >= SYNCS * (RECEIVERS - 1), f"only {ok_gets} gets answered"
    assert os.getpid() in lived and len(lived) >= 2, f"the sender and worker 0 must live the whole run: {lived}"
    for pid, g in growth.items():
        assert g.anon_bytes <= MAX_ANON_GROWTH_BYTES, f"pid {pid}: anonymous memory grew {_mib(g.anon_bytes)}"
        assert g.fds <= MAX_FDS_GROWTH, f"pid {pid}: {g.fds} more open descriptors"
        assert g.threads <= MAX_THREADS_GROWTH, f"pid {pid}: {g.threads} more threads"
