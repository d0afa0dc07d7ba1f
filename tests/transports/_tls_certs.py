"""Certificates for the TLS tests, made in the test: a CA, a server
certificate for 127.0.0.1 and a client certificate, with the
``cryptography`` package if installed, else with the ``openssl`` command
line; :func:`make_certs` returns None when neither exists, and
:func:`certs_or_skip` skips the test then, saying so."""

from __future__ import annotations

import datetime
import importlib.util
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import NamedTuple

__all__ = ["Certs", "make_certs", "certs_or_skip", "server_context", "client_context"]


class Certs(NamedTuple):
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _with_cryptography(d: Path) -> Certs:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path: Path) -> None:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("tensorferry test CA")).issuer_name(name("tensorferry test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    (d / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def leaf(cn: str, usage, san) -> tuple[bytes, object]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), key

    cert, key = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    (d / "server.pem").write_bytes(cert)
    write_key(key, d / "server.key")
    cert, key = leaf("tensorferry receiver", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    (d / "client.pem").write_bytes(cert)
    write_key(key, d / "client.key")
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


def _with_openssl(d: Path) -> Certs:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=tensorferry test CA")
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"), ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{who}.ext").write_text(ext + "\n")
        run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
            "-subj", f"/CN={who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{who}.pem", "-days", "1",
            "-extfile", f"{who}.ext")
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key")


def make_certs(d: Path) -> Certs | None:
    if importlib.util.find_spec("cryptography") is not None:
        return _with_cryptography(d)
    if shutil.which("openssl"):
        return _with_openssl(d)
    return None


def certs_or_skip(d: Path) -> Certs:
    """:func:`make_certs`, or the test skipped where neither way exists."""
    import pytest

    made = make_certs(d)
    if made is None:
        pytest.skip("neither the cryptography package nor the openssl command is here to make test certificates")
    return made


def server_context(certs: Certs, *, require_client: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server_cert, certs.server_key)
    if require_client:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(certs.ca)
    return ctx


def client_context(certs: Certs, *, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(certs.ca)
    if with_cert:
        ctx.load_cert_chain(certs.client_cert, certs.client_key)
    return ctx
