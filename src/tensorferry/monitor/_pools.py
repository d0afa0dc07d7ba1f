"""Pool figures a process exposes through the monitor's collector.

A process that owns a ``MemoryPool`` registers a callable returning a plain
dict; the monitor never imports torch or the pool module, so it stays
importable (and cheap) in processes that have neither.
"""

from __future__ import annotations

__all__ = [
    "POOL_KEYS",
    "PoolFigures",
    "collect_pool_figures",
    "register_pool_source",
    "unregister_pool_source",
]

import threading
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

from tensorferry.errors import ConfigurationError

POOL_KEYS = ("capacity_nbytes", "used_nbytes", "largest_free_nbytes", "transfers", "bytes_moved")
"""The keys a pool source's dict must have, all non-negative ints."""


class PoolFigures(NamedTuple):
    """One pool's figures at one scrape."""

    name: str
    """The name it was registered under (a label value)."""
    capacity_nbytes: int
    """Bytes the pool's buffer holds in all."""
    used_nbytes: int
    """Bytes allocated to live groups."""
    largest_free_nbytes: int
    """The largest contiguous free block: the biggest group that fits now."""
    transfers: int
    """Transfers served since the pool was made (a counter)."""
    bytes_moved: int
    """Bytes moved by those transfers (a counter)."""


_lock = threading.Lock()
_sources: dict[str, Callable[[], Mapping[str, int]]] = {}
_warned: set[str] = set()


def register_pool_source(name: str, source: Callable[[], Mapping[str, int]]) -> None:
    """Expose a pool's figures through the monitor's Prometheus collector.

    Args:
        name: a short, stable name (the ``pool`` label); registering the same
            name again replaces the source.
        source: called at each scrape, in the scraping thread; returns a dict
            with the keys in :data:`POOL_KEYS`. It should be cheap and must
            not block (read counters, do not lock the pool for long).

    Raises:
        ConfigurationError: ``name`` is empty or ``source`` is not callable.
    """
    if not name or not isinstance(name, str):
        raise ConfigurationError(
            f"register_pool_source(name={name!r}): must be a non-empty str (the pool label, e.g. 'sender')"
        )
    if not callable(source):
        raise ConfigurationError(
            f"register_pool_source(source={source!r}) for {name!r}: must be a callable returning a dict "
            f"with keys {', '.join(POOL_KEYS)} (e.g. lambda: pool.stats()._asdict())"
        )
    with _lock:
        _sources[name] = source
        _warned.discard(name)


def unregister_pool_source(name: str) -> None:
    """Stop exposing the pool registered as ``name`` (no error if absent)."""
    with _lock:
        _sources.pop(name, None)


def collect_pool_figures() -> tuple[list[PoolFigures], int]:
    """Call every source; returns ``(figures, failed_count)``.

    A source that raises or returns a malformed dict is skipped (and warned
    about once): one broken pool must not take the process's metrics down.
    """
    with _lock:
        items = list(_sources.items())
    out: list[PoolFigures] = []
    failed = 0
    for name, source in items:
        try:
            d = source()
            values = [int(d[k]) for k in POOL_KEYS]
            if any(v < 0 for v in values):
                raise ConfigurationError(f"pool source {name!r} returned a negative figure: {dict(d)!r}")
        except Exception as exc:  # noqa: BLE001 - user callables may raise anything
            failed += 1
            if name not in _warned:
                _warned.add(name)
                warnings.warn(
                    f"pool source {name!r} failed ({type(exc).__name__}: {exc}); it must return "
                    f"a dict with non-negative int keys {', '.join(POOL_KEYS)}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            continue
        out.append(PoolFigures(name, *values))
    return out, failed
