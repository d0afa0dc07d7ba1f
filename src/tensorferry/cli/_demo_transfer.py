"""The transfer half of ``tensorferry demo``: one trainer, two inference workers.

The demo's own process is the trainer: it holds the synthetic state dict
and a Sender per transport. Two worker processes ("inference") each hold
their own copy of the weights and receive every sync in place (``into=``),
then verify every tensor against the trainer's values. Each sync changes a
marker tensor, so a worker that kept stale weights fails verification.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

from ..errors import TransferError

__all__ = ["transfer_scenarios"]

_WORKERS = 2
_MARKER = "model.layers.0.steps"


def _worker(transport: str, size: int, tensors: int, tickets: Any, results: Any) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torch

    from ..receiver import Receiver
    from ._synthetic import synthetic_state_dict, verify_same

    expected = synthetic_state_dict(size, tensors)
    # The worker's own weights: separate tensors, updated in place each sync.
    weights = {k: torch.zeros_like(v) for k, v in expected.items()}
    try:
        with Receiver(transport) as receiver:
            results.put(("ready", None))
            while True:
                item = tickets.get()
                if item is None:
                    return
                version, wire = item
                receiver.get(wire, into=weights, timeout=120)
                # CLOCK_MONOTONIC is one clock for every process on the host.
                done_at = time.monotonic()
                expected[_MARKER].fill_(version)
                verify_same(expected, weights)
                results.put(("ok", done_at))
    except Exception as exc:  # reported to the trainer, which fails the demo
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def _run_transport(transport: str, sd: dict, args: argparse.Namespace, progress: Any) -> dict:
    from ..sender import Sender

    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    ctx = mp.get_context("spawn")
    tickets = [ctx.Queue() for _ in range(_WORKERS)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(transport, args.size_mib << 20, args.tensors, tickets[i], results), daemon=True)
        for i in range(_WORKERS)
    ]
    task = progress.add_task(f"{transport}: starting workers", total=args.repeats)
    for p in procs:
        p.start()
    try:
        with Sender(transport, capacity_nbytes=nbytes + (64 << 20), prefault=True) as sender:
            for _ in procs:
                kind, detail = results.get(timeout=180)
                if kind != "ready":
                    raise TransferError(f"{transport} worker failed to start: {detail}")
            progress.update(task, description=f"{transport}: syncing to {_WORKERS} workers")
            times: list[float] = []
            for version in range(1, args.repeats + 1):
                sd[_MARKER].fill_(version)
                t0 = time.monotonic()
                ticket = sender.put(sd, readers=_WORKERS)
                wire = ticket.to_bytes()
                for q in tickets:
                    q.put((version, wire))
                done = []
                for _ in procs:
                    kind, detail = results.get(timeout=300)
                    if kind != "ok":
                        raise TransferError(f"{transport} worker: {detail}")
                    done.append(detail)
                sender.wait_released(ticket, timeout=60)
                # A sync ends when the last worker holds the new weights
                # (verification, which follows, is not part of it).
                times.append(max(done) - t0)
                progress.advance(task)
            if sender.pool.stats().used_nbytes:
                raise TransferError(f"{transport}: the pool is not empty after the syncs")
    finally:
        for q in tickets:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    med = sorted(times)[len(times) // 2]
    return {
        "scenario": f"{transport} -> {_WORKERS} workers",
        "tensors": len(sd),
        "nbytes": nbytes * _WORKERS,
        "blocks": len(ticket.blocks) or ticket.num_pieces,
        "seconds": med,
        "layout_bytes": len(wire),
        "verified": True,
    }


def transfer_scenarios(sd: dict, args: argparse.Namespace, progress: Any) -> list[dict]:
    rows = []
    for transport in args.transport_list:  # set by check_demo_args
        rows.append(_run_transport(transport, sd, args, progress))
    return rows
