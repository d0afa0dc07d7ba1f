"""Where OS errors enter the monitor, they become its own errors (psutil's way)."""

from __future__ import annotations

__all__ = ["translate"]

from ..errors import AccessDenied, NoSuchProcess


def translate(exc: OSError, pid: int, name: str | None = None) -> Exception:
    """The monitor's error for an OSError met reading ``pid``'s files (others unchanged)."""
    if isinstance(exc, PermissionError):
        return AccessDenied(pid, name)
    if isinstance(exc, (FileNotFoundError, ProcessLookupError)):
        return NoSuchProcess(pid, name)
    return exc
