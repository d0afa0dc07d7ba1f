"""Broadcast benchmark: one sender, N receivers on N hosts with equal links;
today's star against a chain and a tree of relaying receivers (issue 16).

Hosts are network namespaces on a bridge (``tests/_hosts.py``): every link is
shaped to the same rate (``--rate``) in both directions by a token bucket.
Strategies:

* ``star``: ``put(obj, readers=N)``, every receiver (a plain tcp
  ``Receiver``) pulls the whole object from the sender, whose one link
  carries every copy: N receivers take about N times as long as one.
* ``chain``: ``put(obj, readers=N, fanout=1)``, receivers made with
  ``relay=True``: the sender serves the first, each later one pulls from the
  one before, which passes on each chunk as it arrives (the object's size
  over 32 times its readers, 64 KiB to 1 MiB). Every link carries the
  object about once in and once out, so N receivers should take about as
  long as one (plus a chunk's time and a relay's latency per hop).
* ``tree``: ``fanout=2``, the same receivers: the sender and each relay serve
  two, so each sending link carries two copies (about 2x one receiver),
  depth about log2(N).
* ``trees``: ``put(trees=True)``, the same receivers: two complementary
  binary trees, each carrying half the object; every relay is interior in
  at most one (two half-copies out), the sender sends each half once, and
  each half is about log2(N) hops deep (issue 47).
* ``chain, relay killed``: the chain to the most receivers, the gets sent
  ``FAULT_STAGGER_SECONDS`` apart so that the chain follows the hosts'
  order; the receiver in its middle (host N/2) is SIGKILLed halfway through
  its receive (half the chain's median time after its get was sent). Its
  child re-attaches (to the sender: the relays above it are full, the ones
  below are its own) and resumes at the byte it reached; the time is to the
  last of the other receivers, against the fault-free chain's median. The
  killed worker is started again before the next round. With ``trees``
  among the strategies the same for the two trees, the victim the relay in
  host 2 (the second to acquire: interior in tree A, two children of half
  0), against the fault-free trees' median.

Processes: one long-lived worker per host, started with ``ip netns exec``:
the SENDER in host 0 (a tcp ``Sender`` bound to its address, with a token),
one RECEIVER in each of hosts 1..max(N), holding a plain tcp ``Receiver``
(the star) and a relaying one (chain, tree) listening on its host's address.
This script is the controller; it talks to the workers over their
stdin/stdout in JSON lines (the control plane a user would bring), and
passes the ticket's bytes along. Times are ``time.monotonic()``, one clock
for every namespace (one kernel).

A round: the sender puts the object (a dict of 8 float32 tensors, views of
one flat buffer of ``--nbytes`` random bytes); the controller hands the
ticket to receivers 1..N at once; each does ``Receiver.get`` and reports when
it returned. The time is from the put's start to the last receiver holding
the bytes (the put alone, a copy into the sender's pool, is kept apart too).
The controller then waits for the sender's release (its pool must be empty)
and records the bytes the sender itself sent (``stats()["bytes_sent"]``, in
copies of the object: N for a star, 1 for a chain, 2 for a tree). A relay
keeps a ticket's bytes ``--linger`` seconds after its last child's pull; the
rounds of one N run chain, star, tree, so that a relay's last ticket is let
go (its memory back to the receive cache, capped at one object) before its
next.

Measured in the same run, for comparison: the line-rate limits, one copy
over one link, ``nbytes * 8 / rate`` (what a relay approaches for any N),
and the star's bound, N copies through the sender's link (TCP over Ethernet
carries at most 1448 of every 1514 bytes, so 0.956x the line rate is the
real ceiling); and, unless ``--no-raw``, a raw TCP star (plain sockets from
host 0 to the N hosts at once, one round per N).

One untimed warm-up round to every receiver per strategy first. Rounds are
interleaved (repeat 1 of every N, then repeat 2, ...) so drift of this shared
machine's load spreads over all N; medians are reported. The last round of
each N and every fault round is verified after its timing: each receiver's
BLAKE2b of every received tensor's bytes equals the sender's.

Same-host children (``--same-host K ...``, a run of its own): the sender in
host 0, and in host 1 one relay and K more receivers, each its own process.
The relay takes the object over the link; the others are placed below it
(a relay of their own host, whatever the fanout) and copy it out of its
receive memory (``relay_reads="memory"``: process_vm_readv) or take it as a
local TCP stream (``"tcp"``), interleaved round by round. Two measures per
round: *after* (the relay already holds everything, then the K gets at
once: the local read itself, beside K plain memcpys of the same bytes
between two faulted-in buffers, one in each child process at once, in the
same round) and *pipelined* (the K gets with the relay's own: how long
after the relay the last child holds the bytes). Writes
``bench_broadcast_same_host.json``. With ``--no-ptrace`` the receivers are
non-dumpable and lack CAP_SYS_PTRACE, so the kernel refuses
process_vm_readv (as Yama's ptrace_scope 1 does between siblings) and the
memory reads go through a mapping of the relay's memfd
(``bench_broadcast_same_host_no_ptrace.json``).

Targets (issue 16), checked in the table: 8 receivers with fanout=1 in at
most 1.3x the time of 1 receiver; with a relay killed halfway, every other
receiver done in at most 2x the fault-free time. Issue 47: 16 receivers
with fanout=1 in at most 1.1x (``--receivers 1 4 16 --rate 250mbit
--nbytes 32MiB``: 16 links at once that two shared cores forward). Each
round also records the receivers' CPU (user and system, every thread) per
GiB each received. The JSON's flat ``ratios`` (each strategy and N against
the line rate and against one receiver) are what ``interleave.py`` compares;
the workers import the tensorferry of an inherited ``PYTHONPATH`` first.

This script is the controller; ``_broadcast_workers.py`` holds the workers
it starts in the hosts (``--worker``), ``_broadcast_report.py`` the summary,
table and plots.

Run (as root): ``.venv/bin/python benchmarks/bench_broadcast.py`` (default:
1gbit links, 512 MiB, N = 1 2 4 8, 3 repeats; about 9 GiB of memory, and 8
links at 1 Gbit/s at once is more than a 2-core machine forwards: see
docs/broadcast.md); ``--quick`` is 100mbit and 16 MiB; ``--rate 400mbit
--nbytes 512MiB --star-repeats 1 --no-raw`` and the like for anything
between; ``--replot JSON`` redraws the table and the plot. Writes
``benchmarks/results/bench_broadcast.json`` and ``.png`` (``_quick`` for
``--quick``, ``_<rate>_<size>`` for any other rate or size than the
defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import select
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _broadcast_report import plot, print_table, ratios, summarize
from _broadcast_workers import receiver_worker, sender_worker
from _common import MIB, log, med, package_version, results_dir, write_json, write_result  # benchmarks/_common.py (this script's folder)
from _harness import namespace_hosts

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

STRATEGIES = {"star": None, "chain": 1, "tree": 2, "trees": 2}  # name -> put(fanout=)
TWO_TREES = {"trees"}  # put(trees=True): each half down a binary tree of its own
# The fault rounds' gets go out this far apart, so that the chain is in the
# hosts' order and the victim has a child: a few ms of a busy machine's
# scheduling, and a small part of a round (10 s at 400 Mbit/s, 512 MiB).
FAULT_STAGGER_SECONDS = 0.05
_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_nbytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 512MiB, 32MiB, 1GiB or a number of bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


# -- the controller ------------------------------------------------------------------------


class Worker:
    """One worker process in a host, spoken to in JSON lines."""

    def __init__(self, hosts: Any, i: int, role: str, args: argparse.Namespace, timeout: float) -> None:
        self.name = f"{role}@host{i}"
        argv = [str(Path(__file__).resolve()), "--worker", role, "--host", hosts.address(i), "--token", args.token,
                "--nbytes", str(args.nbytes), "--timeout", str(timeout), "--linger", str(args.linger), "--transport", args.transport]
        prefix: tuple[str, ...] = ()
        if args.no_ptrace and role == "receiver":
            # Root reads any process's memory with CAP_SYS_PTRACE; without it, not a non-dumpable one's.
            prefix, argv = ("setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"), [*argv, "--no-ptrace"]
        # nixl: UCX by TCP over the host's eth0, so that its bytes cross the
        # shaped links (its shared-memory transports would go around them:
        # the hosts share one kernel).
        env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="eth0") if args.transport == "nixl" else dict(os.environ)
        # The tensorferry of an inherited PYTHONPATH first (interleave.py's
        # tree), else this checkout's.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT / "src")]))
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = hosts.run(i, [*prefix, sys.executable, *argv], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"{self.name} said nothing within {timeout:.0f} s (exit code {self.proc.poll()})")
        fact = json.loads(line)
        if "error" in fact:
            raise RuntimeError(f"{self.name} failed:\n{fact['error']}")
        return fact

    def call(self, timeout: float, /, **cmd: Any) -> dict:
        self.send(**cmd)
        return self.recv(timeout)

    def kill(self) -> None:
        """SIGKILL the worker (by its own pid: ``ip netns exec`` execs it in place)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        try:
            self.send(cmd="stop")
            self.proc.wait(timeout=20)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass  # Hosts.close() ends it


def broadcast_round(sender: Worker, receivers: list[Worker], strategy: str, *, verify: bool, timeout: float,
                    stagger: float = 0.0, victim: Worker | None = None, kill_after: float = 0.0) -> dict:
    """One put to ``receivers`` by ``strategy``: the gets sent at once (or
    ``stagger`` apart); ``victim`` SIGKILLed ``kill_after`` seconds after its
    get was sent. The time is to the last surviving receiver's bytes."""
    fanout = STRATEGIES[strategy]
    cpu0 = [r.call(timeout, cmd="cpu")["cpu_seconds"] for r in receivers]
    put = sender.call(timeout, cmd="put", readers=len(receivers), fanout=fanout, trees=strategy in TWO_TREES)
    kill_at = None
    for k, r in enumerate(receivers):
        if k and stagger:
            time.sleep(stagger)
        r.send(cmd="get", ticket=put["ticket"], verify=verify, relay=fanout is not None)
        if r is victim:
            kill_at = time.monotonic() + kill_after
    if victim is not None:
        time.sleep(max(0.0, kill_at - time.monotonic()))
        victim.kill()
    got = [r.recv(timeout) for r in receivers if r is not victim]
    released = sender.call(timeout, cmd="wait", ticket=put["ticket"], timeout=timeout)
    # Every reader released: every relay has served its children.
    cpu = sum(r.call(timeout, cmd="cpu")["cpu_seconds"] - c for r, c in zip(receivers, cpu0) if r is not victim)
    done = [g["t_done"] for g in got]
    total = put["total_nbytes"]
    if put["transport"] == "nixl":
        # nixl: readers READ the sender's pool one-sided (it counts no bytes
        # sent); what did not come from a relay came from it.
        relayed = sum(g["nixl_read_nbytes"] + g["memory_read_nbytes"] + g["stream_nbytes"] for g in got)
        sender_copies = (len(got) * total - relayed) / total
    else:
        sender_copies = (released["bytes_sent"] - put["bytes_sent"]) / total
    return {
        "seconds": max(done) - put["t_put"],
        "put_seconds": put["put_seconds"],
        "gets_seconds": max(done) - min(g["t_start"] for g in got),
        "first_done_seconds": min(done) - put["t_put"],
        "sender_copies": sender_copies,
        # The receivers' CPU (user and system, every thread) per GiB each received.
        "receiver_cpu_seconds_per_gib": cpu / (len(got) * total / (1 << 30)),
        "pool_empty": released["used_nbytes"] == 0,
        "digests": [g["digest"] for g in got] if verify else None,
    }


def raw_round(sender: Worker, receivers: list[Worker], hosts: Any, nbytes: int, timeout: float) -> dict:
    ports = [r.call(timeout, cmd="sink", nbytes=nbytes)["port"] for r in receivers]
    targets = [[hosts.address(k + 1), p] for k, p in enumerate(ports)]
    t0 = sender.call(timeout, cmd="raw", targets=targets, timeout=timeout)["t_start"]
    done = [r.recv(timeout) for r in receivers]
    return {"seconds": max(d["t_done"] for d in done) - t0, "verified": all(d["nbytes"] == nbytes for d in done)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default=None, help="every link's rate, as tc writes it (default 1gbit; --quick 100mbit)")
    ap.add_argument("--nbytes", type=parse_nbytes, default=None, help="object size (default 512MiB; --quick 16MiB)")
    ap.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4, 8], help="numbers of receivers (hosts)")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per strategy and number of receivers (median)")
    ap.add_argument("--star-repeats", type=int, default=None,
                    help="timed rounds of the star (default --repeats; its time is its link's, N copies: 1 is enough for a long run)")
    ap.add_argument("--fault-repeats", type=int, default=2, help="rounds of the chain with a relay killed (0: none)")
    ap.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    ap.add_argument("--linger", type=float, default=2.0, help="Receiver(relay_linger_seconds=) of the relays")
    ap.add_argument("--no-ptrace", action="store_true",
                    help="receivers non-dumpable and without CAP_SYS_PTRACE (as under Yama's ptrace_scope 1): "
                         "same-host children map the relay's memfd instead of process_vm_readv (needs setpriv)")
    ap.add_argument("--no-raw", action="store_true", help="leave out the raw TCP star")
    ap.add_argument("--same-host", type=int, nargs="+", default=None, metavar="K",
                    help="only the same-host section: K receivers beside a relay in its host (memory vs tcp reads vs memcpy)")
    ap.add_argument("--quick", action="store_true", help="100mbit, 16 MiB (smoke run)")
    ap.add_argument("--transport", choices=["tcp", "nixl"], default="tcp",
                    help="the sender's and receivers' transport (nixl: UCX by TCP over each host's link)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, or $TENSORFERRY_BENCH_OUT)")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON", help="only redraw the table and plot")
    # internal: what the workers are started with
    ap.add_argument("--worker", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out = args.out or results_dir(RESULTS)
    if args.worker == "sender":
        sender_worker(args)
        return 0
    if args.worker == "receiver":
        receiver_worker(args)
        return 0
    if args.replot is not None:
        doc = json.loads(args.replot.read_text())
        summarize(doc)
        print_table(doc)
        plot(doc, args.replot.with_suffix(".png"))
        return 0

    hosts_module, reason = namespace_hosts("bench_broadcast")
    if reason is not None:
        return 1
    Hosts, parse_rate = hosts_module.Hosts, hosts_module.parse_rate
    args.rate = args.rate or ("100mbit" if args.quick else "1gbit")
    args.nbytes = args.nbytes or (16 * MIB if args.quick else 512 * MIB)
    args.token = secrets.token_hex(16)
    rate_bits = parse_rate(args.rate)
    ns = sorted(set(args.receivers))
    if ns[0] < 1 or ns[-1] > 200:
        ap.error("--receivers: 1 to 200")
    if args.same_host is not None:
        return same_host(args, Hosts, rate_bits)
    repeats = {k: args.repeats for k in args.strategies}
    if "star" in repeats and args.star_repeats is not None:
        repeats["star"] = args.star_repeats
    line_seconds = args.nbytes * 8 / rate_bits
    # The slowest round is the star to the most receivers: allow 3x its bound.
    timeout = max(60.0, 3 * ns[-1] * line_seconds + 30)
    started, load_start = time.monotonic(), os.getloadavg()[0]
    log(f"{ns[-1] + 1} hosts at {args.rate}; {args.nbytes / MIB:,.0f} MiB; receivers {ns}; strategies {repeats} rounds; "
        f"one copy at the line rate {line_seconds:.2f} s; load {load_start:.2f}")

    doc: dict[str, Any] = {"rounds": {k: {} for k in args.strategies}, "fault": [], "raw_star": {}, "errors": []}
    info: dict[str, Any] = {"nbytes": args.nbytes}
    with Hosts(ns[-1] + 1, rate=args.rate) as hosts:
        sender = Worker(hosts, 0, "sender", args, timeout)
        receivers = [Worker(hosts, k, "receiver", args, timeout) for k in range(1, ns[-1] + 1)]
        try:
            info = sender.recv(120)
            for r in receivers:
                r.recv(120)
            log(f"workers up in {time.monotonic() - started:.1f} s; sender at {info['address']}")
            # Chain, star, tree for each N: a relay's ticket lingers less
            # than a star round lasts, so it is let go before the tree's.
            order = [k for k in ("chain", "star", "tree", "trees") if k in repeats]
            for strategy in order:
                warm = broadcast_round(sender, receivers, strategy, verify=True, timeout=timeout)
                check(doc, f"warm-up {strategy}", warm, info["digest"])
                log(f"warm-up {strategy} to {len(receivers)}: {warm['seconds']:.2f} s")
            for rep in range(max(repeats.values())):
                for n in ns:
                    for strategy in order:
                        if rep >= repeats[strategy]:
                            continue
                        last = rep == repeats[strategy] - 1
                        r = broadcast_round(sender, receivers[:n], strategy, verify=last, timeout=timeout)
                        check(doc, f"{strategy} to {n}", r, info["digest"] if last else None)
                        doc["rounds"][strategy].setdefault(str(n), []).append(r)
                        log(f"{strategy}, {n} receivers, round {rep + 1}: {r['seconds']:.2f} s (put {r['put_seconds']:.2f} s, "
                            f"first done {r['first_done_seconds']:.2f} s, sender sent {r['sender_copies']:.2f} copies)"
                            + (f", verified {r['verified']}" if last else ""))
            n = ns[-1]
            # The chain's victim: host n/2, in its middle. The two trees':
            # host 2, the second to acquire, interior in tree A (two children).
            victims = {"chain": n // 2 - 1, "trees": 1}
            for strategy in [k for k in victims if k in repeats] if args.fault_repeats and n >= 3 else []:
                free = med([r["seconds"] for r in doc["rounds"][strategy][str(n)]])
                for rep in range(args.fault_repeats):
                    k = victims[strategy]
                    r = broadcast_round(sender, receivers[:n], strategy, verify=True, timeout=timeout, stagger=FAULT_STAGGER_SECONDS,
                                        victim=receivers[k], kill_after=0.5 * free)
                    check(doc, f"{strategy} to {n}, relay killed", r, info["digest"])
                    r.update(strategy=strategy, killed_host=k + 1, fault_free_seconds=free)
                    doc["fault"].append(r)
                    log(f"{strategy} to {n}, the relay in host {k + 1} killed after {0.5 * free:.2f} s: {r['seconds']:.2f} s "
                        f"({r['seconds'] / free:.2f}x fault-free), sender sent {r['sender_copies']:.2f} copies, verified {r['verified']}")
                    receivers[k] = Worker(hosts, k + 1, "receiver", args, timeout)
                    receivers[k].recv(120)
            if not args.no_raw:
                for n in ns:
                    r = raw_round(sender, receivers[:n], hosts, info["nbytes"], timeout)
                    doc["raw_star"][str(n)] = [r]
                    log(f"raw tcp star, {n} receivers: {r['seconds']:.2f} s, all bytes {r['verified']}")
        except Exception as exc:
            doc["errors"].append(f"{type(exc).__name__}: {exc}")
            log(f"FAILED: {exc}")
        finally:
            for w in (sender, *receivers):
                w.stop()

    doc["env"] = env_info(args, ns, rate_bits, info["nbytes"], load_start, started)
    summarize(doc)
    default = args.rate == "1gbit" and args.nbytes == 512 * MIB
    suffix = ("_quick" if args.quick else "" if default else f"_{args.rate}_{args.nbytes // MIB}MiB") + ("_nixl" if args.transport == "nixl" else "")
    path = write_result(args.out / f"bench_broadcast{suffix}.json", doc, ratios(doc))
    print_table(doc)
    if doc["rows"]:
        plot(doc, path.with_suffix(".png"))
    log(f"done in {time.monotonic() - started:.0f} s; wrote {path} and .png")
    return 1 if doc["errors"] else 0


def same_host(args: argparse.Namespace, Hosts: Any, rate_bits: int) -> int:
    """The sender in host 0; a relay and max(K) more receivers in host 1.
    Per round and K, for each way of reading the relay (interleaved): the
    relay's get, then the K gets at once (after), and K memcpys at once;
    then the K gets started with the relay's (pipelined)."""
    ks = sorted(set(args.same_host))
    if ks[0] < 1 or ks[-1] > 16:
        print("bench_broadcast: --same-host: 1 to 16 receivers beside the relay", file=sys.stderr)
        return 2
    line_seconds = args.nbytes * 8 / rate_bits
    timeout = max(60.0, 4 * line_seconds + 30)
    started, load_start = time.monotonic(), os.getloadavg()[0]
    log(f"same host: a relay and K = {ks} receivers in host 1, the sender in host 0, links {args.rate}; "
        f"{args.nbytes / MIB:,.0f} MiB; {args.repeats} rounds; load {load_start:.2f}")
    doc: dict[str, Any] = {"rounds": [], "errors": []}
    info: dict[str, Any] = {"nbytes": args.nbytes}
    modes = ["memory", "tcp"]
    with Hosts(2, rate=args.rate) as hosts:
        sender = Worker(hosts, 0, "sender", args, timeout)
        relay = Worker(hosts, 1, "receiver", args, timeout)
        children = [Worker(hosts, 1, "receiver", args, timeout) for _ in range(ks[-1])]
        try:
            info = sender.recv(120)
            for w in (relay, *children):
                w.recv(120)
            log(f"workers up in {time.monotonic() - started:.1f} s")
            for rep in range(args.repeats + 1):  # round 0: warm-up (each receiver's cache, the copy buffers)
                for k in ks:
                    for mode in (modes if rep % 2 else modes[::-1]):
                        kids = children[:k]
                        verify = rep == args.repeats
                        put = sender.call(timeout, cmd="put", readers=1 + k, fanout=1)
                        relay.send(cmd="get", ticket=put["ticket"], verify=verify, relay=True)
                        r_got = relay.recv(timeout)
                        for c in kids:
                            c.send(cmd="get", ticket=put["ticket"], verify=verify, reads=mode)
                        got = [c.recv(timeout) for c in kids]
                        sender.call(timeout, cmd="wait", ticket=put["ticket"], timeout=timeout)
                        for c in kids:
                            c.send(cmd="memcpy")
                        copies = [c.recv(timeout) for c in kids]
                        # Pipelined: the children's gets right after the relay's.
                        put2 = sender.call(timeout, cmd="put", readers=1 + k, fanout=1)
                        relay.send(cmd="get", ticket=put2["ticket"], verify=False, relay=True)
                        time.sleep(0.05)  # the relay acquires first: the children are placed below it
                        for c in kids:
                            c.send(cmd="get", ticket=put2["ticket"], verify=False, reads=mode)
                        r2 = relay.recv(timeout)
                        got2 = [c.recv(timeout) for c in kids]
                        released = sender.call(timeout, cmd="wait", ticket=put2["ticket"], timeout=timeout)
                        row = {
                            "k": k, "mode": mode, "round": rep,
                            "after_seconds": max(g["t_done"] for g in got) - min(g["t_start"] for g in got),
                            "after_each_seconds": [g["t_done"] - g["t_start"] for g in got],
                            "memcpy_seconds": max(c["t_done"] for c in copies) - min(c["t_start"] for c in copies),
                            "relay_seconds": r_got["t_done"] - r_got["t_start"],
                            "pipelined_lag_seconds": max(g["t_done"] for g in got2) - r2["t_done"],
                            "pipelined_relay_seconds": r2["t_done"] - put2["t_put"],
                            "read_from_memory": all(g["memory_read_nbytes"] == put["total_nbytes"] for g in got + got2),
                            "read_through_file": all(g["file_read_nbytes"] == put["total_nbytes"] for g in got + got2),
                            "streamed": all(g["stream_nbytes"] == put["total_nbytes"] for g in got + got2),
                            "sender_copies": (released["bytes_sent"] - put["bytes_sent"]) / put["total_nbytes"] / 2,
                            "pool_empty": released["used_nbytes"] == 0,
                        }
                        if verify:
                            row["verified"] = all(g["digest"] == info["digest"] for g in (r_got, *got))
                            if not row["verified"]:
                                doc["errors"].append(f"{mode}, K={k}: a receiver holds other bytes")
                        if not row["pool_empty"]:
                            doc["errors"].append(f"{mode}, K={k}: the sender's pool is not empty after the release")
                        if mode == "memory" and row["read_through_file"] != args.no_ptrace:
                            doc["errors"].append(f"memory, K={k}: the children read {'not ' if args.no_ptrace else ''}through the relay's file")
                        if not row["read_from_memory" if mode == "memory" else "streamed"]:
                            doc["errors"].append(f"{mode}, K={k}: the children did not read the relay that way")
                        if rep:
                            doc["rounds"].append(row)
                        log(f"{'warm-up ' if not rep else ''}K={k} {mode}: after {row['after_seconds']:.3f} s "
                            f"(memcpy {row['memcpy_seconds']:.3f} s), pipelined lag {row['pipelined_lag_seconds']:.3f} s, "
                            f"relay {row['relay_seconds']:.2f} s, sender copies {row['sender_copies']:.2f}")
        except Exception as exc:
            doc["errors"].append(f"{type(exc).__name__}: {exc}")
            log(f"FAILED: {exc}")
        finally:
            for w in (sender, relay, *children):
                w.stop()
    env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
           "rate": args.rate, "nbytes": info["nbytes"], "k": ks, "repeats": args.repeats, "no_ptrace": args.no_ptrace,
           "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
           "wall_seconds": round(time.monotonic() - started, 1)}
    doc["env"] = env
    doc["summary"] = []
    for k in ks:
        by = {m: [r for r in doc["rounds"] if r["k"] == k and r["mode"] == m] for m in modes}
        if not all(by.values()):
            continue
        mem, tcp = (med([r["after_seconds"] for r in by[m]]) for m in modes)
        copy = med([r["memcpy_seconds"] for r in by["memory"] + by["tcp"]])
        doc["summary"].append({
            "k": k, "memory_seconds": mem, "tcp_seconds": tcp, "memcpy_seconds": copy,
            "memory_vs_memcpy": mem / copy, "tcp_vs_memcpy": tcp / copy, "tcp_vs_memory": tcp / mem,
            "memory_gbytes_per_second": k * info["nbytes"] / mem / 1e9, "tcp_gbytes_per_second": k * info["nbytes"] / tcp / 1e9,
            "pipelined_lag_memory_seconds": med([r["pipelined_lag_seconds"] for r in by["memory"]]),
            "pipelined_lag_tcp_seconds": med([r["pipelined_lag_seconds"] for r in by["tcp"]]),
            "relay_seconds": med([r["relay_seconds"] for r in by["memory"] + by["tcp"]]),
            "sender_copies": med([r["sender_copies"] for r in by["memory"] + by["tcp"]]),
        })
    path = write_json(args.out / f"bench_broadcast_same_host{'_no_ptrace' if args.no_ptrace else ''}.json", doc)
    print(f"same-host receivers of one relay ({'memfd mappings: no process_vm_readv' if args.no_ptrace else 'process_vm_readv'}): "
          f"{info['nbytes'] / MIB:,.0f} MiB, links {args.rate}, medians of {args.repeats}, "
          f"load {env['loadavg_1min_start_end']}")
    print(f"{'K':>3} {'memory s':>9} {'tcp s':>7} {'memcpy s':>9} {'mem/memcpy':>10} {'tcp/memcpy':>10} {'tcp/mem':>8} "
          f"{'lag mem s':>9} {'lag tcp s':>9} {'relay s':>8} {'sender copies':>13}")
    for r in doc["summary"]:
        print(f"{r['k']:>3} {r['memory_seconds']:>9.3f} {r['tcp_seconds']:>7.3f} {r['memcpy_seconds']:>9.3f} "
              f"{r['memory_vs_memcpy']:>9.2f}x {r['tcp_vs_memcpy']:>9.2f}x {r['tcp_vs_memory']:>7.2f}x "
              f"{r['pipelined_lag_memory_seconds']:>9.3f} {r['pipelined_lag_tcp_seconds']:>9.3f} {r['relay_seconds']:>8.2f} "
              f"{r['sender_copies']:>13.2f}")
    for e in doc["errors"]:
        print(f"error: {e}")
    log(f"done in {time.monotonic() - started:.0f} s; wrote {path}")
    return 1 if doc["errors"] else 0


def check(doc: dict, what: str, r: dict, digest: str | None) -> None:
    """Record what a round got wrong: other bytes (when verified), a pool not emptied."""
    digests = r.pop("digests")
    if digest is not None:
        r["verified"] = all(d == digest for d in digests)
        if not r["verified"]:
            doc["errors"].append(f"{what}: {sum(d != digest for d in digests)} receivers hold other bytes")
    if not r["pool_empty"]:
        doc["errors"].append(f"{what}: the sender's pool is not empty after every reader released")


def env_info(args: argparse.Namespace, ns: list[int], rate_bits: int, nbytes: int, load_start: float, started: float) -> dict:
    import torch


    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorferry": package_version("tensorferry"),
        "rate": args.rate,
        "rate_bits": rate_bits,
        "nbytes": nbytes,
        "receivers": ns,
        "repeats": {k: (args.star_repeats if k == "star" and args.star_repeats is not None else args.repeats) for k in args.strategies},
        "fault_repeats": args.fault_repeats,
        "relay_linger_seconds": args.linger,
        "warmup": 1,
        "transport": args.transport,
        "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "wall_seconds": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
