"""The agent: selection, the exact-read budget (deterministic: injected clock
and cost over fixture /proc trees), stall limit, ages, grouping, cgroups."""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import time
from pathlib import Path

import pytest
from monitor_helpers import FIXTURES, as_nobody, wait_until

from tensorferry.errors import ConfigurationError
from tensorferry.monitor import Agent, AgentConfig, Selection, group_samples, sample
from tensorferry.monitor._cgroup import CgroupReader
from tensorferry.monitor._group import group_key
from tensorferry.monitor._procfs import ProcfsBackend
from tensorferry.monitor._types import ExactMemory

MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostBackend(ProcfsBackend):
    """Reads a fixture tree; each smaps_rollup read 'costs' what the test says."""

    def __init__(self, root: Path, cost_seconds: dict[int, float]) -> None:
        super().__init__(str(root))
        self.cost_seconds = cost_seconds
        self.reads: list[int] = []

    def exact(self, pid: int) -> ExactMemory | None:
        e = super().exact(pid)
        self.reads.append(pid)
        return None if e is None else e._replace(cost_seconds=self.cost_seconds.get(pid, 0.001))


def set_rss_kib(root: Path, pid: int, rss_kib: int) -> None:
    status = root / str(pid) / "status"
    text = status.read_text()
    text = re.sub(r"VmRSS:\s+\d+ kB", f"VmRSS:\t{rss_kib} kB", text)
    status.write_text(text)
    # The kernel moves stat's rss (field 24, in 4 KiB pages) with it; the
    # agent reads status again only when stat shows the change.
    stat = root / str(pid) / "stat"
    head, _, tail = stat.read_text().rpartition(")")
    fields = tail.split()
    fields[21] = str(rss_kib // 4)
    stat.write_text(head + ") " + " ".join(fields) + "\n")


def many_process_tree(tmp_path: Path, n: int) -> Path:
    root = tmp_path / "many"
    root.mkdir()
    shutil.copy(FIXTURES / "proc" / "stat", root / "stat")
    for i in range(n):
        pid = 1000 + i
        shutil.copytree(FIXTURES / "proc" / "100", root / str(pid))
        stat = (root / str(pid) / "stat").read_text().replace("100 (trainer)", f"{pid} (trainer)", 1)
        (root / str(pid) / "stat").write_text(stat)
    return root


def test_reread_no_more_often_than_cost_over_budget(proc_tree: Path) -> None:
    clock = FakeClock()
    backend = CostBackend(proc_tree, {100: 0.005})
    agent = Agent(Selection(pids=(100,)), AgentConfig(cpu_budget_fraction=0.001), backend=backend, clock=clock)
    read_times = []
    for second in range(21):
        clock.now = float(second)
        before = len(backend.reads)
        snap = agent.tick()
        if len(backend.reads) > before:
            read_times.append(second)
        s = snap.samples[0]
        assert s.uss_source == "smaps_rollup"
        # The age is measured on the agent's clock since the last read.
        assert s.exact_age_seconds == pytest.approx(second - read_times[-1])
    # 5 ms per read at 0.1% of a core: one read per 5 s.
    assert read_times == [0, 5, 10, 15, 20]
    st = agent.stats()
    assert st.exact_reads == 5 and st.exact_seconds == pytest.approx(0.025)


def test_rss_move_over_ten_percent_rereads_sooner(proc_tree: Path) -> None:
    clock = FakeClock()
    backend = CostBackend(proc_tree, {100: 0.005})
    agent = Agent(Selection(pids=(100,)), backend=backend, clock=clock)
    agent.tick()
    assert backend.reads == [100]
    clock.now = 1.0
    set_rss_kib(proc_tree, 100, int(102400 * 1.05))  # +5%: not enough
    agent.tick()
    assert backend.reads == [100]
    clock.now = 2.0
    set_rss_kib(proc_tree, 100, int(102400 * 1.25))  # +25%: read now, not at t=5
    snap = agent.tick()
    assert backend.reads == [100, 100]
    assert snap.samples[0].exact_age_seconds == 0.0


def test_never_walks_a_process_that_would_stall_too_long(proc_tree: Path) -> None:
    clock = FakeClock()
    backend = CostBackend(proc_tree, {})
    # pid 500: 200 MiB RSS and 400 KiB of page table = 51200 small pages.
    config = AgentConfig(max_stall_seconds=0.001, walk_seconds_per_page=45e-9)
    agent = Agent(Selection(pids=(500,)), config, backend=backend, clock=clock)
    s500 = sample(500, backend=backend)
    assert agent.estimate_walk_seconds(s500) == pytest.approx(0.0002 + 51200 * 45e-9)
    for second in range(5):
        clock.now = float(second)
        snap = agent.tick()
    assert backend.reads == []
    assert snap.stall_skipped_pids == frozenset({500})
    assert snap.samples[0].uss_bytes is None and snap.samples[0].uss_source == "none"
    assert agent.stats().exact_skipped_stall == 5
    forced = Agent(
        Selection(pids=(500,)), AgentConfig(max_stall_seconds=0.001, force_exact=True),
        backend=backend, clock=clock,
    )
    assert forced.tick().samples[0].uss_source == "smaps_rollup"
    assert backend.reads == [500]


def test_measured_cost_over_the_limit_stops_rereads_but_keeps_aged_figures(proc_tree: Path) -> None:
    clock = FakeClock()
    # The model guesses 2.5 ms, the walk really takes 30 ms (the limit is 20 ms).
    backend = CostBackend(proc_tree, {500: 0.030})
    agent = Agent(Selection(pids=(500,)), backend=backend, clock=clock)
    agent.tick()
    for second in range(1, 100, 7):
        clock.now = float(second)
        snap = agent.tick()
    assert backend.reads == [500]
    s = snap.samples[0]
    assert s.uss_source == "smaps_rollup" and s.exact_age_seconds == pytest.approx(clock.now)
    assert snap.stall_skipped_pids == frozenset({500})


def test_total_exact_cost_stays_within_budget_for_many_processes(tmp_path: Path) -> None:
    n = 50
    root = many_process_tree(tmp_path, n)
    clock = FakeClock()
    backend = CostBackend(root, {1000 + i: 0.002 for i in range(n)})
    config = AgentConfig(cpu_budget_fraction=0.001)
    agent = Agent(Selection(all_processes=True), config, backend=backend, clock=clock)
    seconds = 200
    for second in range(seconds + 1):
        clock.now = float(second)
        agent.tick()
    spent = agent.stats().exact_seconds
    bucket = max(config.max_stall_seconds, config.cpu_budget_fraction * config.interval_seconds)
    # Long-run rate plus one full bucket (and at most one read of debt).
    assert spent <= config.cpu_budget_fraction * seconds + bucket + 0.002
    assert spent >= 0.8 * config.cpu_budget_fraction * seconds
    # Every process got exact figures at some point (no starvation).
    assert set(backend.reads) == {1000 + i for i in range(n)}


def test_denied_exact_read_is_counted_once_and_cheap_figures_kept() -> None:
    target = os.getpid()

    def unprivileged_agent() -> str:  # watching a root-owned process
        agent = Agent(Selection(pids=(target,)))
        for _ in range(3):
            snap = agent.tick()
        st = agent.stats()
        s = snap.samples[0]
        return f"{st.exact_denied} {st.exact_reads} {s.rss_bytes > 0} {s.uss_source}"

    assert as_nobody(unprivileged_agent) == "1 0 True none"


def test_jitter_spreads_intervals_within_bounds(proc_tree: Path) -> None:
    agent = Agent(
        Selection(pids=(100,)), AgentConfig(interval_seconds=2.0, jitter_fraction=0.1),
        backend=ProcfsBackend(str(proc_tree)), rng=random.Random(7),
    )
    delays = [agent.next_delay_seconds() for _ in range(200)]
    assert all(1.8 <= d <= 2.2 for d in delays)
    assert max(delays) - min(delays) > 0.2


def test_errors_are_counted_not_raised(proc_tree: Path) -> None:
    agent = Agent(Selection(pids=(100, 300, 77777)), backend=ProcfsBackend(str(proc_tree)))
    snap = agent.tick()
    assert [s.pid for s in snap.samples] == [100]
    assert snap.errors == {"vanished": 1, "zombie": 1, "denied": 0}
    agent.tick()
    assert agent.stats().errors == {"vanished": 2, "zombie": 2, "denied": 0}


def test_all_processes_skips_kernel_threads_and_zombies(proc_tree: Path) -> None:
    agent = Agent(Selection(all_processes=True), backend=ProcfsBackend(str(proc_tree)))
    with pytest.warns(RuntimeWarning):
        snap = agent.tick()
    assert sorted(s.pid for s in snap.samples) == [100, 400, 500, 600]
    assert snap.errors["zombie"] == 1
    # Largest RSS first.
    assert [s.pid for s in snap.samples][:2] == [500, 100]


def test_grouping_by_ray_title_and_bounded_groups(proc_tree: Path) -> None:
    b = ProcfsBackend(str(proc_tree))
    ray = b.cheap(500)
    assert group_key(ray) == "ray::Trainer"
    # Named from the command line (`python train.py --epochs 3`), or by the kernel's comm where asked.
    assert group_key(b.cheap(100)) == "train.py"
    assert group_key(b.cheap(100), "comm") == "trainer"
    assert group_key(b.cheap(100), max_chars=5) == "train"
    assert group_key(ray, "comm") == "ray::Trainer"  # Ray's titles group either way
    workers = [ray._replace(pid=i, cmdline=(f"ray::Trainer.step{i}",)) for i in range(10)]
    others = [b.cheap(100)._replace(pid=100 + i, cmdline=("python", f"proc{i}.py")) for i in range(20)]
    groups = group_samples(workers + others, max_groups=5)
    assert len(groups) == 5
    assert groups[0].name == "ray::Trainer" and groups[0].count == 10
    assert groups[0].rss_bytes == 10 * ray.rss_bytes
    assert groups[-1].name == "other" and groups[-1].count == 20 - 3
    # A group sums USS only when every member has one.
    assert groups[0].uss_bytes is None and groups[0].exact_count == 0
    exact = [w._replace(uss_bytes=MIB, pss_bytes=2 * MIB, uss_source="smaps_rollup", exact_age_seconds=float(i))
             for i, w in enumerate(workers)]
    g = group_samples(exact)[0]
    assert (g.uss_bytes, g.pss_bytes, g.max_exact_age_seconds) == (10 * MIB, 20 * MIB, 9.0)
    with pytest.raises(ConfigurationError, match=r"group_samples\(max_groups=0\)"):
        group_samples(exact, max_groups=0)


def test_snapshot_groups_follow_the_configured_bound_and_are_computed_once(proc_tree: Path) -> None:
    agent = Agent(Selection(pids=(100, 400, 500)), AgentConfig(max_groups=2),
                  backend=ProcfsBackend(str(proc_tree)))
    snap = agent.tick()
    assert len(snap.samples) == 3
    groups = snap.groups
    assert groups == tuple(group_samples(snap.samples, max_groups=2))
    assert len(groups) == 2 and groups[-1].name == "other"
    assert sum(g.count for g in groups) == 3
    assert snap.groups is groups  # kept, not regrouped on every read


def test_cgroup_v1_and_v2_figures_from_fixtures(proc_tree: Path) -> None:
    reader = CgroupReader(str(proc_tree), str(FIXTURES / "sys_cgroup"))
    assert reader.locate(100) == (2, "/workers/a")
    assert reader.locate(400) == (1, "/legacy")
    v2 = reader.read(2, "/workers/a")
    assert v2 is not None
    assert (v2.usage_bytes, v2.limit_bytes, v2.anon_bytes, v2.file_bytes, v2.shmem_bytes) == (
        314572800, 1073741824, 209715200, 94371840, 10485760,
    )
    v1 = reader.read(1, "/legacy")
    assert v1 is not None
    assert (v1.usage_bytes, v1.limit_bytes, v1.anon_bytes, v1.file_bytes) == (20971520, None, 16777216, 4194304)
    agent = Agent(
        Selection(pids=(100, 400, 500)), AgentConfig(cgroups=True),
        backend=ProcfsBackend(str(proc_tree)), cgroup_reader=reader,
    )
    with pytest.warns(RuntimeWarning):
        snap = agent.tick()
    # 100 and 500 share one cgroup: read once.
    assert sorted(c.path for c in snap.cgroups) == ["/legacy", "/workers/a"]


def test_cgroup_of_this_process_on_this_machine() -> None:
    reader = CgroupReader()
    where = reader.locate(os.getpid())
    if where is None:
        pytest.skip("no memory cgroup visible")
    figures = reader.read(*where)
    if figures is None:
        pytest.skip(f"cgroup {where} is not mounted in this namespace")
    assert figures.usage_bytes >= sample(os.getpid()).anon_bytes // 2


def test_selection_by_pid_pattern_tree_and_all(start_target) -> None:
    marker = f"marker{os.getpid()}x{time.monotonic_ns()}"
    plain = start_target("sleep", marker)
    tree = start_target("tree", "2")
    children = set(tree.facts["children"])
    assert Agent(Selection(pids=(plain.pid,))).select() == [plain.pid]
    assert Agent(Selection(pattern=re.escape(marker))).select() == [plain.pid]
    assert set(Agent(Selection(tree_root_pid=tree.pid)).select()) == {tree.pid} | children
    everything = set(Agent(Selection(all_processes=True)).select())
    assert {plain.pid, tree.pid, os.getpid()} | children <= everything
    union = Agent(Selection(pids=(plain.pid,), tree_root_pid=tree.pid)).select()
    assert set(union) == {plain.pid, tree.pid} | children
    snap = Agent(Selection(tree_root_pid=os.getpid())).tick()
    assert {plain.pid, tree.pid} | children <= {s.pid for s in snap.samples}


def test_pattern_never_matches_the_agent_itself() -> None:
    agent = Agent(Selection(pattern=r"pytest|python"))
    assert os.getpid() not in agent.select()


def test_run_ticks_for_duration_and_background_thread_stops(start_target) -> None:
    t = start_target("big", "32")
    agent = Agent(Selection(pids=(t.pid,)), AgentConfig(interval_seconds=0.1, jitter_fraction=0.0))
    snaps = []
    # run() returning at all is the check; how close to 0.45 s it ends is
    # measured in benchmarks/bench_monitor.py --loops, not asserted here.
    agent.run(duration_seconds=0.45, on_snapshot=snaps.append)
    assert len(snaps) >= 1 and agent.stats().ticks == len(snaps)
    assert snaps[-1].samples[0].rss_bytes >= 32 * MIB
    assert snaps[0].samples[0].uss_source == "pagemap"  # small process, budget allows
    agent.start()
    wait_until(lambda: agent.stats().ticks >= len(snaps) + 3, what="three ticks of the background thread")
    agent.stop()
    ticks = agent.stats().ticks
    # This sleep is the test: over 2 intervals after stop(), no tick may come.
    time.sleep(0.25)
    assert agent.stats().ticks == ticks >= len(snaps) + 3
    assert agent.latest is not None and agent.latest.stats.ticks == ticks


@pytest.mark.parametrize(
    "kwargs",
    [
        {"interval_seconds": 0},
        {"interval_seconds": math.nan},
        {"interval_seconds": "1"},
        {"jitter_fraction": 1.0},
        {"cpu_budget_fraction": 0},
        {"cpu_budget_fraction": 2},
        {"max_stall_seconds": -1},
        {"rss_change_fraction": 0},
        {"walk_base_seconds": -1e-3},
        {"pagemap_seconds_per_page": math.inf},
        {"max_groups": 0},
        {"max_groups": 2.5},
        {"fds_every_ticks": 0},
        {"status_max_age_seconds": -1},
        {"rescan_seconds": 0},
    ],
)
def test_config_validation_names_the_field_and_value(kwargs: dict) -> None:
    ((name, bad),) = kwargs.items()
    with pytest.raises(ConfigurationError, match=re.escape(f"AgentConfig({name}={bad!r}): must be")) as info:
        AgentConfig(**kwargs)
    assert isinstance(info.value, ValueError)


def test_selection_validation() -> None:
    with pytest.raises(ConfigurationError, match=r"Selection\(pattern='\('\) is not a valid regular expression"):
        Selection(pattern="(")
    for pids in [(0,), (-3,), ("12",), (True,)]:
        with pytest.raises(ConfigurationError, match=re.escape(f"Selection(pids={pids[0]!r}): each pid")):
            Selection(pids=pids)
    with pytest.raises(ConfigurationError, match=r"Selection\(tree_root_pid=0\)"):
        Selection(tree_root_pid=0)
    with pytest.raises(ConfigurationError, match="selects nothing"):
        Agent(Selection())
