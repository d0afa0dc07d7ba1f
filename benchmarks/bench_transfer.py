"""Transfer benchmark: 1 GiB of float32 between two processes, every transport,
against the limits and the peers, measured in one run.

Two long-lived worker processes (multiprocessing ``spawn``): a SENDER and a
RECEIVER. Ticket bytes travel over a ``multiprocessing.Pipe`` (the control
plane a user would bring). Every time is ``time.monotonic()``, one clock for all
processes on the host, from the sender calling ``put`` (or the peer's first
step) to the receiver holding the data (``get`` returned):

* tensorferry, for each transport in ``tensorferry.transports.available()``:
  the object is a list of 1, 10k or 100k float32 tensors totalling 1 GiB (10k
  and 100k are views of one flat buffer, half of them 2-D; "10k separate" are
  10k tensors with their own storage). Receiver modes:
  ``pool`` (copy mode: a Receiver with a prefaulted receive ``MemoryPool``, the
  fast path), ``new`` (copy mode into new memory: a fresh Receiver without a
  pool for each case, the previous result deleted before each get; its warm-up
  get, the receiver's first, is reported apart as the first get),
  ``into`` (``get(into=...)`` existing, touched tensors) and, for shm,
  ``zero_copy`` (views of the sender's pool; not touched inside the timing).
  The sender's pool is prefaulted (``Sender(prefault=True)``).
* limits: one plain memcpy of 1 GiB into already-touched memory, both as
  torch ``copy_`` of uint8 and as libc ``memcpy`` (``np.copyto``), in the
  receiver process; tensorferry itself copies with libc memcpy, ~1.5x faster
  than torch's ``copy_`` here, so shm's ratio is taken against the libc one
  (the stricter bound) and the ``copy_`` ratio is shown beside it. tensorferry
  splits a large host copy over several threads (``TENSORFERRY_COPY_THREADS``,
  default up to 4), so the same 1 GiB copied as equal slices by that many
  threads at once is measured too (``memcpy_parallel``: the bandwidth limit of
  the machine) and shm is reported against it as well; raw loopback TCP between the
  two processes with tensorferry's chunking (one ``sendmsg`` / ``recvmsg_into``
  loop over the whole 1 GiB, TCP_NODELAY and the socket buffer size of
  ``tensorferry.transports._tcp``); a raw NIXL READ of one 1 GiB descriptor
  (``benchmarks/_raw_nixl.py`` when present, else measured here with
  ``nixl._api``) when nixl is installed.
* peers a user would otherwise use: a ``torch.multiprocessing`` queue of the
  tensors (fresh, not yet shared tensors each time: the queue moves them to
  shared memory, the receiver maps them), and ``torch.save`` of the state dict
  into a buffer, sent over a loopback socket, ``torch.load`` on the other side.

Plans (``Sender.plan`` / ``Receiver.plan``, kept across syncs), for each
transport: the sender changes the data in place (every element +1, untimed)
before each sync; a sync is ``put(plan)`` until the receiver's
``get(ticket, into=recv_plan)`` returned. The first sync makes both plans
inside its timing and is reported apart; the median is taken over the syncs
after it. Objects: 1 tensor (the reference), 100k views of one flat buffer,
100k separately allocated tensors; destinations: the plan's own tensors
(``Receiver.plan(ticket)``) or ``into=`` existing tensors (views of one
buffer; separately allocated for the separate object). Beside them: the same
objects as fresh ``put(obj)`` / ``get(into=targets)`` every sync, the 100k
views planned with ``dtype=torch.bfloat16``, and ``snapshot=False`` (tcp;
shm and nixl refuse it, which is recorded as not applicable). The planned
put alone is held against one libc memcpy of the same bytes in the sender's
process (measured before and after the section, pooled). The last sync of
each case is verified against the source with +1 added as many times as the
sender did (the same float32 operations, so the same bits). The section takes
a few minutes of a full run; ``--plans`` runs it alone (no other limits,
cases or peers), ``--no-plans`` leaves it out.

Each case runs one untimed warm-up transfer, then ``--repeats`` timed ones
(median reported). The LAST timed transfer of every case is verified after its
timing: the receiver compares every tensor's dtype, shape and bits with its
own deterministically regenerated copy of the source (the sender's and the
receiver's pools, and ``into`` targets, are zeroed before that transfer, so
stale bytes cannot pass). Peak RSS growth is measured for real: VmHWM after
resetting it by writing ``5`` to ``/proc/self/clear_refs`` (checked to work at
start-up), in the receiver around each ``get`` and in the sender from ``put``
until the release.

torch runs with ONE intra-op thread in every process by default (``--threads``),
as in bench_pool.py: on this shared 2-core machine a parallel copy stalls
whenever the other core is busy, and the memcpy limit is measured with the same
setting as the copies it bounds.

Run: ``.venv/bin/python benchmarks/bench_transfer.py`` (``--quick`` for a
64 MiB smoke run; ``--profile`` adds cProfile of the timed section (the
calling thread) of the tensorferry cases in both processes, written to
``benchmarks/results/bench_transfer_profile.txt``; ``--only shm:pool:100k ...``
runs a subset, and with ``--plans`` names plan cases as
``tcp:plan:100k-separate:into``, ``shm:plan-bf16:100k:own``, ``nixl:fresh:1:into``;
``--replot JSON`` redraws tables and plots). Writes
``benchmarks/results/bench_transfer.json`` and ``benchmarks/results/bench_transfer.png``
(``bench_transfer_plans.json`` for ``--plans``; the plans section's plot in
``..._plans.png``).
"""

from __future__ import annotations

import os

# NIXL/UCX stays on loopback on these machines (and in every child: spawn
# copies the environment).
os.environ["UCX_NET_DEVICES"] = "lo"

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import socket
import statistics
import struct
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _env import package_version  # benchmarks/_env.py (this script's folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MIB = 1 << 20
GIB = 1 << 30
SEED = 20_260_601
COUNTS = (1, 10_000, 100_000)
# The pools hold 1 GiB plus alignment padding (< 16 bytes a tensor, 100k
# tensors: 1.6 MB) with room to spare.
POOL_SLACK_NBYTES = 16 * MIB
# What the issue asks for, as ratios measured in this run.
TARGET_SHM_VS_MEMCPY = 0.7
# Threads tensorferry splits a large host copy over (TENSORFERRY_COPY_THREADS;
# set in main): the parallel memcpy limit is measured with as many.
COPY_THREADS = 1
TARGET_TCP_VS_RAW = 0.7
TARGET_NIXL_VS_RAW = 0.8
TARGET_100K_VS_1 = 1.5
TARGET_TICKET_NBYTES = 1_000_000
TARGET_TICKET_SECONDS = 0.020
TARGET_RX_RSS_NEW_NBYTES = int(1.1 * GIB)
TARGET_RX_RSS_ZERO_COPY_NBYTES = 64 * MIB
TARGET_TX_RSS_NBYTES = 64 * MIB
# Plans section (issue 15): 100k tensors, the size of a large state dict.
PLAN_COUNT = 100_000
TARGET_PLAN_VIEWS_VS_1 = 1.1
TARGET_PLAN_SEPARATE_VS_1 = 2.0
TARGET_PLAN_PUT_VS_MEMCPY = 1.2
TARGET_PLAN_BF16_VS_FP32 = 0.6
PLAN_HOW = {"plan": "planned", "plan-bf16": "planned, dtype=bfloat16", "plan-nosnap": "planned, snapshot=False",
            "fresh": "fresh put/get"}


# -- shared helpers (both workers) ------------------------------------------------------


def _status_nbytes(field: str) -> int:
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(field.encode() + b":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS; returns that baseline (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_nbytes("VmRSS")


def peak_rss() -> int:
    return _status_nbytes("VmHWM")


def minor_faults() -> int:
    """Page faults of this process so far (fresh memory costs one per 4 KiB page)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def check_peak_reset() -> bool:
    """Touch and free 256 MiB, reset: VmHWM must come back down."""
    import torch

    reset_peak_rss()
    t = torch.ones(256 * MIB, dtype=torch.uint8)
    high = peak_rss()
    del t
    base = reset_peak_rss()
    after = peak_rss()
    return high - base > 200 * MIB and after - base < 16 * MIB


def numel_of(nbytes: int) -> int:
    return nbytes // 4


def source(nbytes: int):
    """The 1 GiB of float32 every case sends, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    return torch.randn(numel_of(nbytes), generator=g)


def piece_sizes(numel: int, count: int) -> list[int]:
    """Deterministic, uneven tensor sizes (in elements) that add up to ``numel``."""
    import numpy as np

    if count == 1:
        return [numel]
    rng = np.random.default_rng(SEED + count)
    w = rng.uniform(0.25, 1.75, count)
    sizes = np.maximum(np.floor(w / w.sum() * numel).astype(np.int64), 1)
    sizes[-1] += numel - int(sizes.sum())
    assert sizes[-1] > 0
    return sizes.tolist()


def views_of(flat, count: int) -> list:
    """``count`` views of ``flat``; every other one 2-D when its size allows."""
    if count == 1:
        return [flat]
    sizes = piece_sizes(flat.numel(), count)
    out = []
    for i, (part, n) in enumerate(zip(flat.split(sizes), sizes)):
        out.append(part.view(4, n // 4) if i % 2 and n % 4 == 0 else part)
    return out


def _drain(peer) -> dict:
    """Drop what a failed job left in the pipe between the workers (an
    abort, a ticket nobody took), so the next job starts in step."""
    dropped = 0
    while peer.poll(0.5):
        peer.recv()
        dropped += 1
    return {"dropped": dropped}


def rotated(n: int, r: int) -> list[int]:
    """``0 .. n-1`` starting at ``r % n``: round ``r``'s order of a group's
    variants (both workers compute it)."""
    return [(r + i) % n for i in range(n)]


def verify(got: list, ref: list) -> str | None:
    """Exact comparison (dtype, shape, every bit); None if equal."""
    import torch

    if not isinstance(got, list) or len(got) != len(ref):
        return f"got {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} items, sent {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        if g.dtype != r.dtype or g.shape != r.shape:
            return f"tensor {i}: got {g.dtype}{tuple(g.shape)}, sent {r.dtype}{tuple(r.shape)}"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[r.element_size()]
        if not torch.equal(g.reshape(-1).view(bits), r.reshape(-1).view(bits)):
            return f"tensor {i}: bytes differ"
    return None


def memcpy_limit(ref, job: dict) -> dict:
    """One copy of ``ref``'s bytes into touched memory, timed (the limits
    job, in whichever worker runs it)."""
    import numpy as np
    import torch

    src = ref.view(torch.uint8)
    nbytes = src.numel()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)  # touched

    threads = int(job.get("threads", 1))
    pool = None
    if job.get("libc") and threads > 1:
        # The bandwidth limit when several cores copy: the same bytes in
        # `threads` equal slices, one np.copyto (libc memcpy, GIL
        # released) per thread at once. Written here, not tensorferry's
        # code, so that it stays the yardstick.
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads)
        d, s_ = dst.numpy(), src.numpy()
        cuts = [nbytes * i // threads for i in range(threads + 1)]
        slices = [(d[a:b], s_[a:b]) for a, b in zip(cuts, cuts[1:])]

        def copy():
            for f in [pool.submit(np.copyto, dd, ss, casting="no") for dd, ss in slices]:
                f.result()
    elif job.get("libc"):
        # numpy's copyto of contiguous uint8 is one libc memcpy.
        d, s_ = dst.numpy(), src.numpy()
        copy = lambda: np.copyto(d, s_, casting="no")  # noqa: E731
    else:
        copy = lambda: dst.copy_(src)  # noqa: E731
    times = []
    for _ in range(job["warmup"] + job["repeats"]):
        t = time.monotonic()
        copy()
        times.append(time.monotonic() - t)
    if pool is not None:
        pool.shutdown()
    ok = torch.equal(dst, src)
    via = "torch copy_ of uint8"
    if job.get("libc"):
        via = f"np.copyto (libc memcpy) in {threads} slices on {threads} threads" if threads > 1 else "np.copyto (libc memcpy)"
    return {"seconds": times[job["warmup"]:], "verified": ok, "via": via, "threads": threads}


def _setup_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _tune(sock: socket.socket) -> None:
    """Exactly what tensorferry's tcp transport does to its sockets."""
    from tensorferry.transports import _tcp

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _tcp._SOCK_BUF)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def _profile_text(prof: cProfile.Profile | None, top: int = 30) -> str | None:
    if prof is None:
        return None
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# -- tensorferry cases ------------------------------------------------------------------


class SenderSide:
    """State and jobs of the sender worker."""

    def __init__(self, nbytes: int, peer) -> None:
        self.nbytes = nbytes
        self.peer = peer
        self.flat = source(nbytes)
        self.sender = None

    def tf_open(self, job: dict) -> dict:
        from tensorferry import Sender

        t = time.monotonic()
        self.sender = Sender(job["transport"], capacity_nbytes=self.nbytes + POOL_SLACK_NBYTES, prefault=True)
        return {"open_seconds": time.monotonic() - t}

    def tf_close(self, job: dict) -> dict:
        self.sender.close()
        self.sender = None
        return {}

    def tf_case(self, job: dict) -> dict:
        from tensorferry import Ticket

        count, kind = job["count"], job["kind"]
        separate = [v.clone() for v in views_of(self.flat, count)] if kind == "separate" else None
        total = job["warmup"] + job["repeats"]
        recs = []
        prof = cProfile.Profile() if job.get("profile") else None
        ticket = tb = None
        for r in range(total):
            verify_now = r == total - 1
            msg = self.peer.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"receiver aborted: {msg[1]}")
            obj = separate[:] if separate is not None else views_of(self.flat, count)
            if verify_now:
                self.sender.pool.buffer.zero_()
            gc.collect()
            base = reset_peak_rss()
            flt = minor_faults()
            if prof is not None and r >= job["warmup"]:
                prof.enable()
            t0 = time.monotonic()
            ticket = self.sender.put(obj)
            t_put = time.monotonic()
            tb = ticket.to_bytes()
            t_enc = time.monotonic()
            if prof is not None:
                prof.disable()
            self.peer.send(("ticket", tb, t0, verify_now))
            self.sender.wait_released(ticket, timeout=300)
            t_rel = time.monotonic()
            growth = peak_rss() - base
            flt = minor_faults() - flt
            del obj
            if r >= job["warmup"]:
                recs.append({
                    "t0": t0,
                    "put_seconds": t_put - t0,
                    "encode_seconds": t_enc - t_put,
                    "released_after_seconds": t_rel - t0,
                    "sender_rss_growth_nbytes": growth,
                    "sender_minor_faults": flt,
                })
        out: dict[str, Any] = {"records": recs, "ticket_nbytes": len(tb), "blocks": len(ticket.blocks),
                               "profile_sender": _profile_text(prof)}
        if job.get("ticket_timing"):
            out.update(self._ticket_timing(count))
        return out

    def _ticket_timing(self, count: int) -> dict:
        """Ticket encode/decode of a ``count``-tensor object, timed while the
        receiver is idle (it is between cases, waiting for the next job:
        after the last transfer it verifies 1 GiB, which would share the
        cores with these timings)."""
        from tensorferry import Ticket

        self.peer.send(("ticket_timing_ready",))
        assert self.peer.recv() == ("receiver_idle",)
        ticket = self.sender.put(views_of(self.flat, count), readers=None)
        try:
            out: dict[str, Any] = {}
            enc, dec = [], []
            for _ in range(7):
                t = time.perf_counter()
                b = ticket.to_bytes()
                enc.append(time.perf_counter() - t)
                t = time.perf_counter()
                lay = Ticket.from_bytes(b).layout
                dec.append(time.perf_counter() - t)
                assert lay.num_tensors == count
            out["ticket_encode_seconds"] = statistics.median(enc)
            out["ticket_decode_seconds"] = statistics.median(dec)
            # Ticket.to_bytes only frames the layout bytes put() encoded: time
            # that encoding too (it is inside put).
            lenc = []
            for _ in range(7):
                t = time.perf_counter()
                lay.to_bytes()
                lenc.append(time.perf_counter() - t)
            out["layout_encode_seconds"] = statistics.median(lenc)
            return out
        finally:
            self.sender.discard(ticket)
            self.sender.wait_released(ticket, timeout=60)

    # -- limits and peers ------------------------------------------------------------

    def rawtcp(self, job: dict) -> dict:
        port = self.peer.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        _tune(sock)
        view = memoryview(self.flat.view(torch_uint8()).numpy())
        for _ in range(job["warmup"] + job["repeats"]):
            assert sock.recv(1) == b"G"
            t0 = time.monotonic()
            sent = 0
            n = len(view)
            while sent < n:
                sent += sock.sendmsg([view[sent:]])
            self.peer.send(t0)
        sock.close()
        return {}

    def tmpq(self, job: dict, queue) -> dict:
        count = job["count"]
        for _ in range(job["warmup"] + job["repeats"]):
            msg = self.peer.recv()
            assert msg == "ready"
            fresh = self.flat.clone()
            obj = views_of(fresh, count)
            gc.collect()
            t0 = time.monotonic()
            queue.put((t0, obj))
            # Keep the tensors alive until the receiver is done with them.
            assert self.peer.recv() == "done"
            del obj, fresh
        return {}

    def tsave(self, job: dict) -> dict:
        import torch

        count = job["count"]
        port = self.peer.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        _tune(sock)
        state = {f"layers.{i}.weight": v for i, v in enumerate(views_of(self.flat, count))}
        for _ in range(job["warmup"] + job["repeats"]):
            assert sock.recv(1) == b"G"
            gc.collect()
            t0 = time.monotonic()
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getbuffer()
            sock.sendall(struct.pack("<dQ", t0, len(data)))
            sock.sendall(data)
            del data, buf
        sock.close()
        return {}

    def rawnixl(self, job: dict) -> dict:
        import threading

        from nixl._api import nixl_agent, nixl_agent_config

        # As tensorferry's nixl transport runs its agents: NIXL's own progress
        # thread off (it spins a core), the serving side polls every 1 ms.
        agent = nixl_agent(f"bench-target-{job['ucx_mode']}", nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {"ucx_error_handling_mode": job["ucx_mode"]})
        buf = self.flat.view(torch_uint8())
        reg = agent.register_memory(buf)
        descs = agent.get_xfer_descs(buf)
        stop = threading.Event()

        def progress() -> None:
            while not stop.wait(0.001):
                agent.get_new_notifs()

        th = threading.Thread(target=progress, daemon=True)
        th.start()
        try:
            self.peer.send((agent.get_agent_metadata(), agent.get_serialized_descs(descs)))
            assert self.peer.recv() == "done"
        finally:
            stop.set()
            th.join()
        agent.deregister_memory(reg)
        return {}

    # -- plans (Sender.plan / put(plan)) ---------------------------------------------

    def drain_peer(self, job: dict) -> dict:
        return _drain(self.peer)

    def memcpy_sender(self, job: dict) -> dict:
        """The memcpy limit in the sender's process (a planned put is one copy)."""
        return memcpy_limit(self.flat, job)

    def plan_refusal(self, job: dict) -> dict:
        """What ``put(plan, snapshot=False)`` says on this transport (only tcp
        serves a plan's own memory): the error, or None if it was accepted."""
        import torch

        from tensorferry import TensorferryError

        plan = self.sender.plan([torch.ones(4)])
        try:
            ticket = self.sender.put(plan, snapshot=False, readers=None)
        except TensorferryError as exc:
            return {"refused": f"{type(exc).__name__}: {exc}"}
        self.sender.discard(ticket)
        self.sender.wait_released(ticket, timeout=60)
        return {"refused": None}

    def plan_group(self, job: dict) -> dict:
        """Syncs of a group of variants, interleaved: each round runs every
        variant once (in an order rotated every round), so load that drifts
        over seconds weighs on all of them alike. Before each sync the
        variant's tensors change in place (every element +1, untimed).
        Variants (``how``): ``plan`` (one SendPlan, made inside the first
        sync's timing), ``plan-bf16`` (planned with ``dtype=torch.bfloat16``),
        ``plan-nosnap`` (``snapshot=False``) or ``fresh`` (a plain
        ``put(obj)`` every sync). With ``memcpy``, each round also times one
        libc memcpy of the same bytes into touched memory in this process,
        while the receiver waits for a ticket (as during a put)."""
        import numpy as np
        import torch

        variants = job["variants"]
        # The group's own copy of the data: it changes, self.flat must not.
        flat = self.flat.clone()
        sep = None
        if any(v["kind"] == "separate" for v in variants):
            sep = [v.clone() for v in views_of(flat, PLAN_COUNT)]
        changes = {"views": 0, "separate": 0}
        copy_dst = torch.zeros(self.nbytes, dtype=torch.uint8) if job.get("memcpy") else None
        memcpy_seconds = []
        plans: list[Any] = [None] * len(variants)
        out = [{"records": [], "first": {}} for _ in variants]
        prof = cProfile.Profile() if job.get("profile") else None
        total = job["warmup"] + job["repeats"]
        for r in range(total):
            timed = r >= job["warmup"]
            for n, i in enumerate(rotated(len(variants), r)):
                v = variants[i]
                objs = sep if v["kind"] == "separate" else views_of(flat, v["count"])
                msg = self.peer.recv()
                if msg[0] != "ready":
                    raise RuntimeError(f"receiver aborted: {msg[1]}")
                if copy_dst is not None and n == 0:
                    # Where a put runs: the receiver waits for the ticket.
                    d, s_ = copy_dst.numpy(), flat.view(torch.uint8).numpy()
                    t = time.monotonic()
                    np.copyto(d, s_, casting="no")
                    if timed:
                        memcpy_seconds.append(time.monotonic() - t)
                if v["kind"] == "separate":
                    torch._foreach_add_(sep, 1.0)
                else:
                    flat.add_(1.0)
                changes[v["kind"]] += 1
                gc.collect()
                if prof is not None and timed:
                    prof.enable()
                t0 = time.monotonic()
                if plans[i] is None and v["how"] != "fresh":
                    plans[i] = self.sender.plan(objs, dtype=torch.bfloat16 if v["how"] == "plan-bf16" else None)
                t_plan = time.monotonic()
                if plans[i] is None:
                    ticket = self.sender.put(objs)
                else:
                    ticket = self.sender.put(plans[i], snapshot=v["how"] != "plan-nosnap")
                t_put = time.monotonic()
                tb = ticket.to_bytes()
                t_enc = time.monotonic()
                if prof is not None:
                    prof.disable()
                self.peer.send(("ticket", tb, t0, changes[v["kind"]]))
                # Also what snapshot=False requires before the next put (and
                # before the tensors change again).
                self.sender.wait_released(ticket, timeout=300)
                rec = {"t0": t0, "plan_seconds": t_plan - t0, "put_seconds": t_put - t_plan,
                       "encode_seconds": t_enc - t_put, "released_after_seconds": time.monotonic() - t0}
                if timed:
                    out[i]["records"].append(rec)
                elif r == 0:
                    out[i]["first"] = rec
                out[i]["ticket_nbytes"] = len(tb)
                del objs
        for o, p in zip(out, plans):
            o["copy_runs"] = p.copy_runs if p is not None else None
        return {"variants": out, "memcpy_seconds": memcpy_seconds, "profile_sender": _profile_text(prof)}

class ReceiverSide:
    """State and jobs of the receiver worker."""

    def __init__(self, nbytes: int, peer) -> None:
        self.nbytes = nbytes
        self.peer = peer
        self.ref = source(nbytes)
        self.transport = None
        self.rx_pool = None
        self.rx_plain = None

    def tf_open(self, job: dict) -> dict:
        self.transport = job["transport"]
        return {}

    def tf_close(self, job: dict) -> dict:
        for rx in (self.rx_pool, self.rx_plain):
            if rx is not None:
                rx.close()
        self.rx_pool = self.rx_plain = None
        gc.collect()
        return {}

    def _receiver(self, mode: str):
        from tensorferry import MemoryPool, Receiver

        if mode == "new" and self.rx_plain is not None:
            # A fresh receiver per new-memory case: its warm-up get is a
            # process's real first get (its receive cache empty), timed apart.
            self.rx_plain.close()
            self.rx_plain = None
            gc.collect()
        if mode == "pool":
            if self.rx_pool is None:
                self.rx_pool = Receiver(self.transport, pool=MemoryPool(self.nbytes + POOL_SLACK_NBYTES, prefault=True))
            return self.rx_pool
        if self.rx_pool is not None:  # pool cases come first: free that GiB now
            self.rx_pool.close()
            self.rx_pool = None
            gc.collect()
        if self.rx_plain is None:
            self.rx_plain = Receiver(self.transport)
        return self.rx_plain

    def tf_case(self, job: dict) -> dict:
        import torch

        mode, count = job["mode"], job["count"]
        ref = views_of(self.ref, count)
        rx = self._receiver(mode)
        targets_flat = targets = None
        if mode == "into":
            targets_flat = torch.zeros(numel_of(self.nbytes))
            targets = views_of(targets_flat, count)
        total = job["warmup"] + job["repeats"]
        recs = []
        problem = "not verified"
        prof = cProfile.Profile() if job.get("profile") else None
        for r in range(total):
            verify_now = r == total - 1
            if verify_now:
                if mode == "pool":
                    rx.pool.buffer.zero_()
                elif mode == "into":
                    targets_flat.zero_()
            gc.collect()
            base = reset_peak_rss()
            self.peer.send(("ready",))
            msg = self.peer.recv()
            _, tb, t0, sender_verifies = msg
            t_got = time.monotonic()
            flt = minor_faults()
            if prof is not None and r >= job["warmup"]:
                prof.enable()
            if mode == "into":
                res = rx.get(tb, into=targets)
            else:
                res = rx.get(tb, zero_copy=(mode == "zero_copy"))
            t1 = time.monotonic()
            if prof is not None:
                prof.disable()
            growth = peak_rss() - base
            flt = minor_faults() - flt
            if verify_now:
                assert sender_verifies
                if mode == "into" and res is not targets:
                    problem = "into= did not return the targets"
                else:
                    problem = verify(res, ref)
            del res  # a real loop drops the last result before the next get
            if r == 0:
                first_get = t1 - t_got
            if r >= job["warmup"]:
                recs.append({
                    "t0": t0,
                    "end_to_end_seconds": t1 - t0,
                    "ticket_transit_seconds": t_got - t0,  # includes the put
                    "get_seconds": t1 - t_got,
                    "receiver_rss_growth_nbytes": growth,
                    "receiver_minor_faults": flt,
                })
        del targets, targets_flat
        gc.collect()
        if job.get("ticket_timing"):
            # Verified and collected: idle while the sender times tickets.
            assert self.peer.recv() == ("ticket_timing_ready",)
            self.peer.send(("receiver_idle",))
        return {"records": recs, "verified": problem is None, "problem": problem,
                "first_get_seconds": first_get, "profile_receiver": _profile_text(prof)}

    # -- limits and peers ------------------------------------------------------------

    def memcpy(self, job: dict) -> dict:
        return memcpy_limit(self.ref, job)

    def rawtcp(self, job: dict) -> dict:
        import torch

        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        self.peer.send(lst.getsockname()[1])
        sock, _ = lst.accept()
        _tune(sock)
        lst.close()
        dst = torch.zeros(self.nbytes, dtype=torch.uint8)
        view = memoryview(dst.numpy())
        times = []
        total = job["warmup"] + job["repeats"]
        for r in range(total):
            if r == total - 1:
                dst.zero_()
            sock.sendall(b"G")
            got = 0
            n = len(view)
            while got < n:
                got += sock.recvmsg_into([view[got:]])[0]
            t1 = time.monotonic()
            t0 = self.peer.recv()
            times.append(t1 - t0)
        sock.close()
        ok = torch.equal(dst, self.ref.view(torch.uint8))
        return {"seconds": times[job["warmup"]:], "verified": ok}

    def tmpq(self, job: dict, queue) -> dict:
        count = job["count"]
        ref = views_of(self.ref, count)
        times, growths = [], []
        total = job["warmup"] + job["repeats"]
        problem = "not verified"
        for r in range(total):
            gc.collect()
            base = reset_peak_rss()
            self.peer.send("ready")
            t0, obj = queue.get(timeout=600)
            t1 = time.monotonic()
            growths.append(peak_rss() - base)
            times.append(t1 - t0)
            if r == total - 1:
                problem = verify(obj, ref)
            del obj
            self.peer.send("done")
        w = job["warmup"]
        return {"seconds": times[w:], "receiver_rss_growth_nbytes": growths[w:], "verified": problem is None,
                "problem": problem}

    def tsave(self, job: dict) -> dict:
        import torch

        count = job["count"]
        ref = views_of(self.ref, count)
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        self.peer.send(lst.getsockname()[1])
        sock, _ = lst.accept()
        _tune(sock)
        lst.close()
        times, growths = [], []
        total = job["warmup"] + job["repeats"]
        problem = "not verified"
        for r in range(total):
            gc.collect()
            base = reset_peak_rss()
            sock.sendall(b"G")
            t0, n = struct.unpack("<dQ", _recv_exact(sock, 16))
            data = bytearray(n)
            view = memoryview(data)
            got = 0
            while got < n:
                got += sock.recv_into(view[got:])
            del view
            state = torch.load(io.BytesIO(data), weights_only=True)
            t1 = time.monotonic()
            del data
            growths.append(peak_rss() - base)
            times.append(t1 - t0)
            if r == total - 1:
                problem = verify(list(state.values()), ref)
            del state
        sock.close()
        w = job["warmup"]
        return {"seconds": times[w:], "receiver_rss_growth_nbytes": growths[w:], "verified": problem is None,
                "problem": problem}

    def rawnixl(self, job: dict) -> dict:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(f"bench-initiator-{job['ucx_mode']}", nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("UCX", {"ucx_error_handling_mode": job["ucx_mode"]})
        dst = torch.zeros(self.nbytes, dtype=torch.uint8)
        reg = agent.register_memory(dst)
        meta, remote_ser = self.peer.recv()
        remote_name = agent.add_remote_agent(meta)
        remote = agent.deserialize_descs(remote_ser)
        local = agent.get_xfer_descs(dst)
        handle = agent.initialize_xfer("READ", local, remote, remote_name)
        times = []
        total = job["warmup"] + job["repeats"]
        try:
            for r in range(total):
                if r == total - 1:
                    dst.zero_()
                t0 = time.monotonic()
                state = agent.transfer(handle)
                deadline = t0 + 120
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError("raw NIXL READ did not finish in 120 s")
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL READ ended in state {state}")
                times.append(time.monotonic() - t0)
            ok = torch.equal(dst, self.ref.view(torch.uint8))
        finally:
            self.peer.send("done")
            handle.release()
            agent.remove_remote_agent(remote_name)
            agent.deregister_memory(reg)
        return {"seconds": times[job["warmup"]:], "verified": ok,
                "via": f"this script (nixl._api, UCX error handling {job['ucx_mode']!r}, busy-poll)"}

    # -- plans (Receiver.plan / get(into=plan)) --------------------------------------

    def drain_peer(self, job: dict) -> dict:
        return _drain(self.peer)

    def plan_group(self, job: dict) -> dict:
        """The receiving half of ``SenderSide.plan_group``: one plain
        Receiver (no receive pool given); ``dest`` ``own``
        (``Receiver.plan(ticket)`` allocates the destinations) or ``into``
        (existing, touched tensors: views of one flat buffer, shared by the
        group's variants of 1 tensor and of 100k views, or separately
        allocated for 100k separate). RecvPlans are made inside the first
        sync's timing. Each variant's last sync is verified right after it
        (the next variant may write the same targets)."""
        import torch

        variants = job["variants"]
        rx = self._receiver("into")
        into = {}
        for v in variants:
            if v["dest"] != "into":
                continue
            dt = torch.bfloat16 if v["how"] == "plan-bf16" else torch.float32
            key = (v["kind"], dt)
            if key not in into:
                if v["kind"] == "separate":
                    into[key] = [torch.zeros(t.shape, dtype=dt) for t in views_of(self.ref, PLAN_COUNT)]
                else:
                    into[key] = torch.zeros(numel_of(self.nbytes), dtype=dt)
        targets = []
        for v in variants:
            dt = torch.bfloat16 if v["how"] == "plan-bf16" else torch.float32
            t = into.get((v["kind"], dt)) if v["dest"] == "into" else None
            targets.append(t if t is None or isinstance(t, list) else views_of(t, v["count"]))
        rplans: list[Any] = [None] * len(variants)
        out = [{"records": [], "first": {}, "problem": "not verified", "returned_planned": True} for _ in variants]
        prof = cProfile.Profile() if job.get("profile") else None
        total = job["warmup"] + job["repeats"]
        for r in range(total):
            timed = r >= job["warmup"]
            for i in rotated(len(variants), r):
                v, o = variants[i], out[i]
                gc.collect()
                self.peer.send(("ready",))
                _, tb, t0, changes = self.peer.recv()
                t_got = time.monotonic()
                if prof is not None and timed:
                    prof.enable()
                plan_seconds = 0.0
                if v["how"] == "fresh":
                    res = rx.get(tb, into=targets[i]) if targets[i] is not None else rx.get(tb)
                else:
                    if rplans[i] is None:
                        rplans[i] = rx.plan(tb, into=targets[i])
                        plan_seconds = time.monotonic() - t_got
                    res = rx.get(tb, into=rplans[i])
                t1 = time.monotonic()
                if prof is not None:
                    prof.disable()
                if targets[i] is not None:
                    o["returned_planned"] &= res is targets[i]
                elif rplans[i] is not None:
                    o["returned_planned"] &= res is rplans[i].result
                if r == total - 1:
                    # After the timing: the values of this sync (the sender
                    # changed them before every put), so stale bytes fail.
                    dt = torch.bfloat16 if v["how"] == "plan-bf16" else torch.float32
                    o["problem"] = verify(res, self._synced(v["count"], dt, changes))
                    if o["problem"] is None and not o["returned_planned"]:
                        o["problem"] = "a get did not return the planned destinations (into= or the plan's own tensors)"
                del res
                rec = {"t0": t0, "end_to_end_seconds": t1 - t0, "ticket_transit_seconds": t_got - t0,
                       "receiver_plan_seconds": plan_seconds, "get_seconds": t1 - t_got - plan_seconds}
                if timed:
                    o["records"].append(rec)
                elif r == 0:
                    o["first"] = rec
        for o in out:
            o["verified"] = o["problem"] is None
        del rplans, targets, into
        gc.collect()
        return {"variants": out, "profile_receiver": _profile_text(prof)}

    def _synced(self, count: int, dtype, syncs: int) -> list:
        """What the sender sent at its ``syncs``-th put: the source with +1
        added ``syncs`` times (the same float32 operations, so the same
        bits), then converted to ``dtype``."""
        exp = self.ref.clone()
        for _ in range(syncs):
            exp.add_(1.0)
        if exp.dtype != dtype:
            exp = exp.to(dtype)
        return views_of(exp, count)


def torch_uint8():
    import torch

    return torch.uint8


def worker(role: str, nbytes: int, threads: int, ctl, peer, queue) -> None:
    """Entry point of both worker processes: run jobs from the main process."""
    _setup_worker(threads)
    try:
        side = SenderSide(nbytes, peer) if role == "sender" else ReceiverSide(nbytes, peer)
        ctl.send({"ready": True, "pid": os.getpid(), "peak_reset_works": check_peak_reset()})
    except BaseException:
        ctl.send({"ready": False, "error": traceback.format_exc()})
        return
    while True:
        job = ctl.recv()
        if job is None:
            return
        fn = getattr(side, job["job"], None)
        if fn is None:  # a job only the other side runs (memcpy)
            ctl.send({})
            continue
        try:
            out = fn(job, queue) if job["job"] == "tmpq" else fn(job)
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            # Unblock the other side if it waits on us.
            try:
                peer.send(("abort", str(exc)))
            except Exception:
                pass
        ctl.send(out)


# -- orchestration (main process) -------------------------------------------------------


class Workers:
    def __init__(self, nbytes: int, threads: int) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        a, b = ctx.Pipe(duplex=True)
        self.queue = ctx.Queue()
        self.ctl = {}
        self.procs = {}
        for role, peer in (("sender", a), ("receiver", b)):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker, args=(role, nbytes, threads, theirs, peer, self.queue), name=f"bench-{role}")
            p.start()
            self.ctl[role] = mine
            self.procs[role] = p
        self.info = {role: self.ctl[role].recv() for role in self.ctl}
        for role, info in self.info.items():
            if not info.get("ready"):
                raise RuntimeError(f"{role} worker failed to start:\n{info.get('error')}")

    def run(self, job: dict, timeout: float = 600.0) -> tuple[dict, dict]:
        for c in self.ctl.values():
            c.send(job)
        out = {}
        for role, c in self.ctl.items():
            if not c.poll(timeout):
                raise RuntimeError(f"{role} worker did not finish job {job} in {timeout} s")
            out[role] = c.recv()
        for role in out:
            if "error" in out[role]:
                other = "receiver" if role == "sender" else "sender"
                # drain an abort the failing side may have sent to the other
                raise RuntimeError(f"{role} failed in job {job}: {out[role]['traceback']}"
                                   f"\n(other side: {out[other].get('error', 'ok')})")
        return out["sender"], out["receiver"]

    def close(self) -> None:
        for c in self.ctl.values():
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()  # only our own children, by handle


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tf_cases(transport: str, repeats: int) -> list[dict]:
    """pool cases first (the receiver frees its pool before the others)."""
    cases = [dict(mode="pool", count=c, kind="views") for c in COUNTS]
    cases.append(dict(mode="pool", count=10_000, kind="separate"))
    for mode in ("new", "into") + (("zero_copy",) if transport == "shm" else ()):
        cases += [dict(mode=mode, count=1, kind="views"), dict(mode=mode, count=100_000, kind="views")]
        if mode == "new":
            # The plain repeated get the receive cache is for (issue: >= 0.7x memcpy from the second get on).
            cases.append(dict(mode=mode, count=10_000, kind="views"))
    for c in cases:
        c.update(job="tf_case", transport=transport, warmup=1, repeats=repeats)
    return cases


def case_label(c: dict) -> str:
    """A case's (or a plans variant's) object, e.g. ``100k separate``."""
    n = {1: "1", 10_000: "10k", 100_000: "100k"}[c["count"]]
    return f"{n}{' separate' if c['kind'] == 'separate' else ''}"


def raw_nixl_limit(w: Workers, nbytes: int, repeats: int) -> dict | None:
    """One 1 GiB descriptor, READ: the helper if someone wrote it, else ours."""
    helper = ROOT / "benchmarks" / "_raw_nixl.py"
    if helper.exists():
        sys.path.insert(0, str(helper.parent))
        try:
            import _raw_nixl  # type: ignore[import-not-found]

            secs = _raw_nixl.raw_nixl_read_seconds(nbytes, 1, repeats)
            # The helper checks the destination byte for byte and raises otherwise.
            out = {"seconds": list(secs) if not isinstance(secs, float) else [secs], "verified": True,
                   "via": "benchmarks/_raw_nixl.py (UCX, error handling 'peer', CMA)"}
            try:
                secs10k = _raw_nixl.raw_nixl_read_seconds(nbytes, 10_000, max(1, repeats // 2))
                out["seconds_10k_descs"] = list(secs10k) if not isinstance(secs10k, float) else [secs10k]
            except Exception as exc:  # the multi-descriptor figure is context only
                out["seconds_10k_descs_error"] = repr(exc)
            return out
        except Exception as exc:
            log(f"benchmarks/_raw_nixl.py failed ({exc!r}); measuring raw NIXL here instead")
    # Both UCX error-handling modes ("peer" is what the transport uses); the
    # faster is the limit, the other is kept for the record.
    runs = {}
    for mode in ("peer", "none"):
        _, runs[mode] = w.run({"job": "rawnixl", "ucx_mode": mode, "warmup": 1, "repeats": repeats})
    best = min(runs, key=lambda m: med(runs[m]["seconds"]))
    out = dict(runs[best])
    out["by_ucx_error_handling"] = {m: {"seconds": r["seconds"], "verified": r["verified"]} for m, r in runs.items()}
    out["verified"] = all(r["verified"] for r in runs.values())
    return out


# -- plans section (Sender.plan, Receiver.plan) -------------------------------------------


def plan_groups(transport: str, repeats: int) -> list[dict]:
    """The plans section's groups; each runs its variants interleaved.

    ``own``: 1 tensor, 100k views of one flat buffer and 100k separately
    allocated tensors, planned, into the plan's own destinations; and one
    memcpy of the same bytes in the sender each round. ``into``: the same
    objects planned into existing tensors, and as fresh put/get(into=).
    ``wire``: 100k views planned as float32, as bfloat16 (``dtype=``) and,
    on tcp, with ``snapshot=False``.
    """
    objects = ((1, "views"), (PLAN_COUNT, "views"), (PLAN_COUNT, "separate"))
    groups = [
        dict(group="own", memcpy=True, variants=[dict(how="plan", count=c, kind=k, dest="own") for c, k in objects]),
        dict(group="into", variants=[dict(how=h, count=c, kind=k, dest="into") for h in ("plan", "fresh") for c, k in objects]),
        dict(group="wire", variants=[dict(how=h, count=PLAN_COUNT, kind="views", dest="own")
                                     for h in ("plan", "plan-bf16") + (("plan-nosnap",) if transport == "tcp" else ())]),
    ]
    for g in groups:
        g.update(job="plan_group", transport=transport, warmup=1, repeats=repeats)
    return groups


def plan_case_id(c: dict) -> str:
    """A plans case's name, e.g. ``tcp:into:plan:100k-separate``."""
    return f"{c['transport']}:{c['group']}:{c['how']}:{case_label(c).replace(' ', '-')}"


def run_plans(w: Workers, transports: list[str], repeats: int, args, doc: dict) -> None:
    """The plans section: the sender's memcpy limit (before and after,
    pooled), then every group of every transport (``--only`` selects
    groups as ``shm:own``, ``tcp:wire``)."""
    plans = doc.setdefault("plans", {"cases": [], "not_applicable": {}, "limits": {}, "memcpy_rounds": {}})
    job = {"warmup": 1, "repeats": max(3, repeats)}
    lim_jobs = [("memcpy_libc_sender", {"libc": True})]
    if COPY_THREADS > 1:
        lim_jobs.append(("memcpy_parallel_sender", {"libc": True, "threads": COPY_THREADS}))
    for key, extra in lim_jobs:
        plans["limits"][key], _ = w.run({"job": "memcpy_sender", **extra, **job})
    for transport in transports:
        try:
            w.run({"job": "tf_open", "transport": transport})
        except Exception as exc:
            doc["errors"].append(f"{transport}: open: {exc}")
            log(f"{transport}: cannot open: {exc}")
            continue
        refused = w.run({"job": "plan_refusal"})[0]["refused"]
        if refused is not None:
            plans["not_applicable"][f"{transport} snapshot=False"] = refused
            log(f"{transport} plan snapshot=False: not applicable ({refused.split(':')[0]})")
        for group in plan_groups(transport, repeats):
            gid = f"{transport}:{group['group']}"
            if args.only and gid not in args.only:
                continue
            group["profile"] = args.profile
            try:
                s, r = w.run(group, timeout=1200)
            except Exception as exc:
                doc["errors"].append(f"{gid}: {exc}")
                log(f"{gid}: FAILED {exc}")
                plans["cases"] += [{**v, "group": group["group"], "transport": transport, "repeats": group["repeats"],
                                    "id": plan_case_id({**v, "group": group["group"], "transport": transport}),
                                    "error": str(exc)} for v in group["variants"]]
                w.run({"job": "tf_close"})
                w.run({"job": "drain_peer"})
                w.run({"job": "tf_open", "transport": transport})
                continue
            if s["memcpy_seconds"]:
                plans["memcpy_rounds"][gid] = s["memcpy_seconds"]
            for n, (v, sv, rv) in enumerate(zip(group["variants"], s["variants"], r["variants"])):
                c = {**v, "group": group["group"], "transport": transport, "repeats": group["repeats"]}
                c["id"] = plan_case_id(c)
                # The group's profiles (all its variants together) go with its first.
                sv["profile_sender"] = s["profile_sender"] if n == 0 else None
                rv["profile_receiver"] = r["profile_receiver"] if n == 0 else None
                plans["cases"].append({**c, "sender": sv, "receiver": rv})
                log(f"{c['id']}: sync {med([x['end_to_end_seconds'] for x in rv['records']]):.3f} s, put "
                    f"{med([x['put_seconds'] for x in sv['records']]):.3f}, first sync {rv['first']['end_to_end_seconds']:.3f}, "
                    f"verified {rv['verified']}")
        w.run({"job": "tf_close"})
    for key, extra in lim_jobs:
        again, _ = w.run({"job": "memcpy_sender", **extra, **job})
        lim = plans["limits"][key]
        lim["seconds_start"], lim["seconds_end"] = lim["seconds"], again["seconds"]
        lim["seconds"] = lim["seconds"] + again["seconds"]
        lim["verified"] = lim["verified"] and again["verified"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per tensorferry case (median)")
    ap.add_argument("--peer-repeats", type=int, default=3, help="timed repeats per peer case")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each worker")
    ap.add_argument("--transports", nargs="*", default=None, help="default: tensorferry.transports.available()")
    ap.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB, 2 repeats (smoke run)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--plans", action="store_true",
                    help="run only the plans section (Sender.plan / Receiver.plan syncs, their own limits)")
    ap.add_argument("--no-plans", action="store_true", help="leave the plans section out of a full run")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed sections (slows them)")
    ap.add_argument("--only", nargs="*", default=None, metavar="TRANSPORT:MODE:TENSORS",
                    help="run only these tensorferry cases (e.g. shm:pool:100k tcp:into:1), no peers")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only redraw the tables and the plot from a results JSON")
    args = ap.parse_args()
    if args.replot is not None:
        doc = json.loads(args.replot.read_text())
        print_tables(doc, doc["env"]["nbytes"])
        if doc["rows"]:
            plot(doc, doc["env"]["nbytes"], args.replot.with_suffix(".png"))
        if doc.get("plans", {}).get("rows"):
            plot_plans(doc, args.replot.with_name(args.replot.stem + "_plans.png"))
        return 0

    from tensorferry._copy import copy_threads
    from tensorferry.transports import available

    global COPY_THREADS
    COPY_THREADS = copy_threads()
    nbytes = 64 * MIB if args.quick else GIB
    repeats = 2 if args.quick else args.repeats
    peer_repeats = 2 if args.quick else args.peer_repeats
    transports = args.transports if args.transports is not None else available()
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    log(f"transports {transports}; {nbytes / MIB:.0f} MiB; repeats {repeats} (peers {peer_repeats}); "
        f"torch threads {args.threads}; load {load_start:.2f}")

    w = Workers(nbytes, args.threads)
    doc: dict[str, Any] = {"limits": {}, "cases": [], "peers": [], "errors": []}
    try:
        log(f"workers up in {time.monotonic() - started:.1f} s: {w.info}")
        limits = doc["limits"]
        job = {"warmup": 1, "repeats": max(3, repeats)}
        # (key, job, options): measured here and again at the end.
        limit_jobs = [("memcpy", "memcpy", {}), ("memcpy_libc", "memcpy", {"libc": True})]
        if COPY_THREADS > 1:
            limit_jobs.append(("memcpy_parallel", "memcpy", {"libc": True, "threads": COPY_THREADS}))
        limit_jobs.append(("raw_tcp", "rawtcp", {}))
        if args.plans:
            limit_jobs = []  # the plans section measures its own
        for key, name, extra in limit_jobs:
            _, limits[key] = w.run({"job": name, **extra, **job})
        if limit_jobs:
            log(f"limits: memcpy (torch copy_) {nbytes / med(limits['memcpy']['seconds']) / 1e9:.2f} GB/s, libc memcpy "
                f"{nbytes / med(limits['memcpy_libc']['seconds']) / 1e9:.2f} GB/s"
                + (f", libc memcpy on {COPY_THREADS} threads {nbytes / med(limits['memcpy_parallel']['seconds']) / 1e9:.2f} GB/s"
                   if "memcpy_parallel" in limits else "") + ", raw tcp "
                f"{nbytes / med(limits['raw_tcp']['seconds']) / 1e9:.2f} GB/s")
        try:
            import importlib.util

            if importlib.util.find_spec("nixl") is not None and not args.plans:
                limits["raw_nixl"] = raw_nixl_limit(w, nbytes, max(3, repeats))
                log(f"limit: raw nixl {nbytes / med(limits['raw_nixl']['seconds']) / 1e9:.2f} GB/s")
        except Exception as exc:
            doc["errors"].append(f"raw nixl: {exc}")
            log(f"raw nixl failed: {exc}")

        for transport in [] if args.plans else transports:
            try:
                w.run({"job": "tf_open", "transport": transport})
            except Exception as exc:
                doc["errors"].append(f"{transport}: open: {exc}")
                log(f"{transport}: cannot open: {exc}")
                continue
            for case in tf_cases(transport, repeats):
                if args.only and not any(o == f"{transport}:{case['mode']}:{case_label(case)}" for o in args.only):
                    continue
                case["profile"] = args.profile
                case["ticket_timing"] = case["mode"] == "pool" and case["count"] == 100_000
                label = f"{transport} {case['mode']} {case_label(case)}"
                try:
                    s, r = w.run(case)
                except Exception as exc:
                    doc["errors"].append(f"{label}: {exc}")
                    log(f"{label}: FAILED {exc}")
                    doc["cases"].append({**case, "error": str(exc)})
                    # The sides may be out of step now: reopen this transport.
                    w.run({"job": "tf_close"})
                    w.run({"job": "tf_open", "transport": transport})
                    continue
                rec = {**case, "sender": s, "receiver": r}
                e2e = med([x["end_to_end_seconds"] for x in r["records"]])
                doc["cases"].append(rec)
                log(f"{label}: {e2e:.3f} s ({nbytes / e2e / 1e9:.2f} GB/s) put {med([x['put_seconds'] for x in s['records']]):.3f} "
                    f"get {med([x['get_seconds'] for x in r['records']]):.3f} verified {r['verified']}")
            w.run({"job": "tf_close"})

        if not args.no_peers and not args.only and not args.plans:
            for count in (1, 10_000):
                _, r = w.run({"job": "tmpq", "count": count, "warmup": 1, "repeats": peer_repeats})
                doc["peers"].append({"peer": "torch.multiprocessing queue", "count": count, "kind": "views", **r})
                log(f"torch mp queue {count}: {med(r['seconds']):.3f} s verified {r['verified']}")
            for count in COUNTS:
                # 100k entries cost torch.save/load ~1 min a round trip here:
                # one timed run, no warm-up (said in the table).
                slow = count == 100_000
                _, r = w.run({"job": "tsave", "count": count, "warmup": 0 if slow else 1,
                              "repeats": 1 if slow else peer_repeats}, timeout=900)
                doc["peers"].append({"peer": "torch.save/socket/torch.load", "count": count, "kind": "views", **r})
                log(f"torch.save {count}: {med(r['seconds']):.3f} s verified {r['verified']}")

        if args.plans or not (args.only or args.no_plans):
            run_plans(w, transports, repeats, args, doc)

        # The limits again at the end: the machine is shared, so pool both runs.
        for key, name, extra in limit_jobs:
            _, again = w.run({"job": name, **extra, **job})
            limits[key]["seconds_start"] = limits[key]["seconds"]
            limits[key]["seconds_end"] = again["seconds"]
            limits[key]["seconds"] = limits[key]["seconds"] + again["seconds"]
            limits[key]["verified"] = limits[key]["verified"] and again["verified"]
    finally:
        w.close()

    doc["env"] = env_info(args, nbytes, repeats, peer_repeats, transports, w.info, load_start, started)
    summarize(doc, nbytes)
    summarize_plans(doc, nbytes)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("_plans" if args.plans else "") + ("_quick" if args.quick else "_profile" if args.profile else "_subset" if args.only else "")
    (args.out / f"bench_transfer{suffix}.json").write_text(json.dumps(doc, indent=1, default=float))
    print_tables(doc, nbytes)
    if args.profile:
        prof_path = args.out / "bench_transfer_profile.txt"
        with prof_path.open("w") as f:
            for c in doc["cases"]:
                if "error" in c:
                    continue
                for side, text in (("SENDER put()", c["sender"].get("profile_sender")),
                                   ("RECEIVER get() (main thread only)", c["receiver"].get("profile_receiver"))):
                    f.write(f"\n===== {c['transport']} {c['mode']} {case_label(c)}: {side}, {c['repeats']} timed runs =====\n")
                    f.write(text or "(none)\n")
            for c in doc.get("plans", {}).get("cases", []):
                if "error" in c or not c["sender"].get("profile_sender"):
                    continue  # a group's profile is kept with its first variant
                for side, text in (("SENDER plan+put", c["sender"].get("profile_sender")),
                                   ("RECEIVER plan+get (main thread only)", c["receiver"].get("profile_receiver"))):
                    f.write(f"\n===== plans group {c['transport']}:{c['group']}: {side}, {c['repeats']} timed rounds "
                            "of all its variants =====\n")
                    f.write(text or "(none)\n")
        log(f"profiles in {prof_path}")
    if doc["rows"]:
        plot(doc, nbytes, args.out / f"bench_transfer{suffix}.png")
    if doc.get("plans", {}).get("rows"):
        plot_plans(doc, args.out / f"bench_transfer{suffix}_plans.png")
    log(f"done in {time.monotonic() - started:.0f} s; wrote {args.out / f'bench_transfer{suffix}.json'} and .png")
    return 0


def env_info(args, nbytes, repeats, peer_repeats, transports, info, load_start, started) -> dict:
    import torch


    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorferry": package_version("tensorferry"),
        "nixl": package_version("nixl"),
        "nbytes": nbytes,
        "repeats": repeats,
        "peer_repeats": peer_repeats,
        "warmup": 1,
        "torch_threads": args.threads,
        "copy_threads": COPY_THREADS,
        "transports": transports,
        "peak_reset_works": {role: i["peak_reset_works"] for role, i in info.items()},
        "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "wall_seconds": round(time.monotonic() - started, 1),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES"),
        "plans_only": args.plans,
    }


# -- summary, tables, plot --------------------------------------------------------------


def summarize(doc: dict, nbytes: int) -> None:
    lim = doc["limits"]
    limit_s = {k: med(v["seconds"]) for k, v in lim.items() if v and v.get("seconds")}
    # shm is bounded by one real memcpy: libc's (tensorferry copies with it;
    # torch's copy_ is ~1.5x slower here and is shown as the brief's figure).
    limit_for = {"shm": "memcpy_libc", "tcp": "raw_tcp", "nixl": "raw_nixl"}
    target_for = {"shm": TARGET_SHM_VS_MEMCPY, "tcp": TARGET_TCP_VS_RAW, "nixl": TARGET_NIXL_VS_RAW}
    rows = []
    for c in doc["cases"]:
        if "error" in c:
            continue
        s, r = c["sender"]["records"], c["receiver"]["records"]
        e2e = med([x["end_to_end_seconds"] for x in r])
        row = {
            "transport": c["transport"], "mode": c["mode"], "count": c["count"], "kind": c["kind"],
            "label": case_label(c),
            "end_to_end_seconds": e2e,
            "end_to_end_all_seconds": [x["end_to_end_seconds"] for x in r],
            "put_seconds": med([x["put_seconds"] for x in s]),
            "get_seconds": med([x["get_seconds"] for x in r]),
            "ticket_transit_minus_put_seconds": med([x["ticket_transit_seconds"] - y["put_seconds"] for x, y in zip(r, s)]),
            "gbps": nbytes / e2e / 1e9,
            "get_gbps": nbytes / med([x["get_seconds"] for x in r]) / 1e9,
            "receiver_rss_growth_nbytes": max(x["receiver_rss_growth_nbytes"] for x in r),
            "sender_rss_growth_nbytes": max(x["sender_rss_growth_nbytes"] for x in s),
            "receiver_minor_faults": med([x["receiver_minor_faults"] for x in r]),
            "sender_minor_faults": med([x["sender_minor_faults"] for x in s]),
            "ticket_nbytes": c["sender"]["ticket_nbytes"],
            "blocks": c["sender"]["blocks"],
            "verified": c["receiver"]["verified"],
            "problem": c["receiver"]["problem"],
            # The untimed warm-up's get: for new memory, the receiver's first.
            "first_get_seconds": c["receiver"].get("first_get_seconds"),
        }
        lk = limit_for.get(c["transport"])
        if lk in limit_s:
            row["vs_limit"] = limit_s[lk] / e2e
            row["get_vs_limit"] = limit_s[lk] / row["get_seconds"]
        rows.append(row)
    doc["rows"] = rows
    idx = {(r["transport"], r["mode"], r["count"], r["kind"]): r for r in rows}
    targets = []

    def add(name: str, required: str, measured: float | None, met: bool | None, note: str = "", unit: str = "x") -> None:
        targets.append({"target": name, "required": required, "measured": measured, "unit": unit, "met": met, "note": note})

    for t in sorted({r["transport"] for r in rows}):
        lk = limit_for[t]
        one = idx.get((t, "pool", 1, "views"))
        if one is not None and lk in limit_s:
            extra = ""
            if t == "shm" and "memcpy" in limit_s:
                extra = f"; vs torch copy_ ({limit_s['memcpy'] * 1e3:.0f} ms): {limit_s['memcpy'] / one['end_to_end_seconds']:.2f}x"
            if t == "shm" and "memcpy_parallel" in limit_s:
                par = limit_s["memcpy_parallel"]
                k = doc["env"].get("copy_threads", COPY_THREADS)
                add(f"{t} copy (pool, 1 tensor) vs memcpy_parallel, put→held", f">= {target_for[t]}x",
                    par / one["end_to_end_seconds"], par / one["end_to_end_seconds"] >= target_for[t],
                    f"the machine's copy bandwidth: 1 GiB in {k} slices on as many threads, "
                    f"{par * 1e3:.0f} ms (tensorferry copies on {k} threads too); get alone "
                    f"{par / one['get_seconds']:.2f}x")
            add(f"{t} copy (pool, 1 tensor) vs {lk}, put→held", f">= {target_for[t]}x", one["vs_limit"],
                one["vs_limit"] >= target_for[t],
                f"put (pack copy) {one['put_seconds'] * 1e3:.0f} ms + get {one['get_seconds'] * 1e3:.0f} ms; "
                f"limit {limit_s[lk] * 1e3:.0f} ms{extra}")
            add(f"{t} copy (pool, 1 tensor) vs {lk}, get alone", f">= {target_for[t]}x", one["get_vs_limit"],
                one["get_vs_limit"] >= target_for[t], "the receiver's get only (the bytes already in the sender's pool)")
        elif lk not in limit_s:
            add(f"{t} copy vs {lk}", f">= {target_for[t]}x", None, None, f"{lk} not measured")
        for mode in ("pool", "new", "into", "zero_copy"):
            a, b = idx.get((t, mode, 1, "views")), idx.get((t, mode, 100_000, "views"))
            if a and b:
                ratio = b["end_to_end_seconds"] / a["end_to_end_seconds"]
                add(f"{t} {mode}: time(100k) / time(1)", f"<= {TARGET_100K_VS_1}x", ratio, ratio <= TARGET_100K_VS_1,
                    f"{b['end_to_end_seconds'] * 1e3:.0f} ms vs {a['end_to_end_seconds'] * 1e3:.0f} ms")
        new10k = idx.get((t, "new", 10_000, "views"))
        if t == "shm" and new10k and "get_vs_limit" in new10k:
            first = new10k["first_get_seconds"]
            add(f"{t} new 10k, repeated plain gets vs {lk}, get alone", f">= {TARGET_SHM_VS_MEMCPY}x",
                new10k["get_vs_limit"], new10k["get_vs_limit"] >= TARGET_SHM_VS_MEMCPY,
                f"gets 2.. of one Receiver, the last result deleted before each: {new10k['get_seconds'] * 1e3:.0f} ms; "
                f"its first get {first * 1e3:.0f} ms ({limit_s[lk] / first:.2f}x)" if first else "")
        new = idx.get((t, "new", 1, "views"))
        new100k = idx.get((t, "new", 100_000, "views"))
        for rr in (new, new100k):
            if rr:
                g = rr["receiver_rss_growth_nbytes"]
                add(f"{t} receiver peak RSS growth, new memory, {rr['label']}", "<= 1.1 GiB", g / GIB,
                    g <= TARGET_RX_RSS_NEW_NBYTES, "", " GiB")
        for cnt in (1, 100_000):
            zc = idx.get((t, "zero_copy", cnt, "views"))
            if zc:
                g = zc["receiver_rss_growth_nbytes"]
                add(f"{t} receiver peak RSS growth, zero_copy, {zc['label']}", "<= 64 MiB", g / MIB,
                    g <= TARGET_RX_RSS_ZERO_COPY_NBYTES, "during get (views not touched)", " MiB")
        t_rows = [r for r in rows if r["transport"] == t]
        worst = max(t_rows, key=lambda r: r["sender_rss_growth_nbytes"])
        add(f"{t} sender peak RSS growth beyond its pool (worst case)", "<= 64 MiB",
            worst["sender_rss_growth_nbytes"] / MIB, worst["sender_rss_growth_nbytes"] <= TARGET_TX_RSS_NBYTES,
            f"worst: {worst['mode']} {worst['label']}", " MiB")
    tk = next((c["sender"] for c in doc["cases"] if c.get("ticket_timing") and "error" not in c), None)
    if tk is not None:
        add("ticket bytes, list of 100k tensors", "< 1 MB", tk["ticket_nbytes"] / 1e6, tk["ticket_nbytes"] < TARGET_TICKET_NBYTES,
            f"{tk['ticket_nbytes']:,} bytes", " MB")
        enc_dec = tk["ticket_encode_seconds"] + tk["ticket_decode_seconds"]
        add("ticket to_bytes + from_bytes + .layout, 100k", "< 20 ms", enc_dec * 1e3, enc_dec < TARGET_TICKET_SECONDS,
            f"encode {tk['ticket_encode_seconds'] * 1e3:.1f} ms, decode+layout {tk['ticket_decode_seconds'] * 1e3:.1f} ms; "
            f"+ Layout.to_bytes inside put {tk.get('layout_encode_seconds', float('nan')) * 1e3:.1f} ms", " ms")
    unverified = [f"{r['transport']} {r['mode']} {r['label']}: {r['problem']}" for r in rows if not r["verified"]]
    unverified += [f"{p['peer']} {p['count']}: {p['problem']}" for p in doc["peers"] if not p.get("verified")]
    unverified += [f"limit {k}" for k, v in lim.items() if v and v.get("verified") is False]
    add("every case verified bit-exact after timing", "all", None, not unverified, "; ".join(unverified) or "all equal", "")
    doc["targets"] = targets
    doc["limits_summary"] = {k: {"median_seconds": v, "gbps": nbytes / v / 1e9} for k, v in limit_s.items()}
    for p in doc["peers"]:
        p["median_seconds"] = med(p["seconds"])
        p["gbps"] = nbytes / p["median_seconds"] / 1e9
        if "memcpy_libc" in limit_s:
            p["vs_memcpy"] = limit_s["memcpy_libc"] / p["median_seconds"]


def summarize_plans(doc: dict, nbytes: int) -> None:
    """Rows of the plans section, their ratios (each against a variant of
    the same interleaved group), and its targets (appended to ``doc["targets"]``)."""
    plans = doc.get("plans")
    if not plans:
        return
    lim = {k: med(v["seconds"]) for k, v in plans["limits"].items() if v and v.get("seconds")}
    plans["limits_summary"] = {k: {"median_seconds": v, "gbps": nbytes / v / 1e9} for k, v in lim.items()}
    rows = []
    for c in plans["cases"]:
        if "error" in c:
            continue
        s, r = c["sender"], c["receiver"]
        sync = med([x["end_to_end_seconds"] for x in r["records"]])
        rows.append({
            "id": c["id"], "transport": c["transport"], "group": c["group"], "how": c["how"], "count": c["count"],
            "kind": c["kind"], "dest": c["dest"], "label": case_label(c),
            "sync_seconds": sync,
            "sync_all_seconds": [x["end_to_end_seconds"] for x in r["records"]],
            "put_seconds": med([x["put_seconds"] for x in s["records"]]),
            "get_seconds": med([x["get_seconds"] for x in r["records"]]),
            "released_after_seconds": med([x["released_after_seconds"] for x in s["records"]]),
            # The first sync: sender.plan + put + receiver.plan + get.
            "first_sync_seconds": r["first"]["end_to_end_seconds"],
            "first_sender_plan_seconds": s["first"]["plan_seconds"],
            "first_put_seconds": s["first"]["put_seconds"],
            "first_receiver_plan_seconds": r["first"]["receiver_plan_seconds"],
            "first_get_seconds": r["first"]["get_seconds"],
            "gbps": nbytes / sync / 1e9,  # of the float32 source, whatever went on the wire
            "ticket_nbytes": s["ticket_nbytes"],
            "copy_runs": s["copy_runs"],
            "repeats": len(r["records"]),
            "verified": r["verified"],
            "problem": r["problem"],
        })
    idx = {(r["transport"], r["group"], r["how"], r["count"], r["kind"]): r for r in rows}
    for row in rows:
        t, g = row["transport"], row["group"]
        ref = idx.get((t, g, "plan", 1, "views")) or idx.get((t, g, "plan", PLAN_COUNT, "views"))
        if ref is not None and ref is not row:
            row["vs_ref"] = row["sync_seconds"] / ref["sync_seconds"]
            row["ref"] = PLAN_HOW[ref["how"]] + " " + ref["label"]
    plans["memcpy_rounds_median"] = {g: med(x) for g, x in plans.get("memcpy_rounds", {}).items()}
    plans["rows"] = rows
    if not doc.get("rows") and not doc.get("peers"):
        doc["targets"] = []  # the plans section alone: no other case to hold to its targets
    targets = doc.setdefault("targets", [])

    def add(name: str, required: str, measured: float | None, met: bool | None, note: str = "", unit: str = "x") -> None:
        targets.append({"target": name, "required": required, "measured": measured, "unit": unit, "met": met,
                        "note": note, "section": "plans"})

    def ms(x: float) -> str:
        return f"{x * 1e3:,.0f} ms"

    dest_name = {"own": "into the plan's own tensors", "into": "into= existing tensors"}
    for t in [t for t in ("shm", "tcp", "nixl") if any(r["transport"] == t for r in rows)]:
        fresh1 = idx.get((t, "into", "fresh", 1, "views"))
        for kind, limit in (("views", TARGET_PLAN_VIEWS_VS_1), ("separate", TARGET_PLAN_SEPARATE_VS_1)):
            fresh = idx.get((t, "into", "fresh", PLAN_COUNT, kind))
            beside = ""
            if fresh and fresh1:
                beside = (f"; fresh put/get(into=) of the same: {ms(fresh['sync_seconds'])} vs "
                          f"{ms(fresh1['sync_seconds'])} ({fresh['sync_seconds'] / fresh1['sync_seconds']:.2f}x)")
            for g in ("own", "into"):
                a, b = idx.get((t, g, "plan", 1, "views")), idx.get((t, g, "plan", PLAN_COUNT, kind))
                if a and b:
                    what = "views of one buffer" if kind == "views" else "separately allocated"
                    ratio = b["sync_seconds"] / a["sync_seconds"]
                    add(f"{t} planned sync, 100k {what} / 1 tensor, {dest_name[g]}", f"<= {limit}x", ratio,
                        ratio <= limit, f"{ms(b['sync_seconds'])} (put {ms(b['put_seconds'])}, get {ms(b['get_seconds'])}) vs "
                        f"{ms(a['sync_seconds'])} (put {ms(a['put_seconds'])}, get {ms(a['get_seconds'])})"
                        + (beside if g == "into" else ""))
        put = idx.get((t, "own", "plan", PLAN_COUNT, "views"))
        paired = plans["memcpy_rounds_median"].get(f"{t}:own")
        if put and paired:
            ratio = put["put_seconds"] / paired
            other = idx.get((t, "into", "plan", PLAN_COUNT, "views"))
            one = idx.get((t, "own", "plan", 1, "views"))
            par = lim.get("memcpy_parallel_sender")
            add(f"{t} planned put(snapshot=True) of 100k views / one memcpy (sender)", f"<= {TARGET_PLAN_PUT_VS_MEMCPY}x",
                ratio, ratio <= TARGET_PLAN_PUT_VS_MEMCPY,
                f"put {ms(put['put_seconds'])}" + (f" ({ms(other['put_seconds'])} in the into= group)" if other else "")
                + (f", of 1 tensor {ms(one['put_seconds'])}" if one else "")
                + f"; libc memcpy in the same rounds {ms(paired)}"
                + (f" (before/after the section {ms(lim['memcpy_libc_sender'])})" if "memcpy_libc_sender" in lim else "")
                + (f", on {doc['env'].get('copy_threads', COPY_THREADS)} threads {ms(par)}" if par else ""))
        fp32, bf16 = idx.get((t, "wire", "plan", PLAN_COUNT, "views")), idx.get((t, "wire", "plan-bf16", PLAN_COUNT, "views"))
        if fp32 and bf16:
            ratio = bf16["sync_seconds"] / fp32["sync_seconds"]
            add(f"{t} planned sync, dtype=bfloat16 / float32 (100k views)", f"<= {TARGET_PLAN_BF16_VS_FP32}x", ratio,
                ratio <= TARGET_PLAN_BF16_VS_FP32,
                f"{ms(bf16['sync_seconds'])} vs {ms(fp32['sync_seconds'])}; put {ms(bf16['put_seconds'])} vs "
                f"{ms(fp32['put_seconds'])}, get {ms(bf16['get_seconds'])} vs {ms(fp32['get_seconds'])}")
        nosnap = idx.get((t, "wire", "plan-nosnap", PLAN_COUNT, "views"))
        refused = plans["not_applicable"].get(f"{t} snapshot=False")
        if fp32 and nosnap:
            saved = fp32["sync_seconds"] - nosnap["sync_seconds"]
            add(f"{t} planned sync, snapshot=False / snapshot=True (100k views)", "report",
                nosnap["sync_seconds"] / fp32["sync_seconds"], None,
                f"{ms(nosnap['sync_seconds'])} vs {ms(fp32['sync_seconds'])}: saves {ms(saved)} a sync "
                f"({saved / fp32['sync_seconds']:.0%}); put {nosnap['put_seconds'] * 1e3:.1f} ms vs {ms(fp32['put_seconds'])}")
        elif refused:
            add(f"{t} planned sync, snapshot=False", "report", None, None, f"not applicable: {refused.split(';')[0]}")
    bad = [f"{r['id']}: {r['problem']}" for r in rows if not r["verified"]]
    bad += [f"{c['id']}: {c['error']}" for c in plans["cases"] if "error" in c]
    add("every plans case verified bit-exact after timing (values changed every sync)", "all", None, not bad,
        "; ".join(bad) or "all equal", "")


def print_plan_table(con, doc: dict) -> None:
    from rich.table import Table

    plans = doc.get("plans") or {}
    if not plans.get("rows"):
        return
    lim = plans.get("limits_summary", {})
    extra = ", ".join(f"{k} {v['median_seconds'] * 1e3:,.0f} ms" for k, v in lim.items())
    rounds = ", ".join(f"{g} {v * 1e3:,.0f} ms" for g, v in plans.get("memcpy_rounds_median", {}).items())
    t = Table(title="plans: sync = sender's put(plan) … receiver's get(into=plan) returned, 2nd sync on (the 1st, "
                    "which makes both plans, apart); a group's variants interleaved; the data changes before every sync. "
                    f"Sender memcpy before/after: {extra}; in the own groups' rounds: {rounds}")
    cols = ("transport", "group", "case", "tensors", "sync ms", "syncs ms", "put ms", "get ms",
            "vs group ref", "1st sync ms (tx plan, rx plan)", "copy runs", "ticket B", "verified")
    for col in cols:
        t.add_column(col, justify="left" if col in ("transport", "group", "case", "tensors") else "right")
    for r in plans["rows"]:
        t.add_row(r["transport"], r["group"], PLAN_HOW[r["how"]], r["label"],
                  f"{r['sync_seconds'] * 1e3:,.0f}", " ".join(f"{x * 1e3:.0f}" for x in r["sync_all_seconds"]),
                  f"{r['put_seconds'] * 1e3:,.1f}", f"{r['get_seconds'] * 1e3:,.0f}",
                  f"{r['vs_ref']:.2f}x {r['ref']}" if "vs_ref" in r else "(ref)",
                  f"{r['first_sync_seconds'] * 1e3:,.0f} ({r['first_sender_plan_seconds'] * 1e3:,.0f}, "
                  f"{r['first_receiver_plan_seconds'] * 1e3:,.0f})",
                  "-" if r["copy_runs"] is None else f"{r['copy_runs']:,}", f"{r['ticket_nbytes']:,}",
                  "yes" if r["verified"] else f"[red]NO {r['problem']}[/]")
    con.print(t)
    for k, v in plans.get("not_applicable", {}).items():
        con.print(f"  {k}: not applicable — {v}")


def plot_plans(doc: dict, path: Path) -> None:
    """One panel per transport: every plans case's median sync (bars, by
    group), the sender's one memcpy in the same rounds as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["plans"]["rows"]
    transports = [t for t in ("shm", "tcp", "nixl") if any(r["transport"] == t for r in rows)]
    color = {"plan": "tab:blue", "plan-bf16": "tab:green", "plan-nosnap": "tab:purple", "fresh": "tab:gray"}
    fig, axes = plt.subplots(1, len(transports), figsize=(5.6 * len(transports), 6.4), squeeze=False)
    for ax, t in zip(axes[0], transports):
        mine = [r for r in rows if r["transport"] == t][::-1]
        ys = range(len(mine))
        vals = [r["sync_seconds"] * 1e3 for r in mine]
        ax.barh(ys, vals, color=[color[r["how"]] for r in mine], alpha=0.85)
        for y, v, r in zip(ys, vals, mine):
            ratio = f"  {r['vs_ref']:.2f}x" if "vs_ref" in r else ""
            ax.text(v, y, f" {v:,.0f} ms{ratio}", va="center", fontsize=7.5)
        ax.set_yticks(list(ys))
        ax.set_yticklabels([f"{r['group']}: {PLAN_HOW[r['how']].replace('planned, ', '')}, {r['label']}" for r in mine],
                           fontsize=7.5)
        paired = doc["plans"].get("memcpy_rounds_median", {}).get(f"{t}:own")
        if paired:
            ax.axvline(paired * 1e3, ls="--", color="black", lw=1, label=f"one libc memcpy (sender), {paired * 1e3:.0f} ms")
            ax.legend(fontsize=7.5, loc="lower right")
        ax.set_xlim(0, max(vals) * 1.35)
        ax.set_xlabel("ms, put(plan) … get(into=plan) returned (median)")
        ax.set_title(t, fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    env = doc["env"]
    fig.suptitle(f"tensorferry plans: {env['nbytes'] / MIB:,.0f} MiB float32 synced between two processes, "
                 f"medians of {env['repeats']} syncs after the first\n{env['date']}, {env['machine']}, "
                 f"load {env['loadavg_1min_start_end'][0]}-{env['loadavg_1min_start_end'][1]}; ratios: vs the group's "
                 "planned 1 tensor (own, into) or float32 100k (wire)", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def print_tables(doc: dict, nbytes: int) -> None:
    from rich.console import Console
    from rich.table import Table

    env = doc["env"]
    con = Console(width=220)
    con.print(f"[bold]tensorferry transfer benchmark[/] — {env['date']} — {env['machine']} — "
              f"{nbytes / MIB:,.0f} MiB float32; medians of {env['repeats']} (peers {env['peer_repeats']}) after "
              f"{env['warmup']} warm-up; torch threads {env['torch_threads']}; load {env['loadavg_1min_start_end']} (start, end)")

    t = Table(title="limits (same run: start and end pooled)")
    for col in ("limit", "median ms", "GB/s", "runs", "verified", "via"):
        t.add_column(col, justify="left" if col in ("limit", "via") else "right")
    for k, v in doc["limits"].items():
        if not v or not v.get("seconds"):
            continue
        s = med(v["seconds"])
        t.add_row(k, f"{s * 1e3:,.0f}", f"{nbytes / s / 1e9:.2f}", str(len(v["seconds"])), str(v.get("verified")),
                  v.get("via", "this script"))
        if v.get("seconds_10k_descs"):
            s10 = med(v["seconds_10k_descs"])
            t.add_row(f"{k}, 10k descriptors (context)", f"{s10 * 1e3:,.0f}", f"{nbytes / s10 / 1e9:.2f}",
                      str(len(v["seconds_10k_descs"])), str(v.get("verified")), f"{s10 / s:.2f}x the 1-descriptor time")
    if doc["limits"]:  # none in a --plans run (its limits are in its table)
        con.print(t)

    t = Table(title="tensorferry: put→held end to end (sender's put … receiver's get returned), separate processes")
    cols = ("transport", "mode", "tensors", "e2e ms", "GB/s", "vs limit", "put ms", "get ms", "get vs limit",
            "blocks", "ticket B", "rx RSS +MiB", "tx RSS +MiB", "rx faults", "verified")
    for col in cols:
        t.add_column(col, justify="left" if col in ("transport", "mode", "tensors") else "right")
    for r in doc["rows"]:
        t.add_row(r["transport"], r["mode"], r["label"], f"{r['end_to_end_seconds'] * 1e3:,.0f}", f"{r['gbps']:.2f}",
                  f"{r['vs_limit']:.2f}x" if "vs_limit" in r else "-", f"{r['put_seconds'] * 1e3:,.0f}",
                  f"{r['get_seconds'] * 1e3:,.0f}", f"{r['get_vs_limit']:.2f}x" if "get_vs_limit" in r else "-",
                  str(r["blocks"]), f"{r['ticket_nbytes']:,}", f"{r['receiver_rss_growth_nbytes'] / MIB:,.1f}",
                  f"{r['sender_rss_growth_nbytes'] / MIB:,.1f}", f"{r['receiver_minor_faults']:,.0f}",
                  "yes" if r["verified"] else f"[red]NO {r['problem']}[/]")
    if doc["rows"]:
        con.print(t)

    if doc["peers"]:
        t = Table(title="peers (what a user would otherwise do), same 1 GiB, separate processes")
        for col in ("peer", "tensors", "median ms", "GB/s", "vs memcpy", "rx RSS +MiB", "runs", "verified"):
            t.add_column(col, justify="left" if col == "peer" else "right")
        for p in doc["peers"]:
            t.add_row(p["peer"], f"{p['count']:,}", f"{p['median_seconds'] * 1e3:,.0f}", f"{p['gbps']:.2f}",
                      f"{p.get('vs_memcpy', float('nan')):.2f}x", f"{max(p['receiver_rss_growth_nbytes']) / MIB:,.1f}",
                      str(len(p["seconds"])), "yes" if p["verified"] else f"[red]NO {p['problem']}[/]")
        con.print(t)

    print_plan_table(con, doc)

    t = Table(title="targets")
    for col in ("target", "required", "measured", "met", "note"):
        t.add_column(col)
    for tg in doc["targets"]:
        m = "-" if tg["measured"] is None else f"{tg['measured']:.2f}{tg['unit']}"
        met = "[yellow]n/a[/]" if tg["met"] is None else ("[green]yes[/]" if tg["met"] else "[red]no[/]")
        if tg["met"] is None and tg["required"] == "report" and tg["measured"] is not None:
            met = "[cyan]reported[/]"
        t.add_row(tg["target"], tg["required"], m, met, tg["note"])
    con.print(t)
    if not all(env["peak_reset_works"].values()):
        con.print("[red]warning: resetting VmHWM through /proc/self/clear_refs did not work in "
                  f"{env['peak_reset_works']}: RSS figures are peaks since process start[/]")
    for e in doc["errors"]:
        con.print(f"[red]error:[/] {e}")


def plot(doc: dict, nbytes: int, path: Path) -> None:
    """Left: the fast path, one line per transport, its bound as a dashed
    line of the same colour. Right: the other receive modes and the peers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env = doc["env"]
    colors = {"shm": "tab:blue", "tcp": "tab:orange", "nixl": "tab:green"}
    bound = {"shm": "memcpy_libc", "tcp": "raw_tcp", "nixl": "raw_nixl"}
    bound_name = {"memcpy_libc": "one libc memcpy", "raw_tcp": "raw loopback TCP", "raw_nixl": "raw NIXL READ, 1 descriptor"}
    rows = doc["rows"]
    limits = doc["limits_summary"]
    transports = [t for t in ("shm", "tcp", "nixl") if any(r["transport"] == t for r in rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 7.6))

    for t in transports:
        pts = sorted((r["count"], r["gbps"]) for r in rows if r["transport"] == t and r["mode"] == "pool" and r["kind"] == "views")
        if pts:
            ax1.plot(*zip(*pts), "o-", color=colors[t], lw=2.4, ms=7, label=f"{t}: copy into a prefaulted receive pool")
            dx, dy, ha = {"shm": (0, 8, "center"), "nixl": (9, -3, "left"), "tcp": (0, -14, "center")}[t]
            for x, y in pts:
                ax1.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(dx, dy), ha=ha, fontsize=8,
                             color=colors[t], fontweight="bold")
        for r in rows:
            if r["transport"] == t and r["mode"] == "pool" and r["kind"] == "separate":
                ax1.plot([r["count"]], [r["gbps"]], "o", mfc="white", mec=colors[t], mew=2, ms=9,
                         label=f"{t}: 10k separate tensors (own storages)")
        lk = bound[t]
        if lk in limits:
            ax1.axhline(limits[lk]["gbps"], ls="--", color=colors[t], lw=1.4,
                        label=f"{t}'s bound: {bound_name[lk]}, {limits[lk]['gbps']:.1f} GB/s")
    if "memcpy_parallel" in limits:
        ax1.axhline(limits["memcpy_parallel"]["gbps"], ls="-.", color=colors["shm"], lw=1.2,
                    label=f"libc memcpy on {env.get('copy_threads', '?')} threads at once, {limits['memcpy_parallel']['gbps']:.1f} GB/s")
    if "memcpy" in limits:
        ax1.axhline(limits["memcpy"]["gbps"], ls=":", color="gray", lw=1.3,
                    label=f"one torch copy_ of uint8, {limits['memcpy']['gbps']:.1f} GB/s")
    ax1.set_ylim(0, max([v["gbps"] for v in limits.values()] + [r["gbps"] for r in rows if r["mode"] == "pool"]) * 1.12)
    ax1.set_ylabel("GB/s, from put() to the receiver holding the data")
    ax1.set_title("fast path: Receiver with a receive pool (copy mode)", fontsize=10)

    for t in transports:
        for mode, style in (("pool", "o-"), ("new", "s:"), ("into", "^--"), ("zero_copy", "D-.")):
            pts = sorted((r["count"], r["gbps"]) for r in rows
                         if r["transport"] == t and r["mode"] == mode and r["kind"] == "views" and r["count"] in (1, 100_000))
            if pts:
                label = {"pool": "receive pool", "new": "new memory", "into": "into= existing tensors",
                         "zero_copy": "zero_copy (views, untouched)"}[mode]
                ax2.plot(*zip(*pts), style, color=colors[t], lw=2.2 if mode == "pool" else 1.4, ms=6,
                         alpha=1.0 if mode == "pool" else 0.8, label=f"{t}: {label}")
    peer_style = {"torch.multiprocessing queue": ("v-", "tab:purple"), "torch.save/socket/torch.load": ("x-", "tab:red")}
    for name, (style, color) in peer_style.items():
        pts = sorted((p["count"], p["gbps"]) for p in doc["peers"] if p["peer"] == name)
        if pts:
            ax2.plot(*zip(*pts), style, color=color, lw=1.6, ms=7, label=f"peer: {name}")
    if "memcpy_libc" in limits:
        ax2.axhline(limits["memcpy_libc"]["gbps"], ls="--", color="black", lw=1.2,
                    label=f"one libc memcpy, {limits['memcpy_libc']['gbps']:.1f} GB/s")
    ax2.set_yscale("log")
    ax2.set_title("receive modes and what a user would otherwise do (log scale)", fontsize=10)

    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks([1, 10, 100, 1000, 10_000, 100_000])
        ax.set_xticklabels(["1", "10", "100", "1k", "10k", "100k"])
        ax.set_xlim(0.6, 3e5)
        ax.set_xlabel("number of float32 tensors, 1 GiB in all (views of one flat buffer)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    fig.suptitle(f"tensorferry: 1 GiB between two processes, medians of {env['repeats']} after a warm-up\n"
                 f"{env['date']}, {env['machine']}, torch threads {env['torch_threads']}, "
                 f"load {env['loadavg_1min_start_end'][0]}-{env['loadavg_1min_start_end'][1]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
