"""Receiver side: a two-tree broadcast's halves, pulled at the same time.

A ticket put with ``trees=True`` names two sources for its one block
(``Located.stripes``): this receiver's parent in each tree (a relay, or
``""``: the sender). Each half (``transports.stripe_bounds``) is pulled
from its own source on a thread of its own, into one stream, and a
relaying receiver passes each half on as it arrives (its
:class:`~tensorferry.transports.RelayBook` tracks the halves' progress
apart). See :mod:`tensorferry.execution._trees` for the layout.
"""

from __future__ import annotations

import threading
from typing import Callable, Union

from ..transports import stripe_bounds

__all__ = ["Source", "pull_halves"]

Source = Union[str, tuple[str, ...]]
"""Whom a broadcast's block comes from: one source (``""``: the sender),
or one a half (a two-tree broadcast)."""


def pull_halves(sources: tuple[str, ...], total_nbytes: int, pull_half: Callable[[int, str, int, int], None]) -> None:
    """``pull_half(k, source, lo, hi)`` for each half ``k`` of a stream of
    ``total_nbytes`` at once (the last on this thread); returns when all
    have, raising the first error any raised."""
    bounds = stripe_bounds(total_nbytes, len(sources))
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            pull_half(k, sources[k], *bounds[k])
        except BaseException as exc:  # noqa: BLE001 - raised below, after the others end
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), name=f"tensorferry-half-{k}", daemon=True) for k in range(len(sources) - 1)]
    for t in threads:
        t.start()
    run(len(sources) - 1)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
