"""The agent's cheap path: held-open stat/status, status carried while stat stands still."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorferry.errors import ConfigurationError, NoSuchProcess
from tensorferry.monitor import Agent, AgentConfig, Selection
from tensorferry.monitor._procfs import ProcfsBackend
from tensorferry.monitor._sample import EXACT_FIELDS, with_exact
from tensorferry.monitor._status import parse_status_kb, status_block_figures
from tensorferry.monitor._types import ExactMemory, ProcessMemory

KIB = 1024
MIB = 1 << 20

# A child that grows its anonymous memory by N MiB on "grow N" and answers "ok".
GROWER = r"""
import mmap, sys
held = []
print("ready", flush=True)
for line in sys.stdin:
    n = int(line.split()[1]) << 20
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for off in range(0, n, 4096):
        m[off] = 1
    held.append(m)
    print("ok", flush=True)
"""


def edit(path: Path, pattern: str, repl: str) -> None:
    text = path.read_text()
    new = re.sub(pattern, repl, text, count=1)
    assert new != text, (path, pattern)
    path.write_text(new)


def set_stat_field(root: Path, pid: int, field: int, value: int) -> None:
    """Field ``field`` of proc(5) numbering (3 = state) in PID/stat."""
    stat = root / str(pid) / "stat"
    head, _, rest = stat.read_text().rpartition(")")
    f = rest.split()
    f[field - 3] = str(value)
    stat.write_text(head + ") " + " ".join(f) + "\n")


def fixture_backend(root: Path) -> ProcfsBackend:
    # Fixture files obey the kernel's invariant only as far as a test keeps it.
    return ProcfsBackend(str(root), keep_open=False, carry_status=True)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_defaults_hold_nothing_for_a_fixture_tree_and_reuse_on_the_kernels(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    assert (b.keep_open, b.carry_status) == (False, False)
    real = ProcfsBackend()
    assert (real.keep_open, real.carry_status) == (True, True)


def test_status_carried_while_stat_stands_still_and_reread_when_rss_moves(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    first = b.cheap_reusing(100)
    assert first.status_age_seconds == 0.0
    assert first.anon_bytes == 61440 * KIB
    # status changes but stat's RSS and vsize do not: the split carries over, and says so.
    edit(proc_tree / "100" / "status", r"RssAnon:\s+\d+", "RssAnon:\t70000")
    carried = b.cheap_reusing(100)
    assert carried.anon_bytes == 61440 * KIB
    assert carried.status_age_seconds > 0.0
    assert carried.rss_bytes == first.rss_bytes and carried.timestamp >= first.timestamp
    # stat's RSS moves (as it does on a kernel whenever VmRSS does): status is read again.
    set_stat_field(proc_tree, 100, 24, 25601)
    fresh = b.cheap_reusing(100)
    assert fresh.status_age_seconds == 0.0
    assert fresh.anon_bytes == 70000 * KIB


def test_status_reread_when_vsize_moves_or_too_old_or_age_zero(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    b.cheap_reusing(100)
    edit(proc_tree / "100" / "status", r"VmSwap:\s+\d+", "VmSwap:\t4096")
    assert b.cheap_reusing(100).swap_bytes == 2048 * KIB  # carried
    set_stat_field(proc_tree, 100, 23, 2147483648 + 4096)
    assert b.cheap_reusing(100).swap_bytes == 4096 * KIB  # vsize moved
    edit(proc_tree / "100" / "status", r"VmSwap:\s+\d+", "VmSwap:\t8192")
    assert b.cheap_reusing(100, max_status_age_seconds=0).swap_bytes == 8192 * KIB
    edit(proc_tree / "100" / "status", r"VmSwap:\s+\d+", "VmSwap:\t1024")
    time.sleep(0.02)
    s = b.cheap_reusing(100, max_status_age_seconds=0.01)
    assert (s.swap_bytes, s.status_age_seconds) == (1024 * KIB, 0.0)
    with pytest.raises(ConfigurationError, match=r"cheap_reusing\(max_status_age_seconds=-1\)"):
        b.cheap_reusing(100, max_status_age_seconds=-1)


def test_a_new_process_under_the_same_pid_is_never_carried_over(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    b.cheap_reusing(100)
    edit(proc_tree / "100" / "status", r"RssShmem:\s+\d+", "RssShmem:\t5")
    set_stat_field(proc_tree, 100, 22, 2000)  # another start time: pid reused
    s = b.cheap_reusing(100)
    assert (s.shmem_bytes, s.status_age_seconds) == (5 * KIB, 0.0)


def test_plain_cheap_never_carries_and_carry_off_always_reads(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    b.cheap_reusing(100)
    edit(proc_tree / "100" / "status", r"RssAnon:\s+\d+", "RssAnon:\t1")
    assert b.cheap(100).anon_bytes == 1 * KIB
    off = ProcfsBackend(str(proc_tree))  # fixture default: no carry
    off.cheap_reusing(100)
    edit(proc_tree / "100" / "status", r"RssAnon:\s+\d+", "RssAnon:\t2")
    assert off.cheap_reusing(100).anon_bytes == 2 * KIB


def test_fd_count_carried_between_counts_and_forgotten_by_retain(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    assert b.cheap_reusing(100, count_fds=True).num_fds == 3
    (proc_tree / "100" / "fd" / "3").write_text("")
    assert b.cheap_reusing(100, count_fds=False).num_fds == 3  # the last count
    assert b.cheap_reusing(100, count_fds=True).num_fds == 4
    b.retain({500})
    assert b.cheap_reusing(100, count_fds=False).num_fds is None


def test_with_exact_replaces_five_fields_in_a_row() -> None:
    # with_exact() slices the tuple around these fields; ProcessMemory must keep them together.
    start = ProcessMemory._fields.index(EXACT_FIELDS[0])
    assert ProcessMemory._fields[start:start + len(EXACT_FIELDS)] == EXACT_FIELDS
    assert EXACT_FIELDS == ("uss_bytes", "pss_bytes", "uss_source", "exact_age_seconds", "exact_cost_seconds")


def test_with_exact_keeps_the_status_age(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    b.cheap_reusing(100)
    s = b.cheap_reusing(100)
    e = with_exact(s, ExactMemory(1, 2, 0, 0.001), 3.0)
    assert (e.uss_bytes, e.pss_bytes, e.uss_source, e.exact_age_seconds) == (1, 2, "smaps_rollup", 3.0)
    assert e.status_age_seconds == s.status_age_seconds > 0
    assert e._replace(uss_bytes=None, pss_bytes=None, uss_source="none",
                      exact_age_seconds=None, exact_cost_seconds=None) == s


def test_agent_refreshes_when_the_fixture_rss_moves(proc_tree: Path) -> None:
    b = fixture_backend(proc_tree)
    agent = Agent(Selection(pids=(100,)), AgentConfig(exact=False), backend=b)
    assert agent.tick().samples[0].status_age_seconds == 0.0
    edit(proc_tree / "100" / "status", r"RssFile:\s+\d+", "RssFile:\t1000")
    s = agent.tick().samples[0]
    assert s.file_bytes == 30720 * KIB and s.status_age_seconds > 0
    set_stat_field(proc_tree, 100, 24, 26000)
    s = agent.tick().samples[0]
    assert s.file_bytes == 1000 * KIB and s.status_age_seconds == 0.0
    # status_max_age_seconds=0: every tick reads status.
    every = Agent(Selection(pids=(100,)), AgentConfig(exact=False, status_max_age_seconds=0),
                  backend=fixture_backend(proc_tree))
    every.tick()
    edit(proc_tree / "100" / "status", r"RssFile:\s+\d+", "RssFile:\t2000")
    assert every.tick().samples[0].file_bytes == 2000 * KIB
    with pytest.raises(ConfigurationError, match=r"AgentConfig\(status_max_age_seconds=-1\)"):
        AgentConfig(status_max_age_seconds=-1)


def test_fast_status_parse_matches_the_line_parse_on_real_processes() -> None:
    for pid in (os.getpid(), os.getppid()):
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
        fast = status_block_figures(status)
        assert fast is not None, "this kernel's status layout is not the one the fast path knows"
        kb = parse_status_kb(status)
        want = tuple(int(kb[k]) << 10 for k in (
            b"VmRSS:", b"RssAnon:", b"RssFile:", b"RssShmem:", b"VmSwap:", b"VmHWM:", b"VmSize:", b"VmPTE:"))
        assert fast == want


def test_real_kernel_fd_count_matches_listdir() -> None:
    b = ProcfsBackend(count_fds=True)
    r, w = os.pipe()
    try:
        s = b.cheap(os.getpid())
        # listdir's own directory fd shows up in its listing.
        assert s.num_fds == len(os.listdir("/proc/self/fd")) - 1
    finally:
        os.close(r)
        os.close(w)


def test_real_grower_is_refreshed_when_its_rss_moves() -> None:
    proc = subprocess.Popen([sys.executable, "-c", GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        b = ProcfsBackend()
        agent = Agent(Selection(pids=(proc.pid,)), AgentConfig(exact=False, status_max_age_seconds=3600), backend=b)
        before = agent.tick().samples[0]
        idle = agent.tick().samples[0]
        # Nothing moved: status carried (the interpreter is idle on stdin).
        if idle.rss_bytes == before.rss_bytes and idle.vms_bytes == before.vms_bytes:
            assert idle.status_age_seconds > 0 and idle.anon_bytes == before.anon_bytes
        proc.stdin.write("grow 32\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        after = agent.tick().samples[0]
        assert after.status_age_seconds == 0.0
        assert after.anon_bytes - before.anon_bytes >= 30 * MIB
        assert after.rss_bytes - before.rss_bytes >= 30 * MIB
        assert after.anon_bytes + after.file_bytes + after.shmem_bytes == after.rss_bytes
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_held_files_close_when_the_process_goes_and_on_retain_and_stop() -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
             for _ in range(2)]
    try:
        b = ProcfsBackend()
        time.sleep(0.2)
        b.cheap(os.getpid())  # the fd-count probe and boot time, outside the count
        baseline = open_fds()
        for p in procs:
            b.cheap_reusing(p.pid)
        assert len(open_fds() - baseline) == 4  # stat + status per process
        b.retain({procs[0].pid})
        assert len(open_fds() - baseline) == 2
        procs[0].stdin.close()
        procs[0].wait(10)
        with pytest.raises(NoSuchProcess):
            b.cheap_reusing(procs[0].pid)
        baseline -= {str(procs[0].stdin.fileno() if not procs[0].stdin.closed else -1)}
        assert open_fds() <= baseline
        baseline = open_fds()
        agent = Agent(Selection(pids=(procs[1].pid,)), AgentConfig(exact=False), backend=b)
        agent.tick()
        assert len(open_fds() - baseline) == 2
        agent.stop()
        assert open_fds() == baseline
        assert agent.tick().samples[0].pid == procs[1].pid  # reopens
        b.close()
        assert open_fds() == baseline
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(10)


def test_open_file_cap_falls_back_to_open_read_close() -> None:
    baseline = open_fds()
    b = ProcfsBackend()
    b.max_open_processes = 0
    s = b.cheap_reusing(os.getpid())
    assert s.pid == os.getpid() and s.rss_bytes > 0
    assert open_fds() == baseline
