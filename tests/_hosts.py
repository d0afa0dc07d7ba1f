"""Test hosts with real links: network namespaces on a rate-limited bridge.

One machine plays several hosts. :class:`Hosts` makes ``count`` network
namespaces ("hosts") and one more for a bridge; each host has one interface,
``eth0``, the end of a veth pair whose other end (``h<i>``) is a port of the
bridge. Both ends of every link are shaped by a token bucket (``tc ... tbf``)
to the same rate, so a host's upload (its ``eth0``) and its download (the
bridge's ``h<i>``) are each limited to ``rate``, as on a switch with equal
links.

Host ``i`` has the address ``198.18.0.<i+1>/24``: 198.18.0.0/15 is reserved
for benchmarking (RFC 2544) and is used here only on interfaces inside the
namespaces made here. No host has a default route and the bridge's namespace
has no uplink, so nothing a host sends can leave the namespaces of its run;
each host's loopback is up (servers that bind 127.0.0.1, UCX) and is its own,
not the machine's.

Names are ``tfh-<pid>-<run>-br`` and ``tfh-<pid>-<run>-h<i>`` (the pid of the
process that made them, a counter per process), so parallel runs never share
one; :func:`remove_leftovers` deletes those whose pid is gone (a run that was
killed before its clean-up), and every :class:`Hosts` calls it on entry.

Used by ``tests/hosts/`` and ``benchmarks/bench_broadcast.py``. Needs root,
``ip`` and ``tc`` (iproute2), and a kernel with veth, bridge and sch_tbf;
:func:`available` says why not where they are missing.

Example::

    with Hosts(2, rate="100mbit") as hosts:
        server = hosts.python(1, "-c", "...", stdout=subprocess.PIPE)
        client = hosts.run(0, ["ip", "route"], stdout=subprocess.PIPE)
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Hosts", "available", "parse_rate", "remove_leftovers", "namespaces", "NAME_PREFIX", "SUBNET"]

NAME_PREFIX = "tfh"
# Host i is SUBNET.<i+1>; .0 is the network, .255 its broadcast.
SUBNET = "198.18.0"
PREFIX_LEN = 24
MAX_HOSTS = 254
REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
TESTS = REPO / "tests"

_NAME_RE = re.compile(rf"^{NAME_PREFIX}-(\d+)-([0-9a-z]+)-(br|h\d+)$")
# tc's rate units (tc(8), "RATES"); "bps" is bytes per second there, so it is
# left out rather than misread.
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 1 << 10, "mibit": 1 << 20, "gibit": 1 << 30, "tibit": 1 << 40,
}
# A token bucket must hold at least one whole packet; 128 KiB also holds a
# 64 KiB GSO super-packet, which tbf would otherwise cut into MTU-sized
# segments in software (CPU this shared machine does not have).
MIN_BURST_NBYTES = 128 << 10
# Beyond that the bucket holds 1 ms of the line rate: the shortest sleep the
# qdisc's timer makes without losing rate.
BURST_SECONDS = 0.001
# Packets wait at most this long in a link's queue before tbf drops them:
# room for several TCP flows sharing one link without losses from the queue.
QUEUE_MS = 50
_run_ids = itertools.count()


def parse_rate(rate: str | int) -> int:
    """Bits per second of a tc rate (``"100mbit"``, ``"1gbit"``, or an int of bits).

    Raises:
        ValueError: an unknown unit or a rate that is not positive.
    """
    if isinstance(rate, int):
        bits = rate
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(rate).lower())
        if m is None or m.group(2) not in ("", *_RATE_UNITS):
            raise ValueError(f"rate {rate!r}: give a number of bits per second with a unit of {sorted(_RATE_UNITS)}, e.g. '100mbit'")
        bits = int(float(m.group(1)) * _RATE_UNITS.get(m.group(2), 1))
    if bits <= 0:
        raise ValueError(f"rate {rate!r}: must be positive")
    return bits


def _ip(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], input=input, capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], input=input, capture_output=True, text=True, check=True, timeout=30)


def _failed(what: str, exc: subprocess.CalledProcessError) -> RuntimeError:
    err = (exc.stderr or "").strip() or (exc.stdout or "").strip()
    return RuntimeError(f"{what}: `{' '.join(map(str, exc.cmd))}` exited {exc.returncode}: {err}")


def namespaces() -> list[str]:
    """Every network namespace of this machine, by name (``ip netns list``)."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete the namespaces of this naming scheme whose owning pid is dead.

    Only names that match ``tfh-<pid>-<run>-(br|h<i>)`` are looked at; those
    of a live process (a run in progress) stay. Processes still inside a
    deleted namespace are not touched (they were started by another run).
    Returns the names deleted.
    """
    removed = []
    for name in namespaces():
        m = _NAME_RE.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        if _ip("netns", "delete", name, check=False).returncode == 0:
            removed.append(name)
    return removed


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` when :class:`Hosts` can be made here, else the reason why not.

    Checks root, ``ip`` and ``tc``, then makes (and deletes) one namespace
    with a bridge, a veth pair and a tbf qdisc: what a run needs, nothing
    more. Cached for the process.
    """
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{NAME_PREFIX}-{os.getpid()}-probe-br"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot make a network namespace: {(exc.stderr or '').strip()}"
    try:
        _ip("-n", probe, "-batch", "-", input="link add b0 type bridge\nlink add p0 type veth peer name p1\n")
        _tc("-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit", "burst", "128kb", "latency", "50ms")
    except subprocess.CalledProcessError as exc:
        return f"cannot make a bridge, veth pair and tbf qdisc in a namespace: {(exc.stderr or '').strip()}"
    finally:
        _ip("netns", "delete", probe, check=False)
    return None


class Hosts:
    """``count`` hosts (network namespaces) on one bridge, each link at ``rate``.

    A context manager: entering makes everything, leaving removes it all
    (also when the body raised): the processes started by :meth:`run` and
    :meth:`python` are ended, then the namespaces deleted (which deletes
    their veths and the bridge).

    Args:
        count: number of hosts, 1 to 254.
        rate: every link's rate in each direction, as tc writes it
            (``"1gbit"``, ``"100mbit"``) or bits per second.
        burst_nbytes: the token bucket's size; default 1 ms of the rate, at
            least 128 KiB.
        queue_ms: the longest a packet waits in a link's queue before tbf
            drops it.

    Raises:
        ValueError: a bad count or rate (at construction).
        RuntimeError: on entry, where :func:`available` gives a reason, or
            a step of the set-up failed (its command and error quoted).
    """

    def __init__(self, count: int, *, rate: str | int = "1gbit", burst_nbytes: int | None = None, queue_ms: int = QUEUE_MS) -> None:
        if not isinstance(count, int) or not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"Hosts(count={count!r}): give 1 to {MAX_HOSTS} hosts (one /24 of 198.18.0.0/15)")
        self.count = count
        self.rate_bits = parse_rate(rate)
        self.rate = f"{self.rate_bits}bit"
        self.burst_nbytes = int(burst_nbytes or max(MIN_BURST_NBYTES, self.rate_bits / 8 * BURST_SECONDS))
        self.queue_ms = int(queue_ms)
        run = f"{next(_run_ids)}{os.urandom(2).hex()}"
        self.bridge = f"{NAME_PREFIX}-{os.getpid()}-{run}-br"
        self.names = [f"{NAME_PREFIX}-{os.getpid()}-{run}-h{i}" for i in range(count)]
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    # -- facts -------------------------------------------------------------------------

    def address(self, i: int) -> str:
        """Host ``i``'s address (``198.18.0.<i+1>``)."""
        self._check(i)
        return f"{SUBNET}.{i + 1}"

    def namespace(self, i: int) -> str:
        """The name of host ``i``'s network namespace (for ``ip -n``, ``tc -n``)."""
        self._check(i)
        return self.names[i]

    @property
    def rate_bytes_per_second(self) -> float:
        return self.rate_bits / 8

    # -- processes ---------------------------------------------------------------------

    def run(self, i: int, argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` (``ip netns exec``); ended on exit.

        ``ip netns exec`` execs ``argv`` in place, so the returned process's
        pid is the command's own.
        """
        self._check(i)
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], **popen_kw)
        self._procs.append(proc)
        return proc

    def python(self, i: int, *args: str, env: dict[str, str] | None = None, prefix: Sequence[str] = (), **popen_kw: Any) -> subprocess.Popen:
        """Start this interpreter inside host ``i`` with ``args``
        (``"-c", code`` or a script path and its arguments), under
        ``prefix`` (a command that execs the rest, as ``setpriv ... --``).

        The repo's ``src`` and ``tests`` folders lead ``PYTHONPATH`` (so
        tensorferry and the test helpers import as they do here), and
        output is unbuffered.
        """
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        return self.run(i, [*prefix, sys.executable, *args], env=env, **popen_kw)

    # -- life --------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        reason = available()
        if reason is not None:
            raise RuntimeError(f"cannot make test hosts: {reason}")
        remove_leftovers()
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except RuntimeError:
            if exc_type is None:
                raise
            # The body's error is the one to see; the leftovers are named
            # by the next run's remove_leftovers once this process is gone.

    def _make(self) -> None:
        try:
            # Each name is recorded before it is made, so close() deletes a
            # half-made one too.
            self._made = [self.bridge, *self.names]
            _ip("-batch", "-", input="".join(f"netns add {n}\n" for n in self._made))
            tbf = f"root tbf rate {self.rate} burst {self.burst_nbytes} latency {self.queue_ms}ms"
            # The bridge forwards at once (no STP learning delay); each
            # veth is made with its far end already in its host.
            bridge_cmds = ["link set lo up", "link add br0 type bridge forward_delay 0 stp_state 0", "link set br0 up"]
            for i, host in enumerate(self.names):
                bridge_cmds += [f"link add h{i} type veth peer name eth0 netns {host}", f"link set h{i} master br0", f"link set h{i} up"]
            _ip("-n", self.bridge, "-batch", "-", input="\n".join(bridge_cmds) + "\n")
            _tc("-n", self.bridge, "-batch", "-", input="".join(f"qdisc add dev h{i} {tbf}\n" for i in range(self.count)))
            for i, host in enumerate(self.names):
                _ip("-n", host, "-batch", "-", input=(
                    "link set lo up\n"
                    f"addr add {self.address(i)}/{PREFIX_LEN} dev eth0\n"
                    "link set eth0 up\n"))
                _tc("-n", host, "qdisc", "add", "dev", "eth0", *tbf.split())
        except subprocess.CalledProcessError as exc:
            raise _failed(f"making {self.count} test hosts", exc) from exc

    def close(self) -> None:
        """End this run's processes, delete its namespaces. Idempotent.

        Raises:
            RuntimeError: a namespace could not be deleted (named).
        """
        self._end_processes()
        left = []
        for name in reversed(self._made):
            r = _ip("netns", "delete", name, check=False)
            if r.returncode != 0 and name in namespaces():
                left.append(f"{name} ({r.stderr.strip()})")
        self._made = []
        if left:
            raise RuntimeError(f"test hosts: could not delete namespaces {left}; `ip netns delete NAME` removes them")

    def _end_processes(self) -> None:
        """SIGTERM what we started, SIGKILL what is left after a grace period;
        then anything else still inside our namespaces (children of ours:
        nobody else can enter a namespace of this run)."""
        live = [p for p in self._procs if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self._procs = []
        for name in self._made:
            r = _ip("netns", "pids", name, check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _check(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self.count:
            raise IndexError(f"host {i!r}: this run has hosts 0 to {self.count - 1}")

    def __repr__(self) -> str:
        return f"Hosts({self.count}, rate={self.rate!r}, bridge={self.bridge!r})"
