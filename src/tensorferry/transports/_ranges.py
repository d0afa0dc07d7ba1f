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
    out_off, out_addr, out_n = [], [], []
    for p, a, n in zip(pos.tolist(), address.tolist(), nbytes.tolist()):
        while n:
            b = int(np.searchsorted(starts, p, side="right")) - 1
            if b >= sizes.size or p >= starts[b] + sizes[b]:
                raise ProtocolError(f"a range at {p:,} lies past the {int(sizes.sum()):,} bytes of the piece")
            k = min(n, int(starts[b] + sizes[b]) - p)
            out_off.append(int(offs[b]) + p - int(starts[b]))
            out_addr.append(a)
            out_n.append(k)
            p, a, n = p + k, a + k, n - k
    return np.array(out_off, dtype=np.int64), np.array(out_addr, dtype=np.int64), np.array(out_n, dtype=np.int64)
