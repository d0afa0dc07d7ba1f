"""One-shot views (``top --once``, ``top --json``): wait for the exact figures, or say why not.

A continuous view paces exact walks by ``--budget`` and shows USS/PSS when
they arrive. A one-shot view has one chance: on a busy machine the first
tick's budget (at most ``--max-stall`` of walking, 20 ms) often ended
inside the walk of a 1 GiB process, and USS/PSS came out empty (4 runs in 8
under load). Here the agent ticks until every selected process has its
figures or ``wait_seconds`` pass, its bucket holding ``wait_seconds`` of
walking: one walk per process is the whole cost of a one-shot view, re-reads
stay paced by ``--budget``, and each step of a walk still stalls its target
at most ``--max-stall``. Whatever is still missing gets a reason.
"""

from __future__ import annotations

__all__ = ["DEFAULT_WAIT_SECONDS", "exact_snapshot", "missing_lines", "one_shot_config"]

import dataclasses
import os
import time
from collections.abc import Callable

from ._agent import Agent, AgentConfig, Snapshot

# A pagemap walk of 1.3 GiB took 20-30 ms on a loaded 2-core machine (load
# 19); walking a node's few hundred processes takes a few seconds at worst.
DEFAULT_WAIT_SECONDS = 10.0
# Between ticks of the wait: each tick re-reads the cheap figures of every
# selected process (about 10 µs each), so the pause keeps that small.
_RETICK_SECONDS = 0.05
# top --once names at most this many pids per reason (--json lists them all).
_PIDS_SHOWN = 10


def one_shot_config(config: AgentConfig, wait_seconds: float) -> AgentConfig:
    """``config`` whose budget bucket holds ``wait_seconds`` of walking.

    The bucket holds ``cpu_budget_fraction x interval_seconds`` (and starts
    full); a one-shot view never waits for the next interval, so its
    interval only sizes the bucket. Re-reads stay paced by the budget.
    """
    return dataclasses.replace(config, interval_seconds=max(config.interval_seconds, wait_seconds / config.cpu_budget_fraction))


def exact_snapshot(
    agent: Agent,
    wait_seconds: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[Snapshot, dict[int, str]]:
    """Tick ``agent`` until every selected process has USS/PSS, or ``wait_seconds`` pass.

    Returns:
        The last snapshot, and for each process in it still without exact
        figures (kernel threads aside), why: not asked for (``--no-exact``),
        the stall limit, not readable by this user, or the wait ran out.
    """
    deadline = clock() + wait_seconds
    proc_root = getattr(agent.backend, "proc_root", "/proc")
    while True:
        snap = agent.tick()
        missing = {s.pid for s in snap.samples if s.uss_source == "none" and not s.kernel_thread}
        blocked = {pid for pid in missing if pid in snap.stall_skipped_pids or not _readable(proc_root, pid)}
        if not agent.config.exact or missing <= blocked or clock() >= deadline:
            break
        sleep(_RETICK_SECONDS)
    return snap, {pid: _why(agent, snap, proc_root, pid, wait_seconds) for pid in sorted(missing)}


def _readable(proc_root: str, pid: int) -> bool:
    # The kernel checks ptrace read access at open (not the file mode: root
    # may still be refused, as for a sandbox's init), and opening walks nothing.
    for name in ("pagemap", "smaps_rollup"):
        try:
            with open(f"{proc_root}/{pid}/{name}", "rb"):
                return True
        except OSError:
            continue
    return False


def _why(agent: Agent, snap: Snapshot, proc_root: str, pid: int, wait_seconds: float) -> str:
    if not agent.config.exact:
        return "not read: --no-exact"
    if pid in snap.stall_skipped_pids:
        return (f"not read: only smaps_rollup is readable and it would stall the process above --max-stall "
                f"{agent.config.max_stall_seconds:g} s; --force-exact reads it anyway")
    if not _readable(proc_root, pid):
        return "not readable by this monitor (another user's process, or one the kernel keeps from ptrace): run as its user or as root"
    return (f"its walk did not finish within --exact-wait {wait_seconds:g} s (a busy machine, or a process that "
            "kept remapping its memory while walked); raise --exact-wait")


def missing_lines(missing: dict[int, str]) -> list[str]:
    """The lines ``top --once`` prints under its table: one per reason, with its pids."""
    by_reason: dict[str, list[int]] = {}
    for pid, why in missing.items():
        by_reason.setdefault(why, []).append(pid)
    lines = []
    for why, pids in by_reason.items():
        shown = ", ".join(map(str, pids[:_PIDS_SHOWN])) + (f" and {len(pids) - _PIDS_SHOWN} more" if len(pids) > _PIDS_SHOWN else "")
        lines.append(f"USS/PSS missing for {len(pids)} process{'es' if len(pids) > 1 else ''} (pid {shown}): {why}")
    return lines
