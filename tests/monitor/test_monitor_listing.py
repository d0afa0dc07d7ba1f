"""What the agent keeps between ticks that a plain re-read would not: the
listing of /proc (kept while /proc/loadavg's last pid stands, extended by
looking at the few pids handed out since, listed again when a watched process
went), records handed out again as the same object while a process stands
still, and snapshots whose records are finished when read."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from monitor_helpers import wait_until
from test_monitor_scale import Sleepers, same_figures, sleepers  # noqa: F401 - the fixture

from tensorferry.monitor import Agent, AgentConfig, Selection
from tensorferry.monitor._procfs import ProcfsBackend
from tensorferry.monitor._procfs_many import PROBE_MAX_PIDS


def _fake_loadavg(b: ProcfsBackend, tmp_path: Path, last_pid: int) -> None:
    """Point ``b``'s /proc/loadavg at a file of ours whose last pid is ``last_pid``
    (the real one moves whenever anything on the machine forks)."""
    path = tmp_path / "loadavg"
    path.write_text(f"0.00 0.00 0.00 1/100 {last_pid}\n")
    if b._loadavg_fd not in (None, -1):
        os.close(b._loadavg_fd)
    b._loadavg_fd = os.open(path, os.O_RDONLY)


def test_the_listing_is_kept_while_no_pid_is_handed_out_and_new_processes_are_looked_at_one_by_one(
    sleepers: Sleepers, tmp_path: Path
) -> None:
    b = ProcfsBackend()
    try:
        assert b._loadavg_fd is not None  # the kernel's /proc: the listing may be kept
        first = b.pids()
        assert os.getpid() in first
        # Nothing handed out since: the same listing, the same list.
        mark = int(b._listed_under)
        _fake_loadavg(b, tmp_path, mark)
        assert b.pids() is first
        (child,) = sleepers.start(1)
        assert b.pids() is first and child not in first  # the fake says nothing was made
        # The pids handed out since the listing, when few, are looked at one
        # by one: the process joins, a thread of ours does not.
        stop = threading.Event()
        tids: list[int] = []
        thread = threading.Thread(target=lambda: (tids.append(threading.get_native_id()), stop.wait()))
        thread.start()
        try:
            wait_until(lambda: bool(tids), what="the thread's id")
            low, high = min(child, tids[0]), max(child, tids[0])
            if high - low >= PROBE_MAX_PIDS:
                pytest.skip(f"pids {low} and {high} are too far apart to be looked at one by one here")
            b._listed_under = str(low - 1).encode()
            _fake_loadavg(b, tmp_path, high)
            probed = b.pids()
            assert child in probed and tids[0] not in probed and probed is not first
            assert b._listing_kept  # no full listing was made
        finally:
            stop.set()
            thread.join()
        # More pids than that since: /proc is listed again.
        _fake_loadavg(b, tmp_path, int(b._listed_under) + PROBE_MAX_PIDS + 1)
        relisted = b.pids()
        assert child in relisted and not b._listing_kept
    finally:
        b.close()


def test_a_watched_process_that_went_is_not_counted_and_the_next_tick_lists_again(
    sleepers: Sleepers, tmp_path: Path
) -> None:
    pids = sleepers.start(3)
    b = ProcfsBackend()
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(exact=False), backend=b)
    try:
        wait_until(lambda: len(agent.tick().samples) == len(pids), what="every sleeper selected")
        b.pids()  # listed again if a process of the machine went meanwhile
        _fake_loadavg(b, tmp_path, int(b._listed_under))  # nothing handed out: the listing is kept
        sleepers.end(pids[:1])  # an exit hands out no pid
        snap = agent.tick()
        # The kept listing still held it; read, it had gone before the tick:
        # not counted, as a process /proc no longer lists is not.
        assert sorted(s.pid for s in snap.samples) == sorted(pids[1:])
        assert snap.errors == {"vanished": 0, "zombie": 0, "denied": 0}
        assert b._listing_stale
        agent.tick()
        assert pids[0] not in b._listed and not b._listing_stale
    finally:
        agent.stop()


def test_a_still_process_keeps_its_record_and_snapshots_finish_their_own_tick(sleepers: Sleepers) -> None:
    pids = sleepers.start(4)
    agent = Agent(Selection(pattern=f"^{sleepers.tag} "), AgentConfig(exact=False, status_max_age_seconds=3600))
    try:
        wait_until(lambda: len(agent.tick().samples) == len(pids), what="every sleeper selected")
        b = agent.backend
        kept: list[object] = []

        def still() -> bool:
            # Sleepers settle after their exec; then a tick builds no record:
            # the backend keeps the very objects.
            before = {pid: b._last[pid].sample for pid in pids}
            kept[:] = [agent.tick()]
            return all(b._last[pid].sample is before[pid] for pid in pids)

        wait_until(still, what="a tick that builds no record")
        first = kept[0]
        time.sleep(0.05)
        second = agent.tick()
        # Each snapshot, read only now, has its own tick's time on them.
        one, two = ({s.pid: s for s in snap.samples} for snap in (first, second))
        for pid in pids:
            assert same_figures(one[pid], two[pid]) == {}
            assert two[pid].timestamp > one[pid].timestamp
            assert two[pid].status_age_seconds > one[pid].status_age_seconds
            assert one[pid].timestamp <= first.timestamp
    finally:
        agent.stop()
