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
    from tensorferry._copy import _native

    assert _native.loop is not None, "tensorferry._memcpy was not built: install with a C compiler (pip install -e .)"
    return _native.loop


@pytest.fixture(params=["c-loop", "python"])
def copies(request, monkeypatch):
    """Which copy loop moves many small runs: the C extension's, or the
    fallback without it (Python loops of memmove, vectored I/O, torch.cat)."""
    from tensorferry._copy import _native

    if request.param == "c-loop":
        request.getfixturevalue("c_loop")
    else:
        monkeypatch.setattr(_native, "loop", None)
    return request.param
