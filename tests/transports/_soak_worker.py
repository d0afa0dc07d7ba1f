"""A receiver process of the soak test (``test_soak.py``), spoken to in JSON lines.

Run as ``python _soak_worker.py TRANSPORT TOKEN RELAY STALL_SECONDS``. It
prints ``{"pid": ...}`` once its Receiver is up, then answers one line per
command read from stdin:

* ``{"cmd": "get", "ticket": HEX, "version": V}``: get the ticket into its
  kept receive plan (made from the first ticket) and answer the digest of
  what it received, or the error's type, whether it is a TensorferryError,
  and its message;
* ``{"cmd": "stats"}``: the Receiver's ``stats()``;
* ``{"cmd": "stop"}``: close the Receiver and exit 0.

The digest is the driver's (:func:`digest`): blake2b of every tensor's
bytes in key order, so a get is checked bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch


def digest(obj: dict[str, torch.Tensor]) -> str:
    """blake2b of each tensor's bytes, in key order (sender and receivers alike)."""
    h = hashlib.blake2b(digest_size=16)
    for key in sorted(obj):
        h.update(obj[key].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def main(transport: str, token: str, relay: bool, stall_seconds: float) -> None:
    from tensorferry import Receiver
    from tensorferry.errors import TensorferryError

    torch.set_num_threads(1)  # four processes on two shared cores
    receiver = Receiver(transport, token=token, timeout=60.0, relay=relay, stall_seconds=stall_seconds)
    plan: Any = None

    def answer(**fields: Any) -> None:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()

    answer(pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            break
        if cmd["cmd"] == "stats":
            answer(**receiver.stats())
            continue
        ticket = bytes.fromhex(cmd["ticket"])
        try:
            if plan is None:
                plan = receiver.plan(ticket)
            answer(version=cmd["version"], digest=digest(receiver.get(ticket, into=plan)))
        except Exception as exc:  # every one is reported: the driver asserts it is typed
            answer(version=cmd["version"], error=type(exc).__name__, typed=isinstance(exc, TensorferryError), message=str(exc)[:500])
    receiver.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", float(sys.argv[4]))
