"""Ticket: encoding, decoding and validation of the claim check (ticket.py).

Tickets are built here as a sender builds them, from a real packed layout,
and decoded as a receiver decodes bytes from the network: trusting nothing.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorferry import MemoryPool, TensorferryError, Ticket, TicketError
from tensorferry.wire._ticket import MAX_TICKET_NBYTES

MiB = 1 << 20


def _layout_bytes(obj) -> tuple[bytes, list[tuple[int, int]], int]:
    with MemoryPool(8 * MiB) as pool:
        packed = pool.pack(obj)
        blocks = [(b.offset, b.nbytes) for b in packed.blocks]
        return packed.layout.to_bytes(), blocks, sum(n for _, n in blocks)


def make_ticket(obj=None, **fields) -> Ticket:
    """A resident ticket of ``obj`` (by default a small state dict), as a
    sender makes one; ``fields`` override any field."""
    if obj is None:
        obj = {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(4, dtype=torch.bfloat16), "n": [torch.tensor(7)]}
    layout_bytes, blocks, total = _layout_bytes(obj)
    base = dict(
        id=123456789,
        transport="shm",
        address="@tensorferry-test",
        pool_generation=3,
        layout_bytes=layout_bytes,
        blocks=blocks,
        total_nbytes=total,
        piece_nbytes=0,
        num_pieces=1,
        readers=1,
        lease_seconds=60.0,
    )
    base.update(fields)
    return Ticket(**base)


def streamed_ticket() -> Ticket:
    """A ticket of a 5 MiB object streamed in 1 MiB pieces (no blocks)."""
    t = make_ticket([torch.zeros(5 * MiB // 4)])
    return msgspec.structs.replace(t, blocks=[], piece_nbytes=1 * MiB, num_pieces=-(-t.total_nbytes // MiB))


VALID = [
    make_ticket().to_bytes(),
    make_ticket({}, blocks=[], total_nbytes=0).to_bytes(),
    make_ticket(torch.tensor(1.0)).to_bytes(),
    streamed_ticket().to_bytes(),
    make_ticket([torch.ones(3)] * 20, readers=0, transport="tcp", address="127.0.0.1:5555").to_bytes(),
]


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("data", VALID)
def test_round_trip_from_any_buffer(data):
    t = Ticket.from_bytes(data)
    assert t.to_bytes() == data
    for buf in (bytearray(data), memoryview(data)):
        assert Ticket.from_bytes(buf) == t


def test_fields_and_layout_survive_the_round_trip():
    t = make_ticket()
    back = Ticket.from_bytes(t.to_bytes())
    assert back == t
    assert back.layout.same_as(t.layout)
    assert back.layout.shapes() == [(3, 4), (4,), ()]
    assert back.layout.dtype_names() == ["float32", "bfloat16", "int64"]
    assert not back.streamed
    s = Ticket.from_bytes(streamed_ticket().to_bytes())
    assert s.streamed and s.num_pieces == 5 and s.blocks == []


def test_an_empty_object_is_not_streamed():
    t = Ticket.from_bytes(VALID[1])
    assert t.total_nbytes == 0 and t.blocks == [] and not t.streamed


def test_a_state_dict_ticket_is_small():
    obj = {f"layers.{i}.{n}": torch.zeros(4, 4) for i in range(100) for n in ("w", "b")}
    assert len(make_ticket(obj).to_bytes()) < 8192


def test_digest_pins_what_was_put_and_not_where_it_is_served():
    t = make_ticket()
    assert len(t.digest) == 16
    rep = msgspec.structs.replace
    # ticket_for changes the transport and address: the digest stays.
    assert rep(t, transport="tcp", address="127.0.0.1:1").digest == t.digest
    assert rep(t, readers=5, lease_seconds=1.0).digest == t.digest
    altered = [
        rep(t, id=t.id + 1),
        rep(t, blocks=[(t.blocks[0][0] + 16, t.blocks[0][1])]),
        rep(t, total_nbytes=t.total_nbytes + 16),
        rep(t, piece_nbytes=16),
        rep(t, num_pieces=2),
        rep(t, layout_bytes=make_ticket({"w": torch.zeros(4, 3)}).layout_bytes),
    ]
    digests = {a.digest for a in altered}
    assert t.digest not in digests and len(digests) == len(altered)


# -- hostile bytes --------------------------------------------------------------------------


def test_bad_magic_and_version():
    data = VALID[0]
    with pytest.raises(TicketError, match="not a tensorferry ticket"):
        Ticket.from_bytes(b"TFLY" + data[4:])
    with pytest.raises(TicketError, match="version 2 is not supported"):
        Ticket.from_bytes(data[:4] + (2).to_bytes(2, "little") + data[6:])
    for short in (b"", b"TF", b"TFTK\x01"):
        with pytest.raises(TicketError):
            Ticket.from_bytes(short)


@pytest.mark.parametrize("wrong", ["TFTK\x01\x00...", None, 7, [1, 2]])
def test_what_is_not_bytes_is_a_ticket_error_naming_it(wrong):
    with pytest.raises(TicketError, match=rf"a ticket is a Ticket .* or the bytes of its to_bytes\(\); got a value of type {type(wrong).__name__}"):
        Ticket.from_bytes(wrong)


def test_a_hex_str_is_told_how_to_become_bytes():
    with pytest.raises(TicketError, match=r"pass bytes\.fromhex\(it\)"):
        Ticket.from_bytes(VALID[0].hex())


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(blocks=[(-16, 64)]), "invalid block"),
        (dict(blocks=[(16, 0)]), "invalid block"),
        (dict(blocks=[(8, 64)]), "invalid block"),  # not 16-byte aligned
        (dict(blocks=[], total_nbytes=100, piece_nbytes=0, num_pieces=2), "positive piece size"),
        (dict(blocks=[], total_nbytes=100, piece_nbytes=10, num_pieces=3), "3 pieces of 10 bytes for 100 bytes"),
        (dict(num_pieces=0), "malformed"),
        (dict(readers=-1), "malformed"),
        (dict(total_nbytes=-1), "malformed"),
        (dict(transport="udp"), "malformed"),
        (dict(address="x" * 513), "malformed"),
        (dict(blocks=[(16 * i, 16) for i in range((1 << 20) + 1)]), "malformed"),
    ],
)
def test_fields_that_lie_are_rejected(fields, message):
    # msgspec validates on decode, not on construction: the forged ticket
    # encodes as a hostile peer would send it.
    data = make_ticket(**fields).to_bytes()
    with pytest.raises(TicketError, match=message):
        Ticket.from_bytes(data)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(address=7), "field 3 (address) has the wrong type: an integer where a string belongs"),
        (dict(readers=-1), "field 10 (readers) is out of range (it must be >= 0)"),
        (dict(transport="udp"), "field 2 (transport) names no transport this tensorferry knows (shm, tcp, nixl)"),
        (dict(blocks=[("a", 16)]), "field 6 (blocks), entry 1 has the wrong type: a string where an integer belongs"),
    ],
)
def test_malformed_fields_are_named_in_our_words_with_the_fix(fields, words):
    data = make_ticket(**fields).to_bytes()
    with pytest.raises(TicketError) as info:
        Ticket.from_bytes(data)
    message = str(info.value)
    assert message == f"ticket is malformed ({words}): pass the bytes Ticket.to_bytes() returned, unchanged " \
                      f"(a ticket cut or altered on the way cannot be read)"
    assert "Expected" not in message and "$[" not in message  # not the decoder's words


def test_a_flipped_byte_and_a_cut_ticket_say_what_is_wrong():
    data = VALID[4]
    # The transport field's first character flipped to a non-letter: an unknown transport.
    at = data.index(b"tcp")
    flipped = data[:at] + b"\x01" + data[at + 1:]
    with pytest.raises(TicketError, match=r"^ticket is malformed \(field 2 \(transport\) names no transport"):
        Ticket.from_bytes(flipped)
    with pytest.raises(TicketError, match=r"^ticket is malformed \(it ends too soon: truncated\): pass the bytes"):
        Ticket.from_bytes(data[:-3])


def test_oversized_ticket_rejected_before_decoding():
    data = VALID[0] + b"\0" * (MAX_TICKET_NBYTES + 1 - len(VALID[0]))
    t0 = time.monotonic()
    with pytest.raises(TicketError, match="exceeds"):
        Ticket.from_bytes(data)
    assert time.monotonic() - t0 < 1.0


def test_bad_layout_bytes_fail_on_access_as_a_ticket_error():
    t = Ticket.from_bytes(make_ticket(layout_bytes=b"TFLY" + b"\0" * 40).to_bytes())
    with pytest.raises(TicketError, match=r"layout is truncated.*: pass the bytes Ticket\.to_bytes\(\) returned, unchanged"):
        t.layout


def test_every_flipped_byte_is_refused_with_the_fix_or_decodes():
    """A byte flipped anywhere: either a TicketError that names the fix, or a
    ticket that still decodes (an altered id, address or lease, which the
    sender refuses by the digest before it lends a slot)."""
    data = VALID[4]
    refused = 0
    for at in range(len(data)):
        flipped = bytearray(data)
        flipped[at] ^= 0x5A
        try:
            Ticket.from_bytes(bytes(flipped)).layout
        except TicketError as exc:
            refused += 1
            assert "Ticket.to_bytes() returned, unchanged" in str(exc), (at, str(exc))
    assert refused > len(data) // 2


def _decode_only_tensorferry_errors(data: bytes) -> None:
    try:
        t = Ticket.from_bytes(data)
        t.layout  # decoded on access: must be as careful
        t.streamed
        t.digest
    except TensorferryError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_ticket_bytes(data):
    with pytest.raises(TicketError):
        Ticket.from_bytes(data)  # no magic: never a ticket
    _decode_only_tensorferry_errors(b"TFTK\x01\x00" + data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_fuzz_truncated_and_corrupted_tickets(valid, data):
    cut = data.draw(st.integers(0, len(valid) - 1))
    with pytest.raises(TicketError):
        Ticket.from_bytes(valid[:cut])
    buf = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    _decode_only_tensorferry_errors(bytes(buf))
