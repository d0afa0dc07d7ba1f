"""TLS benchmark: what ``tls=`` costs a tcp get, against the same get
without it and the raw loopback TCP limit, all in the same run.

One 1 GiB float32 tensor (64 MiB with ``--quick``) from a tcp ``Sender`` in
one worker process to a ``Receiver`` with a prefaulted receive pool in the
other, in two variants that take turns every round (the order rotated, so
drifting load weighs on both): ``plain`` (a token, no TLS) and ``tls`` (the
same token, TLS 1.3 with a certificate made for this run: the tcp control
and data connection encrypted). Time: from the sender's ``put`` to the
receiver's ``get`` returned; one warm-up round, then ``--repeats`` rounds
(median, at least 3). The last round of each variant is verified bit for
bit after its timing. The limit: raw loopback TCP between the same workers
(``sendmsg``/``recvmsg_into``), at the start and the end of the run, pooled.

Ratios: ``tls_vs_plain`` (bytes per second with TLS over without), each
variant against raw TCP. Run: ``.venv/bin/python benchmarks/bench_tls.py``
(``--quick``). Writes ``benchmarks/results/bench_tls.json``.

``--relayed``: the same object broadcast down a chain instead (``put(...,
readers=2, fanout=1)``: the sender, a relaying receiver, its child), each
in a process of its own, the child reading its relay over tcp
(``relay_reads="tcp"``, as on another host), ``plain`` (no TLS anywhere)
and ``tls`` (TLS on both links: the receivers' ``tls=`` and the relay's
``relay_tls=``) taking turns. Time: from the ``put`` to the last of the two
gets returned (the relay passes chunks on while it receives). Every round
checks the child read its relay's stream, the last of each variant is
verified bit for bit in both receivers. Ratio ``relayed_tls_vs_plain``
(bytes per second of the chain with TLS over without). Writes
``bench_tls_relayed.json``.
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"

import datetime
import gc
import ipaddress
import multiprocessing
import ssl
import sys
import tempfile
import time
from pathlib import Path

from _common import environment, interleaved, log, med
from _harness import QUICK_NBYTES, env_end, finish, out_path, run_in_pair, table, transfer_parser, verified_target
from _pair import POOL_SLACK_NBYTES, Peer, job, source, verify, views_of

VARIANTS = ("plain", "tls")
TOKEN = "bench-tls-token-of-at-least-16-bytes"
# What the issue asks: without tls= nothing changes for speed (tcp's own
# targets, bench_transports.py); with it, a figure of what it costs.
TARGET_TLS_REPORTED = "report"


def make_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the ``cryptography``
    package): (certificate, key) PEM files in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return folder / "cert.pem", folder / "key.pem"


@job
def tls_rounds(p: Peer, job: dict) -> dict:
    """Both variants, ``warmup`` + ``repeats`` rounds, alternating."""
    import torch

    from tensorferry import MemoryPool, Receiver, Sender

    cert, key = job["cert"], job["key"]
    cap = p.nbytes + POOL_SLACK_NBYTES
    if p.sends:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
        senders = [Sender("tcp", capacity_nbytes=cap, token=TOKEN, prefault=True, **({"tls": server} if v == "tls" else {}))
                   for v in VARIANTS]
        obj = views_of(p.data, 1)

        def step(i: int, r: int) -> dict:
            p.await_ready()
            if r == job["warmup"] + job["repeats"] - 1:
                senders[i].pool.buffer.zero_()  # stale bytes cannot pass the check
            t0 = time.monotonic()
            ticket = senders[i].put(obj)
            p.send(("ticket", ticket.to_bytes(), t0))
            senders[i].wait_released(ticket, timeout=300)
            return {}
    else:
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_verify_locations(cert)
        pool = MemoryPool(cap, prefault=True)
        receivers = [Receiver("tcp", pool=pool, token=TOKEN, **({"tls": client} if v == "tls" else {})) for v in VARIANTS]
        from tensorferry import Ticket

        def step(i: int, r: int) -> dict:
            gc.collect()
            p.send(("ready",))
            _, tb, t0 = p.recv()
            got = receivers[i].get(Ticket.from_bytes(tb))
            seconds = time.monotonic() - t0
            problem = verify(got, views_of(p.data, 1)) if r == job["warmup"] + job["repeats"] - 1 else None
            del got
            return {"seconds": seconds, "problem": problem}

    try:
        runs = interleaved(len(VARIANTS), job["warmup"], job["repeats"], step)
    finally:
        for end in (senders if p.sends else receivers):
            end.close()
    if p.sends:
        return {}
    return {v: {"seconds": [rec["seconds"] for rec in run["records"]],
                "first_seconds": run["first"]["seconds"],
                "problem": next((rec["problem"] for rec in run["records"] if rec["problem"]), None),
                "verified": not any(rec["problem"] for rec in run["records"])}
            for v, run in zip(VARIANTS, runs)}


def print_rows(con, doc: dict) -> None:
    nbytes, raw = doc["nbytes"], med(doc["limits"]["raw_tcp"]["seconds"])
    rows = []
    for v in VARIANTS:
        s = med(doc["results"][v]["seconds"])
        rows.append([v, f"{s * 1e3:,.1f}", f"{nbytes / s / 1e9:.2f}", f"{raw / s:.2f}x",
                     f"{med(doc['results']['plain']['seconds']) / s:.2f}x", str(len(doc["results"][v]["seconds"])),
                     "yes" if doc["results"][v]["verified"] else f"NO {doc['results'][v]['problem']}"])
    con.print(table(f"tcp get of {nbytes / 2**20:,.0f} MiB, plain and TLS, medians",
                    ["variant", "ms", "GB/s", "vs raw tcp", "bytes/s vs plain", "rounds", "verified"], rows))


# -- a relayed chain: sender -> relay -> child, a process each ----------------------------


def chain_member(role: str, conn, nbytes: int, cert: str, key: str, threads: int) -> None:
    """One process of the chain (``role``: sender, relay or child), told
    by the driver which variant each round runs; answers with its times."""
    import torch

    from tensorferry import Receiver, Sender, Ticket

    torch.set_num_threads(threads)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cert)
    data = source(nbytes)
    if role == "sender":
        ends = {v: Sender("tcp", capacity_nbytes=nbytes + POOL_SLACK_NBYTES, token=TOKEN, prefault=True,
                          **({"tls": server} if v == "tls" else {})) for v in VARIANTS}
    else:
        # Both relay: whichever acquires first pulls from the sender and the
        # other from it (fanout=1), a chain whatever order they come in.
        ends = {v: Receiver("tcp", token=TOKEN, relay=True, relay_reads="tcp", timeout=300.0,
                            **({"tls": client, "relay_tls": server} if v == "tls" else {})) for v in VARIANTS}
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            if role == "sender":
                v, _ = msg
                t0 = time.monotonic()
                ticket = ends[v].put(data, readers=2, fanout=1)
                conn.send((ticket.to_bytes(), t0))
                ends[v].wait_released(ticket, timeout=300)
                conn.send("released")
            else:
                v, tb, check = msg
                gc.collect()
                before = ends[v].stats()["relay_stream_nbytes"]
                got = ends[v].get(Ticket.from_bytes(tb))
                t1 = time.monotonic()
                problem = verify([got], [data]) if check else None
                del got
                conn.send((t1, ends[v].stats()["relay_stream_nbytes"] - before, problem))
    finally:
        for end in ends.values():
            end.close()


def relayed_rounds(nbytes: int, cert: Path, key: Path, warmup: int, repeats: int, threads: int) -> dict:
    """Both variants of the chain, ``warmup`` + ``repeats`` rounds,
    alternating; per variant the chain's seconds and whether it verified."""
    ctx = multiprocessing.get_context("spawn")
    roles = ("sender", "relay", "child")
    pipes, procs = {}, []
    for role in roles:
        here, there = ctx.Pipe()
        proc = ctx.Process(target=chain_member, args=(role, there, nbytes, str(cert), str(key), threads), name=f"bench-tls-{role}")
        proc.start()
        pipes[role] = here
        procs.append(proc)
    try:
        for role in roles:
            if pipes[role].recv() != "ready":
                raise RuntimeError(f"the chain's {role} did not start")

        def step(i: int, r: int) -> dict:
            v, last = VARIANTS[i], r == warmup + repeats - 1
            pipes["sender"].send((v, r))
            tb, t0 = pipes["sender"].recv()
            for role in roles[1:]:
                pipes[role].send((v, tb, last))
            ends = [pipes[role].recv() for role in roles[1:]]
            if pipes["sender"].recv() != "released":
                raise RuntimeError("the sender's ticket was not released")
            streamed = sorted(e[1] for e in ends)
            problem = next((e[2] for e in ends if e[2]), None)
            if streamed != [0, nbytes]:
                problem = problem or f"not a chain: the receivers read {streamed} bytes from a relay, expected [0, {nbytes}]"
            return {"seconds": max(e[0] for e in ends) - t0, "problem": problem}

        runs = interleaved(len(VARIANTS), warmup, repeats, step)
    finally:
        for role in roles:
            pipes[role].send(None)
        for proc in procs:
            proc.join(timeout=60)
            if proc.exitcode is None:
                proc.kill()
    return {v: {"seconds": [rec["seconds"] for rec in run["records"]],
                "problem": next((rec["problem"] for rec in run["records"] if rec["problem"]), None),
                "verified": not any(rec["problem"] for rec in run["records"])}
            for v, run in zip(VARIANTS, runs)}


def print_relayed(con, doc: dict) -> None:
    nbytes, plain = doc["nbytes"], med(doc["results"]["plain"]["seconds"])
    rows = []
    for v in VARIANTS:
        s = med(doc["results"][v]["seconds"])
        rows.append([v, f"{s * 1e3:,.1f}", f"{nbytes / s / 1e9:.2f}", f"{plain / s:.2f}x", f"{s / plain:.2f}x",
                     str(len(doc["results"][v]["seconds"])),
                     "yes" if doc["results"][v]["verified"] else f"NO {doc['results'][v]['problem']}"])
    con.print(table(f"relayed chain (sender -> relay -> child, tcp) of {nbytes / 2**20:,.0f} MiB, plain and TLS, medians",
                    ["variant", "ms", "GB/s", "bytes/s vs plain", "time vs plain", "rounds", "verified"], rows))


def main_relayed(args, nbytes: int, repeats: int) -> int:
    doc: dict = {"nbytes": nbytes, "repeats": repeats, "relayed": True, "limits": {}, "results": {}, "errors": []}
    env, started = environment(tls=ssl.OPENSSL_VERSION), time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_certificate(Path(tmp))
        log(f"relayed chain plain and TLS, {nbytes / 2**20:,.0f} MiB, 1 warm-up + {repeats} rounds")
        doc["results"] = relayed_rounds(nbytes, cert, key, 1, repeats, args.threads)
    doc["env"] = env_end(env, started)
    plain, tls = (med(doc["results"][v]["seconds"]) for v in VARIANTS)
    ratios = {"relayed_tls_vs_plain": plain / tls}
    verified_target(doc, "relayed plain and TLS gets verified (both receivers), a chain every round",
                    [v for v in VARIANTS if not doc["results"][v]["verified"]])
    doc["targets"].append({"target": "relayed chain: TLS bytes/s over plain (reported)", "required": TARGET_TLS_REPORTED,
                           "measured": ratios["relayed_tls_vs_plain"], "unit": "x", "met": None, "note": ssl.OPENSSL_VERSION})
    finish(doc, ratios, out_path(args, "bench_tls_relayed"), nbytes, [print_relayed])
    return 0 if all(doc["results"][v]["verified"] for v in VARIANTS) else 1


def main() -> int:
    ap = transfer_parser(__doc__)
    ap.add_argument("--relayed", action="store_true", help="a chain sender -> relay -> child (3 processes) instead of one get")
    args = ap.parse_args()
    nbytes = QUICK_NBYTES if args.quick else 1 << 30
    repeats = max(3, args.repeats)
    if args.relayed:
        return main_relayed(args, nbytes, repeats)
    doc: dict = {"nbytes": nbytes, "repeats": repeats, "limits": {}, "results": {}, "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = make_certificate(Path(tmp))

        def measure(w) -> None:
            log(f"tcp plain and TLS, {nbytes / 2**20:,.0f} MiB, 1 warm-up + {repeats} rounds")
            _, doc["results"] = w.run({"job": "tls_rounds", "cert": str(cert), "key": str(key), "warmup": 1, "repeats": repeats},
                                      timeout=1800)

        run_in_pair(["bench_tls"], doc, environment(tls=ssl.OPENSSL_VERSION), nbytes, args.threads, measure, limits=("raw_tcp",))
    plain, tls = (med(doc["results"][v]["seconds"]) for v in VARIANTS)
    raw = med(doc["limits"]["raw_tcp"]["seconds"])
    ratios = {"tls_vs_plain": plain / tls, "plain_vs_raw_tcp": raw / plain, "tls_vs_raw_tcp": raw / tls}
    doc["bytes_per_second"] = {"plain": nbytes / plain, "tls": nbytes / tls, "raw_tcp": nbytes / raw}
    verified_target(doc, "plain and TLS gets verified", [v for v in VARIANTS if not doc["results"][v]["verified"]])
    doc["targets"].append({"target": "TLS bytes/s over plain (reported)", "required": TARGET_TLS_REPORTED,
                           "measured": ratios["tls_vs_plain"], "unit": "x", "met": None, "note": ssl.OPENSSL_VERSION})
    finish(doc, ratios, out_path(args, "bench_tls"), nbytes, [print_rows])
    return 0 if all(doc["results"][v]["verified"] for v in VARIANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
