"""The receive cache (_recv_cache.py) on its own, and under real gets.

Real Senders and Receivers over shm and tcp on loopback; the memory the
cache keeps is checked in /proc/self/maps. No timing is asserted: a wait
for the trimmer polls its condition.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from tensorferry import ConfigurationError, MemoryPool, Receiver, Sender
from tensorferry.memory._recv_cache import CACHE_ENV, ReceiveCache, cap_nbytes
from tensorferry.monitor._pools import POOL_KEYS, collect_pool_figures

MiB = 1 << 20
TRANSPORTS = ("shm", "tcp")


def payload(seed: int, nbytes: int = 4 * MiB, count: int = 4) -> list[torch.Tensor]:
    """``count`` float32 tensors of ``nbytes`` in all, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(nbytes // 4 // count, generator=g) for _ in range(count)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def mapped_nbytes(lo: int, nbytes: int) -> int:
    """Bytes of ``[lo, lo + nbytes)`` that some mapping of this process covers."""
    hi = lo + nbytes
    covered = 0
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split()[0].split("-"))
            covered += max(0, min(b, hi) - max(a, lo))
    return covered


def wait_for(cond, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def cache_figures(name: str):
    return next((f for f in collect_pool_figures()[0] if f.name == name), None)


# -- under real gets -------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_second_get_reuses_the_memory_of_a_collected_result(transport):
    x = payload(1)
    with Sender(transport, capacity_nbytes=8 * MiB) as s, Receiver(transport, timeout=20.0) as r:
        t = s.put(x, readers=None)
        first = r.get(t)
        ptr = first[0].data_ptr()
        assert same(first, x)
        st = r.stats()
        assert (st["cache_misses"], st["cache_hits"], st["cache_live_nbytes"], st["cache_cached_nbytes"]) == (1, 0, 4 * MiB, 0)
        del first
        st = r.stats()
        assert (st["cache_live_nbytes"], st["cache_cached_nbytes"], st["cache_cached_buffers"]) == (0, 4 * MiB, 1)
        second = r.get(t)
        assert second[0].data_ptr() == ptr
        assert same(second, x)
        st = r.stats()
        assert (st["cache_misses"], st["cache_hits"], st["cache_cached_nbytes"]) == (1, 1, 0)
        assert (st["gets"], st["bytes_received"], st["cache_taken_nbytes"]) == (2, 8 * MiB, 8 * MiB)
        s.discard(t)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_results_still_alive_are_never_reused(transport):
    x, y = payload(2), payload(3)
    with Sender(transport, capacity_nbytes=16 * MiB) as s, Receiver(transport, timeout=20.0) as r:
        tx, ty = s.put(x, readers=None), s.put(y, readers=None)
        kept = r.get(tx)
        for _ in range(3):
            other = r.get(ty)
            assert other[0].data_ptr() != kept[0].data_ptr()
            assert same(other, y)
            del other
        assert same(kept, x), "a later get wrote into a result still alive"
        # One view of the kept result holds its whole mapping.
        one = kept[2]
        del kept
        again = r.get(ty)
        assert again[2].data_ptr() != one.data_ptr()
        assert torch.equal(one, x[2])
        st = r.stats()
        assert (st["cache_misses"], st["cache_hits"]) == (2, 3)  # the kept one's and the first other's
        s.discard(tx)
        s.discard(ty)


def test_a_get_larger_than_the_cap_works_and_is_not_kept():
    x = payload(4, nbytes=8 * MiB)
    with Sender("shm", capacity_nbytes=16 * MiB) as s, Receiver("shm", cache_nbytes=4 * MiB) as r:
        t = s.put(x, readers=None)
        for _ in range(2):
            got = r.get(t)
            assert same(got, x)
            del got
        st = r.stats()
        assert (st["cache_bypassed"], st["cache_hits"], st["cache_misses"], st["cache_cached_nbytes"]) == (2, 0, 0, 0)
        s.discard(t)


def test_idle_memory_past_the_cap_is_evicted_oldest_first():
    x = payload(5, nbytes=3 * MiB)
    with Sender("shm", capacity_nbytes=16 * MiB) as s, Receiver("shm", cache_nbytes=4 * MiB) as r:
        t = s.put(x, readers=None)
        a, b = r.get(t), r.get(t)  # both alive: 6 MiB live, over the cap, never refused
        assert r.stats()["cache_live_nbytes"] == 6 * MiB
        b_ptr = b[0].data_ptr()
        del a  # idle first: the oldest
        del b
        st = r.stats()
        assert (st["cache_cached_nbytes"], st["cache_evicted_nbytes"], st["cache_live_nbytes"]) == (3 * MiB, 3 * MiB, 0)
        c = r.get(t)
        assert c[0].data_ptr() == b_ptr, "the newest idle mapping was the one kept"
        assert same(c, x)
        s.discard(t)


def test_memory_idle_longer_than_its_time_is_unmapped_without_another_get():
    x = payload(6)
    with Sender("shm", capacity_nbytes=8 * MiB) as s, Receiver("shm", cache_idle_seconds=0.2) as r:
        t = s.put(x, readers=None)
        got = r.get(t)
        addr = got[0].data_ptr()
        del got
        assert r.stats()["cache_cached_nbytes"] == 4 * MiB
        assert mapped_nbytes(addr, 4 * MiB) == 4 * MiB
        assert wait_for(lambda: r.stats()["cache_trimmed_nbytes"] == 4 * MiB), r.stats()
        assert r.stats()["cache_cached_nbytes"] == 0
        assert mapped_nbytes(addr, 4 * MiB) < MiB, "trimmed, yet still mapped"
        name = r._cache.name
        # Holding nothing, the trimmer thread ends.
        assert wait_for(lambda: not any(th.name.endswith(name) for th in threading.enumerate()))
        got = r.get(t)  # and starts again
        assert same(got, x) and any(th.name.endswith(name) for th in threading.enumerate())
        s.discard(t)


def test_a_full_receive_pool_overflows_into_the_cache():
    x = payload(7)
    with Sender("shm", capacity_nbytes=8 * MiB) as s, Receiver("shm", pool=MemoryPool(1 * MiB)) as r:
        t = s.put(x, readers=None)
        for _ in range(2):
            got = r.get(t)
            assert same(got, x)
            del got
        st = r.stats()
        assert (st["cache_misses"], st["cache_hits"]) == (1, 1)
        s.discard(t)
        r.pool.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_streamed_object_lands_in_the_cache(transport):
    x = payload(8, nbytes=12 * MiB, count=3)
    with Sender(transport, capacity_nbytes=4 * MiB) as s, Receiver(transport, timeout=20.0) as r:
        for _ in range(2):
            t = s.put(x)
            assert t.streamed
            got = r.get(t)
            assert same(got, x)
            del got
        st = r.stats()
        assert (st["cache_misses"], st["cache_hits"]) == (1, 1)


def test_concurrent_gets_on_several_threads_keep_the_books_straight():
    objs = [payload(10 + k, nbytes=(2 + k) * MiB) for k in range(3)]
    with Sender("shm", capacity_nbytes=32 * MiB) as s, Receiver("shm", cache_nbytes=16 * MiB) as r:
        tickets = [s.put(o, readers=None) for o in objs]
        errors: list[str] = []
        held: list[list[torch.Tensor]] = []

        def work(seed: int) -> None:
            for i in range(12):
                k = (seed + i) % 3
                got = r.get(tickets[k])
                if not same(got, objs[k]):
                    errors.append(f"thread {seed} get {i}: wrong bytes")
                # Some results die on another thread than the one that got them.
                if i % 3 == 0:
                    held.append(got)
                elif held:
                    held.pop()
                del got

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        del held[:]
        gc.collect()
        st = r.stats()
        assert st["gets"] == 48 and st["cache_hits"] + st["cache_misses"] == 48 and st["cache_hits"] > 0
        assert st["cache_live_nbytes"] == 0 and 0 < st["cache_cached_nbytes"] <= 16 * MiB
        for t in tickets:
            s.discard(t)


# -- off, configuration ----------------------------------------------------------


def test_cache_nbytes_0_turns_it_off_and_registers_nothing():
    x = payload(20)
    before = {f.name for f in collect_pool_figures()[0]}
    with Sender("shm", capacity_nbytes=8 * MiB) as s, Receiver("shm", cache_nbytes=0) as r:
        t = s.put(x, readers=None)
        for _ in range(2):
            got = r.get(t)
            assert same(got, x)
            del got
        st = r.stats()
        assert (st["cache_capacity_nbytes"], st["cache_bypassed"], st["cache_hits"], st["cache_cached_nbytes"]) == (0, 2, 0, 0)
        assert {f.name for f in collect_pool_figures()[0]} == before
        s.discard(t)


@pytest.mark.parametrize(
    ("raw", "want"),
    [("0", 0), ("2G", 2 << 30), ("512MiB", 512 * MiB), ("64m", 64 * MiB), (" 1048576 ", MiB), ("3kb", 3 << 10)],
)
def test_the_variable_sets_the_cap(monkeypatch, raw, want):
    monkeypatch.setenv(CACHE_ENV, raw)
    assert cap_nbytes() == want
    with Receiver("shm") as r:
        assert r.stats()["cache_capacity_nbytes"] == want
    assert cap_nbytes(5 * MiB) == 5 * MiB  # the argument wins


def test_the_default_cap_is_2_gib_at_most_an_eighth_of_the_memory(monkeypatch):
    import os

    monkeypatch.delenv(CACHE_ENV, raising=False)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert cap_nbytes() == min(2 << 30, total // 8)


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5G", "2 GB GB", "0x100"])
def test_a_bad_variable_is_a_configuration_error_naming_it(monkeypatch, raw):
    monkeypatch.setenv(CACHE_ENV, raw)
    with pytest.raises(ConfigurationError, match=f"{CACHE_ENV}='{raw}'.*0 to turn the receive cache off"):
        Receiver("shm")


@pytest.mark.parametrize("value", [-1, 1.5, True, "2G"])
def test_a_bad_cache_nbytes_is_a_configuration_error_and_leaves_nothing_running(value):
    threads = threading.active_count()
    with pytest.raises(ConfigurationError, match=r"Receiver\(cache_nbytes=.*at least 0"):
        Receiver("shm", cache_nbytes=value)
    assert wait_for(lambda: threading.active_count() <= threads, 3.0), "a refused Receiver left a thread running"


@pytest.mark.parametrize("value", [0, -2.0, float("nan"), "60"])
def test_a_bad_cache_idle_seconds_is_a_configuration_error(value):
    with pytest.raises(ConfigurationError, match=r"Receiver\(cache_idle_seconds\)="):
        Receiver("shm", cache_idle_seconds=value)


def test_stats_keys():
    with Receiver("tcp") as r:
        assert set(r.stats()) == {
            "gets", "bytes_received", "delivered_nbytes", "cache_capacity_nbytes", "cache_cached_nbytes", "cache_cached_buffers",
            "cache_live_nbytes", "cache_hits", "cache_misses", "cache_bypassed", "cache_taken_nbytes",
            "cache_trimmed_nbytes", "cache_evicted_nbytes",
            "relay_memory_read_nbytes", "relay_file_read_nbytes", "relay_stream_nbytes", "relay_nixl_read_nbytes",
        }
        assert all(isinstance(v, int) for v in r.stats().values())


# -- the monitor and close -------------------------------------------------------


def test_the_monitor_pool_source_shows_the_cache_until_close():
    x = payload(21)
    with Sender("shm", capacity_nbytes=8 * MiB) as s:
        r = Receiver("shm", cache_nbytes=64 * MiB)
        name = r._cache.name
        assert name.startswith("receive-cache:")
        t = s.put(x, readers=None)
        got = r.get(t)
        f = cache_figures(name)
        assert f is not None and collect_pool_figures()[1] == 0
        assert (f.capacity_nbytes, f.used_nbytes, f.largest_free_nbytes, f.transfers, f.bytes_moved) == (64 * MiB, 4 * MiB, 0, 1, 4 * MiB)
        del got
        f = cache_figures(name)
        assert (f.used_nbytes, f.largest_free_nbytes) == (0, 4 * MiB)
        r.close()
        assert cache_figures(name) is None
        s.discard(t)


def test_a_receiver_dropped_unclosed_leaves_the_monitor_after_one_scrape():
    r = Receiver("shm", cache_nbytes=8 * MiB)
    name = r._cache.name
    del r
    gc.collect()
    gone = [f for f in collect_pool_figures()[0] if f.name == name]
    assert all(tuple(f[1:]) == (0,) * len(POOL_KEYS) for f in gone)
    assert cache_figures(name) is None


def test_close_unmaps_idle_memory_and_leaves_live_results_valid():
    # y is under half of x: x's idle mapping is not reused for it.
    x, y = payload(22, nbytes=16 * MiB), payload(23, nbytes=6 * MiB)
    with Sender("shm", capacity_nbytes=40 * MiB) as s:
        r = Receiver("shm")
        tx, ty = s.put(x, readers=None), s.put(y, readers=None)
        idle = r.get(tx)
        idle_addr = idle[0].data_ptr()
        del idle
        live = r.get(ty)
        live_addr = live[0].data_ptr()
        assert mapped_nbytes(idle_addr, 16 * MiB) == 16 * MiB
        r.close()
        r.close()
        st = r.stats()
        assert (st["cache_cached_nbytes"], st["cache_trimmed_nbytes"], st["cache_live_nbytes"]) == (0, 16 * MiB, 6 * MiB)
        assert mapped_nbytes(idle_addr, 16 * MiB) < 4 * MiB, "close left idle memory mapped"
        assert mapped_nbytes(live_addr, 6 * MiB) == 6 * MiB
        assert same(live, y), "close touched a live result"
        del live
        st = r.stats()
        assert (st["cache_cached_nbytes"], st["cache_live_nbytes"], st["cache_trimmed_nbytes"]) == (0, 0, 22 * MiB)
        assert mapped_nbytes(live_addr, 6 * MiB) < 2 * MiB, "a result's memory outlived it after close"
        s.discard(tx)
        s.discard(ty)


# -- the cache on its own ----------------------------------------------------------


def test_best_fit_within_twice_the_size():
    c = ReceiveCache(64 * MiB, float("inf"))
    try:
        bufs = {n: c.take(n * MiB)[0] for n in (2, 3, 8)}
        ptrs = {n: b.data_ptr() for n, b in bufs.items()}
        del bufs
        buf, reused = c.take(3 * MiB - 100)  # 3 MiB fits best (2 is too small)
        assert reused and buf.data_ptr() == ptrs[3] and buf.numel() == 3 * MiB - 100
        buf2, reused2 = c.take(3 * MiB)  # only 8 MiB is left: more than twice 3
        assert not reused2 and buf2.data_ptr() not in ptrs.values()
        buf3, reused3 = c.take(5 * MiB)  # 8 MiB is within twice 5
        assert reused3 and buf3.data_ptr() == ptrs[8]
        assert buf.data_ptr() % 16 == buf2.data_ptr() % 16 == 0
        st = c.stats()
        assert (st.hits, st.misses, st.cached_buffers, st.cached_nbytes) == (2, 4, 1, 2 * MiB)
    finally:
        c.close()


def test_small_takes_bypass_and_the_memory_returns_from_any_thread():
    c = ReceiveCache(64 * MiB, float("inf"))
    try:
        small, reused = c.take(4096)
        assert not reused and small.numel() == 4096 and c.stats().bypassed == 1
        buf, _ = c.take(2 * MiB)
        views = [buf[: MiB], buf[MiB:]]
        del buf
        box = [views.pop()]
        th = threading.Thread(target=box.clear)
        th.start()
        th.join()
        assert c.stats().live_nbytes == 2 * MiB  # a view still holds the storage
        views.clear()
        st = c.stats()
        assert (st.live_nbytes, st.cached_nbytes) == (0, 2 * MiB)
    finally:
        c.close()


def test_a_forked_child_reuses_what_it_inherited_and_the_parent_keeps_its_own():
    import os

    c = ReceiveCache(64 * MiB, float("inf"))
    try:
        held, _ = c.take(2 * MiB)
        held.fill_(7)
        ptr = held.data_ptr()
        pid = os.fork()
        if pid == 0:  # the child: its copy of the result comes back to its copy of the cache
            code = 3
            try:
                del held
                buf, reused = c.take(2 * MiB)
                code = 0 if reused and buf.data_ptr() == ptr and int(buf[0]) == 7 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert int(held.sum()) == 7 * 2 * MiB and c.stats().live_nbytes == 2 * MiB
    finally:
        c.close()


# -- shared (a relay's memory) ---------------------------------------------------


def _fd_open(fd: int) -> bool:
    import os

    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_a_shared_cache_hands_out_sealed_memfds_reused_and_closed_with_their_memory():
    """A relay's cache: each take's memory is bytes 0 on of a memfd sealed
    at its size (another process mapping it can never read past its end);
    a collected result's memfd comes back with its pages for the next take,
    and the fd is closed once its mapping is gone (trimmed here)."""
    import fcntl
    import mmap
    import os

    import numpy as np

    from tensorferry.memory._system import SHARED_SEALS

    cache = ReceiveCache(64 * MiB, idle_seconds=float("inf"), shared=True)
    try:
        buf, reused, fd = cache.take_shared(3 * MiB + 5)
        assert not reused and fd >= 0 and buf.numel() == 3 * MiB + 5
        assert os.fstat(fd).st_size >= buf.numel()
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SHARED_SEALS == SHARED_SEALS
        buf.copy_(torch.arange(buf.numel(), dtype=torch.int64).to(torch.uint8))
        # What a child on the host sees: a read-only mapping of the file.
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        try:
            seen = mmap.mmap(ro, buf.numel(), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(ro)
        assert np.array_equal(np.frombuffer(seen, dtype=np.uint8), buf.numpy())
        seen.close()
        with pytest.raises(OSError):
            os.ftruncate(fd, 4096)  # sealed: the relay itself cannot shrink it under a child
        del buf
        gc.collect()
        again, reused, fd2 = cache.take_shared(3 * MiB)
        assert reused and fd2 == fd
        small, _, fd3 = cache.take_shared(100)  # bypassed (under 1 MiB), still shareable, not kept
        assert fd3 >= 0 and fd3 != fd
        del again, small
        gc.collect()
        assert not _fd_open(fd3)  # closed with its memory
        assert _fd_open(fd)  # idle in the cache
    finally:
        cache.close()
    gc.collect()
    assert not _fd_open(fd)


def test_take_shared_needs_a_shared_cache():
    cache = ReceiveCache(64 * MiB)
    try:
        with pytest.raises(ConfigurationError, match="shared=True"):
            cache.take_shared(2 * MiB)
    finally:
        cache.close()
