"""bench_broadcast's workers, one per namespace host: the sender (a tcp
``Sender`` bound to its host's address) and the receivers (a plain and a
relaying ``Receiver``), each spoken to over stdin/stdout in JSON lines, and
the raw TCP star's ends. Run as ``bench_broadcast.py --worker ROLE``."""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import resource
import socket
import sys
import threading
import time
import traceback
from typing import Any

from _common import MIB

SEED = 20_260_616
TENSORS = 8
# A relay that sends nothing this long is given up by its children; a
# killed one is noticed at once (its sockets close), this bounds a silent one.
STALL_SECONDS = 5.0


# -- workers (inside the namespace hosts) ------------------------------------------------


def _say(**fact: Any) -> None:
    sys.stdout.write(json.dumps(fact) + "\n")
    sys.stdout.flush()


def _digest(tensors: dict) -> str:
    """BLAKE2b of every tensor's name, dtype, shape and bytes, in order."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name, t in tensors.items():
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(memoryview(t.contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


def _source(nbytes: int) -> tuple[Any, dict]:
    """``nbytes`` of seeded random bytes, and the object: TENSORS float32 views of them."""
    import torch

    numel = nbytes // 4 // TENSORS * TENSORS
    flat = torch.randint(0, 256, (numel * 4,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED))
    part = numel // TENSORS
    f32 = flat.view(torch.float32)
    return flat, {f"layers.{k}.weight": f32[k * part:(k + 1) * part].view(-1, 1024) if part % 1024 == 0
                  else f32[k * part:(k + 1) * part] for k in range(TENSORS)}


def sender_worker(args: argparse.Namespace) -> None:
    import torch

    from tensorferry import Sender, Ticket

    torch.set_num_threads(1)
    flat, obj = _source(args.nbytes)
    nbytes = flat.numel()
    payload = memoryview(flat.numpy())
    with Sender(args.transport, host=args.host, token=args.token, capacity_nbytes=nbytes + MIB, prefault=True) as sender:
        _say(ready=os.getpid(), nbytes=nbytes, digest=_digest(obj), address=sender.address)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "put":
                    t0 = time.monotonic()
                    ticket = sender.put(obj, readers=cmd["readers"], one_shot=True, fanout=cmd["fanout"], trees=cmd.get("trees", False))
                    _say(ticket=ticket.to_bytes().hex(), t_put=t0, put_seconds=time.monotonic() - t0,
                         total_nbytes=ticket.total_nbytes, bytes_sent=sender.stats()["bytes_sent"], transport=args.transport)
                elif cmd["cmd"] == "wait":
                    sender.wait_released(Ticket.from_bytes(bytes.fromhex(cmd["ticket"])), timeout=cmd["timeout"])
                    stats = sender.stats()
                    _say(released=True, used_nbytes=stats["used_nbytes"], bytes_sent=stats["bytes_sent"])
                elif cmd["cmd"] == "raw":
                    _say(t_start=_raw_star(payload, cmd["targets"], cmd["timeout"]))
                elif cmd["cmd"] == "stop":
                    break
            except Exception:
                _say(error=traceback.format_exc())


def _raw_star(payload: memoryview, targets: list[list], timeout: float) -> float:
    """Send ``payload`` to every (host, port) at once, one thread each; the start time."""
    errors: list[str] = []

    def one(host: str, port: int) -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout) as s:
                s.sendall(payload)
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc}")

    threads = [threading.Thread(target=one, args=(h, p)) for h, p in targets]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise OSError(f"raw star: {errors}")
    return t0


def receiver_worker(args: argparse.Namespace) -> None:
    import torch

    from tensorferry import Receiver

    torch.set_num_threads(1)
    if args.no_ptrace:
        PR_SET_DUMPABLE = 4
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    # Each receive cache keeps at most one object's memory between rounds.
    cache = args.nbytes + MIB
    tr = args.transport
    with Receiver(tr, token=args.token, timeout=args.timeout, cache_nbytes=cache) as plain, \
            Receiver(tr, token=args.token, timeout=args.timeout, cache_nbytes=cache, relay=True, host=args.host,
                     stall_seconds=STALL_SECONDS, relay_linger_seconds=args.linger) as relay, \
            Receiver(tr, token=args.token, timeout=args.timeout, cache_nbytes=cache, relay_reads="tcp") as by_tcp:
        # Leaves below a relay of their host: ``plain`` copies out of its
        # memory (relay_reads="memory", the default), ``by_tcp`` streams.
        by_reads = {"memory": plain, "tcp": by_tcp}
        _say(ready=os.getpid(), relay_address=relay.relay_address)
        copy = None
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "get":
                    receiver = by_reads[cmd["reads"]] if "reads" in cmd else relay if cmd["relay"] else plain
                    before = receiver.stats()
                    t0 = time.monotonic()
                    got = receiver.get(bytes.fromhex(cmd["ticket"]))
                    t1 = time.monotonic()
                    digest = _digest(got) if cmd["verify"] else None
                    del got
                    after = receiver.stats()
                    _say(t_start=t0, t_done=t1, digest=digest,
                         memory_read_nbytes=after["relay_memory_read_nbytes"] - before["relay_memory_read_nbytes"],
                         stream_nbytes=after["relay_stream_nbytes"] - before["relay_stream_nbytes"],
                         file_read_nbytes=after["relay_file_read_nbytes"] - before["relay_file_read_nbytes"],
                         nixl_read_nbytes=after["relay_nixl_read_nbytes"] - before["relay_nixl_read_nbytes"])
                elif cmd["cmd"] == "memcpy":
                    # The same bytes copied by libc between two buffers
                    # faulted in beforehand (as the receive cache's are).
                    if copy is None:
                        copy = (torch.ones(args.nbytes, dtype=torch.uint8), torch.zeros(args.nbytes, dtype=torch.uint8))
                    src, dst = copy
                    t0 = time.monotonic()
                    ctypes.memmove(dst.data_ptr(), src.data_ptr(), args.nbytes)
                    _say(t_start=t0, t_done=time.monotonic())
                elif cmd["cmd"] == "cpu":
                    use = resource.getrusage(resource.RUSAGE_SELF)  # every thread's: the relay's server too
                    _say(cpu_seconds=use.ru_utime + use.ru_stime)
                elif cmd["cmd"] == "sink":
                    _sink(args.host, cmd["nbytes"], args.timeout)
                elif cmd["cmd"] == "stop":
                    break
            except Exception:
                _say(error=traceback.format_exc())


def _sink(host: str, nbytes: int, timeout: float) -> None:
    """Listen, say the port, read ``nbytes`` from one connection, say when done."""
    buf = bytearray(4 * MIB)
    with socket.socket() as srv:
        srv.bind((host, 0))
        srv.listen(1)
        _say(port=srv.getsockname()[1])
        srv.settimeout(timeout)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout)
            got = 0
            while got < nbytes and (n := conn.recv_into(buf)):
                got += n
    _say(t_done=time.monotonic(), nbytes=got)
