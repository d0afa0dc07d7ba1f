"""Sharded deltas: delta plans over shards (``tf.Box`` here; DTensors in
real process groups in ``test_sharded_dtensor.py``) into kept sharded
plans, which read only the delta's records of the chunks their ranges
touch, from every source rank; everyone else reads its whole ranges.

Real senders (one per source rank) and receivers over shm and tcp. Every
check is bitwise against the sources' values cast as the plans cast them;
what a worker received is its receiver's ``bytes_received``.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorferry as tf
from tensorferry.plans._delta import CHUNK_WORDS, chunk_table
from tensorferry.plans._delta_sharded import _groups

MiB = 1 << 20
RANKS = 2
# name -> global shape; each source rank holds a band of rows (uneven: 3 ranks' worth
# of rows split over 2), sent as bfloat16.
SHAPES = {"embed": (1001, 512), "proj": (512, 1536), "norm": (64, 3)}


def _sources(seed: int) -> list[dict[str, tf.Box]]:
    g = torch.Generator().manual_seed(seed)
    out: list[dict[str, tf.Box]] = [{} for _ in range(RANKS)]
    for name, (rows, cols) in SHAPES.items():
        full = torch.randn(rows, cols, generator=g)
        cut = [0, rows * 3 // 5, rows]
        for k in range(RANKS):
            out[k][name] = tf.Box(full[cut[k] : cut[k + 1]].clone(), (cut[k], 0), (rows, cols))
    return out


def _global(sources: list[dict[str, tf.Box]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([s[name].tensor for s in sources]).to(torch.bfloat16) for name in SHAPES}


def _target(kind: str, worker: int, workers: int = 2) -> dict[str, tf.Box]:
    """A worker's boxes: ``column`` (a band of columns: every source row's
    part) or ``row`` (a band of rows)."""
    out = {}
    for name, (rows, cols) in SHAPES.items():
        n = rows if kind == "row" else cols
        lo, hi = n * worker // workers, n * (worker + 1) // workers
        if kind == "row":
            out[name] = tf.Box(torch.zeros(hi - lo, cols, dtype=torch.bfloat16), (lo, 0), (rows, cols))
        else:
            out[name] = tf.Box(torch.zeros(rows, hi - lo, dtype=torch.bfloat16), (0, lo), (rows, cols))
    return out


def _exact(target: dict[str, tf.Box], want: dict[str, torch.Tensor]) -> bool:
    for name, box in target.items():
        region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.tensor.shape))
        if not torch.equal(box.tensor.view(torch.int16), want[name][region].contiguous().view(torch.int16)):
            return False
    return True


def _share(target: dict[str, tf.Box]) -> int:
    return sum(b.tensor.numel() * b.tensor.element_size() for b in target.values())


def _change(sources: list[dict[str, tf.Box]], g: torch.Generator, fraction: float) -> None:
    for s in sources:
        for box in s.values():
            flat = box.tensor.view(-1)
            n = max(1, int(flat.numel() * fraction)) if fraction else 0
            if n:
                idx = torch.randint(0, flat.numel(), (n,), generator=g)
                flat[idx] += 1.0 + torch.rand(n, generator=g)


class _Ranks:
    """One sender a source rank, each with a bf16 delta plan of its boxes."""

    def __init__(self, transport: str, sources: list[dict[str, tf.Box]], delta: bool = True) -> None:
        self.senders = [tf.Sender(transport, capacity_nbytes=32 * MiB) for _ in sources]
        self.plans = [s.plan(src, dtype=torch.bfloat16, delta=delta) for s, src in zip(self.senders, sources)]

    def put(self, readers: int) -> list:
        return [s.put(p, readers=readers) for s, p in zip(self.senders, self.plans)]

    def released(self, tickets: list) -> None:
        for s, t in zip(self.senders, tickets):
            s.wait_released(t, timeout=20)

    def close(self) -> None:
        for s in self.senders:
            s.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_small_step_reads_only_changed_chunks_of_each_workers_ranges(transport):
    """Column and row workers of row-sharded sources: the first get reads
    the whole share; after a small step (1% over tcp; 0.1% over shm, where
    a sender sends only deltas under 1% of the bytes) each worker receives
    at most 5% of its share, from every rank, and ends bit-exact; a
    non-delta plan's worker receives its whole share every time."""
    g = torch.Generator().manual_seed(1)
    sources = _sources(0)
    ranks = _Ranks(transport, sources)
    plain = _Ranks(transport, sources, delta=False)
    targets = [_target("column", 0), _target("column", 1), _target("row", 0), _target("row", 1)]
    receivers = [tf.Receiver(transport, timeout=30.0) for _ in targets]
    other = tf.Receiver(transport, timeout=30.0)
    other_target = _target("column", 1)
    fraction = 0.01 if transport == "tcp" else 0.001
    try:
        tickets = ranks.put(len(targets))
        splans = [r.plan(tickets, into=t) for r, t in zip(receivers, targets)]
        for step in range(4):
            if step:
                _change(sources, g, fraction)
                tickets = ranks.put(len(targets))
            for r, t, sp in zip(receivers, targets, splans):
                before = r.bytes_received
                r.get(tickets, into=sp)
                got = r.bytes_received - before
                assert _exact(t, _global(sources)), (step, t)
                if step == 0:
                    assert got == _share(t)
                else:
                    assert all(x.delta is not None and x.delta.base for x in tickets), [x.delta for x in tickets]
                    assert 0 < got <= 0.05 * _share(t), (step, got, _share(t))
            ranks.released(tickets)
            whole = plain.put(1)
            before = other.bytes_received
            other.get(whole, into=other_target)
            assert other.bytes_received - before == _share(other_target)
            assert _exact(other_target, _global(sources))
            plain.released(whole)
    finally:
        for r in [*receivers, other]:
            r.close()
        ranks.close()
        plain.close()


def test_the_index_lets_a_row_worker_skip_the_other_ranks_chunks():
    """Row workers whose rows lie on one rank read only that rank's
    records: a worker of rows [0, 300) of the embedding (all on rank 0),
    after a 1% step, receives no more than rank 0's delta."""
    g = torch.Generator().manual_seed(2)
    sources = _sources(3)
    ranks = _Ranks("tcp", sources)
    target = {"embed": tf.Box(torch.zeros(300, 512, dtype=torch.bfloat16), (0, 0), (1001, 512)),
              "proj": tf.Box(torch.zeros(100, 1536, dtype=torch.bfloat16), (0, 0), (512, 1536)),
              "norm": tf.Box(torch.zeros(10, 3, dtype=torch.bfloat16), (0, 0), (64, 3))}
    try:
        with tf.Receiver("tcp", timeout=30.0) as r:
            tickets = ranks.put(1)
            sp = r.plan(tickets, into=target)
            r.get(tickets, into=sp)
            ranks.released(tickets)
            _change(sources, g, 0.01)
            tickets = ranks.put(1)
            before = r.bytes_received
            r.get(tickets, into=sp)
            got = r.bytes_received - before
            assert _exact(target, _global(sources))
            assert 0 < got < tickets[0].delta.nbytes * 0.5, (got, tickets[0].delta.nbytes)
            ranks.released(tickets)
    finally:
        ranks.close()


def test_chunk_groups_are_the_chunks_the_runs_touch():
    layout_sizes = np.array([3 * CHUNK_WORDS * 2 + 10, 5000 * 4], dtype=np.int64)

    class _Layout:
        nbytes = layout_sizes
        alignments = np.array([2, 4], dtype=np.int64)
        boxes = object()

    offsets = np.array([0, (int(layout_sizes[0]) + 3) // 4 * 4], dtype=np.int64)
    table = chunk_table(_Layout, offsets)
    assert table.count == 6 and table.index_nbytes == 48
    # a run inside chunk 1, one spanning the end of chunk 3 and chunk 4, one in chunk 5
    pos = np.array([CHUNK_WORDS * 2 + 4, int(offsets[0]) + 3 * CHUNK_WORDS * 2, int(offsets[1]) + CHUNK_WORDS * 4 + 8])
    n = np.array([8, 2 + 12, 4])
    first, last = _groups(table, pos, pos, n)
    assert first.tolist() == [1, 3] and last.tolist() == [2, 6]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.001, 0.01, 0.3]),  # fraction changed before the puts
            st.lists(st.sampled_from(["get", "skip", "replan", "restart"]), min_size=3, max_size=3),  # each worker's move
        ),
        min_size=1,
        max_size=6,
    ),
    transport=st.sampled_from(["shm", "tcp"]),
    seed=st.integers(0, 2**16),
)
def test_any_sequence_of_steps_skips_joins_and_replans_ends_bit_exact(steps, transport, seed):
    """Three workers (two column halves, one row band) over any sequence
    of steps; each worker gets, skips (then reads its whole share), makes
    its plan again or restarts its receiver; a worker joins at its first
    get. Every get ends bit-exact, and a get whose plan held the base of
    every rank's delta reads less than the share."""
    g = torch.Generator().manual_seed(seed)
    sources = _sources(seed)
    ranks = _Ranks(transport, sources)
    targets = [_target("column", 0), _target("column", 1), _target("row", 1)]
    receivers = [tf.Receiver(transport, timeout=30.0) for _ in targets]
    plans: list = [None] * len(targets)
    held: list = [None] * len(targets)  # the versions each worker's plan holds
    try:
        for fraction, moves in steps:
            _change(sources, g, fraction)
            readers = [i for i, m in enumerate(moves) if m != "skip"]
            tickets = ranks.put(max(1, len(readers)))
            for i in readers:
                if moves[i] == "restart":
                    receivers[i].close()
                    receivers[i] = tf.Receiver(transport, timeout=30.0)
                    plans[i] = None
                if moves[i] in ("replan", "restart") or plans[i] is None:
                    plans[i] = receivers[i].plan(tickets, into=targets[i])
                    held[i] = None
                before = receivers[i].bytes_received
                receivers[i].get(tickets, into=plans[i])
                got = receivers[i].bytes_received - before
                assert _exact(targets[i], _global(sources)), (i, moves)
                based = held[i] is not None and all(t.delta.base == h for t, h in zip(tickets, held[i]))
                if not based:
                    assert got == _share(targets[i])
                elif all(t.delta.nbytes < 0.3 * t.total_nbytes for t in tickets):
                    assert got < _share(targets[i])
                held[i] = [t.delta.version for t in tickets]
            if not readers:
                for s, t in zip(ranks.senders, tickets):
                    s.discard(t)
            else:
                ranks.released(tickets)
    finally:
        for r in receivers:
            r.close()
        ranks.close()


def test_relaying_replicas_pass_delta_records_and_whole_shares_on():
    """Ranks put with ``fanout=1`` to three relaying replicas of one column
    worker: the first sync (whole shares) goes through the relays; after a
    1% step each replica reads its delta records (at most 5% of its share),
    of which the replicas pass on to each other, and all end bit-exact; a
    replica that skipped a step reads its whole share."""
    g = torch.Generator().manual_seed(5)
    sources = _sources(9)
    ranks = _Ranks("tcp", sources)
    targets = [_target("column", 0) for _ in range(3)]
    receivers = [tf.Receiver("tcp", timeout=30.0, relay=True) for _ in targets]
    try:
        plans = None
        for step, moves in enumerate([("get",) * 3, ("get", "get", "skip"), ("get",) * 3]):
            if step:
                _change(sources, g, 0.01)
            readers = [i for i, m in enumerate(moves) if m == "get"]
            tickets = [s.put(p, readers=len(readers), fanout=1) for s, p in zip(ranks.senders, ranks.plans)]
            plans = plans or [r.plan(tickets, into=t) for r, t in zip(receivers, targets)]
            got = {}
            for i in readers:
                before = receivers[i].bytes_received
                receivers[i].get(tickets, into=plans[i])
                got[i] = receivers[i].bytes_received - before
                assert _exact(targets[i], _global(sources)), (step, i)
            ranks.released(tickets)
            share = _share(targets[0])
            relayed = [sum(r.stats()[k] for k in ("relay_memory_read_nbytes", "relay_stream_nbytes", "relay_nixl_read_nbytes"))
                       for r in receivers]
            if step == 0:
                assert sum(relayed) >= share, relayed  # two replicas' shares, at least one of them from a relay
            if step == 1:
                assert all(0 < n <= 0.05 * share for n in got.values()), got
                # the delta records: one replica's from the ranks, the next's from it
                assert 0 < sum(relayed) - sum(before_step) <= 0.05 * share, (relayed, before_step)
            before_step = relayed
            if step == 2:
                assert got[2] == share and all(0 < got[i] <= 0.05 * share for i in (0, 1)), got
    finally:
        for r in receivers:
            r.close()
        ranks.close()


@pytest.mark.parametrize("where", ["index", "record"])
def test_a_corrupted_sharded_delta_is_refused_and_the_next_get_reads_the_whole_share(where):
    """Every index entry a worker reads and every record is checked: an
    index entry past the records, or a record's chunk index out of range,
    written over rank 0's delta block, is a ProtocolError; that rank's
    version is dropped, so the next get reads the worker's whole share of
    it, and the targets end bit-exact."""
    from tensorferry.errors import ProtocolError
    from tensorferry.memory._pool import Block

    g = torch.Generator().manual_seed(4)
    sources = _sources(6)
    ranks = _Ranks("tcp", sources)
    target = _target("column", 0)
    try:
        with tf.Receiver("tcp", timeout=30.0) as r:
            tickets = ranks.put(1)
            sp = r.plan(tickets, into=target)
            r.get(tickets, into=sp)
            ranks.released(tickets)
            _change(sources, g, 0.01)
            tickets = ranks.put(1)
            (offset, nbytes), = tickets[0].delta.blocks
            block = ranks.senders[0].pool.view(Block(offset, nbytes))
            if where == "index":
                block[nbytes - 8 :] = 0x7F  # the last chunk's record end: far past the records
            else:
                block[:4] = 0xFF  # the first record's chunk: 2**32 - 1, out of range
            with pytest.raises(ProtocolError):
                r.get(tickets, into=sp)
            for s, t in zip(ranks.senders, tickets):
                s.discard(t)
            _change(sources, g, 0.01)
            tickets = ranks.put(1)
            before = r.bytes_received
            r.get(tickets, into=sp)
            got = r.bytes_received - before
            assert _exact(target, _global(sources))
            # rank 0's part whole (its version was dropped), rank 1's by delta
            assert _share(target) * 0.3 < got < _share(target), (got, _share(target))
            ranks.released(tickets)
    finally:
        ranks.close()


def test_a_worker_that_maps_the_ranks_memory_reads_a_dense_delta_whole():
    """Ranks serving shm and tcp send deltas up to the across-hosts limit
    (a 10% step's is sent); a worker over shm (it maps the ranks' pools)
    reads its whole share instead, as a whole object's get does past the
    same-host limit, and a worker over tcp reads the delta; both exact."""
    g = torch.Generator().manual_seed(8)
    sources = _sources(2)
    senders = [tf.Sender("shm", extra_transports=("tcp",), capacity_nbytes=32 * MiB) for _ in sources]
    plans = [s.plan(src, dtype=torch.bfloat16, delta=True) for s, src in zip(senders, sources)]
    targets = {"shm": _target("column", 0), "tcp": _target("column", 0)}
    try:
        with tf.Receiver("shm", timeout=30.0) as r_shm, tf.Receiver("tcp", timeout=30.0) as r_tcp:
            receivers = {"shm": r_shm, "tcp": r_tcp}
            splans: dict = {}
            for step in range(2):
                if step:
                    _change(sources, g, 0.1)
                puts = [s.put(p, readers=2) for s, p in zip(senders, plans)]
                got = {}
                for name, r in receivers.items():
                    tickets = [s.ticket_for(t, name) for s, t in zip(senders, puts)]
                    splans[name] = splans.get(name) or r.plan(tickets, into=targets[name])
                    before = r.bytes_received
                    r.get(tickets, into=splans[name])
                    got[name] = r.bytes_received - before
                    assert _exact(targets[name], _global(sources)), (step, name)
                for s, t in zip(senders, puts):
                    s.wait_released(t, timeout=20)
            assert all(t.delta.base and t.delta.nbytes > 0.01 * t.total_nbytes for t in puts)
            assert got["shm"] == _share(targets["shm"]) and got["tcp"] < _share(targets["tcp"]), got
    finally:
        for s in senders:
            s.close()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_snapshot_false_puts_offer_sharded_deltas_too(transport):
    """``put(plan, snapshot=False)`` (the ranks' tensors served as they
    are, compared in place): after a 0.1% step a worker reads its delta
    records, a small part of its share, bit-exact."""
    g = torch.Generator().manual_seed(3)
    sources = [{k: tf.Box(b.tensor.to(torch.bfloat16), b.offsets, b.global_shape) for k, b in s.items()} for s in _sources(1)]
    senders = [tf.Sender(transport, capacity_nbytes=32 * MiB) for _ in sources]
    plans = [s.plan(src, delta=True) for s, src in zip(senders, sources)]
    target = _target("column", 1)
    try:
        with tf.Receiver(transport, timeout=30.0) as r:
            sp = None
            for step in range(3):
                if step:
                    _change(sources, g, 0.001)
                tickets = [s.put(p, readers=1, snapshot=False) for s, p in zip(senders, plans)]
                sp = sp or r.plan(tickets, into=target)
                before = r.bytes_received
                r.get(tickets, into=sp)
                got = r.bytes_received - before
                assert _exact(target, {n: torch.cat([s[n].tensor for s in sources]) for n in SHAPES}), step
                assert got == _share(target) if step == 0 else 0 < got <= 0.05 * _share(target), (step, got)
                for s, t in zip(senders, tickets):
                    s.wait_released(t, timeout=20)
    finally:
        for s in senders:
            s.close()
