"""What the stats say about delta syncs: the receiver counts the bytes that
crossed the link (``bytes_received``) apart from the objects it delivered
(``delivered_nbytes``), and the sender's ``last_put_changed`` is a count
only where a compare ran (-1 otherwise).

The delta get runs for real: the receiver in a second process, over tcp.
"""

from __future__ import annotations

import multiprocessing as mp

import torch

import tensorferry as tf

MiB = 1 << 20
N = 4 * MiB  # float32 elements: a 16 MiB object


def _receiver(tickets: mp.Queue, stats: mp.Queue) -> None:
    """A worker: one kept plan, a get of every ticket, its stats after each."""
    torch.set_num_threads(1)
    with tf.Receiver("tcp", timeout=30.0) as r:
        plan = None
        while (data := tickets.get()) is not None:
            plan = plan or r.plan(data)
            got = r.get(data, into=plan)
            stats.put({**r.stats(), "checksum": float(got["w"].double().sum())})


def test_a_delta_get_over_tcp_counts_the_bytes_that_crossed():
    w = {"w": torch.zeros(N)}
    ctx = mp.get_context("spawn")
    tickets, stats = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(tickets, stats), daemon=True)
    child.start()
    try:
        with tf.Sender("tcp", capacity_nbytes=64 * MiB) as s:
            plan = s.plan(w, delta=True)
            t = s.put(plan)
            tickets.put(t.to_bytes())
            first = stats.get(timeout=60)
            s.wait_released(t, timeout=30)
            assert (first["gets"], first["bytes_received"], first["delivered_nbytes"]) == (1, 16 * MiB, 16 * MiB)
            assert s.stats()["last_put_changed"] == -1  # the first put: nothing to compare with

            w["w"][: N // 1000] += 1.0  # 0.1% of the elements
            t = s.put(plan)
            assert t.delta.base and 0 < t.delta.nbytes < MiB
            tickets.put(t.to_bytes())
            second = stats.get(timeout=60)
            s.wait_released(t, timeout=30)
            assert second["checksum"] == float(w["w"].double().sum())  # the delta landed
            assert second["bytes_received"] - first["bytes_received"] == t.delta.nbytes
            assert second["delivered_nbytes"] - first["delivered_nbytes"] == 16 * MiB
            assert s.stats()["last_put_changed"] == N // 1000
            assert s.stats()["last_put_delta_nbytes"] == t.delta.nbytes

            t = s.put(plan)  # nothing changed: compared, none found, nothing to read
            tickets.put(t.to_bytes())
            third = stats.get(timeout=60)
            s.wait_released(t, timeout=30)
            assert s.stats()["last_put_changed"] == 0 and s.stats()["last_put_delta_nbytes"] == 0
            assert third["bytes_received"] == second["bytes_received"]
            assert third["delivered_nbytes"] - second["delivered_nbytes"] == 16 * MiB
    finally:
        tickets.put(None)
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_last_put_changed_is_minus_one_where_no_compare_ran():
    w = {"w": torch.zeros(MiB)}
    with tf.Sender("shm", capacity_nbytes=16 * MiB) as s, tf.Receiver("shm", timeout=30.0) as r:
        s.put(w)  # not a plan at all
        assert s.stats()["last_put_changed"] == -1
        plain = s.plan(w)
        t = s.put(plain)
        r.get(t)
        assert s.stats()["last_put_changed"] == -1  # a plan without delta=True
        plan = s.plan(w, delta=True)
        t = s.put(plan)
        rp = r.plan(t)
        r.get(t, into=rp)
        assert s.stats()["last_put_changed"] == -1  # its first put
        w["w"][: MiB // 20] += 1.0  # 5%: over the one-host limit, the compare stops there
        t = s.put(plan)
        r.get(t, into=rp)
        assert not t.delta.base and s.stats()["last_put_changed"] == -1
        assert torch.equal(rp.result["w"], w["w"])  # the whole object was read
