"""The wire layer: what crosses between a sender and a receiver, as pure math and bytes.

Owns the packing arithmetic (:mod:`.packing`: align-up, packed offsets,
grouping by block, the one range merger), the boxes of global tensors
(``_boxes``: a sharded layout's optional section, element runs between two
boxes), the layout and its bounded encoding (``_layout``), the control
messages and their framing (:mod:`.protocol`, which also gives the
block bytes' socket I/O of ``_blocks`` and the vectored I/O by address of
``_iovec``, where ``IOV_MAX`` is defined, once) and the ticket (``_ticket``).

May import: numpy, msgspec, the standard library and
:mod:`tensorferry.errors`. Never torch, never a higher layer: both the
sender and the receiver compute the same layout from these functions.
"""

from __future__ import annotations

from . import packing, protocol
from ._boxes import Boxes, box_runs, cover, region
from ._layout import DTYPES, ELEMENT_SIZE_BY_CODE, MAX_TENSORS, NO_ALIASES, Layout, TreeOp
from ._ticket import MAX_TICKET_NBYTES, TRANSPORTS, DeltaOffer, Ticket, TransportName

__all__ = [
    "packing", "protocol",
    "Boxes", "box_runs", "cover", "region",
    "DTYPES", "ELEMENT_SIZE_BY_CODE", "MAX_TENSORS", "NO_ALIASES", "Layout", "TreeOp",
    "MAX_TICKET_NBYTES", "TRANSPORTS", "DeltaOffer", "Ticket", "TransportName",
]
