"""``Ticket``: the small, versioned, validated claim check of one transfer.

A Sender's ``put`` returns a Ticket; the user moves it over their own control
plane (a queue, an RPC, Ray); a Receiver's ``get`` redeems it. It holds the
layout, where the bytes are (blocks in the sender's pool, or a stream of
pieces for objects larger than the pool), and how to reach the sender.
Encoded with msgspec's msgpack, typed and bounded on decode; no pickle.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal, get_args

import msgspec

from ..errors import TicketError
from ._layout import MAX_LAYOUT_NBYTES, Layout

__all__ = ["DeltaOffer", "Ticket", "MAX_TICKET_NBYTES"]

# The one list of transport names; everything else refers to these.
TransportName = Literal["shm", "tcp", "nixl"]
TRANSPORTS: tuple[str, ...] = get_args(TransportName)

_MAGIC = b"TFTK"
_VERSION = 1
# The layout dominates a ticket; everything else is a few hundred bytes.
MAX_TICKET_NBYTES = MAX_LAYOUT_NBYTES + (1 << 20)
# Blocks a ticket (and a Located, which names them) may list.
MAX_BLOCKS = 1 << 20
_MAX_ADDRESS = 512


class DeltaOffer(msgspec.Struct, frozen=True, array_like=True):
    """The optional section of a delta plan's ticket (``plans/_delta.py``).

    Attributes:
        version: the id of the version this ticket carries (0: none).
        base: the id of the version its delta is against (0: no delta;
            every receiver reads the whole object).
        ticket_id: the reader slots of the delta's bytes (0: nothing to read).
        blocks: where the delta's bytes are in the sender's pool (one block,
            or none when nothing changed).
        nbytes: the delta's size.
        changed: elements that changed since ``base``.
    """

    version: Annotated[int, msgspec.Meta(ge=0)]
    base: Annotated[int, msgspec.Meta(ge=0)]
    ticket_id: int = 0
    blocks: Annotated[list[tuple[int, int]], msgspec.Meta(max_length=1)] = []
    nbytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    changed: Annotated[int, msgspec.Meta(ge=0)] = 0


class Ticket(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """Everything a receiver needs to fetch one object from one sender.

    Attributes:
        id: the transfer's id, unique per sender.
        transport: ``"shm"``, ``"tcp"`` or ``"nixl"``.
        address: where the sender listens (a Unix socket name, or host:port).
        pool_generation: the sender pool's generation; a receiver refuses a
            ticket from an earlier pool at a recycled address.
        layout_bytes: the encoded [``Layout``][tensorferry.wire.Layout].
        blocks: ``(offset, nbytes)`` in the sender's pool, one per block, when
            the object is resident (``num_pieces == 1``).
        total_nbytes: the object's packed size as one block (streamed objects
            travel as byte ranges of that block).
        piece_nbytes: bytes per piece of a streamed object.
        num_pieces: 1 for a resident object, more for a streamed one.
        readers: how many gets the sender waits for before freeing (0: any
            number, until the sender discards it).
        lease_seconds: how long unredeemed slots are kept.
        version: the how-manyth put of a kept plan this is (0: a one-shot
            put; omitted from the bytes then); a sharded get refuses
            tickets of different versions mixed.
        delta: a delta plan's versions and delta (None for any other put;
            omitted from the bytes then).
    """

    id: int
    transport: TransportName
    address: Annotated[str, msgspec.Meta(max_length=_MAX_ADDRESS)]
    pool_generation: int
    layout_bytes: Annotated[bytes, msgspec.Meta(max_length=MAX_LAYOUT_NBYTES)]
    blocks: Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_BLOCKS)]
    total_nbytes: Annotated[int, msgspec.Meta(ge=0)]
    piece_nbytes: Annotated[int, msgspec.Meta(ge=0)]
    num_pieces: Annotated[int, msgspec.Meta(ge=1)]
    readers: Annotated[int, msgspec.Meta(ge=0)]
    lease_seconds: float
    # Optional, at the end: left out of the bytes at their defaults.
    version: Annotated[int, msgspec.Meta(ge=0)] = 0
    delta: DeltaOffer | None = None

    @property
    def streamed(self) -> bool:
        return self.num_pieces > 1 or not self.blocks and self.total_nbytes > 0

    @property
    def digest(self) -> bytes:
        """16 bytes that pin what the sender put: the id, the layout, the
        blocks and the sizes (not the address or transport, which
        ``Sender.ticket_for`` changes). A receiver presents it when it takes a
        reader slot; a sender refuses an altered ticket before taking one."""
        h = hashlib.blake2b(digest_size=16)
        h.update(_ENCODER.encode((self.id, self.total_nbytes, self.piece_nbytes, self.num_pieces, self.blocks)))
        h.update(self.layout_bytes)
        if self.delta is not None:
            h.update(_ENCODER.encode(self.delta))
        return h.digest()

    def delta_ticket(self) -> "Ticket":
        """The delta's bytes as a ticket of their own (its reader slots, its
        digest), for a receiver holding the base version."""
        d = self.delta
        if d is None or not d.ticket_id:
            raise TicketError(f"ticket {self.id} offers no delta bytes")
        return Ticket(id=d.ticket_id, transport=self.transport, address=self.address, pool_generation=self.pool_generation,
                      layout_bytes=b"", blocks=d.blocks, total_nbytes=d.nbytes, piece_nbytes=0, num_pieces=1,
                      readers=self.readers, lease_seconds=self.lease_seconds)

    @property
    def layout(self) -> Layout:
        """The decoded, validated layout (decoded on every access).

        Raises:
            TicketError: the layout's bytes are corrupted (with the fix).
        """
        try:
            return Layout.from_bytes(self.layout_bytes)
        except TicketError as exc:
            raise TicketError(f"ticket {self.id}'s {exc}: {_FIX}") from exc

    def to_bytes(self) -> bytes:
        # Optional sections at their defaults left out (msgspec would write
        # each): a ticket without them has the bytes it had before they
        # existed, and decodes with their defaults.
        fields = msgspec.structs.astuple(self)
        n = len(fields)
        while n > _REQUIRED_FIELDS and fields[n - 1] == _DEFAULTS[n - 1]:
            n -= 1
        return _MAGIC + _VERSION.to_bytes(2, "little") + _ENCODER.encode(fields[:n])

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "Ticket":
        """Decode and validate a ticket (from the network: trust nothing).

        Raises:
            TicketError: truncated, oversized, corrupted or hostile bytes,
                or not bytes at all.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TicketError(f"{_what_a_ticket_is(data)}; Ticket.from_bytes takes the bytes")
        data = bytes(data)
        if len(data) > MAX_TICKET_NBYTES:
            raise TicketError(f"ticket of {len(data):,} bytes exceeds the limit of {MAX_TICKET_NBYTES:,}")
        if len(data) < 6 or data[:4] != _MAGIC:
            raise TicketError(f"not a tensorferry ticket (bad magic or truncated): {_FIX}")
        version = int.from_bytes(data[4:6], "little")
        if version != _VERSION:
            raise TicketError(
                f"ticket version {version} is not supported (this tensorferry reads {_VERSION}): "
                f"install the same tensorferry release on the sender and the receiver (or, if the ticket was altered on the way, {_FIX})"
            )
        try:
            ticket = _DECODER.decode(data[6:])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TicketError(_malformed(str(exc))) from exc
        for off, n in ticket.blocks:
            if off < 0 or n <= 0 or off % 16:
                raise TicketError(f"ticket has an invalid block (offset {off}, nbytes {n}): {_FIX}")
        if ticket.delta is not None:
            d = ticket.delta
            if any(off < 0 or n <= 0 or off % 16 for off, n in d.blocks) or sum(n for _, n in d.blocks) != d.nbytes \
                    or bool(d.blocks) != bool(d.ticket_id) or d.nbytes >= max(ticket.total_nbytes, 1):
                raise TicketError(f"ticket has an invalid delta (blocks {d.blocks}, nbytes {d.nbytes}, of {ticket.total_nbytes} bytes): {_FIX}")
        if ticket.num_pieces > 1 and ticket.piece_nbytes <= 0:
            raise TicketError(f"a streamed ticket needs a positive piece size: {_FIX}")
        if ticket.num_pieces > 1 and -(-ticket.total_nbytes // ticket.piece_nbytes) != ticket.num_pieces:
            raise TicketError(
                f"ticket says {ticket.num_pieces} pieces of {ticket.piece_nbytes:,} bytes for "
                f"{ticket.total_nbytes:,} bytes: {_FIX}"
            )
        return ticket


_FIX = "pass the bytes Ticket.to_bytes() returned, unchanged (a ticket cut or altered on the way cannot be read)"
# msgspec's own wording, taken apart to say it in ours: what was expected,
# what was found, and where (``$[2]``: the third field, ``$[5][0][1]``: the
# first entry of the sixth field, its second number).
_WRONG_TYPE = re.compile(r"Expected `(\w+)`, got `(\w+)`")
_OUT_OF_RANGE = re.compile(r"Expected `(\w+)` ((?:>|<)=?) (\S+)")
_LENGTH = re.compile(r"Expected `(\w+)` of (?:at (?:least|most) )?length")


def _what_a_ticket_is(given: object) -> str:
    """The message for a value given where a ticket belongs (receiver side)."""
    hint = ""
    if isinstance(given, str):
        hint = " (a str: if it is ticket.to_bytes().hex(), pass bytes.fromhex(it); base64: base64.b64decode(it))"
    return (
        f"a ticket is a Ticket (what Sender.put returns) or the bytes of its to_bytes(); "
        f"got a value of type {type(given).__name__}{hint}"
    )


def _malformed(decoder_message: str) -> str:
    """A TicketError's message for msgspec's decode or validation error:
    which field (numbered from 1, and named), what is wrong with it, and the fix."""
    what, _, where = decoder_message.partition(" - at `")
    indexes = [int(i) for i in re.findall(r"\[(\d+)\]", where)]
    place = _place(indexes)
    if m := _WRONG_TYPE.match(what):
        problem = f"{place} has the wrong type: {_NOUN.get(m[2], m[2])} where {_NOUN.get(m[1], m[1])} belongs"
    elif m := _OUT_OF_RANGE.match(what):
        problem = f"{place} is out of range (it must be {m[2]} {m[3]})"
    elif _LENGTH.match(what):
        problem = f"{place} has too many or too few entries"
    elif what.startswith("Invalid enum value"):
        problem = f"{place} names no transport this tensorferry knows ({', '.join(TRANSPORTS)})"
    elif "truncated" in what:
        problem = "it ends too soon: truncated"
    elif "UTF-8" in what:
        problem = "a string in it is not UTF-8"
    else:
        problem = "its bytes are not valid MessagePack"
    return f"ticket is malformed ({problem}): {_FIX}"


def _place(indexes: list[int]) -> str:
    if not indexes or indexes[0] >= len(Ticket.__struct_fields__):
        return "the list of fields"
    name = Ticket.__struct_fields__[indexes[0]]
    text = f"field {indexes[0] + 1} ({name})"
    if name == "delta" and len(indexes) > 1 and indexes[1] < len(DeltaOffer.__struct_fields__):
        text += f", its {DeltaOffer.__struct_fields__[indexes[1]]}"
    elif len(indexes) > 1:
        text += f", entry {indexes[1] + 1}"
    return text


_NOUN = {"int": "an integer", "str": "a string", "None": "nil", "array": "a list", "bytes": "a byte string",
         "float": "a number", "object": "a map", "bool": "a boolean"}

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Ticket)
# The fields every ticket has; the optional sections follow, with their defaults.
_REQUIRED_FIELDS = len(Ticket.__struct_fields__) - len(Ticket.__struct_defaults__)
_DEFAULTS = (None,) * _REQUIRED_FIELDS + Ticket.__struct_defaults__
