"""Argument checks shared by the monitor's configuration records and functions.

A bad value is a :class:`~tensorferry.errors.ConfigurationError` (also a
``ValueError``) whose message names the argument as the caller wrote it, the
value, and what would work.
"""

from __future__ import annotations

__all__ = ["check_number", "check_int"]

import math
from collections.abc import Callable

from ..errors import ConfigurationError


def check_number(where: str, value: object, ok: Callable[[float], bool], need: str) -> float:
    """``value`` if it is a real number (not a bool) for which ``ok`` holds.

    Args:
        where: the argument as the caller wrote it (``AgentConfig(interval_seconds)``).
        value: what was given.
        ok: the range test; NaN fails every comparison, so it is refused too.
        need: what would work, said to the caller (``must be > 0 seconds``).

    Raises:
        ConfigurationError: naming ``where``, ``value`` and ``need``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
        raise ConfigurationError(f"{_name_value(where, value)}: {need}")
    return value


def check_int(where: str, value: object, minimum: int, need: str) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else as :func:`check_number`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{_name_value(where, value)}: {need}")
    return value


def _name_value(where: str, value: object) -> str:
    # "AgentConfig(interval_seconds)" -> "AgentConfig(interval_seconds=0)"
    if where.endswith(")"):
        return f"{where[:-1]}={value!r})"
    return f"{where}={value!r}"
