"""NixlEndpoint against real NIXL/UCX on loopback, between real processes.

Peers are spawned processes that register a pool of seeded random bytes and
hand their metadata over a Pipe; this process reads from them and checks
every byte. On one host UCX reads a peer's memory with CMA, which needs
nothing from the peer once connected (a stopped peer is still readable), so
the timeout and mid-read death tests use a peer restricted to TCP
(``UCX_TLS=tcp``), whose READ needs the peer's progress.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import struct
import threading
import time
import uuid
from typing import Any, NamedTuple

# Before NIXL is imported anywhere in this process: UCX must use loopback only.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np
import pytest


def _require_nixl() -> None:
    """Skip when the nixl extra is absent; a broken install fails, it does not skip."""
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("the nixl extra is not installed (pip install nixl==1.5.1 after torch)", allow_module_level=True)
    import nixl._api  # noqa: F401  (import errors of an installed nixl must surface)


_require_nixl()

import torch  # noqa: E402

from tensorferry.errors import PeerGoneError, ProtocolError, TransferError, TransferTimeoutError  # noqa: E402
from tensorferry.transports._nixl_agent import NixlEndpoint, Region  # noqa: E402

pytestmark = pytest.mark.nixl

MIB = 1 << 20
POOL_NBYTES = 64 * MIB
_CTX = mp.get_context("spawn")
_SPAWN_TIMEOUT_SECONDS = 60.0


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    """The bytes a peer with ``seed`` holds: both sides regenerate them."""
    return torch.empty(nbytes, dtype=torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(seed))


def _serve(conn: Any, nbytes: int, seed: int, env: dict[str, str]) -> None:
    """Peer process: register a pool of seeded bytes, send its metadata, obey commands."""
    os.environ.update(env)  # before NIXL is imported in this process
    from tensorferry.transports._nixl_agent import NixlEndpoint

    ep = NixlEndpoint(f"peer-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    pool = _pattern(nbytes, seed)
    ep.register(pool)
    conn.send((ep.metadata(), pool.data_ptr(), nbytes))
    while True:
        cmd = conn.recv()
        if cmd == "close":
            ep.close()
            conn.send("closed")
        elif cmd == "exit":
            ep.close()
            return


class Peer(NamedTuple):
    proc: Any
    conn: Any
    metadata: bytes
    base: int
    nbytes: int
    expected: torch.Tensor


def _spawn_peer(nbytes: int = POOL_NBYTES, seed: int = 1, env: dict[str, str] | None = None) -> Peer:
    ours, theirs = _CTX.Pipe()
    proc = _CTX.Process(target=_serve, args=(theirs, nbytes, seed, env or {}), daemon=True)
    proc.start()
    theirs.close()
    if not ours.poll(_SPAWN_TIMEOUT_SECONDS):
        proc.kill()
        raise AssertionError(f"peer {proc.pid} sent no metadata in {_SPAWN_TIMEOUT_SECONDS} s")
    md, base, n = ours.recv()
    return Peer(proc, ours, md, base, n, _pattern(nbytes, seed))


def _sigstop(pid: int) -> None:
    """Stop ``pid`` and wait until the kernel reports every thread stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                states.add(f.read().rsplit(b")", 1)[1].split()[0])
        if states <= {b"T", b"t"}:
            return
        time.sleep(0.001)
    raise AssertionError(f"peer {pid} did not stop within 10 s")


def _stop_peer(peer: Peer) -> None:
    if peer.proc.is_alive():
        try:
            os.kill(peer.proc.pid, signal.SIGCONT)  # a test may leave it stopped
            peer.conn.send("exit")
        except (OSError, BrokenPipeError):
            pass
        peer.proc.join(5)
    if peer.proc.is_alive():
        peer.proc.kill()
        peer.proc.join(5)
    peer.conn.close()


@pytest.fixture(scope="module")
def peer() -> Any:
    p = _spawn_peer()
    yield p
    _stop_peer(p)


@pytest.fixture()
def reader() -> Any:
    # A reader serves nobody: no background progress thread.
    with NixlEndpoint(f"reader-{uuid.uuid4().hex[:8]}", progress_interval_seconds=None) as ep:
        ep.dst = torch.zeros(POOL_NBYTES, dtype=torch.uint8)  # type: ignore[attr-defined]
        ep.register(ep.dst)  # type: ignore[attr-defined]
        yield ep


def _scattered_ranges(rng: np.random.Generator, count: int, total_nbytes: int, space_nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` disjoint (offset, nbytes) ranges of random sizes inside ``space_nbytes``, in random order."""
    sizes = rng.integers(1, 2 * total_nbytes // count, size=count)
    gaps = rng.integers(0, (space_nbytes - sizes.sum()) // count, size=count)
    offsets = np.cumsum(gaps) + np.concatenate(([0], np.cumsum(sizes)[:-1]))
    assert offsets[-1] + sizes[-1] <= space_nbytes
    order = rng.permutation(count)  # never adjacent in list order: no merging
    return offsets[order], sizes[order]


def _check(dst: torch.Tensor, expected: torch.Tensor, l_off: np.ndarray, r_off: np.ndarray, sizes: np.ndarray) -> None:
    for lo, ro, n in zip(l_off.tolist(), r_off.tolist(), sizes.tolist()):
        assert torch.equal(dst[lo : lo + n], expected[ro : ro + n]), f"bytes differ: local {lo}, remote {ro}, {n} bytes"


def test_read_one_descriptor_verified(peer: Peer, reader: NixlEndpoint) -> None:
    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    l_off, r_off, n = 4096, 1000, 16 * MIB + 3  # odd, unaligned: READ moves bytes, not pages
    reader.read(name, [(peer.base + r_off, n)], [(dst.data_ptr() + l_off, n)], timeout=30)
    assert torch.equal(dst[l_off : l_off + n], peer.expected[r_off : r_off + n])
    # Nothing outside the destination range was written.
    assert not dst[:l_off].any() and not dst[l_off + n :].any()


def test_read_1000_descriptors_verified(peer: Peer, reader: NixlEndpoint) -> None:
    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    r_off, sizes = _scattered_ranges(rng, 1000, 8 * MIB, POOL_NBYTES)
    # Destinations packed in another order, with 64-byte holes between them.
    order = rng.permutation(1000)
    l_off = np.empty(1000, dtype=np.int64)
    l_off[order] = np.concatenate(([0], np.cumsum(sizes[order] + 64)[:-1]))
    remote = np.stack([peer.base + r_off, sizes], axis=1).astype(np.uint64)
    local = np.stack([dst.data_ptr() + l_off, sizes], axis=1).astype(np.uint64)
    reader.read(name, remote, local, timeout=30)
    _check(dst, peer.expected, l_off, r_off, sizes)
    # The holes between destinations stay untouched.
    ends = (l_off + sizes)[order]
    holes = torch.from_numpy((ends[:, None] + np.arange(64)).ravel())
    assert not dst[holes].any()
    # Plain Python lists of tuples work too (what the transport may pass).
    dst.zero_()
    reader.read(name, [tuple(map(int, r)) for r in remote[:50]], [tuple(map(int, r)) for r in local[:50]], timeout=30)
    _check(dst, peer.expected, l_off[:50], r_off[:50], sizes[:50])


def test_adjacent_ranges_merge_but_not_across_registrations(peer: Peer) -> None:
    # Two local registrations that touch: a range pair adjacent on both
    # sides but crossing their boundary must go out as two descriptors.
    buf = torch.zeros(8 * MIB, dtype=torch.uint8)
    half = 4 * MIB
    with NixlEndpoint(f"reader-{uuid.uuid4().hex[:8]}", progress_interval_seconds=None) as ep:
        ep.register(buf[:half])
        ep.register(buf[half:])
        name = ep.add_remote(peer.metadata)
        step = 256 * 1024
        starts = np.arange(0, 8 * MIB, step)
        remote = [(peer.base + int(s), step) for s in starts]
        local = [(buf.data_ptr() + int(s), step) for s in starts]
        ep.read(name, remote, local, timeout=30)
        assert torch.equal(buf, peer.expected[: 8 * MIB])


def test_many_reads_reuse_one_registration(peer: Peer, reader: NixlEndpoint) -> None:
    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    regions_before = reader.regions
    fds_before = len(os.listdir("/proc/self/fd"))
    rng = np.random.default_rng(1)
    for i in range(200):
        count = int(rng.integers(1, 40))
        r_off, sizes = _scattered_ranges(rng, count, 256 * 1024, POOL_NBYTES)
        l_off = rng.permutation(np.arange(count)) * (512 * 1024)
        dst[: count * 512 * 1024].zero_()
        reader.read(
            name,
            np.stack([peer.base + r_off, sizes], axis=1),
            np.stack([dst.data_ptr() + l_off, sizes], axis=1),
            timeout=30,
        )
        _check(dst, peer.expected, l_off, r_off, sizes)
    assert reader.regions == regions_before and len(regions_before) == 1
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2  # no handle leaks a descriptor


def test_concurrent_reads_from_threads(peer: Peer, reader: NixlEndpoint) -> None:
    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    errors: list[BaseException] = []
    slot = 8 * MIB

    def work(t: int) -> None:
        rng = np.random.default_rng(100 + t)
        try:
            for _ in range(25):
                n = int(rng.integers(1, slot))
                ro = int(rng.integers(0, POOL_NBYTES - n))
                reader.read(name, [(peer.base + ro, n)], [(dst.data_ptr() + t * slot, n)], timeout=30)
                assert torch.equal(dst[t * slot : t * slot + n], peer.expected[ro : ro + n])
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors


def test_out_of_range_and_malformed_ranges_rejected_before_any_transfer(peer: Peer, reader: NixlEndpoint) -> None:
    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    d, b, n = dst.data_ptr(), peer.base, POOL_NBYTES
    ok = (b, 4096)
    good_local = (d, 4096)
    cases: list[tuple[Any, Any, str]] = [
        ([(b + n - 100, 200)], [(d, 200)], "remote range 0"),  # runs past the peer's region end
        ([(b - 1, 10)], [(d, 10)], "remote range 0"),  # starts before it
        ([(b + n, 1)], [(d, 1)], "remote range 0"),  # just past it
        ([ok, (1 << 40, 4096)], [good_local, (d + 8192, 4096)], "remote range 1"),
        ([ok], [(d + n - 10, 4096)], "local range 0"),
        ([ok], [(12345, 4096)], "local range 0"),
        ([(b, -5)], [(d, -5)], "cannot be negative"),
        ([ok, ok], [good_local], "2 remote ranges but 1 local"),
        ([(b, 100)], [(d, 200)], "byte counts must match"),
        ([(b, 1, 2)], [(d, 1, 2)], "(address, nbytes) pairs"),
        (np.array([[1.5, 2.0]]), [(d, 2)], "integers"),
    ]
    for remote, local, needle in cases:
        with pytest.raises(ValueError) as info:
            reader.read(name, remote, local, timeout=5)
        assert needle in str(info.value), (needle, str(info.value))
    msg = str(pytest.raises(ValueError, reader.read, name, [(b + n - 100, 200)], [(d, 200)], timeout=5).value)
    assert f"{b + n - 100:#x}" in msg and "200 bytes" in msg and f"{b:#x}" in msg  # the numbers are in the message
    with pytest.raises(ValueError, match="unknown peer 'nobody'"):
        reader.read("nobody", [ok], [good_local], timeout=5)
    for bad_timeout in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            reader.read(name, [ok], [good_local], timeout=bad_timeout)
    assert not dst.any()  # nothing was transferred by any of them
    reader.read(name, [], [], timeout=5)  # nothing to do is fine
    reader.read(name, [(b, 0)], [(d, 0)], timeout=5)  # zero-byte pairs are skipped
    reader.read(name, [ok], [good_local], timeout=5)  # and the endpoint still reads
    assert torch.equal(dst[:4096], peer.expected[:4096])


def test_peer_without_registered_memory_is_rejected() -> None:
    with NixlEndpoint("empty-peer", progress_interval_seconds=None) as empty, NixlEndpoint(
        f"reader-{uuid.uuid4().hex[:8]}", progress_interval_seconds=None
    ) as ep:
        buf = torch.zeros(4096, dtype=torch.uint8)
        ep.register(buf)
        name = ep.add_remote(empty.metadata())
        assert name == "empty-peer"
        with pytest.raises(ValueError, match="peer 'empty-peer' has no registered memory"):
            ep.read(name, [(buf.data_ptr(), 16)], [(buf.data_ptr(), 16)], timeout=5)


def test_range_the_peer_never_registered_is_refused_by_nixl(peer: Peer, reader: NixlEndpoint) -> None:
    # A peer whose envelope claims more than it registered: our bounds check
    # passes, NIXL's own registration lookup still refuses, before any byte moves.
    header = struct.Struct("<4sHHII")
    name_n = header.unpack_from(peer.metadata)[2]
    at = header.size + name_n + 8  # the first region's nbytes field
    forged = bytearray(peer.metadata)
    struct.pack_into("<Q", forged, at, peer.nbytes + 4096)
    name = reader.add_remote(bytes(forged))
    dst = reader.dst  # type: ignore[attr-defined]
    with pytest.raises(TransferError, match="no registration covering"):
        reader.read(name, [(peer.base + peer.nbytes, 16)], [(dst.data_ptr(), 16)], timeout=5)
    assert not dst.any()
    reader.read(name, [(peer.base, 16)], [(dst.data_ptr(), 16)], timeout=5)  # what it did register still reads
    assert torch.equal(dst[:16], peer.expected[:16])


def test_metadata_envelope_rejects_bad_bytes(peer: Peer, reader: NixlEndpoint) -> None:
    md = peer.metadata
    header = struct.Struct("<4sHHII")
    magic, version, name_n, regions_n, md_n = header.unpack_from(md)
    bad = {
        "empty": b"",
        "truncated header": md[:10],
        "truncated": md[:-1],
        "padded": md + b"\0",
        "magic": b"XXXX" + md[4:],
        "version": header.pack(magic, version + 1, name_n, regions_n, md_n) + md[header.size :],
        "huge regions": header.pack(magic, version, name_n, 1 << 30, md_n) + md[header.size :],
        "huge metadata": header.pack(magic, version, name_n, regions_n, 1 << 31) + md[header.size :],
        "random": np.random.default_rng(3).integers(0, 256, 500, dtype=np.uint8).tobytes(),
    }
    # The envelope is intact but NIXL's bytes inside are garbage.
    inner_at = len(md) - md_n
    bad["nixl garbage"] = md[:inner_at] + bytes(md_n)
    for label, data in bad.items():
        with pytest.raises(ProtocolError):
            reader.add_remote(data)
        assert reader.peers == [], label
    with pytest.raises(ValueError, match="this endpoint itself"):
        reader.add_remote(reader.metadata())
    # A good one still loads, twice (the second replaces the first).
    assert reader.add_remote(md) == reader.add_remote(md)
    assert len(reader.peers) == 1


def test_register_is_idempotent_and_rejects_overlap() -> None:
    with NixlEndpoint(f"reg-{uuid.uuid4().hex[:8]}", progress_interval_seconds=None) as ep:
        buf = torch.zeros(MIB, dtype=torch.uint8)
        first = ep.register(buf)
        assert first == Region(buf.data_ptr(), MIB, "DRAM", 0)
        assert ep.register(buf) == first and ep.register(buf.view(torch.int32)) == first
        assert ep.regions == [first]
        with pytest.raises(ValueError, match="overlaps"):
            ep.register(buf[100:200])
        with pytest.raises(ValueError, match="contiguous"):
            ep.register(torch.zeros(8, 8, dtype=torch.uint8).t())
        with pytest.raises(ValueError, match="empty"):
            ep.register(torch.zeros(0, dtype=torch.uint8))
        other = torch.zeros(4096, dtype=torch.uint8)
        ep.register(other)
        assert [r.addr for r in ep.regions] == sorted([buf.data_ptr(), other.data_ptr()])
        ep.deregister(buf)
        ep.deregister(buf)  # unknown now: ignored
        assert ep.regions == [Region(other.data_ptr(), 4096, "DRAM", 0)]


def test_close_is_idempotent_and_final(peer: Peer) -> None:
    ep = NixlEndpoint(f"close-{uuid.uuid4().hex[:8]}")  # with its progress thread
    buf = torch.zeros(4096, dtype=torch.uint8)
    ep.register(buf)
    name = ep.add_remote(peer.metadata)
    ep.close()
    ep.close()
    assert ep.closed and ep.regions == [] and ep.peers == []
    assert ep._progress_thread is not None and not ep._progress_thread.is_alive()
    for call in (
        lambda: ep.read(name, [(peer.base, 16)], [(buf.data_ptr(), 16)], timeout=5),
        lambda: ep.register(buf),
        ep.metadata,
        lambda: ep.add_remote(peer.metadata),
    ):
        with pytest.raises(TransferError, match="closed"):
            call()
    ep.remove_remote(name)  # cleanup after close is a no-op
    ep.progress()
    with NixlEndpoint(f"ctx-{uuid.uuid4().hex[:8]}", progress_interval_seconds=None) as ep2:
        ep2.register(buf)
    assert ep2.closed
    ep2.close()


def test_unknown_backend_is_unavailable() -> None:
    from tensorferry.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="no 'NOPE' backend"):
        NixlEndpoint(f"nb-{uuid.uuid4().hex[:8]}", backend="NOPE")


def test_stopped_peer_times_out_then_killed_peer_is_gone() -> None:
    # Over TCP a READ needs the peer's progress: stopped, it never finishes.
    # A small pool: UCX emulates READ over TCP at well under 1 GB/s.
    victim = _spawn_peer(nbytes=4 * MIB, seed=7, env={"UCX_TLS": "tcp"})
    pid = victim.proc.pid
    try:
        with NixlEndpoint(f"reader-{uuid.uuid4().hex[:8]}", progress_interval_seconds=None) as ep:
            dst = torch.zeros(victim.nbytes, dtype=torch.uint8)
            ep.register(dst)
            name = ep.add_remote(victim.metadata)
            one = ([(victim.base, MIB)], [(dst.data_ptr(), MIB)])
            ep.read(name, *one, timeout=30)  # connected, and the TCP path works
            assert torch.equal(dst[:MIB], victim.expected[:MIB])

            _sigstop(pid)
            outcome: list[BaseException | None] = []

            def stalled_read() -> None:
                try:
                    ep.read(name, *one, timeout=1.0)
                    outcome.append(None)
                except BaseException as exc:  # checked below
                    outcome.append(exc)

            try:
                stalled = threading.Thread(target=stalled_read)
                stalled.start()
                # The stalled read holds the endpoint until its timeout.
                def held() -> bool:
                    if ep._lock.acquire(blocking=False):
                        ep._lock.release()
                        return False
                    return True

                deadline = time.monotonic() + 5.0
                while not held() and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert held(), "the stalled read never started"
                # A second read on the same endpoint waits for the first, within its own timeout.
                with pytest.raises(TransferTimeoutError, match="waited 0.3 s for another read"):
                    ep.read(name, *one, timeout=0.3)
                stalled.join(10)
            finally:
                os.kill(pid, signal.SIGCONT)
            (exc,) = outcome
            assert isinstance(exc, TransferTimeoutError) and "did not finish within 1.0 s" in str(exc), exc
            # The cancelled request was released: the endpoint reads again.
            dst.zero_()
            ep.read(name, *one, timeout=30)
            assert torch.equal(dst[:MIB], victim.expected[:MIB])

            # Stopped, the peer holds a read in flight; then it dies under it.
            _sigstop(pid)
            threading.Timer(0.3, victim.proc.kill).start()
            # Detected, not timed out (that would be a TransferTimeoutError).
            with pytest.raises(PeerGoneError, match="disconnected"):
                ep.read(name, *one, timeout=20)
            # Later reads fail as gone too, and the peer can be forgotten.
            with pytest.raises(PeerGoneError):
                ep.read(name, *one, timeout=20)
            ep.remove_remote(name)
            assert ep.peers == []
    finally:
        _stop_peer(victim)


def test_dead_peer_over_cma_raises_and_endpoint_stays_usable(peer: Peer, reader: NixlEndpoint) -> None:
    victim = _spawn_peer(nbytes=4 * MIB, seed=11)
    try:
        dst = reader.dst  # type: ignore[attr-defined]
        gone = reader.add_remote(victim.metadata)
        alive = reader.add_remote(peer.metadata)
        reader.read(gone, [(victim.base, MIB)], [(dst.data_ptr(), MIB)], timeout=30)
        assert torch.equal(dst[:MIB], victim.expected[:MIB])
        victim.proc.kill()
        victim.proc.join(10)
        with pytest.raises(PeerGoneError):
            reader.read(gone, [(victim.base, MIB)], [(dst.data_ptr(), MIB)], timeout=20)
        reader.read(alive, [(peer.base, MIB)], [(dst.data_ptr(), MIB)], timeout=30)
        assert torch.equal(dst[:MIB], peer.expected[:MIB])
    finally:
        _stop_peer(victim)


def test_unclosed_endpoint_is_collected_and_its_thread_ends() -> None:
    import gc

    ep = NixlEndpoint(f"gc-{uuid.uuid4().hex[:8]}")
    ep.register(torch.zeros(4096, dtype=torch.uint8))
    thread = ep._progress_thread
    assert thread is not None and thread.is_alive()
    del ep
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()


def test_a_pipeline_of_posted_reads_completes_in_order(peer: Peer, reader: NixlEndpoint) -> None:
    """Chunks READ two at a time (post_read / poll_read): each chunk's end
    comes back in the order posted, once its bytes are in place."""
    from tensorferry.transports._nixl_reads import ReadPipeline

    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    pipe = ReadPipeline(reader, name, depth=2)
    chunk, total, ends = 3 * MIB + 5, 40 * MIB, []
    pos = 0
    while pos < total:
        if pipe.full:
            end = pipe.wait()
            assert torch.equal(dst[:end], peer.expected[:end])  # everything up to a reported end is in place
            ends.append(end)
        k = min(chunk, total - pos)
        pipe.post(peer.base + pos, dst.data_ptr() + pos, k, pos + k, timeout=30)
        assert len(pipe.inflight) <= 2
        pos += k
    while pipe.inflight:
        ends.append(pipe.wait())
    assert ends == sorted(ends) and ends[-1] == total and len(ends) == -(-total // chunk)
    assert torch.equal(dst[:total], peer.expected[:total])


def test_a_posted_read_is_checked_first_and_a_cancelled_one_leaves_the_endpoint_usable(peer: Peer, reader: NixlEndpoint) -> None:
    name = reader.add_remote(peer.metadata)
    dst = reader.dst  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="outside|not inside|registered"):
        reader.post_read(name, [(peer.base + peer.nbytes - 10, 20)], [(dst.data_ptr(), 20)], timeout=5)
    pending = reader.post_read(name, [(peer.base, 32 * MIB)], [(dst.data_ptr(), 32 * MIB)], timeout=30)
    reader.cancel_read(pending)
    assert reader.poll_read(pending)  # released: nothing left in flight
    dst.zero_()
    reader.read(name, [(peer.base, 8 * MIB)], [(dst.data_ptr(), 8 * MIB)], timeout=30)
    assert torch.equal(dst[: 8 * MIB], peer.expected[: 8 * MIB])
