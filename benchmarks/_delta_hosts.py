"""bench_delta.py's network part: a sender and four receivers on hosts with
1 Gbit/s links (network namespaces, ``tests/_hosts.py``).

Each round changes a fraction of the bf16 object (untimed), then syncs it
twice, in an order rotated every round: the *full* sync a plain kept plan
does best, a relay chain (``put(fanout=1)``, receivers made with
``relay=True``: every link carries the object about once), and the *delta*
sync of a delta plan through the same chain (the relays pass the delta
on; receivers that hold no base read the whole object the same way). A sync's
time is from the put's start to the last receiver's get returning
(``time.monotonic``: one clock, one kernel). The last delta sync is
checked bit for bit on every receiver.

Processes: one per host, started with ``ip netns exec``, talking JSON lines
over stdin/stdout: ``python _delta_hosts.py sender|receiver ...``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def _say(**fact: Any) -> None:
    print(json.dumps(fact), flush=True)


def sender(host: str, token: str, size_mib: int) -> None:
    import torch

    import tensorferry as tf

    torch.set_num_threads(1)
    numel = size_mib * MIB // 2
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with tf.Sender("tcp", host=host, token=token, capacity_nbytes=(3 * size_mib + 64) * MIB) as s:
        plans = {"full": s.plan({"x": x}), "delta": s.plan({"x": x}, delta=True)}
        _say(ready=os.getpid())
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "change":
                g = torch.Generator().manual_seed(cmd["seed"])
                idx = torch.randint(0, numel, (max(1, int(numel * cmd["fraction"])),), generator=g)
                x[idx] = (x[idx].float() + 1.0).to(torch.bfloat16)
                _say(ok=True)
            elif cmd["cmd"] == "put":
                t0 = time.monotonic()
                t = s.put(plans[cmd["plan"]], readers=cmd["readers"], fanout=cmd["fanout"])
                d = t.delta
                _say(t0=t0, ticket=t.to_bytes().hex(), delta_nbytes=d.nbytes if d is not None and d.base else None,
                     total_nbytes=t.total_nbytes)
            elif cmd["cmd"] == "wait":
                s.wait_released(tf.Ticket.from_bytes(bytes.fromhex(cmd["ticket"])), timeout=120)
                _say(ok=True)
            elif cmd["cmd"] == "digest":
                _say(digest=hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest())


def receiver(host: str, token: str) -> None:
    import torch

    import tensorferry as tf

    torch.set_num_threads(1)
    plans: dict[str, Any] = {}
    with tf.Receiver("tcp", token=token, timeout=120.0, relay=True, host=host) as r:
        _say(ready=os.getpid())
        for line in sys.stdin:
            cmd = json.loads(line)
            ticket = tf.Ticket.from_bytes(bytes.fromhex(cmd["ticket"])) if "ticket" in cmd else None
            if cmd["cmd"] == "get":
                name = cmd["plan"]
                if name not in plans:
                    plans[name] = r.plan(ticket)
                r.get(ticket, into=plans[name])
                _say(t1=time.monotonic())
            elif cmd["cmd"] == "digest":
                x = plans["delta"].result["x"]
                _say(digest=hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest())


class _Proc:
    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.ready = self.read()  # the worker's first line: it is up

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a host's worker ended (exit {self.proc.poll()})")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict:
        self.send(**cmd)
        return self.read()


def hosts_part(size_mib: int, repeats: int, fractions: tuple[float, ...], receivers: int = 4, rate: str = "1gbit") -> dict:
    """The network figures, or a reason they could not be measured."""
    import secrets
    import subprocess

    from _common import log, med, rotated
    from _harness import namespace_hosts

    hosts_module, reason = namespace_hosts()
    if reason is not None:
        return {"skipped": reason}
    Hosts = hosts_module.Hosts
    token = secrets.token_hex(8)
    me = str(Path(__file__).resolve())
    out: dict[str, Any] = {"size_mib": size_mib, "receivers": receivers, "rate": rate, "fractions": {}}
    with Hosts(receivers + 1, rate=rate) as hosts:
        kw = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
        snd = _Proc(hosts.python(0, me, "sender", hosts.address(0), token, str(size_mib), **kw))
        rcv = [_Proc(hosts.python(i, me, "receiver", hosts.address(i), token, **kw)) for i in range(1, receivers + 1)]

        def sync(name: str) -> tuple[float, Any]:
            put = snd.ask(cmd="put", plan=name, readers=receivers, fanout=1)
            for r in rcv:
                r.send(cmd="get", plan=name, ticket=put["ticket"])
            done = max(r.read()["t1"] for r in rcv)
            snd.ask(cmd="wait", ticket=put["ticket"])
            return done - put["t0"], put

        seed = 0
        for fraction in fractions:
            times: dict[str, list[float]] = {"full": [], "delta": []}
            last: Any = None
            for rnd in range(repeats + 1):
                seed += 1
                snd.ask(cmd="change", fraction=fraction, seed=seed)
                for i in rotated(2, rnd):
                    name = ("full", "delta")[i]
                    seconds, put = sync(name)
                    if rnd:
                        times[name].append(seconds)
                    if name == "delta":
                        last = put
            want = snd.ask(cmd="digest")["digest"]
            got = [r.ask(cmd="digest")["digest"] for r in rcv]
            assert got == [want] * receivers, "a receiver's bytes differ from the sender's after delta syncs"
            full, delta = med(times["full"]), med(times["delta"])
            out["fractions"][str(fraction)] = {"full_seconds": full, "delta_seconds": delta, "delta_vs_full": delta / full,
                                               "delta_nbytes": last["delta_nbytes"], "total_nbytes": last["total_nbytes"]}
            log(f"hosts {fraction:>6.1%} changed: full {full:6.3f} s, delta {delta:6.3f} s ({delta / full:.2f}x), "
                f"delta bytes {last['delta_nbytes']} of {last['total_nbytes']}")
    return out


if __name__ == "__main__":
    if sys.argv[1] == "sender":
        sender(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        receiver(sys.argv[2], sys.argv[3])
