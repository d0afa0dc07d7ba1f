"""DTensor trainers to DTensor workers, with real process groups: 4 source
ranks on a (2, 2) gloo CPU mesh (mixed Shard/Replicate placements, uneven
sizes, tied embeddings, a 0-d tensor) to 2 worker ranks on a (2,) mesh
(vocab-, column-, row-parallel and replicated targets), over every
transport; a second sync after the sources changed their shards in place
replays the plans; a third casts to bf16. Workers' processes in
``_sharded_workers.py``."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import _sharded_workers as W  # noqa: E402

pytest.importorskip("torch.distributed")

_TIMEOUT_SECONDS = 240.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _take(q, deadline: float):
    item = q.get(timeout=max(deadline - time.monotonic(), 0.1))
    if item[1] == -1 or item[0] == "error":
        raise AssertionError(f"a rank failed:\n{item[2]}")
    return item


@contextlib.contextmanager
def _ranks(procs: list):
    """The ranks' processes started, and killed if the body fails; a rank
    that does not answer in time fails the test."""
    for p in procs:
        p.start()
    try:
        yield
    except queue.Empty:
        pytest.fail("the ranks did not finish in time")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _joined(procs: list, deadline: float) -> None:
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 1.0))
        assert p.exitcode == 0


def test_dtensor_sources_to_dtensor_workers_every_transport():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["UCX_NET_DEVICES"] = "lo"
    transports = ("tcp", "shm") + (("nixl",) if importlib.util.find_spec("nixl") else ())
    ctx = mp.get_context("spawn")
    out, results = ctx.Queue(), ctx.Queue()
    gos = [ctx.Queue() for _ in range(4)]
    to_workers = [ctx.Queue() for _ in range(2)]
    src_port, dst_port = _port(), _port()
    procs = [ctx.Process(target=W.source_main, args=(k, src_port, transports, 2 * len(transports), out, gos[k])) for k in range(4)]
    procs += [ctx.Process(target=W.worker_main, args=(k, dst_port, transports, to_workers[k], results)) for k in range(2)]
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    reports = {}
    with _ranks(procs):
        for sync in (1, 2, 3):
            by_rank = {}
            while len(by_rank) < 4:
                rank, got_sync, tickets = _take(out, deadline)
                assert got_sync == sync
                by_rank[rank] = tickets
            for q in to_workers:
                q.put((sync, by_rank))
            if sync < 3:
                for _ in range(2):
                    _take(results, deadline)
            else:
                while len(reports) < 2:
                    kind, rank, report = _take(results, deadline)
                    if kind == "report":
                        reports[rank] = report
            for q in gos:
                q.put(True)
        _joined(procs, deadline)
    for rank, report in reports.items():
        assert report["bad"] == {k: [] for k in report["bad"]}, f"worker {rank}: wrong shards {report['bad']}"
        assert set(report["bad"]) == {f"{tr}-{n}" for tr in transports for n in (1, 2)} | {"bf16"}
        assert report["errors"] == {k: True for k in report["errors"]} and len(report["errors"]) == 5, report["errors"]
        # Each worker received exactly its own shards' bytes (the tied
        # embedding once), over every transport.
        for tr in transports:
            assert report["received"][f"{tr}-1"] == report["share"], (rank, tr, report)


def test_fsdp2_gpt2_to_a_whole_model_and_a_tensor_parallel_worker():
    """A transformers GPT-2 sharded with fully_shard on 2 CPU ranks (uneven
    vocab rows, tied embeddings) to one worker's whole model (into= the
    module) and one worker's column slices (Boxes)."""
    pytest.importorskip("transformers")
    import torch

    import tensorferry as tf
    from tensorferry import Box

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gos = [ctx.Queue() for _ in range(2)]
    port = _port()
    procs = [ctx.Process(target=W.fsdp_source_main, args=(k, port, out, gos[k])) for k in range(2)]
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    with _ranks(procs):
        tickets = [None, None]
        for _ in range(2):
            rank, _, got = _take(out, deadline)
            tickets[rank] = got[0]
        reference = W.gpt2().state_dict()
        whole = W.gpt2(seed=1)
        slices = {k: Box(torch.zeros(v.shape[0], (v.shape[1] + 1) // 2), (0, v.shape[1] // 2), tuple(v.shape)) if v.dim() == 2 else torch.zeros_like(v)
                  for k, v in reference.items()}
        with tf.Receiver("tcp") as r:
            r.get(tickets, into=whole)
            r.get(tickets[::-1], into=slices)
        for k, v in whole.state_dict().items():
            assert torch.equal(v, reference[k]), k
        for k, v in slices.items():
            want = reference[k][:, reference[k].shape[1] // 2 :] if isinstance(v, Box) else reference[k]
            assert torch.equal(v.tensor if isinstance(v, Box) else v, want), k
        for q in gos:
            q.put(True)
        _joined(procs, deadline)


def test_fsdp2_module_plan_notices_replaced_parameters_not_forward_backward():
    """A kept plan of a ``fully_shard`` module on 2 gloo ranks: puts between
    each forward and backward (one layer unsharded meanwhile) are no false
    alarm and send the current shards, as do puts after real optimizer
    steps; ``load_state_dict(assign=True)``, a parameter set to another
    DTensor and a DTensor swapped in place (``torch.utils.swap_tensors``)
    are each refused with PlanStaleError before any ticket is made; a new
    plan then sends the new parameters."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=W.fsdp_watch_main, args=(k, port, out)) for k in range(2)]
    deadline = time.monotonic() + _TIMEOUT_SECONDS
    with _ranks(procs):
        reports = dict(_take(out, deadline)[1:] for _ in range(2))
        _joined(procs, deadline)
    for rank, report in reports.items():
        # the first layer's group unsharded between its forward and backward, the second's resharded
        assert all(states.count(False) >= 1 for states in report["states"]), (rank, report["states"])
        for mid, after, changed in report["steps"]:
            assert mid and after and not changed, (rank, report["steps"])
        for how in ("assign", "setattr", "swapped"):
            assert "no longer the tensor the plan was made with" in report[how] and "nothing was sent" in report[how], (rank, how, report[how])
        assert report["replanned"] and report["after"], (rank, report)
        # FSDP2's groups unreadable (another torch): still no false alarm, still refused
        assert report["unread"] == (True, True), (rank, report["unread"])
        assert "no longer the tensor the plan was made with" in report["unread_setattr"], (rank, report["unread_setattr"])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_row_sharded_delta_trainers_to_column_workers_read_only_their_changes(transport):
    """Two trainer ranks (gloo processes) of row-sharded DTensors with a
    bf16 delta plan; two column-parallel workers and one that joins late.
    A first sync reads each worker's whole share; after each small step
    (1% of the elements over tcp; 0.1% over shm, where only deltas under
    1% of the bytes are sent) each worker that held the previous version
    receives at most 5% of its share, from both ranks, and every worker's
    columns are bit-exact; the late worker's first get reads its whole
    share, its next the delta."""
    import numpy as np
    import torch

    import tensorferry as tf

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    fraction = 0.01 if transport == "tcp" else 0.001
    fractions = [0.0, fraction, fraction, fraction]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    gos = [ctx.Queue() for _ in range(2)]
    port = _port()
    procs = [ctx.Process(target=W.delta_source_main, args=(k, port, transport, fractions, 3, out, gos[k])) for k in range(2)]
    deadline = time.monotonic() + _TIMEOUT_SECONDS

    def target(worker: int) -> dict:
        t = {}
        for name, shape in W.DELTA_SHAPES.items():
            if len(shape) == 1:
                t[name] = torch.zeros(shape, dtype=torch.bfloat16)  # the whole vector
                continue
            lo, hi = shape[1] * worker // 2, shape[1] * (worker + 1) // 2
            t[name] = tf.Box(torch.zeros(shape[0], hi - lo, dtype=torch.bfloat16), (0, lo), shape)
        return t

    def exact(t: dict, full: dict) -> bool:
        for name, x in t.items():
            want = full[name] if not isinstance(x, tf.Box) else full[name][:, x.offsets[1] : x.offsets[1] + x.tensor.shape[1]]
            got = (x.tensor if isinstance(x, tf.Box) else x).view(torch.int16).numpy()
            if not np.array_equal(got, want):
                return False
        return True

    def share(t: dict) -> int:
        return sum((x.tensor if isinstance(x, tf.Box) else x).numel() * 2 for x in t.values())

    targets = [target(0), target(1), target(1)]
    receivers = [tf.Receiver(transport, timeout=60.0) for _ in targets]
    plans: list = [None, None, None]
    received: list = []
    try:
        with _ranks(procs):
            for step in range(len(fractions)):
                got = {}
                for _ in range(2):
                    rank, _, ticket, shards = _take(out, deadline)
                    got[rank] = (ticket, shards)
                tickets = [got[k][0] for k in (1, 0)]  # any order
                full = {name: np.concatenate([got[k][1][name][1] for k in (0, 1)]) for name in W.DELTA_SHAPES}
                row = []
                for i, (r, t) in enumerate(zip(receivers, targets)):
                    if i == 2 and step < 2:  # joins at step 2; its slots go back unread until then
                        for tk in tickets:
                            r.get(tk)
                        row.append(None)
                        continue
                    if plans[i] is None:
                        plans[i] = r.plan(tickets, into=t)
                    before = r.bytes_received
                    r.get(tickets, into=plans[i])
                    row.append(r.bytes_received - before)
                    assert exact(t, full), (step, i)
                received.append(row)
                for q in gos:
                    q.put(True)
            _joined(procs, deadline)
    finally:
        for r in receivers:
            r.close()
    shares = [share(t) for t in targets]
    assert received[0][:2] == shares[:2] and received[2][2] == shares[2], (received, shares)
    for step in (1, 2, 3):
        for i in (0, 1):
            assert 0 < received[step][i] <= 0.05 * shares[i], (step, i, received, shares)
    assert 0 < received[3][2] <= 0.05 * shares[2], (received, shares)
