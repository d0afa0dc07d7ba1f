"""Byte ranges of an acquired piece (a sharded get's reads) as ranges of
the sender's pool: what every channel's ``read_ranges`` starts from."""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError

__all__ = ["block_ranges"]


def block_ranges(blocks: list[tuple[int, int]], pos: np.ndarray, address: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ranges of a piece's stream (``pos``: positions in its ``blocks``
    back to back) as ranges of the sender's pool: ``(pool offset, local
    address, nbytes)``, a range cut in two where it crosses a block's end.

    Raises:
        ProtocolError: a range past the blocks' end.
    """
    if len(blocks) == 1:
        off, n = blocks[0]
        if pos.size and int((pos + nbytes).max()) > n:
            raise ProtocolError(f"a range ends past the {n:,} bytes of the piece")
        return pos + off, address, nbytes
    sizes = np.array([n for _, n in blocks], dtype=np.int64)
    offs = np.array([o for o, _ in blocks], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    end = pos + nbytes
    if pos.size and int(end.max()) > int(sizes.sum()):
        raise ProtocolError(f"a range ends past the {int(sizes.sum()):,} bytes of the piece")
    # The blocks each range starts and ends in; a range of k blocks becomes k parts.
    first = np.searchsorted(starts, pos, side="right") - 1
    last = np.searchsorted(starts, end - 1, side="right") - 1
    count = last - first + 1
    of = np.repeat(np.arange(pos.size), count)
    block = first[of] + np.arange(of.size) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(pos[of], starts[block])
    hi = np.minimum(end[of], starts[block] + sizes[block])
    return offs[block] + lo - starts[block], address[of] + lo - pos[of], hi - lo
