"""The raw-NIXL limit: one READ of ``nbytes`` between two processes, NIXL alone.

What the transfer benchmark compares tensorferry's ``nixl`` transport with:
the same bytes moved by NIXL directly, as 1 descriptor or as N equal
descriptors (one per tensor, what a per-tensor transport issues).

How it measures:

* two fresh spawned processes: a *server* registers ``nbytes`` of CPU memory
  (a known pattern) and polls its agent every millisecond (as tensorferry's
  serving endpoints do); a *reader* registers its destination, loads the
  server's metadata, and times READs. This process imports neither torch's
  memory nor NIXL;
* both agents as tensorferry creates them: UCX backend, error handling
  ``peer``, no NIXL progress thread. On one host UCX moves the bytes with CMA
  (``process_vm_readv``), a single copy by the kernel;
* each repeat times ``initialize_xfer`` (descriptor lists from a prebuilt
  (N, 3) array) + ``transfer`` + polling to ``DONE``, as a user pays it.
  ``initialize_xfer`` keeps every descriptor; ``make_prepped_xfer`` would
  merge the adjacent ones into one and hide the per-descriptor cost;
* one untimed READ first: it makes the connection and faults in the
  destination pages, which a pool-based transport also pays only once;
* after timing, the destination is checked byte for byte.

Run: ``.venv/bin/python benchmarks/_raw_nixl.py`` prints medians for 1 GiB
as 1 / 10k / 100k descriptors (``--json PATH`` also writes them).
"""

from __future__ import annotations

import os

# Loopback only, set before NIXL is imported (the children inherit it).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["raw_nixl_read_seconds", "raw_nixl_read_table"]

GIB = 1 << 30
# A READ of 1 GiB takes ~0.2 s here (0.6 s as 100k descriptors); a minute
# covers a loaded machine, and nothing waits unbounded.
_STEP_TIMEOUT_SECONDS = 120.0
_SERVER_POLL_SECONDS = 0.001


def _agent(name: str) -> Any:
    # As tensorferry imports it: UCX's modules limited so that the process
    # exits cleanly where rdma-core is installed, NIXL's INFO lines off.
    from tensorferry.transports._nixl_load import import_nixl

    api = import_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    return agent


def _pattern(nbytes: int) -> Any:
    """int64 counting pattern: cheap to build, every 8-byte word distinct."""
    import torch

    return torch.arange((nbytes + 7) // 8, dtype=torch.int64).view(torch.uint8)[:nbytes]


def _server(conn: Any, nbytes: int) -> None:
    agent = _agent(f"raw-server-{os.getpid()}")
    src = _pattern(nbytes)
    reg = agent.register_memory(src)
    conn.send((agent.get_agent_metadata(), src.data_ptr()))
    # Answer the reader's connection handshake (and TCP-emulated READs).
    while not conn.poll(_SERVER_POLL_SECONDS):
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)


def _descs(base: int, nbytes: int, count: int) -> Any:
    """(N, 3) uint64 rows (address, nbytes, device 0): ``count`` adjacent equal pieces (±1 byte)."""
    import numpy as np

    edges = (np.arange(count + 1, dtype=np.uint64) * np.uint64(nbytes)) // np.uint64(count)
    rows = np.zeros((count, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + edges[:-1]
    rows[:, 1] = edges[1:] - edges[:-1]
    return rows


def _reader(conn: Any, nbytes: int, desc_counts: list[int], repeats: int, metadata: bytes, remote_base: int) -> None:
    import torch

    try:
        agent = _agent(f"raw-reader-{os.getpid()}")
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        reg = agent.register_memory(dst)
        peer = agent.add_remote_agent(metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer

        def read(local: Any, remote: Any) -> float:
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer)
            state = agent.transfer(handle)
            deadline = time.monotonic() + _STEP_TIMEOUT_SECONDS
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            seconds = time.perf_counter() - t0
            handle.release()
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ of {nbytes:,} bytes as {len(local):,} descriptors ended in state {state!r}")
            return seconds

        expected = _pattern(nbytes)
        results: dict[int, list[float]] = {}
        for count in desc_counts:
            local, remote = _descs(dst.data_ptr(), nbytes, count), _descs(remote_base, nbytes, count)
            read(local, remote)  # untimed: connection, page faults
            dst.zero_()
            results[count] = [read(local, remote) for _ in range(repeats)]
            if not torch.equal(dst, expected):
                bad = int((dst != expected).nonzero()[0])
                raise RuntimeError(f"raw NIXL READ as {count:,} descriptors left wrong bytes from offset {bad:,}")
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        conn.send(("ok", results))
    except BaseException as exc:  # reported to the parent, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _recv(conn: Any, proc: Any, what: str) -> Any:
    deadline = time.monotonic() + _STEP_TIMEOUT_SECONDS
    while not conn.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"the raw NIXL {what} (pid {proc.pid}) exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the raw NIXL {what} (pid {proc.pid}) said nothing for {_STEP_TIMEOUT_SECONDS} s")
    return conn.recv()


def raw_nixl_read_table(nbytes: int, desc_counts: Sequence[int], repeats: int) -> dict[int, list[float]]:
    """Seconds per raw NIXL READ of ``nbytes``, for each descriptor count, from one pair of processes.

    Args:
        nbytes: bytes per READ (both processes allocate this much).
        desc_counts: descriptor counts to measure (1 = one descriptor).
        repeats: timed READs per count, after one untimed warm-up READ.

    Returns:
        ``{count: [seconds of each timed READ]}``.

    Raises:
        ValueError: a count is below 1 or above ``nbytes``, or ``repeats`` < 1.
        RuntimeError: NIXL failed, a process died, or the bytes were wrong.
        TimeoutError: a process stalled for ``_STEP_TIMEOUT_SECONDS``.
    """
    counts = [int(c) for c in desc_counts]
    if nbytes < 1 or repeats < 1 or any(not 1 <= c <= nbytes for c in counts):
        raise ValueError(f"need nbytes >= 1, repeats >= 1 and 1 <= count <= nbytes; got {nbytes}, {repeats}, {counts}")
    ctx = mp.get_context("spawn")
    s_conn, s_child = ctx.Pipe()
    r_conn, r_child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(s_child, nbytes), daemon=True)
    reader = None
    server.start()
    try:
        metadata, remote_base = _recv(s_conn, server, "server")
        reader = ctx.Process(target=_reader, args=(r_child, nbytes, counts, repeats, metadata, remote_base), daemon=True)
        reader.start()
        status, payload = _recv(r_conn, reader, "reader")
        if status != "ok":
            raise RuntimeError(f"raw NIXL reader failed: {payload}")
        return payload
    finally:
        try:
            s_conn.send("stop")
        except OSError:
            pass
        for proc in (reader, server):
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)


def raw_nixl_read_seconds(nbytes: int, num_descs: int, repeats: int) -> list[float]:
    """Seconds per raw NIXL READ of ``nbytes`` between two processes, as ``num_descs`` equal descriptors.

    Args:
        nbytes: bytes per READ.
        num_descs: 1 for one descriptor, else that many adjacent descriptors of equal size (±1 byte).
        repeats: timed READs, after one untimed warm-up READ.

    Returns:
        The seconds of each timed READ (take the median).

    Raises:
        ValueError, RuntimeError, TimeoutError: as :func:`raw_nixl_read_table`.
    """
    return raw_nixl_read_table(nbytes, [num_descs], repeats)[num_descs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nbytes", type=int, default=GIB, help="bytes per READ (default 1 GiB)")
    parser.add_argument("-d", "--descs", type=int, nargs="+", default=[1, 10_000, 100_000], help="descriptor counts")
    parser.add_argument("-r", "--repeats", type=int, default=5, help="timed READs per count")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    table = raw_nixl_read_table(args.nbytes, args.descs, args.repeats)
    one = statistics.median(table[args.descs[0]])
    print(f"raw NIXL READ of {args.nbytes:,} bytes between two processes (UCX, loopback), median of {args.repeats}")
    print(f"{'descriptors':>12} {'median ms':>10} {'GB/s':>7} {'vs first':>9}")
    rows = []
    for count in args.descs:
        med = statistics.median(table[count])
        rows.append({"descriptors": count, "median_seconds": med, "gb_per_second": args.nbytes / med / 1e9, "seconds": table[count]})
        print(f"{count:>12,} {med * 1e3:>10.1f} {args.nbytes / med / 1e9:>7.2f} {med / one:>8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nbytes": args.nbytes, "repeats": args.repeats, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
