"""Helpers of the monitor tests (a unique module name: no clash with other conftests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
TARGET = FIXTURES / "target.py"


class Target:
    """A target process started by a test; ended by closing stdin, then by pid."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGET), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"target {args} failed to start (rc {self.proc.returncode})")
        self.facts = json.loads(line)
        self.pid: int = self.proc.pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for pid in [self.facts.get("child"), *self.facts.get("children", [])]:
            if pid:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def rollup_truth(pid: int) -> dict[str, int]:
    """smaps_rollup parsed independently of the code under test: {field: bytes}."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def wait_until(condition: Callable[[], bool], *, timeout_seconds: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_seconds``.

    The timeout only bounds a broken run: a passing one returns as soon as the
    condition holds, however slow or loaded the machine.
    """
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_seconds} s")
        time.sleep(0.005)


def as_nobody(work: Callable[[], str]) -> str:
    """``work()`` run in a forked child that dropped to the user nobody (as
    an unprivileged agent would run), its string result handed back through a
    pipe. Skips unless this process is root. The child has already imported
    everything it needs: it opens no file of the checkout."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to drop to nobody in a child")
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                result = work()
            except BaseException as e:  # the test's assertion shows it
                result = f"the child raised {e!r}"
            os.write(w, result.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        result = f.read()
    os.waitpid(child, 0)
    return result


def kernel_thread_pid() -> int:
    """Pid 2 (kthreadd), after checking it is visible and a kernel thread
    here; skips where a pid namespace hides it."""
    import pytest

    try:
        with open("/proc/2/stat") as f:
            flags = int(f.read().rpartition(")")[2].split()[6])
    except OSError:
        pytest.skip("pid 2 not visible (pid namespace)")
    if not flags & 0x00200000:  # PF_KTHREAD
        pytest.skip("pid 2 is not a kernel thread here (pid namespace)")
    return 2
