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
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"

import datetime
import gc
import ipaddress
import ssl
import sys
import tempfile
import time
from pathlib import Path

from _common import environment, interleaved, log, med
from _harness import QUICK_NBYTES, finish, out_path, run_in_pair, table, transfer_parser, verified_target
from _pair import POOL_SLACK_NBYTES, Peer, job, verify, views_of

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


def main() -> int:
    ap = transfer_parser(__doc__)
    args = ap.parse_args()
    nbytes = QUICK_NBYTES if args.quick else 1 << 30
    repeats = max(3, args.repeats)
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
