"""Fixtures of the monitor tests: fixture /proc trees and real target processes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from monitor_helpers import FIXTURES, Target


@pytest.fixture
def start_target() -> Iterator:
    started: list[Target] = []

    def start(*args: str) -> Target:
        t = Target(*args)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


@pytest.fixture
def proc_tree(tmp_path: Path) -> Path:
    """A writable copy of the fixture /proc tree."""
    dest = tmp_path / "proc"
    shutil.copytree(FIXTURES / "proc", dest)
    return dest
