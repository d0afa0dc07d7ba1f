"""The error hierarchy of tensorferry, and the checks of public arguments
shared by the sender, the receiver and the receive cache (each returns the
value in its working type or raises
[``ConfigurationError``][tensorferry.errors.ConfigurationError] naming the
argument, the value, and what would work).

Every error raised on purpose is a
[``TensorferryError``][tensorferry.errors.TensorferryError]. Each subclass
also inherits the builtin that fits, so ``except MemoryError`` or
``except ValueError`` keep working for callers who do not know tensorferry.
Messages say what happened, give the numbers, and name the fix.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "TensorferryError",
    "PoolExhaustedError",
    "PoolCreationError",
    "LayoutMismatchError",
    "UnsupportedTensorError",
    "PlanStaleError",
    "PlanBusyError",
    "TicketError",
    "TransferError",
    "PeerGoneError",
    "TransferTimeoutError",
    "AuthenticationError",
    "ProtocolError",
    "BackendUnavailableError",
    "ConfigurationError",
    "MonitorError",
    "NoSuchProcess",
    "ZombieProcess",
    "AccessDenied",
]


class TensorferryError(Exception):
    """Base class of every error tensorferry raises on purpose."""


class PoolExhaustedError(TensorferryError, MemoryError):
    """A pool cannot hold what was asked of it; nothing was allocated."""

    def __init__(
        self,
        requested_nbytes: int,
        free_nbytes: int,
        largest_free_nbytes: int,
        capacity_nbytes: int,
        *,
        detail: str = "",
    ) -> None:
        self.requested_nbytes = requested_nbytes
        self.free_nbytes = free_nbytes
        self.largest_free_nbytes = largest_free_nbytes
        self.capacity_nbytes = capacity_nbytes
        self.detail = detail
        parts = [
            f"pool cannot hold {requested_nbytes:,} bytes: "
            f"{free_nbytes:,} of {capacity_nbytes:,} bytes are free, "
            f"the largest free block is {largest_free_nbytes:,} bytes"
        ]
        if detail:
            parts.append(detail)
        parts.append(
            "nothing was allocated; release objects you no longer need "
            "(Packed.release()), or create the pool with a larger capacity_nbytes"
        )
        super().__init__("; ".join(parts))

    def __reduce__(self):
        # Picklable with its fields (Ray ships task errors between processes).
        args = (self.requested_nbytes, self.free_nbytes, self.largest_free_nbytes, self.capacity_nbytes)
        return (_rebuild_pool_exhausted, (type(self), args, self.detail))


def _rebuild_pool_exhausted(cls, args, detail):
    return cls(*args, detail=detail)


class PoolCreationError(TensorferryError, MemoryError):
    """A pool's buffer could not be made: the host or the device refused the memory.

    Carries ``capacity_nbytes`` and ``device``; the message adds what the
    machine has and the fix. The refusal itself (an ``OSError`` of the memfd
    or mapping, a CUDA out-of-memory) is the ``__cause__``.
    """

    def __init__(self, capacity_nbytes: int, device: str, detail: str) -> None:
        self.capacity_nbytes = capacity_nbytes
        self.device = device
        self.detail = detail
        super().__init__(
            f"cannot create a {capacity_nbytes:,}-byte pool on {device}: {detail}; "
            "create the pool with a smaller capacity_nbytes"
        )

    def __reduce__(self):
        return (type(self), (self.capacity_nbytes, self.device, self.detail))


class LayoutMismatchError(TensorferryError, ValueError):
    """Sender and receiver disagree about the layout of a transfer."""


class UnsupportedTensorError(TensorferryError, ValueError):
    """An object holds a leaf tensorferry cannot pack (named in the message)."""


class PlanStaleError(TensorferryError, RuntimeError):
    """A kept plan no longer matches the tensors it was made for (a tensor
    replaced, moved, resized, or a module's parameter reassigned): make a new
    plan. Nothing was sent."""


class PlanBusyError(TensorferryError, RuntimeError):
    """A ``snapshot=False`` put of a plan while receivers still read the
    previous one (its tensors are the bytes they read): wait for
    ``Sender.wait_released`` first."""


class TicketError(TensorferryError, ValueError):
    """Ticket or layout bytes are truncated, corrupted, oversized or hostile."""


class TransferError(TensorferryError, RuntimeError):
    """A transfer between processes failed."""


class PeerGoneError(TransferError, ConnectionError):
    """The other side of a transfer went away (died, closed, unreachable)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A wait of a transfer ran past its timeout."""


class AuthenticationError(TransferError, PermissionError):
    """A peer did not present the shared-secret token."""


class ProtocolError(TransferError):
    """A peer sent bytes that do not follow tensorferry's wire protocol."""


class BackendUnavailableError(TensorferryError, ImportError):
    """An optional backend (nixl, ray, CUDA) is not installed or not usable."""


class ConfigurationError(TensorferryError, ValueError):
    """A setting (argument or ``TENSORFERRY_*`` variable) has a value that cannot work.

    Also raised for an object used after it was closed, as Python's files raise
    ``ValueError`` for I/O on a closed file. The message names the argument or
    variable, its value, and what would work.
    """


class MonitorError(TensorferryError):
    """Base class of the monitor's per-process errors; carries ``pid``."""

    def __init__(self, pid: int, name: str | None = None, msg: str | None = None) -> None:
        self.pid = pid
        self.name = name
        who = f"pid {pid}" + (f" ({name})" if name else "")
        self._msg = msg
        super().__init__(msg or f"{who}: {self._what}")

    def __reduce__(self):
        return (type(self), (self.pid, self.name, self._msg))

    _what = "cannot be sampled"


class NoSuchProcess(MonitorError, ProcessLookupError):
    """The process exited (or never existed) before it could be read."""

    _what = "process no longer exists; it exited between listing and reading"


class ZombieProcess(NoSuchProcess):
    """The process has exited but was not yet reaped; it has no memory."""

    _what = "process is a zombie (exited, not yet reaped by its parent); it holds no memory"


class AccessDenied(MonitorError, PermissionError):
    """The process belongs to another user and the file is not readable."""

    _what = (
        "permission denied; run the monitor as the process's user or as root, "
        "or sample it without exact figures"
    )


# -- argument checks ------------------------------------------------------------------


def positive_seconds(name: str, value: object, *, allow_inf: bool = False) -> float:
    """``value`` as seconds: a real number above 0 (and finite unless ``allow_inf``).

    Args:
        name: how the caller spells the argument, e.g. ``"put(lease_seconds)"``.
        value: what the user passed.
        allow_inf: accept ``float("inf")`` (a wait or lease without end).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(f"{name}={value!r}: expected a number of seconds above 0, for example 60")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0 or (math.isinf(seconds) and not allow_inf):
        limit = "above 0" if allow_inf else "above 0 and finite"
        raise ConfigurationError(f"{name}={value!r}: the seconds must be {limit}, for example 60")
    return seconds


def reader_count(value: object) -> int | None:
    """The ``readers=`` of a put: an int of at least 1, or ``None`` (until discard)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigurationError(
            f"readers={value!r}: pass the number of receivers that will get the object (an int of at least 1), "
            "or None to serve any number of gets until discard(ticket)"
        )
    return int(value)
