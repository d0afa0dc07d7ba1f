"""Shared pieces of the transfer test suites: objects, comparisons, workers.

Imported by ``test_transfer_contract.py`` and ``test_transfer_faults.py``
(pytest puts this folder on ``sys.path``), and by the worker processes they
start with the ``spawn`` context (which inherits ``sys.path``). Everything is
real: real pools, real sockets, real processes.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import random
import time
import traceback
from typing import Any, Callable

import pytest
import torch

from tensorferry.wire._layout import DTYPES as WIRE_DTYPES

TRANSPORTS = ("shm", "tcp", "nixl")
# Every dtype tensorferry's wire format knows that this torch has, found as
# tensorferry._tensors finds them: a dtype added to the format is tested here.
DTYPES = [getattr(torch, name) for name in WIRE_DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]
# complex32 warns on every tensor made of it; the warning is torch's, not ours.
COMPLEX_HALF_WARNING = "ignore:ComplexHalf support is experimental"


def drip(sock, payload: bytes, rng: random.Random) -> None:
    """Send ``payload`` in chunks of random sizes (1 byte to 300 kB), so a
    receiver's calls end anywhere inside its runs."""
    pos = 0
    while pos < len(payload):
        k = rng.choice((1, 100, 4096, 65536, 300_000))
        sock.sendall(payload[pos : pos + k])
        pos += k


def require(transport: str) -> None:
    """Skip a nixl test only when the nixl package itself is absent.

    tensorferry's own nixl modules are imported plainly: an import error in
    our code, or in an installed nixl, fails the test instead of skipping it.
    """
    if transport == "nixl":
        os.environ["UCX_NET_DEVICES"] = "lo"
        if importlib.util.find_spec("nixl") is None:
            pytest.skip("the nixl package is not installed (pip install nixl==1.5.1 after torch)")
        import nixl._api  # noqa: F401
        import tensorferry.transports._nixl  # noqa: F401


# -- deterministic objects -----------------------------------------------------------


def make_tensor(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` with every byte drawn from ``gen``.

    Float8 and friends are made from random bytes (torch cannot sample them);
    NaN payloads are fine because comparisons are bitwise.
    """
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float64 if not dtype.is_complex else torch.complex128).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(1 << 62)), min(info.max, 1 << 62)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def state_dict(seed: int, *, scale: int = 1) -> dict[str, Any]:
    """A nested, deterministic model-like object: dicts, int keys, a tuple, a list."""
    g = torch.Generator().manual_seed(seed)
    flat = make_tensor(g, torch.float32, (4096 * scale,))
    return {
        "embed.weight": flat[: 1024 * scale].view(32 * scale, 32),
        "layers": [
            {"w": flat[1024 * scale : 3072 * scale].view(64 * scale, 32), "b": make_tensor(g, torch.bfloat16, (64 * scale,))},
            {"w": make_tensor(g, torch.float16, (16, 8 * scale)), "b": make_tensor(g, torch.float64, (16,))},
        ],
        "buffers": (make_tensor(g, torch.int64, (7,)), make_tensor(g, torch.bool, (3, 3))),
        3: {"scale": make_tensor(g, torch.complex128, ()), "steps": make_tensor(g, torch.int32, (1,))},
        "head": flat[3072 * scale :],
    }


def big_object(seed: int, nbytes: int) -> list[torch.Tensor]:
    """About ``nbytes`` of mixed tensors (for streaming through a small pool)."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], nbytes
    sizes = [1 << 20, 3 << 20, 5 << 18, 7 << 20]
    dtypes = [torch.float32, torch.uint8, torch.float64, torch.bfloat16]
    i = 0
    while left > 0:
        n = min(sizes[i % 4], left)
        dt = dtypes[i % 4]
        out.append(make_tensor(g, dt, (max(1, n // dt.itemsize),)))
        left -= n
        i += 1
    return out


def broadcast_object(seed: int = 0) -> dict[str, Any]:
    """What the relay tests broadcast: 12 MB of floats, a small int tensor
    and a state dict (a few dtypes and shapes)."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3_000_000, generator=g), "steps": torch.arange(999), **state_dict(seed)}


def in_threads(fn: Any, count: int) -> None:
    """``fn(i)`` for every ``i`` below ``count`` at once (a thread each);
    the first error any of them raised is raised once all have ended."""
    import threading

    errors: list = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]


def get_all(receivers: list[Any], ticket: Any, **kw: Any) -> list[Any]:
    """Every receiver gets ``ticket`` at once (a thread each); their results
    in order. The first error any of them raised is raised."""
    out: list = [None] * len(receivers)

    def run(i: int) -> None:
        out[i] = receivers[i].get(ticket, **kw)

    in_threads(run, len(receivers))
    return out


def random_object(seed: int, *, max_tensors: int = 6, max_numel: int = 2048) -> Any:
    """A random nesting of small tensors of random dtypes (including 0-dim, 0-size)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def leaf() -> torch.Tensor:
        dt = rng.choice(DTYPES)
        kind = rng.random()
        if kind < 0.1:
            shape: tuple[int, ...] = ()
        elif kind < 0.15:
            shape = (0, rng.randint(1, 4))
        else:
            shape = tuple(rng.randint(1, 16) for _ in range(rng.randint(1, 3)))
            while torch.Size(shape).numel() > max_numel:
                shape = shape[1:] or (1,)
        t = make_tensor(g, dt, shape)
        if t.dim() == 2 and rng.random() < 0.2:
            t = t.t()  # a non-contiguous leaf now and then
        return t

    def node(depth: int, budget: list[int]) -> Any:
        if depth > 2 or budget[0] <= 1 or rng.random() < 0.4:
            budget[0] -= 1
            return leaf()
        kind = rng.choice(["dict", "list", "tuple"])
        items = [node(depth + 1, budget) for _ in range(rng.randint(0, 3))]
        if kind == "dict":
            return {f"k{i}" if i % 2 else i: v for i, v in enumerate(items)}
        return items if kind == "list" else tuple(items)

    return node(0, [rng.randint(1, max_tensors)])


# -- comparisons ---------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as raw bytes, in row-major order (bitwise, NaN-safe)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8)


def assert_same(got: Any, want: Any, path: str = "obj") -> None:
    """Exact structural and bitwise equality; containers must keep their types."""
    assert type(got) is type(want), f"{path}: got {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(tensor_bytes(got), tensor_bytes(want)), f"{path}: values differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        raise AssertionError(f"{path}: unexpected leaf {want!r}")


def leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in leaves(v)]
    return []


# -- process and pool observation ----------------------------------------------------


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def pool_empty(pool: Any) -> bool:
    s = pool.stats()
    return s.used_nbytes == 0 and s.live_objects == 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memfd_mappings(name: str) -> int:
    """How many mappings of this process are of memfds named ``name...``
    (``/proc/self/maps`` shows a memfd as ``/memfd:NAME (deleted)``).

    Only memfds: a path test ("tensorferry" anywhere in the line) also
    counts every library of a checkout or venv whose folder has that name.
    """
    with open("/proc/self/maps") as f:
        return sum(f"/memfd:{name}" in line for line in f)


def shm_tensorferry_entries() -> set[str]:
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {n for n in names if "tensorferry" in n.lower()}


# -- worker processes (spawn) ---------------------------------------------------------


def _reply(out_q: Any, *item: Any) -> None:
    out_q.put(item)


def sender_worker(capacity_nbytes: int, cmd_q: Any, out_q: Any, kwargs: dict | None = None) -> None:
    """A sender process driven by commands (one Sender per transport, made on first use):

    ``("put", transport, kind, seed, readers, extra)`` -> ``("ticket", bytes)``;
    ``("wait", transport, ticket_bytes, timeout)`` -> ``("released", ok, used_nbytes)``;
    ``("stats", transport)`` -> ``("stats", Sender.stats())``;
    ``("stop",)`` -> closes and exits. It first replies ``("ready", pid)``.
    """
    os.environ["UCX_NET_DEVICES"] = "lo"
    from tensorferry import Sender, Ticket

    senders: dict[str, Any] = {}
    keep: list[Any] = []
    _reply(out_q, "ready", os.getpid())
    try:
        while True:
            cmd = cmd_q.get()
            try:
                if cmd[0] in ("put", "wait", "stats") and cmd[1] not in senders:
                    senders[cmd[1]] = Sender(cmd[1], capacity_nbytes=capacity_nbytes, **(kwargs or {}))
                if cmd[0] == "put":
                    _, transport, kind, seed, readers, extra = cmd
                    obj = build(kind, seed, extra)
                    keep.append(obj)  # streamed objects must outlive the put
                    ticket = senders[transport].put(obj, readers=readers)
                    _reply(out_q, "ticket", ticket.to_bytes())
                elif cmd[0] == "wait":
                    _, transport, tb, timeout = cmd
                    sender = senders[transport]
                    try:
                        sender.wait_released(Ticket.from_bytes(tb), timeout)
                        ok = True
                    except TimeoutError:
                        ok = False
                    _reply(out_q, "released", ok, sender.pool.stats().used_nbytes)
                elif cmd[0] == "stats":
                    _reply(out_q, "stats", senders[cmd[1]].stats())
                elif cmd[0] == "stop":
                    return
            except BaseException as exc:
                _reply(out_q, "error", type(exc).__name__, traceback.format_exc())
    finally:
        for s in senders.values():
            s.close()


def build(kind: str, seed: int, extra: Any = None) -> Any:
    """Regenerate the same object in any process from (kind, seed)."""
    if kind == "state":
        return state_dict(seed, scale=extra or 1)
    if kind == "big":
        return big_object(seed, extra)
    if kind == "random":
        return random_object(seed)
    raise ValueError(kind)


def receiver_worker(cmd_q: Any, out_q: Any) -> None:
    """A receiver process (one Receiver per transport, made on first use).

    ``("get", ticket_bytes, kind, seed, extra, zero_copy, hold)`` gets, verifies
    against the regenerated object, replies ``("got", ok, detail)``; with
    ``hold`` it keeps the result (zero-copy views hold the sender's slot).
    ``("raw_partial_fetch", ticket_bytes, nbytes)``: tcp: acquire, Fetch, read
    only ``nbytes`` of the data and stall, replying ``("stalled",)``.
    ``("stop",)`` closes and exits.
    """
    os.environ["UCX_NET_DEVICES"] = "lo"
    from tensorferry import Receiver, Ticket

    receivers: dict[str, Any] = {}
    held: list[Any] = []
    _reply(out_q, "ready", os.getpid())
    try:
        while True:
            cmd = cmd_q.get()
            try:
                if cmd[0] == "get":
                    _, tb, kind, seed, extra, zero_copy, hold = cmd
                    transport = Ticket.from_bytes(tb).transport
                    if transport not in receivers:
                        receivers[transport] = Receiver(transport, timeout=30.0)
                    got = receivers[transport].get(tb, zero_copy=zero_copy)
                    try:
                        assert_same(got, build(kind, seed, extra))
                        ok, detail = True, ""
                    except AssertionError as exc:
                        ok, detail = False, str(exc)
                    if hold:
                        held.append(got)
                    del got
                    _reply(out_q, "got", ok, detail)
                elif cmd[0] == "raw_partial_fetch":
                    _, tb, nbytes = cmd
                    _raw_partial_fetch(Ticket.from_bytes(tb), nbytes, held)
                    _reply(out_q, "stalled")
                elif cmd[0] == "stop":
                    return
            except BaseException as exc:
                _reply(out_q, "error", type(exc).__name__, traceback.format_exc())
    finally:
        held.clear()
        for r in receivers.values():
            r.close()


def _raw_partial_fetch(ticket: Any, nbytes: int, held: list[Any]) -> None:
    """Acquire a tcp ticket's slot, ask for its bytes, read only a few of them."""
    from tensorferry.wire import protocol as P
    from tensorferry.transports._tcp import TcpChannel

    ch = TcpChannel(ticket.address, timeout=10.0)
    ch.acquire(ticket.id, 0, timeout=10.0, digest=ticket.digest)
    P.send_msg(ch.sock, P.Fetch(ticket_id=ticket.id, piece=0))
    reply = P.recv_msg(ch.sock)
    assert reply[0] == "DATA", reply
    buf = bytearray(nbytes)
    P.recv_exact_into(ch.sock, memoryview(buf), deadline=time.monotonic() + 10.0)
    held.append(ch)  # keep the socket open, unread: the sender stays blocked


class Worker:
    """A spawned worker process with a command queue and a reply queue."""

    def __init__(self, ctx: Any, target: Callable, *args: Any, **kwargs: Any) -> None:
        self.cmd_q = ctx.Queue()
        self.out_q = ctx.Queue()
        self.proc = ctx.Process(target=target, args=(*args, self.cmd_q, self.out_q), kwargs=kwargs, daemon=True)
        self.proc.start()
        self.pid = self.proc.pid

    def ready(self, timeout: float = 60.0) -> None:
        item = self.recv(timeout)
        assert item[0] == "ready", item
        assert item[1] == self.pid

    def send(self, *cmd: Any) -> None:
        self.cmd_q.put(cmd)

    def recv(self, timeout: float = 30.0) -> tuple:
        try:
            item = self.out_q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker {self.pid} did not answer within {timeout} s (alive: {self.proc.is_alive()})") from None
        if item[0] == "error":
            raise AssertionError(f"worker {self.pid} failed: {item[1]}: {item[2]}")
        return item

    def call(self, *cmd: Any, timeout: float = 30.0) -> tuple:
        self.send(*cmd)
        return self.recv(timeout)

    def kill(self) -> None:
        """SIGKILL this worker (by the pid of the process we started)."""
        import signal

        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(timeout=10.0)
        assert not self.proc.is_alive()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
            except (OSError, ValueError):
                pass
            self.proc.join(timeout=10.0)
        if self.proc.is_alive():
            self.kill()
        self.cmd_q.close()
        self.out_q.close()
