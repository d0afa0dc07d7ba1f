"""What every benchmark records about the software it measured (imported by
the ``bench_*.py`` scripts, which run with this folder on ``sys.path``)."""

from __future__ import annotations

from importlib import metadata


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"absent"``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
