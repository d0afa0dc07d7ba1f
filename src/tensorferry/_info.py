"""What ``tensorferry info`` prints: versions and optional backends."""

from __future__ import annotations

import importlib.util
import platform
import sys

from . import __version__

__all__ = ["info_rows", "backend_available"]


def backend_available(name: str) -> bool:
    """True when an optional backend can be imported (without importing it)."""
    if name == "nixl":
        try:
            return importlib.util.find_spec("nixl._api") is not None
        except (ImportError, ValueError):
            return False
    return importlib.util.find_spec(name) is not None


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def info_rows() -> list[tuple[str, str]]:
    rows = [
        ("tensorferry", __version__),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("torch", _version("torch")),
        ("numpy", _version("numpy")),
        ("msgspec", _version("msgspec")),
        ("psutil", _version("psutil")),
        ("prometheus-client", _version("prometheus-client")),
        ("ray", _version("ray")),
        ("nixl", _version("nixl")),
    ]
    cuda = "not available"
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            cuda = f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}"
    rows.append(("cuda", cuda))
    rows.append(("backends", ", ".join(
        name for name, ok in [
            ("pool", True),
            ("shm", sys.platform.startswith("linux")),
            ("tcp", True),
            ("nixl", backend_available("nixl")),
            ("ray", backend_available("ray")),
        ] if ok
    )))
    return rows
