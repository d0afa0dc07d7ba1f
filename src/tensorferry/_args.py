"""Checks of public arguments shared by the sender and the receiver.

Each returns the value in its working type or raises
:class:`~tensorferry.errors.ConfigurationError` naming the argument, the
value, and what would work.
"""

from __future__ import annotations

import math
import numbers

from .errors import ConfigurationError

__all__ = ["positive_seconds", "reader_count"]


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
