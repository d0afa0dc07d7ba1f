"""The /proc reader against fixture trees: figures, kernel threads, zombies, gaps."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tensorferry.monitor as monitor
from tensorferry.errors import AccessDenied, MonitorError, NoSuchProcess, TensorferryError, ZombieProcess
from tensorferry.monitor import sample
from tensorferry.monitor._procfs import ProcfsBackend

KIB = 1024
MIB = 1 << 20


def test_public_api_is_exactly_all() -> None:
    assert sorted(monitor.__all__) == sorted(
        [
            "Agent", "AgentConfig", "AgentStats", "CgroupMemory", "ExactMemory", "GroupMemory",
            "MonitorCollector", "PoolFigures", "ProcessMemory", "PrometheusServer", "Selection",
            "Snapshot", "UssSource", "build_table", "group_samples", "register_pool_source",
            "run_top", "sample", "serve_prometheus", "unregister_pool_source",
        ]
    )
    for name in monitor.__all__:
        assert getattr(monitor, name) is not None


def test_import_does_not_load_torch_prometheus_or_rich() -> None:
    code = (
        "import sys, tensorferry.monitor as m, os;"
        "m.sample(os.getpid(), exact=True);"
        "bad = [k for k in sys.modules if k.split('.')[0] in ('torch', 'prometheus_client', 'rich')];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"monitor import pulled in {out.stdout.strip()}"


def test_cheap_figures_from_fixture(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    s = b.cheap(100)
    assert (s.pid, s.ppid, s.name) == (100, 1, "trainer")
    assert s.cmdline == ("python", "train.py", "--epochs", "3")
    assert s.rss_bytes == 102400 * KIB
    assert (s.anon_bytes, s.file_bytes, s.shmem_bytes) == (61440 * KIB, 30720 * KIB, 10240 * KIB)
    assert s.anon_bytes + s.file_bytes + s.shmem_bytes == s.rss_bytes
    assert s.swap_bytes == 2048 * KIB
    assert s.peak_rss_bytes == 204800 * KIB
    assert s.vms_bytes == 2097152 * KIB
    assert s.page_table_bytes == 400 * KIB
    tick = os.sysconf("SC_CLK_TCK")
    assert s.cpu_user_seconds == pytest.approx(250 / tick)
    assert s.cpu_system_seconds == pytest.approx(50 / tick)
    assert s.create_time == pytest.approx(1700000000 + 1000 / tick)
    assert (s.num_threads, s.num_fds) == (4, 3)
    # Cheap samples never claim a USS.
    assert (s.uss_bytes, s.pss_bytes, s.uss_source, s.exact_age_seconds) == (None, None, "none", None)


def test_exact_figures_from_fixture_rollup(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    e = b.exact(100)
    assert e is not None
    assert e.uss_bytes == (10240 + 40960) * KIB  # Private_Clean + Private_Dirty
    assert e.pss_bytes == 81920 * KIB
    assert e.swap_pss_bytes == 1024 * KIB
    assert e.cost_seconds >= 0
    s = sample(100, exact=True, backend=b)
    assert s.uss_source == "smaps_rollup"
    assert (s.uss_bytes, s.pss_bytes) == (e.uss_bytes, e.pss_bytes)
    assert s.exact_age_seconds == 0.0
    # anon (RSS - shared) and USS are different figures, each labelled as what it is.
    assert s.anon_bytes != s.uss_bytes


def test_kernel_thread_has_no_user_memory(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    s = sample(2, exact=True, backend=b)
    assert s.kernel_thread
    assert s.name == "kthreadd"
    assert s.rss_bytes == s.anon_bytes == s.vms_bytes == 0
    assert s.cmdline == ()
    assert (s.uss_bytes, s.uss_source) == (None, "none")
    assert b.exact(2) is None


def test_zombie_raises_zombie_process(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    with pytest.raises(ZombieProcess) as info:
        b.cheap(300)
    err = info.value
    assert (err.pid, err.name) == (300, "worker")
    assert "zombie" in str(err) and "300" in str(err)
    assert isinstance(err, NoSuchProcess) and isinstance(err, TensorferryError)


def test_missing_process_raises_no_such_process(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    with pytest.raises(NoSuchProcess) as info:
        b.cheap(99999)
    assert info.value.pid == 99999
    assert isinstance(info.value, ProcessLookupError)
    with pytest.raises(NoSuchProcess):
        b.exact(99999)


def test_missing_status_fields_default_with_one_warning(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = b.cheap(400)
        second = b.cheap(400)
    status_warnings = [w for w in caught if "status has no" in str(w.message)]
    assert len(status_warnings) == 1, [str(w.message) for w in caught]
    msg = str(status_warnings[0].message)
    assert "RssAnon" in msg and "reporting 0" in msg
    # statm still gives the figures: resident 5120 pages, shared 1024 pages.
    page = os.sysconf("SC_PAGE_SIZE")
    assert first == second._replace(timestamp=first.timestamp)
    assert first.rss_bytes == 20480 * KIB
    assert first.anon_bytes == (5120 - 1024) * page
    assert first.file_bytes == 1024 * page
    assert (first.shmem_bytes, first.swap_bytes) == (0, 0)


def test_missing_rollup_means_no_exact_figures_and_one_warning(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    with pytest.warns(RuntimeWarning, match="smaps_rollup does not exist"):
        assert b.exact(400) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert b.exact(400) is None  # warned once only
    with pytest.warns(RuntimeWarning, match="no Pss line"):
        assert b.exact(600) is None


def test_errors_are_monitor_errors_with_pid() -> None:
    for cls in (NoSuchProcess, ZombieProcess, AccessDenied):
        err = cls(42, "w")
        assert isinstance(err, MonitorError) and err.pid == 42 and "pid 42 (w)" in str(err)
    assert isinstance(AccessDenied(1), PermissionError)


def test_boot_time_missing_warns_and_counts_from_zero(proc_tree: Path) -> None:
    (proc_tree / "stat").write_text("cpu 0 0 0\n")
    b = ProcfsBackend(str(proc_tree))
    with pytest.warns(RuntimeWarning, match="no btime"):
        s = b.cheap(100)
    assert s.create_time == pytest.approx(1000 / os.sysconf("SC_CLK_TCK"))


def test_pid_listing_ignores_non_pid_entries(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    assert sorted(b.pids()) == [2, 100, 300, 400, 500, 600]
    assert b.ppid(500) == 100
