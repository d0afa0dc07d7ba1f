"""The exact-read schedule's tick over what can be due (``run(fresh=...)``)
makes the choices its pass over every sample makes: the same processes read,
tick after tick, as records stand still, move, come and go."""

from __future__ import annotations

import random

from tensorferry.monitor import AgentConfig
from tensorferry.monitor._exact_schedule import ExactScheduler
from tensorferry.monitor._types import ExactMemory, ProcessMemory


class _Rollups:
    """Answers smaps_rollup reads with figures and a cost that follow RSS
    (a plain backend without pagemap: every read is one whole walk), and
    records which pids were read."""

    pagemap = False

    def __init__(self) -> None:
        self.read: list[int] = []

    def exact(self, pid: int) -> ExactMemory:
        self.read.append(pid)
        return ExactMemory(uss_bytes=pid * 4096, pss_bytes=pid * 4096, swap_pss_bytes=0, cost_seconds=0.0002 + pid * 1e-6)


def _record(pid: int, rss: int) -> ProcessMemory:
    return ProcessMemory(pid, 1, "p", ("p",), 1000.0 + pid, 0.0, rss, rss, 0, 0, 0, rss, rss * 2, 4096 * (1 + rss // (1 << 21)),
                         0.0, 0.0, 1, 3, False, None, None, "none", None, None, 0.0)


def test_looking_at_what_can_be_due_reads_what_a_pass_over_every_sample_reads() -> None:
    rng = random.Random(49)
    cfg = AgentConfig(cpu_budget_fraction=0.01, max_stall_seconds=0.02)
    full_backend, inc_backend = _Rollups(), _Rollups()
    full, inc = ExactScheduler(cfg, full_backend, 0.0), ExactScheduler(cfg, inc_backend, 0.0)
    records = {pid: _record(pid, rng.randrange(1, 400) << 20) for pid in range(100, 160)}
    next_pid = 160
    for tick in range(1, 400):
        now = float(tick)
        fresh: list[ProcessMemory] = []
        for pid in list(records):
            roll = rng.random()
            if roll < 0.01:
                del records[pid]  # the process ends
            elif roll < 0.08:
                records[pid] = _record(pid, max(1 << 20, records[pid].rss_bytes + rng.randrange(-64, 64) * (1 << 20)))
                fresh.append(records[pid])  # it moved: a new record
        if rng.random() < 0.3:
            records[next_pid] = _record(next_pid, rng.randrange(1, 400) << 20)
            fresh.append(records[next_pid])
            next_pid += 1
        samples = [records[p] for p in sorted(records)]
        if tick == 1:
            fresh = samples  # the first tick builds every record (as the backend's first reads do)
        alive = {(s.pid, s.create_time) for s in samples}
        full.keep_only(alive)
        inc.keep_only(alive)
        full_backend.read.clear()
        inc_backend.read.clear()
        skipped_full = full.run(samples, now)
        skipped_inc = inc.run(samples, now, fresh=fresh)
        assert inc_backend.read == full_backend.read, tick
        assert skipped_inc == skipped_full, tick
        assert inc.published() == full.published(), tick
    # Both read most processes, many more than once, and the stall limit forbade some.
    assert full.counters.exact_reads > 200 and full.counters.exact_skipped_stall > 0
    assert inc.counters.exact_skipped_stall == full.counters.exact_skipped_stall
