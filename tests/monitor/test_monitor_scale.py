"""The agent at node scale: what it keeps between ticks is right (figures as a
one-shot sample gives them, pid reuse, exec, exits, new children), a steady
tick reads one file per process, and /metrics over many processes is valid
and sums. Timing is measured in benchmarks/bench_monitor.py --scale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from monitor_helpers import wait_until
from test_monitor_cheap_reuse import set_stat_field

from tensorferry.monitor import Agent, AgentConfig, Selection, serve_prometheus
from tensorferry.monitor._cli import _snapshot_json
from tensorferry.monitor._names import process_name
from tensorferry.monitor import _procfs, _procfs_many
from tensorferry.monitor._procfs import ProcfsBackend
from tensorferry.monitor._sample import EXACT_FIELDS
from tensorferry.monitor._types import ProcessMemory

# What a later sample of a process that stands still may differ in: when it
# was taken, how old its carried status is, and the exact figures (walked
# on the agent's budget, never by a one-shot cheap sample).
_MOVING = {"timestamp", "status_age_seconds", *EXACT_FIELDS}


class Sleepers:
    """``sleep`` processes whose argv[0] is a tag; ended by pid."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.pids: list[int] = []

    def start(self, n: int) -> list[int]:
        new = [os.posix_spawn("/bin/sleep", [self.tag, "infinity"], os.environ) for _ in range(n)]
        self.pids += new
        return new

    def end(self, pids: list[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.pids.remove(pid)


@pytest.fixture
def sleepers() -> Iterator[Sleepers]:
    s = Sleepers(f"tfsleeper{os.getpid()}x{time.monotonic_ns()}")
    yield s
    s.end(list(s.pids))


def same_figures(a: ProcessMemory, b: ProcessMemory) -> dict[str, tuple[object, object]]:
    """The fields in which ``a`` and ``b`` differ, beyond those that move by nature."""
    return {f: (x, y) for f, x, y in zip(ProcessMemory._fields, a, b) if f not in _MOVING and x != y}


@pytest.mark.parametrize("native", [True, False], ids=["C loop", "Python loop"])
def test_agent_figures_equal_a_one_shot_sample_and_a_steady_tick_reads_only_stat(
    sleepers: Sleepers, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    # The install builds it (a C compiler is on every machine CI runs on):
    # missing, this test fails rather than skips.
    assert not native or _procfs_many._native is not None, (
        "tensorferry.monitor._still was not built: install with a C compiler (pip install -e .)")
    monkeypatch.setattr(ProcfsBackend, "use_native", native)
    pids = sleepers.start(40)
    # Status and command lines are due again after 10 s; a loaded machine may
    # take that long between ticks here, and then reads them as it should.
    monkeypatch.setattr(_procfs, "CMDLINE_REFRESH_SECONDS", 3600.0)
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(exact=False, status_max_age_seconds=3600))
    # A process caught in its exec has no command line yet: matched a tick later.
    wait_until(lambda: len(agent.tick().samples) == len(pids), what="every sleeper selected")
    opened: list[str] = []
    preads: list[int] = []
    real_open, real_pread = os.open, os.pread
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k))
    monkeypatch.setattr(os, "pread", lambda fd, *a: preads.append(fd) or real_pread(fd, *a))
    handed_back: list[list[tuple[int, object]]] = []
    if native:
        real_still = _procfs_many._native.still_many
        monkeypatch.setattr(_procfs_many._native, "still_many",
                            lambda *a: handed_back.append(real_still(*a)) or handed_back[-1])
    mine = tuple(f"/proc/{pid}/" for pid in pids)
    for _ in range(3):
        preads.clear()
        handed_back.clear()
        snap = agent.tick()
        # Idle processes: one pread of each one's stat, no status, no cmdline,
        # none of their files opened (other processes of the machine that
        # start meanwhile have their command lines read, to be matched); and
        # one of /proc/loadavg (is the last listing of /proc still whole?).
        if native:
            # The C loop made the reads; it handed back only processes whose
            # fds are counted this tick (fds_every_ticks), with stat as read.
            assert len(preads) == 1
            (back,) = handed_back
            assert all(raw is not None for _, raw in back) and len(back) <= len(pids) // 10 + 1
        else:
            assert len(preads) == len(pids) + 1
        assert [path for path in opened if path.startswith(mine)] == []
    monkeypatch.undo()
    one_shot = ProcfsBackend(count_fds=True)
    assert sorted(s.pid for s in snap.samples) == sorted(pids)
    for s in snap.samples:
        ref = one_shot.cheap(s.pid)
        assert same_figures(s, ref) == {}, s.pid
        assert s.timestamp >= ref.timestamp - 5 and s.status_age_seconds > 0
    # Ticks later the timestamps move on and the status age grows.
    later = {s.pid: s for s in agent.tick().samples}
    for s in snap.samples:
        assert later[s.pid].timestamp > s.timestamp
        assert later[s.pid].status_age_seconds > s.status_age_seconds


def test_a_moving_process_is_read_again_each_tick(sleepers: Sleepers) -> None:
    grower = subprocess.Popen(
        [sys.executable, "-c", "import sys\nheld = []\nfor line in sys.stdin:\n"
         "    held.append(bytearray(8 << 20))\n    print('ok', flush=True)\n", sleepers.tag],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        agent = Agent(Selection(pids=(grower.pid,)), AgentConfig(exact=False, status_max_age_seconds=3600))
        before = agent.tick().samples[0]
        for step in range(1, 4):
            grower.stdin.write("grow\n")
            grower.stdin.flush()
            assert grower.stdout.readline().strip() == "ok"
            s = agent.tick().samples[0]
            assert s.rss_bytes - before.rss_bytes >= step * 7 << 20
            assert s.status_age_seconds == 0.0  # RSS moved: status read with it
            assert s.anon_bytes + s.file_bytes + s.shmem_bytes == s.rss_bytes
    finally:
        grower.stdin.close()
        grower.wait(10)


def test_exited_processes_leave_and_their_files_close(sleepers: Sleepers) -> None:
    pids = sleepers.start(6)
    b = ProcfsBackend()
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(exact=False), backend=b)
    wait_until(lambda: len(agent.tick().samples) == len(pids), what="every sleeper selected")
    held = len(os.listdir("/proc/self/fd"))
    sleepers.end(pids[:4])
    snap = agent.tick()
    assert sorted(s.pid for s in snap.samples) == sorted(pids[4:])
    assert snap.errors == {"vanished": 0, "zombie": 0, "denied": 0}  # gone from /proc: not selected at all
    # stat and status of each of the 4 closed.
    assert held - len(os.listdir("/proc/self/fd")) == 8
    new = sleepers.start(2)
    expected = sorted(pids[4:] + new)
    wait_until(lambda: sorted(s.pid for s in agent.tick().samples) == expected, what="the new sleepers joining")


def test_exec_changes_the_command_line_and_the_match_at_the_next_tick(tmp_path: Path) -> None:
    before_tag, after_tag = f"tfexecA{os.getpid()}", f"tfexecB{os.getpid()}"
    code = ("import os, sys\nsys.stdin.readline()\n"
            f"os.execv('/bin/sleep', [{after_tag!r}, 'infinity'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code, before_tag], stdin=subprocess.PIPE)
    try:
        # Until Popen's exec of Python, the child's command line is this test's.
        wait_until(lambda: before_tag.encode() in open(f"/proc/{proc.pid}/cmdline", "rb").read(),
                   what="the child's start")
        # A long refresh: only the exec may make the agent read the command line again.
        old_match = Agent(Selection(pattern=before_tag), AgentConfig(exact=False, rescan_seconds=3600))
        by_pid = Agent(Selection(pids=(proc.pid,)), AgentConfig(exact=False))
        assert [s.pid for s in old_match.tick().samples] == [proc.pid]
        assert by_pid.tick().samples[0].cmdline[-1] == before_tag
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        wait_until(lambda: open(f"/proc/{proc.pid}/cmdline", "rb").read().startswith(after_tag.encode()),
                   what="the exec")
        s = by_pid.tick().samples[0]
        assert s.cmdline == (after_tag, "infinity") and s.name == "sleep"
        assert process_name(s) == after_tag
        # Matched before the exec, not after: it leaves the selection at the tick that sees the exec.
        assert proc.pid not in {s.pid for s in old_match.tick().samples}
        assert proc.pid not in old_match.select()
        # A selection by the new command line finds it (a miss is matched again every rescan_seconds).
        new_match = Agent(Selection(pattern=after_tag), AgentConfig(exact=False))
        assert [s.pid for s in new_match.tick().samples] == [proc.pid]
    finally:
        proc.kill()
        proc.wait(10)


def test_a_reused_pid_is_matched_again_at_once(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree), keep_open=False, carry_status=True)
    agent = Agent(Selection(pattern=r"train\.py"), AgentConfig(exact=False, rescan_seconds=3600), backend=b)
    assert [s.pid for s in agent.tick().samples] == [100]
    assert [s.pid for s in agent.tick().samples] == [100]
    # pid 100 ends and another process gets it between two ticks: another
    # start time and command line, the same listing.
    set_stat_field(proc_tree, 100, 22, 5000)
    (proc_tree / "100" / "cmdline").write_bytes(b"python\0serve.py\0")
    assert agent.tick().samples == ()
    assert agent.select() == []
    # And back: a process matching again under the pid is selected at the next scan.
    set_stat_field(proc_tree, 100, 22, 6000)
    (proc_tree / "100" / "cmdline").write_bytes(b"python\0train.py\0")
    by_pid = Agent(Selection(pids=(100,)), AgentConfig(exact=False), backend=b)
    assert by_pid.tick().samples[0].cmdline == ("python", "train.py")


def test_a_reused_pid_is_never_handed_the_old_sample(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree), keep_open=False, carry_status=True)
    first, _ = b.cheap_many([100])
    again, _ = b.cheap_many([100])
    assert same_figures(first[0], again[0]) == {}
    set_stat_field(proc_tree, 100, 22, 5000)  # same pid, another start time
    (proc_tree / "100" / "cmdline").write_bytes(b"python\0serve.py\0")
    reused, errors = b.cheap_many([100])
    assert errors == {"vanished": 0, "zombie": 0, "denied": 0}
    assert reused[0].create_time != first[0].create_time
    assert reused[0].cmdline == ("python", "serve.py") and reused[0].status_age_seconds == 0.0


def test_new_children_join_the_tree_at_the_next_tick() -> None:
    code = ("import os, sys\nkids = []\nfor line in sys.stdin:\n"
            "    kids.append(os.posix_spawn('/bin/sleep', ['sleep', 'infinity'], os.environ))\n"
            "    print(kids[-1], flush=True)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        agent = Agent(Selection(tree_root_pid=parent.pid), AgentConfig(exact=False))
        assert [s.pid for s in agent.tick().samples] == [parent.pid]
        for _ in range(3):
            parent.stdin.write("spawn\n")
            parent.stdin.flush()
            kids.append(int(parent.stdout.readline()))
            assert sorted(s.pid for s in agent.tick().samples) == sorted([parent.pid, *kids])
        os.kill(kids[0], signal.SIGKILL)
        wait_until(lambda: kids[0] not in {s.pid for s in agent.tick().samples}, what="the killed child leaving")
    finally:
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.stdin.close()
        parent.wait(10)


def test_names_are_cached_per_command_line_comm_source_and_length() -> None:
    base = ProcessMemory(1, 0, "python3", ("python3", "-m", "vllm.entrypoints.api_server"), 0.0, 0.0,
                         0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 1, None)
    assert process_name(base) == "vllm.entrypoints.api_server"
    assert process_name(base, max_chars=4) == "vllm"
    assert process_name(base, names="comm") == "python3"
    assert process_name(base._replace(cmdline=("python3", "train.py"))) == "train.py"
    assert process_name(base._replace(cmdline=(), name="kworker")) == "kworker"


def test_json_lines_hold_what_the_records_hold(sleepers: Sleepers) -> None:
    sleepers.start(3)
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "))
    wait_until(lambda: len(agent.tick().samples) == 3, what="every sleeper selected")
    snap = agent.latest
    doc = json.loads(_snapshot_json(snap))
    assert len(doc["processes"]) == 3
    for row, s in zip(doc["processes"], snap.samples):
        expected = {**s._asdict(), "cmdline": list(s.cmdline), "group": snap.name_of(s)}
        assert row == expected
    assert doc["groups"] == [g._asdict() for g in snap.groups]
    assert doc["monitor"] == json.loads(json.dumps(snap.stats._asdict()))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def test_metrics_over_hundreds_of_processes_parse_and_sum_to_the_groups(sleepers: Sleepers) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    pids = sleepers.start(300)
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(exact=False))
    wait_until(lambda: len(agent.tick().samples) == len(pids), what="every sleeper selected")
    with serve_prometheus(agent, port=0, labels="process") as per_process, serve_prometheus(agent, port=0) as grouped:
        by_pid = list(text_string_to_metric_families(_scrape(per_process.url)))
        by_group = list(text_string_to_metric_families(_scrape(grouped.url)))
    resident = {f.name: f for f in by_pid}["tensorferry_process_resident_bytes"]
    seen = {(s.labels["pid"], s.labels["kind"]) for s in resident.samples}
    assert len(seen) == len(resident.samples) == 3 * len(pids)  # each pid once per kind
    assert {int(p) for p, _ in seen} == set(pids)
    sums: dict[tuple[str, str], float] = {}
    for s in resident.samples:
        sums[(s.labels["name"], s.labels["kind"])] = sums.get((s.labels["name"], s.labels["kind"]), 0.0) + s.value
    groups = {f.name: f for f in by_group}
    group_resident = {(s.labels["name"], s.labels["kind"]): s.value
                      for s in groups["tensorferry_process_resident_bytes"].samples}
    assert sums == group_resident == {(sleepers.tag, k): pytest.approx(v) for (_, k), v in sums.items()}
    count = {s.labels["name"]: s.value for s in groups["tensorferry_processes"].samples}
    assert count == {sleepers.tag: len(pids)}


def test_fast_exposition_writes_the_bytes_prometheus_client_writes(sleepers: Sleepers) -> None:
    from functools import partial

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.openmetrics import exposition as om

    from tensorferry.monitor import register_pool_source, unregister_pool_source
    from tensorferry.monitor._exposition import Exposition, fast_format
    from tensorferry.monitor._prometheus import MonitorCollector

    sleepers.start(20)
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(cgroups=True))
    wait_until(lambda: len(agent.tick().samples) == 20, what="every sleeper selected")
    agent.tick()
    # Label values that need escaping, and text that is not ASCII.
    odd = 'w"ei\\ghts\nü'
    register_pool_source(odd, lambda: {"capacity_nbytes": 1 << 30, "used_nbytes": 5, "largest_free_nbytes": 7,
                                       "transfers": 3, "bytes_moved": 1 << 40}, role="sender")
    try:
        for labels in ("group", "process"):
            registry = CollectorRegistry(auto_describe=False)
            registry.register(MonitorCollector(agent, labels=labels))
            fast = Exposition()
            for _ in range(2):  # the second from the label text kept
                assert fast.render(registry, "text") == generate_latest(registry)
                assert fast.render(registry, "openmetrics") == om.generate_latest(registry)
            # What Prometheus 3 and 2 ask for, and what curl gets.
            for accept in ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
                           "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
                           "application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                           "*/*"):
                encoder, _ = choose_encoder(accept)
                fmt = fast_format(encoder)
                assert fmt is not None
                assert fast.render(registry, fmt) == encoder(registry)
    finally:
        unregister_pool_source(odd)
    # Formats it does not write are left to prometheus_client.
    assert fast_format(partial(om.generate_latest, escaping="dots", version="1.0.0")) is None
    assert fast_format(partial(generate_latest, escaping="values")) is None


def test_metrics_endpoint_answers_openmetrics_and_gzip_as_prometheus_asks(sleepers: Sleepers) -> None:
    import gzip

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    pids = sleepers.start(50)
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(exact=False))
    wait_until(lambda: len(agent.tick().samples) == len(pids), what="every sleeper selected")
    with serve_prometheus(agent, port=0, labels="process") as server:
        req = urllib.request.Request(server.url, headers={
            "Accept": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,*/*;q=0.2",
            "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.headers["Content-Encoding"] == "gzip"
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
            body = gzip.decompress(resp.read()).decode()
    assert body.endswith("# EOF\n")
    threads = {f.name: f for f in om_families(body)}["tensorferry_process_threads"]
    assert sorted(int(s.labels["pid"]) for s in threads.samples) == sorted(pids)
    assert all(s.value == 1 for s in threads.samples)  # sleep has one thread
