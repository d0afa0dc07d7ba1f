from __future__ import annotations

import pytest

try:
    import torch
except ImportError:  # the monitor's tests run without torch
    torch = None


def pytest_collection_modifyitems(config, items):
    has_gpu = torch is not None and torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture
def c_loop():
    """tensorferry's C copy loop (``_copy._native.loop``). The install builds it
    (a C compiler is on every machine CI runs on): missing, the tests that
    need it fail rather than skip."""
    from tensorferry.copy import _native

    assert _native.loop is not None, "tensorferry.copy._memcpy was not built: install with a C compiler (pip install -e .)"
    return _native.loop


@pytest.fixture(params=["c-loop", "python"])
def copies(request, monkeypatch):
    """Which copy loop moves many small runs: the C extension's, or the
    fallback without it (Python loops of memmove, vectored I/O, torch.cat)."""
    from tensorferry.copy import _native

    if request.param == "c-loop":
        request.getfixturevalue("c_loop")
    else:
        monkeypatch.setattr(_native, "loop", None)
    return request.param


# -- the transfer fixtures shared by tests/plans and tests/transports ------------------
#
# A test module narrows them by defining its own ``transport`` (a smaller
# parameter list) or ``sender_capacity_nbytes``.


@pytest.fixture(params=("shm", "tcp", "nixl"))
def transport(request) -> str:
    """Each transport in turn; nixl skips only where its package is absent."""
    from _transfer_helpers import require

    require(request.param)
    return request.param


@pytest.fixture
def sender_capacity_nbytes() -> int:
    return 32 << 20


@pytest.fixture
def sender(transport, sender_capacity_nbytes):
    from tensorferry import Sender

    with Sender(transport, capacity_nbytes=sender_capacity_nbytes) as s:
        yield s


@pytest.fixture
def receiver(transport):
    from tensorferry import Receiver

    with Receiver(transport, timeout=20.0) as r:
        yield r
