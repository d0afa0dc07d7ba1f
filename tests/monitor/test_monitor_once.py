"""One-shot views (``top --once``, ``top --json``) in real processes: they wait
for the exact walk within ``--exact-wait``, say why a figure is missing, and
print whole values into a pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from monitor_helpers import rollup_truth
from test_monitor_cli import RUN_CLI

# A budget and stall limit so small that one tick's bucket (1 ms of walking)
# ends inside the walk of the 512 MiB target (131k pages): what a busy
# machine did to the default bucket and a 1.1 GiB process.
_STARVED = ["--max-stall", "0.001", "--budget", "0.0001"]
_TARGET_MIB = 512


def _top(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-c", RUN_CLI, "top", *argv], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return proc


def test_json_waits_for_the_walk_one_tick_leaves_unfinished(start_target) -> None:  # type: ignore[no-untyped-def]
    t = start_target("big", str(_TARGET_MIB))
    one_tick = json.loads(_top("--json", "-p", str(t.pid), *_STARVED, "--exact-wait", "0").stdout)
    (proc,) = one_tick["processes"]
    assert proc["uss_bytes"] is None and one_tick["monitor"]["walks_in_progress"] == 1
    (missing,) = one_tick["exact_missing"]
    assert missing["pid"] == t.pid and "did not finish within --exact-wait 0 s" in missing["reason"]

    waited = json.loads(_top("--json", "-p", str(t.pid), *_STARVED, "--exact-wait", "60").stdout)
    (proc,) = waited["processes"]
    truth = rollup_truth(t.pid)
    private = truth["Private_Clean"] + truth["Private_Dirty"]
    assert proc["uss_source"] == "pagemap" and waited["exact_missing"] == []
    assert abs(proc["uss_bytes"] - private) <= private // 100, (proc["uss_bytes"], private)
    assert waited["monitor"]["ticks"] >= 1 and waited["monitor"]["walks_in_progress"] == 0


def test_once_names_what_is_missing_and_prints_whole_values_into_a_pipe(start_target) -> None:  # type: ignore[no-untyped-def]
    t = start_target("big", str(_TARGET_MIB))
    # COLUMNS=40: rich's width for a pipe; the table needs about 75.
    out = _top("--once", "-p", str(t.pid), *_STARVED, "--exact-wait", "0", env={"COLUMNS": "40"}).stdout
    assert "…" not in out, out
    row = next(line for line in out.splitlines() if line.split()[:1] == [str(t.pid)])
    cells = row.split()  # PID NAME RSS ANON FILE SHMEM SWAP USS PSS AGE THR CPU: none cut, none dropped
    assert len(cells) == 12 and cells[1] == "target.py" and cells[2] in (f"{_TARGET_MIB + d}M" for d in range(40)), row
    assert f"USS/PSS missing for 1 process (pid {t.pid}): its walk did not finish within --exact-wait 0 s" in out
