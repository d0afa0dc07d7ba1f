"""Two worker processes for the transfer benchmarks: one worker, run as the
sender or as the receiver.

Two long-lived processes (multiprocessing ``spawn``) hold the same
deterministic source data. The main process sends both the same job; a job
is one function (registered with :func:`job`) that runs in both workers and
does its role's half (``peer.sends``), the two halves side by side.
Ticket bytes and timestamps travel over a ``multiprocessing.Pipe`` between
the workers (the control plane a user would bring). Every time is
``time.monotonic()``, one clock for all processes on the host.

Also here: the data every transfer benchmark sends (``source``,
``views_of``), the exact check after timing (``verify``), and the limits
measured in the worker pair (``measure_limits``: memcpy in the receiver, raw
loopback TCP between the two workers; raw NIXL through ``_raw_nixl.py``).
"""

from __future__ import annotations

import cProfile
import gc
import importlib
import io
import os
import pstats
import socket
import time
import traceback
from typing import Any, Callable

from _common import MIB, SOCK_BUF_NBYTES, check_peak_reset, copy_threads, memcpy_seconds, raw_nixl_limit, tune

__all__ = ["SEED", "POOL_SLACK_NBYTES", "Peer", "Workers", "job", "source", "views_of", "verify", "case_label",
           "profile_text", "measure_limits", "limits_again"]

SEED = 20_260_601
# The pools hold the data plus alignment padding (< 16 bytes a tensor, 100k
# tensors: 1.6 MB) with room to spare.
POOL_SLACK_NBYTES = 16 * MIB

JOBS: dict[str, Callable[["Peer", dict], dict]] = {}


def job(fn: Callable[["Peer", dict], dict]) -> Callable[["Peer", dict], dict]:
    """Register ``fn`` as the job of its name, run by both workers."""
    JOBS[fn.__name__] = fn
    return fn


# -- the data -------------------------------------------------------------------------


def source(nbytes: int):
    """The float32 data every case sends, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    return torch.randn(nbytes // 4, generator=g)


def piece_sizes(numel: int, count: int) -> list[int]:
    """Deterministic, uneven tensor sizes (in elements) that add up to ``numel``."""
    import numpy as np

    if count == 1:
        return [numel]
    rng = np.random.default_rng(SEED + count)
    w = rng.uniform(0.25, 1.75, count)
    sizes = np.maximum(np.floor(w / w.sum() * numel).astype(np.int64), 1)
    sizes[-1] += numel - int(sizes.sum())
    if sizes[-1] <= 0:
        raise ValueError(f"{count} tensors do not fit in {numel} elements")
    return sizes.tolist()


def views_of(flat, count: int) -> list:
    """``count`` views of ``flat``; every other one 2-D when its size allows."""
    if count == 1:
        return [flat]
    sizes = piece_sizes(flat.numel(), count)
    return [part.view(4, n // 4) if i % 2 and n % 4 == 0 else part
            for i, (part, n) in enumerate(zip(flat.split(sizes), sizes))]


def case_label(c: dict) -> str:
    """A case's object, e.g. ``100k separate``."""
    n = {1: "1", 10_000: "10k", 100_000: "100k"}.get(c["count"], f"{c['count']:,}")
    return f"{n}{' separate' if c.get('kind') == 'separate' else ''}"


def verify(got: Any, ref: list) -> str | None:
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


def profile_text(prof: cProfile.Profile | None, top: int = 30) -> str | None:
    if prof is None:
        return None
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


# -- one worker, either role ----------------------------------------------------------


class Peer:
    """One worker's state. ``sends``: the sender's role (a ``Sender``),
    else the receiver's (its ``Receiver``s). ``data``: the source, the same
    bits in both processes (the receiver checks against it)."""

    def __init__(self, role: str, nbytes: int, pipe: Any, queue: Any) -> None:
        self.role = role
        self.sends = role == "sender"
        self.nbytes = nbytes
        self.pipe = pipe
        self.queue = queue
        self.data = source(nbytes)
        self.transport: str | None = None
        self.sender: Any = None
        self.rx_pool: Any = None
        self.rx_plain: Any = None

    def send(self, msg: Any) -> None:
        self.pipe.send(msg)

    def recv(self) -> Any:
        return self.pipe.recv()

    def accept_tuned(self) -> socket.socket:
        """The receiver's end of a loopback socket to the sender (which
        calls ``connect_tuned``), tuned as tensorferry's tcp transport is."""
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        self.send(lst.getsockname()[1])
        sock, _ = lst.accept()
        tune(sock)
        lst.close()
        return sock

    def connect_tuned(self) -> socket.socket:
        """The sender's end of the receiver's ``accept_tuned`` socket."""
        sock = socket.create_connection(("127.0.0.1", self.recv()))
        tune(sock)
        return sock

    def await_ready(self) -> None:
        """The sender waits for the receiver's go (or its abort)."""
        msg = self.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"receiver aborted: {msg[1]}")

    def receiver(self, mode: str = "plain", *, fresh: bool = False) -> Any:
        """The receiver's ``Receiver``: ``pool`` (a prefaulted receive
        ``MemoryPool`` of the data's size) or ``plain`` (no pool; ``fresh``
        makes a new one, whose first get is a process's real first get).
        Pool cases come first: asking for a plain one frees the pool's memory."""
        from tensorferry import MemoryPool, Receiver

        if mode == "pool":
            if self.rx_pool is None:
                self.rx_pool = Receiver(self.transport, pool=MemoryPool(self.nbytes + POOL_SLACK_NBYTES, prefault=True))
            return self.rx_pool
        if self.rx_pool is not None:
            self.rx_pool.close()
            self.rx_pool = None
        if fresh and self.rx_plain is not None:
            self.rx_plain.close()
            self.rx_plain = None
        gc.collect()
        if self.rx_plain is None:
            self.rx_plain = Receiver(self.transport)
        return self.rx_plain


@job
def tf_open(p: Peer, job: dict) -> dict:
    """Open a transport: the sender's ``Sender`` with a prefaulted pool of
    ``capacity_nbytes`` (default: the data plus slack)."""
    p.transport = job["transport"]
    if not p.sends:
        return {}
    from tensorferry import Sender

    t = time.monotonic()
    cap = job.get("capacity_nbytes") or p.nbytes + POOL_SLACK_NBYTES
    p.sender = Sender(job["transport"], capacity_nbytes=cap, prefault=True)
    return {"open_seconds": time.monotonic() - t}


@job
def tf_close(p: Peer, job: dict) -> dict:
    for end in (p.sender, p.rx_pool, p.rx_plain):
        if end is not None:
            end.close()
    p.sender = p.rx_pool = p.rx_plain = None
    gc.collect()
    return {}


@job
def drain(p: Peer, job: dict) -> dict:
    """Drop what a failed job left in the pipe (an abort, a ticket nobody
    took), so the next job starts in step."""
    dropped = 0
    while p.pipe.poll(0.5):
        p.recv()
        dropped += 1
    return {"dropped": dropped}


@job
def memcpy(p: Peer, job: dict) -> dict:
    """The copy limit, in the worker ``job["role"]`` names (the receiver's by default)."""
    if p.role != job.get("role", "receiver"):
        return {}
    return memcpy_seconds(p.data, job["warmup"], job["repeats"], libc=job.get("libc", True),
                          threads=job.get("threads", 1))


@job
def rawtcp(p: Peer, job: dict) -> dict:
    """The raw TCP limit: the data as one ``sendmsg`` / ``recvmsg_into``
    loop over loopback between the workers (tensorferry's chunking), timed
    from the sender's first send to the receiver holding the last byte."""
    import torch

    total = job["warmup"] + job["repeats"]
    if p.sends:
        sock = p.connect_tuned()
        view = memoryview(p.data.view(torch.uint8).numpy())
        for _ in range(total):
            if sock.recv(1) != b"G":
                raise ConnectionError("raw tcp: the receiver went away")
            t0 = time.monotonic()
            sent = 0
            while sent < len(view):
                sent += sock.sendmsg([view[sent:]])
            p.send(t0)
        sock.close()
        return {}
    sock = p.accept_tuned()
    dst = torch.zeros(p.nbytes, dtype=torch.uint8)
    view = memoryview(dst.numpy())
    times = []
    for r in range(total):
        if r == total - 1:
            dst.zero_()
        sock.sendall(b"G")
        got = 0
        while got < len(view):
            got += sock.recvmsg_into([view[got:]])[0]
        t1 = time.monotonic()
        times.append(t1 - p.recv())
    sock.close()
    return {"seconds": times[job["warmup"]:], "verified": bool(torch.equal(dst, p.data.view(torch.uint8))),
            "via": f"sendmsg/recvmsg_into loop, TCP_NODELAY, {SOCK_BUF_NBYTES // MIB} MiB socket buffers"}


def worker(role: str, nbytes: int, threads: int, modules: list[str], ctl: Any, pipe: Any, queue: Any) -> None:
    """Entry point of both worker processes: run jobs from the main process."""
    import torch

    torch.set_num_threads(threads)
    try:
        for name in modules:
            importlib.import_module(name)  # registers its jobs
        peer = Peer(role, nbytes, pipe, queue)
        ctl.send({"ready": True, "pid": os.getpid(), "peak_reset_works": check_peak_reset()})
    except BaseException:
        ctl.send({"ready": False, "error": traceback.format_exc()})
        return
    while True:
        spec = ctl.recv()
        if spec is None:
            return
        try:
            out = JOBS[spec["job"]](peer, spec)
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            try:  # unblock the other side if it waits on us
                pipe.send(("abort", str(exc)))
            except Exception:
                pass
        ctl.send(out)


class Workers:
    """The sender and receiver workers; ``modules``: the benchmark modules
    whose jobs they run (imported in each worker)."""

    def __init__(self, nbytes: int, threads: int, modules: list[str]) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        a, b = ctx.Pipe(duplex=True)
        self.queue = ctx.Queue()
        self.ctl: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        for role, pipe in (("sender", a), ("receiver", b)):
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker, args=(role, nbytes, threads, modules, theirs, pipe, self.queue),
                               name=f"bench-{role}")
            proc.start()
            self.ctl[role], self.procs[role] = mine, proc
        self.info = {role: c.recv() for role, c in self.ctl.items()}
        for role, info in self.info.items():
            if not info.get("ready"):
                self.close()
                raise RuntimeError(f"{role} worker failed to start:\n{info.get('error')}")

    def run(self, spec: dict, timeout: float = 600.0) -> tuple[dict, dict]:
        """Run ``spec`` in both workers; returns (sender's result, receiver's)."""
        for c in self.ctl.values():
            c.send(spec)
        out = {}
        for role, c in self.ctl.items():
            if not c.poll(timeout):
                raise RuntimeError(f"{role} worker did not finish job {spec['job']} in {timeout} s")
            out[role] = c.recv()
        for role, other in (("sender", "receiver"), ("receiver", "sender")):
            if "error" in out[role]:
                raise RuntimeError(f"{role} failed in job {spec['job']}: {out[role]['traceback']}"
                                   f"\n(other side: {out[other].get('error', 'ok')})")
        return out["sender"], out["receiver"]

    def reopen(self, transport: str) -> None:
        """After a failed job: close, drop what is left in the pipe, reopen."""
        self.run({"job": "tf_close"})
        self.run({"job": "drain"})
        self.run({"job": "tf_open", "transport": transport})

    def close(self) -> None:
        for c in self.ctl.values():
            try:
                c.send(None)
            except OSError:
                pass
        for proc in self.procs.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()  # only our own children, by handle


# -- limits measured in the pair ------------------------------------------------------


def limit_jobs(which: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(key, job) of the limits in ``which``: ``memcpy`` (torch copy_),
    ``memcpy_libc``, ``memcpy_parallel`` (libc on tensorferry's copy
    threads, when more than one), ``raw_tcp``; ``_sender`` suffixes run in
    the sender's process."""
    out = []
    for key in which:
        role = "sender" if key.endswith("_sender") else "receiver"
        base = key[: -len("_sender")] if role == "sender" else key
        if base == "memcpy":
            out.append((key, {"job": "memcpy", "libc": False, "role": role}))
        elif base == "memcpy_libc":
            out.append((key, {"job": "memcpy", "libc": True, "role": role}))
        elif base == "memcpy_parallel" and copy_threads() > 1:
            out.append((key, {"job": "memcpy", "libc": True, "threads": copy_threads(), "role": role}))
        elif base == "raw_tcp":
            out.append((key, {"job": "rawtcp"}))
    return out


def _limit_result(s: dict, r: dict, spec: dict) -> dict:
    return s if spec.get("role") == "sender" else r


def measure_limits(w: Workers, limits: dict, which: tuple[str, ...], repeats: int) -> None:
    """The limits in ``which`` into ``limits`` (measured again at the end by
    :func:`limits_again`: the machine is shared, so both runs are pooled)."""
    for key, spec in limit_jobs(which):
        limits[key] = _limit_result(*w.run({**spec, "warmup": 1, "repeats": repeats}), spec)


def limits_again(w: Workers, limits: dict, repeats: int) -> None:
    for key, spec in limit_jobs(tuple(k for k in limits if k != "raw_nixl")):
        again = _limit_result(*w.run({**spec, "warmup": 1, "repeats": repeats}), spec)
        lim = limits[key]
        lim["seconds_start"], lim["seconds_end"] = lim["seconds"], again["seconds"]
        lim["seconds"] = lim["seconds"] + again["seconds"]
        lim["verified"] = lim["verified"] and again["verified"]


def measure_raw_nixl(limits: dict, nbytes: int, repeats: int, errors: list) -> None:
    """The raw-NIXL READ limit (one descriptor; 10k as context), if nixl is installed."""
    try:
        lim = raw_nixl_limit(nbytes, repeats, many_descs=10_000)
    except Exception as exc:  # reported, not hidden: the nixl ratios stay unmeasured
        errors.append(f"raw nixl: {exc!r}")
        return
    if lim is not None:
        limits["raw_nixl"] = lim
