"""The examples under examples/ run as a user runs them: a fresh interpreter
on the script, its output checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_weight_sync_plans_keeps_both_workers_equal_to_the_trainer(transport):
    """Three syncs from a trainer process to two worker processes (the
    README's plans snippet with readers=2): after every sync each worker's
    weights hash to the trainer's, which they did not before the first."""
    steps = 3
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "weight_sync_plans.py"), "--transport", transport, "--steps", str(steps), "--json"],
        capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    trainer = report["trainer"]
    assert report["transport"] == transport
    assert len(trainer) == steps and len(set(trainer)) == steps  # every step changed the weights
    assert report["workers"] == [trainer, trainer]
    assert trainer[0] not in report["workers_before"]
    assert len(set(report["workers_before"])) == 2
    assert report["exit_codes"] == [0, 0]
