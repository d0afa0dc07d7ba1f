"""Reading the workers' answers: one JSON line per fact on their stdout."""

from __future__ import annotations

import json
import select
import subprocess


def next_fact(proc: subprocess.Popen, timeout: float, who: str) -> dict:
    """The next JSON line ``proc`` prints; fails with its stderr if it ends
    or says nothing within ``timeout`` seconds (then it is killed)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        if proc.poll() is None:
            proc.kill()
        raise AssertionError(f"{who} said nothing within {timeout} s (exit {proc.wait()}): {proc.stderr.read()}")
    return json.loads(line)
