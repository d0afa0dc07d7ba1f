"""``tensorferry top``: one rendered frame, and ``q`` through a pipe (no tty)."""

from __future__ import annotations

import io
import os

from rich.console import Console

from tensorferry.monitor import Agent, AgentConfig, Selection, build_table, run_top
from tensorferry.monitor._procfs import ProcfsBackend
from tensorferry.monitor._top import KeyReader, format_bytes, is_quit_key


def render(table) -> str:  # type: ignore[no-untyped-def]
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_table_sorted_by_memory_with_exact_age(proc_tree) -> None:  # type: ignore[no-untyped-def]
    backend = ProcfsBackend(str(proc_tree))
    agent = Agent(Selection(pids=(100, 500)), AgentConfig(max_stall_seconds=0.0025), backend=backend)
    snap = agent.tick()
    # 500 (200 MiB of 4 KiB pages: an estimated 2.5 ms walk) is over the limit.
    assert snap.stall_skipped_pids == frozenset({500})
    text = render(build_table(snap))
    rows = [line for line in text.splitlines() if "train.py" in line or "ray::" in line]
    assert len(rows) == 2
    assert "500" in rows[0] and "ray::Trainer" in rows[0]  # larger RSS first
    assert "100" in rows[1] and "100M" in rows[1] and "50M" in rows[1]  # rss, uss
    assert "0s" in rows[1] and "too big" in rows[0]
    caption = " ".join(text.split())
    assert "ANON is RSS - shared, not USS" in caption
    # The caption says where the exact figures came from, as the snapshot has them.
    assert "walked from: smaps_rollup 1" in caption and "q quits" in caption
    assert "q quits" not in " ".join(render(build_table(snap, live=False)).split())
    # Sorting by USS: a process without one sorts by its RSS, so 500 stays on top.
    by_uss = render(build_table(snap, sort_by="uss", limit=1))
    assert "ray::Trainer" in by_uss and "train.py" not in by_uss


def test_table_says_too_big_for_stall_skipped(proc_tree) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(Selection(pids=(500,)), AgentConfig(max_stall_seconds=0.001),
                  backend=ProcfsBackend(str(proc_tree)))
    text = render(build_table(agent.tick()))
    assert "too big" in text


def test_format_bytes() -> None:
    assert format_bytes(None) == "-"
    assert format_bytes(512) == "512B"
    assert format_bytes(1536) == "1.5K"
    assert format_bytes(3 << 30) == "3.0G"
    assert format_bytes(100 << 20) == "100M"
    assert len(format_bytes((1 << 30) - 1)) <= 5


def test_q_from_a_pipe_quits_after_one_frame() -> None:
    r, w = os.pipe()
    os.write(w, b"xq")
    agent = Agent(Selection(pids=(os.getpid(),)), AgentConfig(interval_seconds=5.0))
    out = io.StringIO()
    with os.fdopen(r, "rb") as stream:
        # No duration: only the q can end this call, after the first frame.
        frames = run_top(agent, console=Console(file=out, width=160), keys=KeyReader(stream))
    os.close(w)
    assert frames == 1
    assert str(os.getpid()) in out.getvalue()


def test_closed_pipe_and_duration_end_the_loop() -> None:
    r, w = os.pipe()
    os.close(w)  # end of input: never a key, never a busy loop
    agent = Agent(Selection(pids=(os.getpid(),)), AgentConfig(interval_seconds=0.1, jitter_fraction=0.0))
    with os.fdopen(r, "rb") as stream:
        frames = run_top(agent, console=Console(file=io.StringIO()), keys=KeyReader(stream),
                         duration_seconds=0.45)
    # Returning is the check (a closed pipe never quits by itself); frames per
    # second are measured in benchmarks/bench_monitor.py --loops.
    assert frames >= 1


def test_key_helpers() -> None:
    assert is_quit_key("q") and is_quit_key("Q")
    assert not is_quit_key("x") and not is_quit_key(None)
    reader = KeyReader(io.StringIO("q"))  # no fileno: polls by sleeping
    assert reader.poll(0.01) is None
    reader.close()
