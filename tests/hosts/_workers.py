"""Programs the host tests run inside a namespace host: ``python _workers.py VERB ARGS``.

Each prints one JSON line per fact on stdout and exits; times are
``time.monotonic()``, which every namespace shares (one kernel, one clock).

* ``sink HOST CONNECTIONS``: listens on ``HOST``:any port, prints
  ``{"port"}``, reads every connection to its end, prints ``{"nbytes",
  "last"}`` (the monotonic time of the last byte).
* ``source HOST PORT NBYTES``: prints ``{"start"}`` just before it connects,
  then sends ``NBYTES`` zero bytes and closes.
* ``probe PORT OUTSIDE...``: what this host can reach: a TCP connect to
  ``127.0.0.1:PORT``, a listener on its own loopback, and a UDP ``connect``
  to each ``OUTSIDE`` address (a route look-up: sends nothing).
* ``tf_send HOST TOKEN NBYTES SEED``: a tcp ``Sender`` bound to ``HOST`` puts
  :func:`make_object`, prints ``{"ticket", "checksum"}``, waits for the
  release, prints ``{"released"}``, and closes when a line comes on stdin.
* ``tf_recv TOKEN``: reads a ticket's hex from stdin, ``Receiver.get``, prints
  ``{"checksum", "nbytes"}``.
* ``bc_sender HOST TOKEN CAPACITY [TRANSPORT]``: a ``Sender`` (tcp, or
  ``TRANSPORT``: nixl) that takes JSON
  commands on stdin, one a line, and answers each with one line: ``put``
  (``nbytes``, ``seed``, ``readers``, ``fanout``, ``trees``) answers ``{"ticket",
  "checksum", "total_nbytes", "t_put"}``; ``wait`` (``ticket``, ``timeout``)
  waits for the release and answers ``{"bytes_sent", "used_nbytes",
  "live_tickets"}`` (the sender's ``stats()``), as ``stats`` does at once;
  ``stop`` closes it.
* ``bc_receiver HOST TOKEN RELAY STALL LINGER [READS [GUARDED [TRANSPORT]]]``:
  a ``Receiver`` (tcp, or ``TRANSPORT``), relaying (``RELAY`` 1) on ``HOST`` or a leaf (0), reading
  same-host relays by ``READS`` (``memory``, the default, or ``tcp``);
  ``GUARDED`` 1 makes the process non-dumpable (``PR_SET_DUMPABLE`` 0: only
  a process with CAP_SYS_PTRACE may read its memory). Prints ``{"ready",
  "relay_address", "pid"}``, then answers commands: ``get`` (``ticket``)
  with ``{"checksum", "t_start", "t_done"}``; ``stats`` with
  ``{"relay_bytes_sent", "relay_bytes_lent", "memory_read_nbytes",
  "file_read_nbytes", "nixl_read_nbytes", "relay_bytes_exposed",
  "stream_nbytes", "refused", "bytes_received"}``; ``stop`` closes it. It
  stays up after a get: its children may still pull from it.

A failed command answers ``{"error": traceback}``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import sys
import threading
import time
import traceback
from typing import Any

CHUNK = 1 << 20


def say(**fact: Any) -> None:
    print(json.dumps(fact), flush=True)


def make_object(seed: int, nbytes: int) -> dict[str, Any]:
    """A deterministic, model-like dict of tensors of about ``nbytes`` in all."""
    import torch

    g = torch.Generator().manual_seed(seed)
    quarter = max(1, nbytes // 16)  # float32: 4 bytes an element, 4 tensors
    return {
        "embed.weight": torch.randn((quarter // 64, 64), generator=g),
        "layers": [torch.randn(quarter, generator=g) for _ in range(2)],
        "head": torch.randint(-(1 << 30), 1 << 30, (quarter,), generator=g, dtype=torch.int32),
    }


def checksum(obj: Any) -> str:
    """SHA-256 of every leaf's dtype, shape and bytes, in the object's order."""
    import torch

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        else:
            for v in x:
                walk(v)

    walk(obj)
    return h.hexdigest()


def sink(host: str, connections: int) -> None:
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(connections)
    say(port=srv.getsockname()[1])
    totals, lasts = [0] * connections, [0.0] * connections

    def drain(k: int, conn: socket.socket) -> None:
        buf = bytearray(CHUNK)
        with conn:
            while n := conn.recv_into(buf):
                totals[k] += n
                lasts[k] = time.monotonic()

    threads = []
    for k in range(connections):
        conn, _ = srv.accept()
        threads.append(threading.Thread(target=drain, args=(k, conn)))
        threads[-1].start()
    for t in threads:
        t.join()
    say(nbytes=sum(totals), last=max(lasts))


def source(host: str, port: int, nbytes: int) -> None:
    block = bytes(CHUNK)
    say(start=time.monotonic())
    with socket.create_connection((host, port), timeout=30) as s:
        left = nbytes
        while left > 0:
            s.sendall(block[: min(left, CHUNK)])
            left -= CHUNK


def _outcome(fn: Any) -> str:
    try:
        fn()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "ok"


def probe(port: int, outside: list[str]) -> None:
    def root_loopback() -> None:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()

    def own_loopback() -> None:
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            socket.create_connection(srv.getsockname(), timeout=5).close()

    def udp_route(addr: str) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # discard port; UDP connect only picks a route

    say(root_loopback=_outcome(root_loopback), own_loopback=_outcome(own_loopback),
        outside={a: _outcome(lambda a=a: udp_route(a)) for a in outside})


def tf_send(host: str, token: str, nbytes: int, seed: int) -> None:
    from tensorferry import Sender

    obj = make_object(seed, nbytes)
    with Sender("tcp", host=host, token=token, capacity_nbytes=nbytes + (1 << 20)) as sender:
        ticket = sender.put(obj, readers=1)
        say(ticket=ticket.to_bytes().hex(), checksum=checksum(obj))
        sender.wait_released(ticket, timeout=60)
        say(released=True)
        # The ledger counts a release before the server has answered it: a
        # sender closed at once can cut that answer off, and the receiver's
        # get then fails although it holds every byte. So it closes only
        # when told that the receiver is done.
        sys.stdin.readline()


def tf_recv(token: str) -> None:
    from tensorferry import Receiver

    ticket = bytes.fromhex(sys.stdin.readline().strip())
    with Receiver("tcp", token=token, timeout=30.0) as receiver:
        got = receiver.get(ticket)
        say(checksum=checksum(got), nbytes=receiver.bytes_received)
        del got


def _commands() -> Any:
    """JSON commands from stdin, until ``stop`` or the end of stdin."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            return
        yield cmd


def bc_sender(host: str, token: str, capacity_nbytes: int, transport: str = "tcp") -> None:
    from tensorferry import Sender, Ticket

    objects: dict[tuple[int, int], tuple[Any, str]] = {}
    with Sender(transport, host=host, token=token, capacity_nbytes=capacity_nbytes) as sender:
        say(ready=True, address=sender.address)
        for cmd in _commands():
            try:
                if cmd["cmd"] == "put":
                    key = (cmd["seed"], cmd["nbytes"])
                    if key not in objects:
                        obj = make_object(*key)
                        objects[key] = (obj, checksum(obj))
                    obj, digest = objects[key]
                    t0 = time.monotonic()
                    ticket = sender.put(obj, readers=cmd["readers"], fanout=cmd["fanout"], trees=cmd.get("trees", False))
                    say(ticket=ticket.to_bytes().hex(), checksum=digest, total_nbytes=ticket.total_nbytes, t_put=t0)
                elif cmd["cmd"] in ("wait", "stats"):
                    if cmd["cmd"] == "wait":
                        sender.wait_released(Ticket.from_bytes(bytes.fromhex(cmd["ticket"])), timeout=cmd["timeout"])
                    s = sender.stats()
                    say(bytes_sent=s["bytes_sent"], used_nbytes=s["used_nbytes"], live_tickets=s["live_tickets"])
            except Exception:
                say(error=traceback.format_exc())


def bc_receiver(host: str, token: str, relay: bool, stall_seconds: float, linger_seconds: float, reads: str = "memory",
                guarded: bool = False, transport: str = "tcp") -> None:
    import ctypes
    import os

    from tensorferry import Receiver

    if guarded:
        PR_SET_DUMPABLE = 4
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    with Receiver(transport, token=token, timeout=60.0, relay=relay, host=host, port=0,
                  stall_seconds=stall_seconds, relay_linger_seconds=linger_seconds, relay_reads=reads) as receiver:
        say(ready=True, relay_address=receiver.relay_address, pid=os.getpid())
        for cmd in _commands():
            try:
                if cmd["cmd"] == "get":
                    t0 = time.monotonic()
                    got = receiver.get(bytes.fromhex(cmd["ticket"]))
                    t1 = time.monotonic()
                    say(checksum=checksum(got), t_start=t0, t_done=t1)
                    del got
                elif cmd["cmd"] == "stats":
                    st = receiver.stats()
                    say(relay_bytes_sent=st.get("relay_bytes_sent", 0), relay_bytes_lent=st.get("relay_bytes_lent", 0),
                        memory_read_nbytes=st["relay_memory_read_nbytes"], stream_nbytes=st["relay_stream_nbytes"],
                        file_read_nbytes=st["relay_file_read_nbytes"], nixl_read_nbytes=st["relay_nixl_read_nbytes"],
                        relay_bytes_exposed=st.get("relay_bytes_exposed", 0),
                        # Why the kernel refused a vm read (also logged); not a public counter.
                        refused=receiver._same_host_reads.refused, bytes_received=receiver.bytes_received)
            except Exception:
                say(error=traceback.format_exc())


def main(argv: list[str]) -> None:
    verb, args = argv[0], argv[1:]
    if verb == "sink":
        sink(args[0], int(args[1]))
    elif verb == "source":
        source(args[0], int(args[1]), int(args[2]))
    elif verb == "probe":
        probe(int(args[0]), args[1:])
    elif verb == "tf_send":
        tf_send(args[0], args[1], int(args[2]), int(args[3]))
    elif verb == "tf_recv":
        tf_recv(args[0])
    elif verb == "bc_sender":
        bc_sender(args[0], args[1], int(args[2]), *args[3:4])
    elif verb == "bc_receiver":
        bc_receiver(args[0], args[1], args[2] == "1", float(args[3]), float(args[4]), *args[5:6], *[a == "1" for a in args[6:7]], *args[7:8])
    else:
        raise SystemExit(f"_workers.py: unknown verb {verb!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
