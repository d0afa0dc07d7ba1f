"""``tensorferry top``: a live table of the selected processes, largest first.

The table is built by a pure function of a snapshot (tested directly); the
loop around it redraws each tick and quits on ``q``. Keys are read from a
file descriptor with select(), so a pipe works as well as a terminal.
"""

from __future__ import annotations

__all__ = ["KeyReader", "SortKey", "build_table", "format_bytes", "run_top"]

import os
import select
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import IO

from rich import box
from rich.console import Console
from rich.table import Table

from ._agent import Agent, Snapshot
from ._types import ProcessMemory, SortKey

_QUIT_KEYS = frozenset("qQ")


def format_bytes(nbytes: int | None) -> str:
    """``1.5G`` / ``100M``-style sizes (binary units, at most 5 characters); ``-`` for None."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            # One decimal only where it matters: keeps every column narrow.
            return f"{value:.1f}{unit}" if value < 10 and unit != "B" else f"{value:.0f}{unit}"
        value /= 1024
    return f"{value:.0f}T"


def _sort_value(s: ProcessMemory, key: SortKey) -> float:
    if key == "cpu":
        return s.cpu_user_seconds + s.cpu_system_seconds
    if key in ("uss", "pss"):
        # Unknown exact figures sort by RSS, so nothing big hides at the bottom.
        value = s.uss_bytes if key == "uss" else s.pss_bytes
        return float(value if value is not None else s.rss_bytes)
    return float(getattr(s, f"{key}_bytes"))


def _age(s: ProcessMemory, stall_skipped: frozenset[int]) -> str:
    if s.exact_age_seconds is not None:
        return f"{s.exact_age_seconds:.0f}s"
    if s.pid in stall_skipped:
        # Too big to walk within the stall limit: say so rather than "-".
        return "too big"
    return "-"


def build_table(snapshot: Snapshot, *, sort_by: SortKey = "rss", limit: int | None = None, live: bool = True) -> Table:
    """The rich Table for one snapshot, sorted by ``sort_by``, largest first.

    Args:
        snapshot: what the agent saw.
        sort_by: the column to sort by.
        limit: show at most this many rows (None: all).
        live: the table is redrawn until ``q`` (the caption says so).
    """
    samples = sorted(snapshot.samples, key=lambda s: _sort_value(s, sort_by), reverse=True)
    shown = samples[:limit] if limit is not None else samples
    total_rss = sum(s.rss_bytes for s in snapshot.samples)
    errs = ", ".join(f"{k} {v}" for k, v in snapshot.errors.items() if v)
    st = snapshot.stats
    sources = Counter(s.uss_source for s in snapshot.samples if s.uss_source != "none")
    exact_from = ", ".join(f"{src} {n}" for src, n in sorted(sources.items())) or "none read yet"
    caption = (
        f"{len(snapshot.samples)} processes, RSS {format_bytes(total_rss)}; "
        f"ANON is RSS - shared, not USS; USS/PSS exact, walked from: {exact_from} (- not read yet); "
        f"AGE = how old. "
        f"monitor: {st.exact_reads} exact reads, {st.cpu_seconds:.2f}s CPU, "
        f"RSS {format_bytes(st.rss_bytes)}" + (f"; skipped: {errs}" if errs else "") + (". q quits" if live else ".")
    )
    # No vertical rules: twelve columns must fit an 80-column terminal.
    table = Table(
        title=f"tensorferry top (sorted by {sort_by})", caption=caption, expand=False,
        box=box.SIMPLE_HEAD, padding=(0, 0, 0, 1), pad_edge=False,
    )
    for header in ("PID", "NAME", "RSS", "ANON", "FILE", "SHMEM", "SWAP", "USS", "PSS", "AGE", "THR", "CPU s"):
        if header == "NAME":
            # The name gives way first; figures and pids are never cut.
            table.add_column(header, no_wrap=True, overflow="ellipsis", min_width=6, ratio=1)
        else:
            table.add_column(header, justify="right", no_wrap=True, min_width=len(header))
    for s in shown:
        table.add_row(
            str(s.pid),
            snapshot.name_of(s)[:32],
            format_bytes(s.rss_bytes),
            format_bytes(s.anon_bytes),
            format_bytes(s.file_bytes),
            format_bytes(s.shmem_bytes),
            format_bytes(s.swap_bytes),
            format_bytes(s.uss_bytes),
            format_bytes(s.pss_bytes),
            _age(s, snapshot.stall_skipped_pids),
            str(s.num_threads),
            f"{s.cpu_user_seconds + s.cpu_system_seconds:.1f}",
        )
    return table


class KeyReader:
    """Reads single keys from a terminal or a pipe without blocking.

    On a terminal it switches to cbreak mode (keys arrive without Enter) and
    restores the mode on close; on anything else (a pipe, a file, /dev/null)
    it reads what arrives as is, so tests and scripts can send ``q``.

    Args:
        stream: where keys come from (stdin by default).
    """

    def __init__(self, stream: IO[str] | IO[bytes] | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdin
        self._fd: int | None = None
        self._saved: list | None = None  # type: ignore[type-arg]
        try:
            self._fd = self._stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None
        if self._fd is not None and os.isatty(self._fd):
            import termios
            import tty

            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)

    def poll(self, timeout_seconds: float) -> str | None:
        """One key if one arrives within ``timeout_seconds``, else None (also at end of input)."""
        if self._fd is None:
            time.sleep(timeout_seconds)
            return None
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout_seconds))
        if not ready:
            return None
        data = os.read(self._fd, 1)
        if not data:
            # End of input (a closed pipe) reads as ready forever: wait the timeout out.
            time.sleep(timeout_seconds)
            return None
        return data.decode("utf-8", "replace")

    def close(self) -> None:
        """Restore the terminal mode."""
        if self._saved is not None and self._fd is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
            self._saved = None

    def __enter__(self) -> KeyReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_quit_key(key: str | None) -> bool:
    """True for the keys that quit (``q`` / ``Q``)."""
    return key is not None and key in _QUIT_KEYS


def run_top(
    agent: Agent,
    *,
    console: Console | None = None,
    keys: KeyReader | None = None,
    sort_by: SortKey = "rss",
    limit: int | None = None,
    duration_seconds: float | None = None,
    on_frame: Callable[[Snapshot], None] | None = None,
) -> int:
    """Redraw the table every tick until ``q`` (or ``duration_seconds``).

    Runs in this thread: it calls ``agent.tick()`` itself for each frame
    (the agent's own thread need not be started) and waits
    ``agent.next_delay_seconds()`` (the interval, with jitter) between
    frames, reading keys meanwhile. The first frame is drawn at once.

    Args:
        agent: the agent whose selection is sampled, once a frame.
        console: the rich ``Console`` to draw on (default: a new one on
            stdout); its height sets the default ``limit``.
        keys: where the quit key is read from (default: a ``KeyReader``
            of stdin, made here and closed on return, which restores the
            terminal's mode; one passed in is left open). ``q`` or ``Q``
            quits; other keys, and the end of a piped input, are ignored.
        sort_by: the column the rows are sorted by, largest first:
            ``"rss"`` (default), ``"uss"``, ``"pss"``, ``"anon"``,
            ``"shmem"``, ``"swap"`` (bytes) or ``"cpu"`` (user plus system
            seconds). For ``"uss"``/``"pss"``, a process whose exact figure
            is not known yet sorts by its RSS.
        limit: show at most this many rows (default None: the console's
            height less 8 lines for the title, header, borders and caption,
            and at least 5).
        duration_seconds: stop this many seconds after the call, ending
            the wait in progress (default None: only ``q`` stops it). At
            least one frame is drawn, even for 0.
        on_frame: called with each frame's snapshot once it is drawn, in
            this thread (default None).

    Returns:
        The number of frames drawn (at least 1).
    """
    from rich.live import Live

    console = console or Console()
    if limit is None:
        # Title, header, borders and caption take ~8 lines; keep the frame on screen.
        limit = max(5, console.height - 8)
    own_keys = keys is None
    keys = keys or KeyReader()
    frames = 0
    start = time.monotonic()
    try:
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                snap = agent.tick()
                live.update(build_table(snap, sort_by=sort_by, limit=limit), refresh=True)
                frames += 1
                if on_frame is not None:
                    on_frame(snap)
                deadline = time.monotonic() + agent.next_delay_seconds()
                if duration_seconds is not None:
                    deadline = min(deadline, start + duration_seconds)
                quit_ = False
                while (left := deadline - time.monotonic()) > 0:
                    if is_quit_key(keys.poll(left)):
                        quit_ = True
                        break
                if quit_ or (duration_seconds is not None and time.monotonic() - start >= duration_seconds):
                    break
    finally:
        if own_keys:
            keys.close()
    return frames
