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
