"""Broadcast benchmark: one sender, N receivers on N hosts with equal links,
today's "star" (every receiver pulls the whole object from the sender).

The baseline of issue 16 (broadcast by relaying receivers). Hosts are network
namespaces on a bridge (``tests/_hosts.py``): every link is shaped to the same
rate (``--rate``) in both directions by a token bucket, so the sender's one
link carries every copy in a star, and N receivers should take about N times
as long as one. A relay broadcast (chain, tree) is meant to bring that back to
about the time of one receiver; its lines go into the same plot
(:func:`plot` takes a dict of strategies) when it exists.

Processes: one long-lived worker per host, started with ``ip netns exec``:
the SENDER in host 0 (a tcp ``Sender`` bound to its address, with a token),
one RECEIVER in each of hosts 1..max(N) (a tcp ``Receiver``). This script is
the controller; it talks to the workers over their stdin/stdout in JSON lines
(the control plane a user would bring), and passes the ticket's bytes along.
Times are ``time.monotonic()``, one clock for every namespace (one kernel).

A round for N receivers: the sender ``put(obj, readers=N)``s the object (a
dict of 8 float32 tensors, views of one flat buffer of ``--nbytes`` random
bytes); the controller hands the ticket to receivers 1..N at once; each does
``Receiver.get`` and reports when it returned. The time is from the put's
start to the last receiver holding the bytes; the put alone (a copy into the
sender's pool) and the span of the gets are kept apart too. The controller
then waits for the sender's release before the next round.

Measured in the same run, for comparison:

* the line-rate limits: one copy over one link, ``nbytes * 8 / rate``
  (what a perfect relay approaches for any N), and the star's bound, N copies
  through the sender's link, ``N * nbytes * 8 / rate`` (TCP over Ethernet
  carries at most 1448 of every 1514 bytes, so 0.956x the line rate is the
  real ceiling);
* raw TCP star: the same bytes sent from host 0 by plain sockets to each of
  the N receivers at once (one thread and one connection a receiver), i.e.
  what the star costs with no tensorferry at all; one round per N, after the
  star's rounds, on fresh connections.

One untimed warm-up round to every receiver first (connections, receive
memory). Rounds are interleaved (repeat 1 of every N, then repeat 2, ...) so
drift of this shared machine's load spreads over all N; medians are reported.
The last round of each N is verified after its timing: each receiver's
BLAKE2b of every received tensor's bytes equals the sender's.

Run (as root): ``.venv/bin/python benchmarks/bench_broadcast.py`` (default:
1gbit links, 512 MiB, N = 1 2 4 8, 3 repeats: about 6 minutes and 7 GiB of
memory); ``--quick`` is 100mbit and 16 MiB; ``--rate 200mbit --nbytes 32MiB
--receivers 1 2 4`` and the like for anything between; ``--replot JSON``
redraws the table and the plot. Writes ``benchmarks/results/bench_broadcast.json``
and ``.png`` (``_quick`` for ``--quick``, ``_<rate>_<size>`` for any other
rate or size than the defaults).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import secrets
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))  # the test-host harness, tests/_hosts.py

MIB = 1 << 20
SEED = 20_260_616
TENSORS = 8
_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_nbytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 512MiB, 32MiB, 1GiB or a number of bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
    with Sender("tcp", host=args.host, token=args.token, capacity_nbytes=nbytes + MIB, prefault=True) as sender:
        _say(ready=os.getpid(), nbytes=nbytes, digest=_digest(obj), address=sender.address)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "put":
                    t0 = time.monotonic()
                    ticket = sender.put(obj, readers=cmd["readers"], one_shot=True)
                    _say(ticket=ticket.to_bytes().hex(), t_put=t0, put_seconds=time.monotonic() - t0)
                elif cmd["cmd"] == "wait":
                    sender.wait_released(Ticket.from_bytes(bytes.fromhex(cmd["ticket"])), timeout=cmd["timeout"])
                    _say(released=True, used_nbytes=sender.pool.stats().used_nbytes)
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
    with Receiver("tcp", token=args.token, timeout=args.timeout) as receiver:
        _say(ready=os.getpid())
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "get":
                    t0 = time.monotonic()
                    got = receiver.get(bytes.fromhex(cmd["ticket"]))
                    t1 = time.monotonic()
                    digest = _digest(got) if cmd["verify"] else None
                    del got
                    _say(t_start=t0, t_done=t1, digest=digest)
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


# -- the controller ------------------------------------------------------------------------


class Worker:
    """One worker process in a host, spoken to in JSON lines."""

    def __init__(self, hosts: Any, i: int, role: str, args: argparse.Namespace, timeout: float) -> None:
        self.name = f"{role}@host{i}"
        argv = [str(Path(__file__).resolve()), "--worker", role, "--host", hosts.address(i), "--token", args.token,
                "--nbytes", str(args.nbytes), "--timeout", str(timeout)]
        self.proc = hosts.python(i, *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

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

    def stop(self) -> None:
        try:
            self.send(cmd="stop")
            self.proc.wait(timeout=20)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass  # Hosts.close() ends it


def star_round(sender: Worker, receivers: list[Worker], *, verify: bool, timeout: float) -> dict:
    put = sender.call(timeout, cmd="put", readers=len(receivers))
    for r in receivers:
        r.send(cmd="get", ticket=put["ticket"], verify=verify)
    got = [r.recv(timeout) for r in receivers]
    sender.call(timeout, cmd="wait", ticket=put["ticket"], timeout=timeout)
    done = [g["t_done"] for g in got]
    return {
        "seconds": max(done) - put["t_put"],
        "put_seconds": put["put_seconds"],
        "gets_seconds": max(done) - min(g["t_start"] for g in got),
        "first_done_seconds": min(done) - put["t_put"],
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
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per number of receivers (median)")
    ap.add_argument("--no-raw", action="store_true", help="leave out the raw TCP star")
    ap.add_argument("--quick", action="store_true", help="100mbit, 16 MiB (smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON", help="only redraw the table and plot")
    # internal: what the workers are started with
    ap.add_argument("--worker", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--token", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "sender":
        sender_worker(args)
        return 0
    if args.worker == "receiver":
        receiver_worker(args)
        return 0
    if args.replot is not None:
        doc = json.loads(args.replot.read_text())
        print_table(doc)
        plot(doc, args.replot.with_suffix(".png"))
        return 0

    from _hosts import Hosts, available, parse_rate

    reason = available()
    if reason is not None:
        print(f"bench_broadcast: cannot make namespace hosts here: {reason}", file=sys.stderr)
        return 1
    args.rate = args.rate or ("100mbit" if args.quick else "1gbit")
    args.nbytes = args.nbytes or (16 * MIB if args.quick else 512 * MIB)
    args.token = secrets.token_hex(16)
    rate_bits = parse_rate(args.rate)
    ns = sorted(set(args.receivers))
    if ns[0] < 1 or ns[-1] > 200:
        ap.error("--receivers: 1 to 200")
    line_seconds = args.nbytes * 8 / rate_bits
    # The slowest round is the star to the most receivers: allow 3x its bound.
    timeout = max(60.0, 3 * ns[-1] * line_seconds + 30)
    started, load_start = time.monotonic(), os.getloadavg()[0]
    log(f"{ns[-1] + 1} hosts at {args.rate}; {args.nbytes / MIB:,.0f} MiB; receivers {ns}; repeats {args.repeats}; "
        f"one copy at the line rate {line_seconds:.2f} s; load {load_start:.2f}")

    doc: dict[str, Any] = {"star": {}, "raw_star": {}, "errors": []}
    info: dict[str, Any] = {"nbytes": args.nbytes}
    with Hosts(ns[-1] + 1, rate=args.rate) as hosts:
        sender = Worker(hosts, 0, "sender", args, timeout)
        receivers = [Worker(hosts, k, "receiver", args, timeout) for k in range(1, ns[-1] + 1)]
        try:
            info = sender.recv(120)
            for r in receivers:
                r.recv(120)
            log(f"workers up in {time.monotonic() - started:.1f} s; sender at {info['address']}")
            warm = star_round(sender, receivers, verify=True, timeout=timeout)
            bad = [k + 1 for k, d in enumerate(warm["digests"]) if d != info["digest"]]
            if bad:
                doc["errors"].append(f"warm-up: receivers on hosts {bad} hold other bytes")
            log(f"warm-up to {len(receivers)}: {warm['seconds']:.2f} s, verified {not bad}")
            for rep in range(args.repeats):
                for n in ns:
                    last = rep == args.repeats - 1
                    r = star_round(sender, receivers[:n], verify=last, timeout=timeout)
                    if last:
                        r["verified"] = all(d == info["digest"] for d in r.pop("digests"))
                    else:
                        r.pop("digests")
                    doc["star"].setdefault(str(n), []).append(r)
                    log(f"star, {n} receivers, round {rep + 1}: {r['seconds']:.2f} s "
                        f"(put {r['put_seconds']:.2f} s, first done {r['first_done_seconds']:.2f} s)"
                        + (f", verified {r['verified']}" if last else ""))
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
    args.out.mkdir(parents=True, exist_ok=True)
    default = args.rate == "1gbit" and args.nbytes == 512 * MIB
    suffix = "_quick" if args.quick else "" if default else f"_{args.rate}_{args.nbytes // MIB}MiB"
    path = args.out / f"bench_broadcast{suffix}.json"
    path.write_text(json.dumps(doc, indent=1))
    print_table(doc)
    if doc["rows"]:
        plot(doc, path.with_suffix(".png"))
    log(f"done in {time.monotonic() - started:.0f} s; wrote {path} and .png")
    return 1 if doc["errors"] else 0


def env_info(args: argparse.Namespace, ns: list[int], rate_bits: int, nbytes: int, load_start: float, started: float) -> dict:
    import torch

    def ver(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensorferry": ver("tensorferry"),
        "rate": args.rate,
        "rate_bits": rate_bits,
        "nbytes": nbytes,
        "receivers": ns,
        "repeats": args.repeats,
        "warmup": 1,
        "transport": "tcp",
        "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "wall_seconds": round(time.monotonic() - started, 1),
    }


# -- summary, table, plot ------------------------------------------------------------------


def summarize(doc: dict) -> None:
    """One row per N: medians, ratios to N=1, the line-rate limits."""
    env = doc["env"]
    line = env["nbytes"] * 8 / env["rate_bits"]
    rows = []
    star1 = med([r["seconds"] for r in doc["star"]["1"]]) if "1" in doc["star"] else None
    raw1 = med([r["seconds"] for r in doc["raw_star"]["1"]]) if "1" in doc["raw_star"] else None
    for key in sorted(doc["star"], key=int):
        n, rounds = int(key), doc["star"][key]
        s = med([r["seconds"] for r in rounds])
        raw = med([r["seconds"] for r in doc["raw_star"][key]]) if key in doc["raw_star"] else None
        rows.append({
            "receivers": n,
            "seconds": s,
            "seconds_all": [r["seconds"] for r in rounds],
            "put_seconds": med([r["put_seconds"] for r in rounds]),
            "first_done_seconds": med([r["first_done_seconds"] for r in rounds]),
            "vs_one_receiver": s / star1 if star1 else None,
            "line_seconds": line,
            "star_bound_seconds": n * line,
            "vs_star_bound": s / (n * line),
            "aggregate_mbit": n * env["nbytes"] * 8 / s / 1e6,
            "raw_star_seconds": raw,
            "raw_vs_one_receiver": raw / raw1 if raw and raw1 else None,
            "verified": all(r.get("verified", True) for r in rounds) and any("verified" in r for r in rounds),
        })
    doc["rows"] = rows


def print_table(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    env = doc["env"]
    con = Console(width=200)
    con.print(f"[bold]tensorferry broadcast benchmark[/] — {env['date']} — {env['machine']} — "
              f"{env['nbytes'] / MIB:,.0f} MiB over tcp, every link {env['rate']} ({env['rate_bits'] / 1e6:,.0f} Mbit/s) "
              f"both ways; medians of {env['repeats']} after {env['warmup']} warm-up; load {env['loadavg_1min_start_end']}")
    t = Table(title="star: every receiver pulls from the one sender (time from put to the last receiver holding the bytes)")
    for col in ("receivers", "seconds", "vs 1 receiver", "one copy at line rate", "N copies at line rate (bound)",
                "vs bound", "aggregate Mbit/s", "put s", "first done s", "raw TCP star s", "raw vs 1", "verified"):
        t.add_column(col, justify="right")
    for r in doc["rows"]:
        t.add_row(str(r["receivers"]), f"{r['seconds']:.2f}", f"{r['vs_one_receiver']:.2f}x" if r["vs_one_receiver"] else "-",
                  f"{r['line_seconds']:.2f}", f"{r['star_bound_seconds']:.2f}", f"{r['vs_star_bound']:.2f}x",
                  f"{r['aggregate_mbit']:,.0f}", f"{r['put_seconds']:.2f}", f"{r['first_done_seconds']:.2f}",
                  f"{r['raw_star_seconds']:.2f}" if r["raw_star_seconds"] else "-",
                  f"{r['raw_vs_one_receiver']:.2f}x" if r["raw_vs_one_receiver"] else "-",
                  "yes" if r["verified"] else "[red]NO[/]")
    con.print(t)
    for e in doc["errors"]:
        con.print(f"[red]error:[/] {e}")


def plot(doc: dict, path: Path) -> None:
    """Time against receivers: one line per strategy (a dict, so chain and
    tree join star when they exist), the raw TCP star, and the line-rate
    limits (one copy: the ideal of a relay; N copies: the star's bound)."""
    rows = doc["rows"]
    strategies = {"star (tensorferry tcp, today)": {r["receivers"]: r["seconds"] for r in rows}}
    references = {
        "raw TCP star (plain sockets, same links)": {r["receivers"]: r["raw_star_seconds"] for r in rows if r["raw_star_seconds"]},
        "N copies at the line rate (the star's bound)": {r["receivers"]: r["star_bound_seconds"] for r in rows},
        "one copy at the line rate (what a relay approaches)": {r["receivers"]: r["line_seconds"] for r in rows},
    }
    plot_strategies(strategies, references, doc["env"], path)


def plot_strategies(strategies: dict[str, dict[int, float]], references: dict[str, dict[int, float]], env: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.6))
    markers = "osD^v"
    for k, (name, pts) in enumerate(strategies.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], f"{markers[k % len(markers)]}-", lw=2.4, ms=7, label=name)
        for x in xs:
            ax.annotate(f"{pts[x]:.1f} s", (x, pts[x]), textcoords="offset points", xytext=(6, -12), fontsize=8)
    for (name, pts), style in zip(references.items(), ("x--", ":", "-.")):
        if pts:
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], style, color="gray", lw=1.4, label=name)
    ns = sorted({x for pts in strategies.values() for x in pts})
    ax.set_xticks(ns)
    ax.set_xlabel("receivers (each on its own host)")
    ax.set_ylabel("seconds until every receiver holds the object")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8.5, loc="upper left")
    ax.set_title(f"broadcast of {env['nbytes'] / MIB:,.0f} MiB from one sender, every link {env['rate']} both ways\n"
                 f"{env['date']}, {env['machine']}, medians of {env['repeats']}, "
                 f"load {env['loadavg_1min_start_end'][0]}-{env['loadavg_1min_start_end'][1]}", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
