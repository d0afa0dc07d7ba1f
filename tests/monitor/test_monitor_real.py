"""The sampler against real processes: copy-on-write, /dev/shm, 10k mappings,
vanished, zombie, permission denied, kernel threads; checked against smaps_rollup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from monitor_helpers import as_nobody, kernel_thread_pid, rollup_truth

from tensorferry.errors import AccessDenied, NoSuchProcess, ZombieProcess
from tensorferry.monitor import sample
from tensorferry.monitor._psutil import PsutilBackend

MIB = 1 << 20


def test_forked_child_anon_rss_is_badly_wrong_and_labelled_honestly(start_target) -> None:
    t = start_target("cow", "128")
    child = int(t.facts["child"])
    cheap = sample(child)
    exact = sample(child, exact=True)
    truth = rollup_truth(child)
    # The child's 128 MiB are all shared copy-on-write with its parent: RssAnon
    # (what "RSS - shared" gives) counts them, USS does not.
    assert cheap.anon_bytes >= 120 * MIB
    assert exact.uss_bytes is not None and exact.uss_bytes < 24 * MIB
    assert cheap.anon_bytes > 5 * exact.uss_bytes
    # Honest labels: the cheap sample has no USS at all, the exact one says so.
    assert (cheap.uss_bytes, cheap.uss_source) == (None, "none")
    assert exact.uss_source == "pagemap"
    # The parent's own allocations may break a few shared pages meanwhile.
    assert abs(exact.uss_bytes - (truth["Private_Clean"] + truth["Private_Dirty"])) <= 1 * MIB
    # PSS splits the shared pages between parent and child.
    assert 60 * MIB <= exact.pss_bytes <= 100 * MIB
    assert abs(exact.pss_bytes - truth["Pss"]) <= 2 * MIB


def test_dev_shm_is_shmem_not_anon_and_uss_pss_see_it(start_target) -> None:
    name = f"tensorferry-test-{uuid.uuid4().hex}"
    path = f"/dev/shm/{name}"
    try:
        a = start_target("shm", name, "64")
        only = sample(a.pid, exact=True)
        # A segment one process maps: RSS - shared (anon) leaves all 64 MiB out,
        # USS (private to it) includes them.
        assert only.shmem_bytes >= 63 * MIB
        assert only.anon_bytes < 32 * MIB
        assert only.uss_bytes is not None and only.uss_bytes >= only.anon_bytes + 60 * MIB
        b = start_target("shm", name, "64")
        shared_a = sample(a.pid, exact=True)
        shared_b = sample(b.pid, exact=True)
        # Two mappers: USS drops it (shared), PSS gives each half.
        for s in (shared_a, shared_b):
            assert s.shmem_bytes >= 63 * MIB
            assert s.uss_bytes is not None and s.pss_bytes is not None
            assert s.uss_bytes < only.uss_bytes - 48 * MIB
            assert s.pss_bytes >= 30 * MIB
            assert s.pss_bytes - s.uss_bytes >= 28 * MIB
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert not os.path.exists(path)


def test_ten_thousand_mappings_cheap_and_exact_match_truth(start_target) -> None:
    t = start_target("maps", "10000")
    assert t.facts["mappings"] >= 10000
    cheap = sample(t.pid)
    exact = sample(t.pid, exact=True)
    truth = rollup_truth(t.pid)
    assert abs(exact.uss_bytes - (truth["Private_Clean"] + truth["Private_Dirty"])) <= MIB // 4
    assert exact.exact_cost_seconds is not None and exact.exact_cost_seconds > 0
    # status counters are per-CPU batched: close to, not equal to, the walk.
    assert abs(cheap.rss_bytes - truth["Rss"]) <= max(0.05 * truth["Rss"], 2 * MIB)
    assert abs(cheap.anon_bytes - truth["Anonymous"]) <= max(0.05 * truth["Anonymous"], 2 * MIB)
    # That the cheap sample costs the same at 49 and 50k mappings is measured
    # in benchmarks/bench_monitor.py (section 1), not asserted here.


def test_cheap_matches_truth_for_own_process() -> None:
    s = sample(os.getpid(), exact=True)
    truth = rollup_truth(os.getpid())
    assert abs(s.rss_bytes - truth["Rss"]) <= max(0.05 * truth["Rss"], 2 * MIB)
    assert s.uss_bytes is not None and 0 < s.uss_bytes <= s.rss_bytes
    assert s.pss_bytes is not None and s.uss_bytes <= s.pss_bytes <= s.rss_bytes
    assert s.num_fds is not None and s.num_fds >= 3
    assert s.num_threads >= 1
    assert time.time() - 86400 * 365 < s.create_time <= time.time()


def test_vanished_process_raises_no_such_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pid = proc.pid
    os.kill(pid, signal.SIGKILL)
    proc.wait(10)
    with pytest.raises(NoSuchProcess) as info:
        sample(pid)
    assert info.value.pid == pid
    with pytest.raises(NoSuchProcess):
        sample(pid, exact=True)


def test_real_zombie_raises_zombie_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    break
            time.sleep(0.01)
        with pytest.raises(ZombieProcess) as info:
            sample(proc.pid)
        assert info.value.pid == proc.pid
    finally:
        proc.wait(10)


def test_another_users_process_denies_exact_but_not_cheap() -> None:
    target = os.getpid()

    def unprivileged_sample() -> str:  # of the root-owned parent
        s = sample(target)
        result = f"cheap {s.rss_bytes > 0} {s.num_fds}"
        try:
            sample(target, exact=True)
            result += " exact-allowed"
        except AccessDenied as e:
            result += f" denied {e.pid}"
        return result

    assert as_nobody(unprivileged_sample) == f"cheap True None denied {target}"


def test_real_kernel_thread_has_no_exact_figures() -> None:
    s = sample(kernel_thread_pid(), exact=True)
    assert s.kernel_thread and s.rss_bytes == 0
    assert (s.uss_bytes, s.uss_source) == (None, "none")


def test_psutil_backend_agrees_with_procfs(start_target) -> None:
    t = start_target("big", "64")
    b = PsutilBackend()
    p = b.cheap(t.pid)
    q = sample(t.pid)
    assert p.pid == t.pid and p.ppid == os.getpid()
    assert abs(p.rss_bytes - q.rss_bytes) <= 2 * MIB
    assert p.rss_bytes >= 64 * MIB
    assert p.uss_source == "none"  # on Linux psutil's USS needs the walk
    e = b.exact(t.pid)
    assert e is not None and e.uss_bytes >= 63 * MIB
    assert b.cmdline(t.pid)[-2:] == ("big", "64")
    with pytest.raises(NoSuchProcess):
        b.cheap(2**22 + 12345)
    with pytest.raises(NoSuchProcess):
        b.exact(2**22 + 12345)
