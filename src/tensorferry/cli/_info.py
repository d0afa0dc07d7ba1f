"""What ``tensorferry info`` prints: versions, optional dependencies, the C
extensions and the backends this machine can run."""

from __future__ import annotations

import importlib.util
import platform
import sys

from .. import __version__
from ..transports import backend_available

__all__ = ["info_rows", "backend_available", "extension_rows", "OPTIONAL"]

# The compiled helpers, by the layer that loads them, and what runs without
# them (all are optional).
_EXTENSIONS = (
    ("copy._memcpy", "the batched copy loop; without it copies of many small tensors take Python loops"),
    ("tensors._ptrs", "the pointer checks; without it data pointers are read one tensor at a time"),
    ("plans._diff", "delta plans' compare and apply; without it a delta plan sends the whole object every put"),
    ("monitor._still", "the monitor's tick over still processes; without it the same loop runs in Python"),
)
OPTIONAL = (
    ("prometheus-client", "monitor's /metrics"),
    ("rich", "top and demo"),
    ("psutil", "monitor off Linux"),
    ("ray", "the Ray plug-in"),
    ("nixl", "the nixl transport"),
    ("matplotlib", "benchmark plots"),
)
"""Optional dependencies ``info`` reports (distribution name, what needs it)."""


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "not installed"


def extension_rows() -> list[tuple[str, str]]:
    """``(module, "built" or "not built: ...")`` per C extension, found without importing it."""
    rows = []
    for module, without in _EXTENSIONS:
        try:
            spec = importlib.util.find_spec(f"tensorferry.{module}")
        except (ImportError, ValueError):
            spec = None
        built = spec is not None and spec.origin is not None and not spec.origin.endswith(".py")
        rows.append((module, "built" if built else f"not built ({without}; reinstall with a C/C++ compiler)"))
    return rows


def info_rows() -> list[tuple[str, str]]:
    rows = [
        ("tensorferry", __version__),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("torch", _version("torch")),
        ("numpy", _version("numpy")),
        ("msgspec", _version("msgspec")),
    ]
    for dist, what in OPTIONAL:
        found = _version(dist)
        rows.append((dist, found if found != "not installed" else f"not installed (needed by {what})"))
    rows.append(("c-extensions", "; ".join(f"{m}: {state}" for m, state in extension_rows())))
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
