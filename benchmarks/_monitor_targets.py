"""bench_monitor's target processes (``tests/monitor/fixtures/target.py``:
small, many mappings, large resident sets, torch imported), the per-call
timer every cost is measured with, and the CPU pinning of a victim apart
from its monitor."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "monitor" / "fixtures" / "target.py"


class Target:
    """A benchmark target; ends by closing its stdin, then by its pid."""

    def __init__(self, label: str, *args: str) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGET), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target {label} failed to start")
        self.facts = json.loads(line)
        self.pid = self.proc.pid

    def churn(self, seconds: float) -> dict[str, float]:
        self.proc.stdin.write(f"churn {seconds}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def per_call(fn, *, min_calls: int, max_seconds: float) -> float:
    """Median seconds per call of ``fn`` (each call timed alone)."""
    times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(times) < min_calls or (time.perf_counter() < deadline and len(times) < 20 * min_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_calls and time.perf_counter() > deadline:
            break
    return statistics.median(times)


def pin_apart(victim: Target) -> tuple[set[int], int | None]:
    """The victim on the last CPU, this process (and the monitor threads it
    starts) on the others, so a row measures lock stalls, not the monitor
    taking the victim's core. Returns this process's affinity to restore and
    the victim's CPU (None on one CPU: nothing pinned)."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        return mine, None
    cpu = max(mine)
    os.sched_setaffinity(victim.pid, {cpu})
    os.sched_setaffinity(0, mine - {cpu})
    return mine, cpu
