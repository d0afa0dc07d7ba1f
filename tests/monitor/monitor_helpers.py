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
