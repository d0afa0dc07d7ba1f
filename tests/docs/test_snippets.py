"""Every python block of README.md and docs/ runs, as a user would run it.

Blocks are read by ``_snippets.py`` (its docstring has the markers). Each
program runs in a fresh folder as a script of its own; a process group's
scripts start together and must all exit 0 (a sender and its receivers).
Blocks that cannot run on this machine say why in their marker, and each
is reported as a skip with that reason; the list of them is pinned below,
so a new one is a decision made in this file, not a silent gap.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _snippets import REPO, Program, all_programs, blocks, pages, programs

# Pages other engineers own carry no markers; their blocks that cannot run
# here are named by (page, first line) with the reason.
FOREIGN = {
    ("docs/vllm.md", "from vllm import LLM"):
        "loads Qwen/Qwen2.5-0.5B into a vLLM engine (a download); tests/vllm_engine/test_offline.py runs the same calls in a real CPU engine",
    ("docs/vllm.md", "from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory"):
        "needs a running vLLM server at 127.0.0.1:8000 and a policy model; tests/vllm_engine/test_server.py runs the same calls against real servers",
    ("docs/vllm.md", "import torch.distributed as dist"):
        "an FSDP2 trainer on several GPUs (nccl) beside a vLLM server; tests/vllm_engine/test_fsdp.py runs it with gloo ranks into a real CPU server",
    ("docs/security.md", "import ssl"):
        "needs certificate files (sender.pem, receiver.pem, host-b.pem, ca.pem and their keys) and hosts at 10.0.0.5 and "
        "10.0.0.6; the TLS tests (tests/transports/test_auth.py, test_relay_tls.py) make their own",
}

# Every block not run here, and why: (page, reason). Changing this set is
# changing what the docs promise is tested.
NOT_RUN = {
    ("docs/guides/rl-weight-sync.md", "needs a CUDA GPU and nixl with an RDMA network; the same sync runs above over shm"),
    ("docs/guides/vllm-cpu.md", "runs in vLLM's CPU build: tests/vllm_engine/test_guide.py runs this page's blocks there"),
    ("docs/guides/vllm-cpu.md", "needs a running vLLM server at 127.0.0.1:8000; tests/vllm_engine/test_server.py runs the same calls against real servers"),
    ("docs/guides/vllm-cpu.md", "needs running vLLM servers at 127.0.0.1:8000 and :8001; tests/vllm_engine/test_server.py runs the same calls against real servers"),
}

TIMEOUT_S = 240
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def _reason(p: Program) -> str:
    if p.reason:
        return p.reason
    first = p.sources[0].strip().splitlines()[0] if p.sources[0].strip() else ""
    return FOREIGN.get((p.page, first), "")


PROGRAMS = all_programs()


@pytest.mark.parametrize("program", [p for p in PROGRAMS if not _reason(p)], ids=lambda p: p.id)
def test_snippet_runs(program: Program, tmp_path: Path) -> None:
    procs, logs = [], []
    for k, source in enumerate(program.sources):
        script = tmp_path / f"snippet_{k}.py"
        script.write_text(source)
        logs.append(tmp_path / f"snippet_{k}.log")
        with logs[-1].open("w") as log:  # a file, not a pipe: nothing blocks on a full pipe
            procs.append(subprocess.Popen([sys.executable, script.name], cwd=tmp_path, env=ENV, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # Until all exit, one fails (the others may wait on it for ever), or time is up.
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    report = "\n".join(f"--- process {k} (exit {c}):\n{log.read_text()[-4000:]}" for k, (c, log) in enumerate(zip(codes, logs)))
    assert codes == [0] * len(procs), f"{program.id} failed:\n{report}"


@pytest.mark.parametrize("program", [p for p in PROGRAMS if _reason(p)], ids=lambda p: p.id)
def test_snippet_not_runnable_here(program: Program) -> None:
    pytest.skip(f"{program.id} is not run here: {_reason(program)}")


def test_the_blocks_not_run_are_the_ones_listed() -> None:
    marked = {(p.page, p.reason) for p in PROGRAMS if p.reason}
    assert marked == NOT_RUN, "a block was marked not-run (or unmarked): update NOT_RUN with the reason"
    foreign = {(p.page, p.sources[0].strip().splitlines()[0]) for p in PROGRAMS
               if not p.reason and _reason(p)}
    # A page being written beside these docs may not be here yet.
    present = {key for key in FOREIGN if (REPO / key[0]).exists()}
    assert foreign == present, "a foreign page's block changed: update FOREIGN"


def test_every_page_has_its_blocks_read(tmp_path: Path) -> None:
    """The reader itself: markers, groups, `continue` and the errors it gives."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n<!-- snippet: continue -->\n```python\nassert x == 1\n```\n"
        "<!-- snippet: process group=pair -->\n```python\na = 1\n```\n"
        "<!-- snippet: process group=pair -->\n```python\nb = 2\n```\n"
        "<!-- snippet: not-run reason=\"needs a GPU\" -->\n```python\nc = 3\n```\n```bash\nls\n```\n"
    )
    import _snippets
    orig = _snippets.REPO
    _snippets.REPO = tmp_path
    try:
        progs = programs(blocks(page))
        assert [(p.sources, p.reason) for p in progs] == [
            (("x = 1\nassert x == 1\n",), ""), (("a = 1\n", "b = 2\n"), ""), (("c = 3\n",), "needs a GPU")]
        page.write_text("<!-- snippet: sometimes -->\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="first word must be one of"):
            blocks(page)
        page.write_text("<!-- snippet: not-run -->\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="needs reason"):
            blocks(page)
        page.write_text("<!-- snippet: process group=alone -->\n```python\nx = 1\n```\n")
        with pytest.raises(ValueError, match="has one block"):
            programs(blocks(page))
    finally:
        _snippets.REPO = orig
    assert len(pages()) > 10 and sum(len(p.sources) for p in PROGRAMS) >= 15
