"""Fixtures of the host tests: namespace hosts, or a skip that says why not."""

from __future__ import annotations

import pytest
from _hosts import Hosts, available

# Low enough that a few MiB take a fraction of a second on this shared
# 2-core machine, high enough that the timing noise is a few percent.
TEST_RATE = "100mbit"


def pytest_configure(config):
    config.addinivalue_line("markers", "hosts: needs network namespaces (root, iproute2): tests/_hosts.py")


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.timing)], ids=["bytes", "timed"])
def timed(request) -> bool:
    """Whether a test also asserts its time or rate: only under ``-m timing``
    (the default run deselects it); the bytes and counts are checked in both."""
    return request.param


@pytest.fixture(scope="session")
def need_hosts() -> None:
    """Skip, with the reason, where namespace hosts cannot be made."""
    reason = available()
    if reason is not None:
        pytest.skip(f"no namespace hosts here: {reason}")


@pytest.fixture(scope="module")
def hosts(need_hosts) -> Hosts:
    """Three hosts at TEST_RATE, shared by a module's tests (each test ends its own processes)."""
    with Hosts(3, rate=TEST_RATE) as h:
        yield h
