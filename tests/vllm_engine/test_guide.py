"""The vLLM-on-CPU guide's runnable blocks, run here in vLLM's CPU build.

``docs/guides/vllm-cpu.md`` marks them not-run for the main docs test (its
environment holds vLLM 0.33's classes, which start no engine); this test
runs each of them as a user would, a script in an empty folder with this
environment's interpreter, and fails on any exit status but 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
from _snippets import REPO, blocks, programs  # noqa: E402

PAGE = REPO / "docs" / "guides" / "vllm-cpu.md"
HERE = "runs in vLLM's CPU build"
RUN = [p for p in programs(blocks(PAGE)) if p.reason.startswith(HERE)]

pytestmark = pytest.mark.timeout(900)


def test_the_guide_has_runnable_blocks() -> None:
    assert RUN, f"{PAGE.name} has no block marked {HERE!r}: the guide's recipe would go untested"


@pytest.mark.parametrize("program", RUN, ids=lambda p: p.id)
def test_guide_block_runs(program, tmp_path: Path) -> None:
    (script,) = program.sources
    (tmp_path / "guide.py").write_text(script)
    proc = subprocess.Popen([sys.executable, "guide.py"], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:  # its engine core and worker are in its session: end them all
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    assert b"round 2:" in out
