"""The Ray transport's per-process settings, read from ``TENSORFERRY_*`` variables.

Ray creates the transport with no arguments, in processes the user does not
start, so configuration travels as environment variables in a
``runtime_env``. :func:`settings` reads and checks them in one place: the
driver checks what it is about to send (:func:`tensorferry.ray.env_vars`),
and every actor checks what it was given, so a bad value fails with its
variable's name instead of deep inside a transfer.

Imports nothing heavy: ``tensorferry.ray`` stays cheap to import.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping, NamedTuple, TypeVar

from ..errors import ConfigurationError
from ..wire import TRANSPORTS as _TICKET_TRANSPORTS

__all__ = ["Settings", "settings", "TRANSPORTS", "DEFAULT_POOL_NBYTES"]

TRANSPORTS = ("auto", *_TICKET_TRANSPORTS)
# The first pool segment of a source actor. A memfd costs memory only for
# pages that were written, so a generous size is free until used.
DEFAULT_POOL_NBYTES = 1 << 30
DEFAULT_TIMEOUT_SECONDS = 60.0
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

T = TypeVar("T")


class Settings(NamedTuple):
    """Per-process configuration, read from the environment.

    Attributes:
        pool_nbytes: size of a source actor's first pool segment, kept for the
            life of the process (``TENSORFERRY_RAY_POOL_BYTES``, default
            1 GiB; a memfd costs memory only for pages that were written).
            An object that does not fit beside the ones still held gets a
            segment of its own, released once idle.
        pool_max_nbytes: cap on all of a source actor's segments together
            (``TENSORFERRY_RAY_POOL_MAX_BYTES``, default 0: no cap but the
            memory the machine, or the process's cgroup, has available).
        transport: ``auto`` (shm on one node, tcp across nodes), ``shm``,
            ``tcp`` or ``nixl`` (``TENSORFERRY_RAY_TRANSPORT``).
        host: address the tcp server binds and advertises
            (``TENSORFERRY_RAY_HOST``, default 127.0.0.1; set the node's IP
            and a token for multi-host clusters).
        token: shared secret (``TENSORFERRY_TOKEN``).
        zero_copy: same-node receivers get views of the source's pool instead
            of a copy (``TENSORFERRY_RAY_ZERO_COPY=1``); the source keeps the
            blocks until those views are collected.
        timeout_seconds: per-get timeout (``TENSORFERRY_RAY_TIMEOUT``).
        recv_pool_nbytes: a prefaulted receive pool per destination actor
            (``TENSORFERRY_RAY_RECV_POOL_BYTES``, default 0: none). Received
            tensors are then views of it, and their block returns when the
            last view is collected; a get that does not fit uses new memory.
            It saves the page faults of new memory (0.3-0.4 s per GiB here)
            at the price of that much resident memory per actor.
    """

    pool_nbytes: int = DEFAULT_POOL_NBYTES
    transport: str = "auto"
    host: str = "127.0.0.1"
    token: str = ""
    zero_copy: bool = False
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    recv_pool_nbytes: int = 0
    pool_max_nbytes: int = 0


def _read(env: Mapping[str, str], name: str, default: T, parse: Callable[[str], T], want: str) -> T:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return parse(raw.strip())
    except (ValueError, OverflowError):  # a parser's bare ConfigurationError(raw) too
        raise ConfigurationError(
            f"{name}={raw!r} cannot be used: it must be {want}; fix it in the runtime_env's env_vars "
            f"(tensorferry.ray.runtime_env(...) checks them in the driver), or unset it for the default, {default!r}"
        ) from None


def _nbytes(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.replace("_", ""))
        if value < minimum:
            raise ConfigurationError(raw)
        return value

    return parse


def _seconds(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(raw)
    return value


def _flag(raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigurationError(raw)


def _transport(raw: str) -> str:
    if raw not in TRANSPORTS:
        raise ConfigurationError(raw)
    return raw


def _host(raw: str) -> str:
    if not raw:
        raise ConfigurationError(raw)
    return raw


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and check the ``TENSORFERRY_*`` variables of ``env`` (default: this process's).

    Raises:
        ConfigurationError: a variable's value cannot work; the message names
            the variable, its value and what it takes.
    """
    env = os.environ if env is None else env
    d = Settings()
    s = Settings(
        pool_nbytes=_read(env, "TENSORFERRY_RAY_POOL_BYTES", d.pool_nbytes, _nbytes(1), "a whole number of bytes of at least 1"),
        transport=_read(env, "TENSORFERRY_RAY_TRANSPORT", d.transport, _transport, "one of " + ", ".join(TRANSPORTS)),
        host=_read(env, "TENSORFERRY_RAY_HOST", d.host, _host, "an address to bind (e.g. the node's IP)"),
        token=env.get("TENSORFERRY_TOKEN", d.token),
        zero_copy=_read(env, "TENSORFERRY_RAY_ZERO_COPY", d.zero_copy, _flag, "1 or 0 (true/false, yes/no, on/off)"),
        timeout_seconds=_read(env, "TENSORFERRY_RAY_TIMEOUT", d.timeout_seconds, _seconds, "a positive number of seconds"),
        recv_pool_nbytes=_read(env, "TENSORFERRY_RAY_RECV_POOL_BYTES", d.recv_pool_nbytes, _nbytes(0), "a whole number of bytes (0: no receive pool)"),
        pool_max_nbytes=_read(env, "TENSORFERRY_RAY_POOL_MAX_BYTES", d.pool_max_nbytes, _nbytes(0), "a whole number of bytes (0: no cap but the machine's memory)"),
    )
    if s.token:
        # Checked where it is set (the driver's env_vars), not in every actor's
        # first transfer; the transports' import is paid only when one is set.
        from ..transports import resolve_token

        resolve_token(s.token, "TENSORFERRY_TOKEN")
    if s.pool_max_nbytes and s.pool_max_nbytes < s.pool_nbytes:
        raise ConfigurationError(
            f"TENSORFERRY_RAY_POOL_MAX_BYTES={s.pool_max_nbytes} is below TENSORFERRY_RAY_POOL_BYTES={s.pool_nbytes} "
            "(the first segment alone would break the cap); raise the cap, lower the first segment, or set the cap to 0"
        )
    return s
