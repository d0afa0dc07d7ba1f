"""``tensorferry._memory``: new host memory (huge pages where they pay) and its settings."""

from __future__ import annotations

import pytest
import torch

from tensorferry import ConfigurationError
from tensorferry.memory import _system as _memory


def _vma_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping that holds ``addr``."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if entry is not None:
                    return entry
                entry = {"range": head} if lo <= addr < hi else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert entry is not None, f"no mapping holds {addr:#x}"
    return entry


def test_new_host_bytes_large_ones_ask_for_huge_pages_and_go_back_when_collected():
    import gc

    small = _memory.new_host_bytes(4096)
    assert small.numel() == 4096 and small.dtype == torch.uint8
    n = 64 << 20
    t = _memory.new_host_bytes(n)
    assert t.numel() == n and t.dtype == torch.uint8 and t.is_contiguous()
    t.fill_(7)
    part = t[n - 10 :]  # a view keeps the mapping alive
    addr = t.data_ptr()
    vma = _vma_of(addr)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read()
    if "[never]" not in mode:
        assert vma.get("THPeligible") == "1", vma
        assert "hg" in vma.get("VmFlags", "").split(), f"MADV_HUGEPAGE was not applied: {vma.get('VmFlags')}"
    del t
    gc.collect()
    assert _vma_of(addr)["range"] == vma["range"], "unmapped while a view was alive"
    assert int(part.sum()) == 70
    del part
    gc.collect()
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]
    assert not any(lo <= addr < hi and (lo, hi) == tuple(int(x, 16) for x in vma["range"].split("-")) for lo, hi in spans), "the mapping outlived its last tensor"


def test_huge_pages_can_be_turned_off_and_a_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TENSORFERRY_HUGE_PAGES", "0")
    t = _memory.new_host_bytes(16 << 20)
    # Plain torch.empty memory: not a mapping of its own starting at the
    # tensor (the heap's flags depend on what ran before, so they are not
    # what is checked).
    lo = int(_vma_of(t.data_ptr())["range"].split("-")[0], 16)
    assert lo != t.data_ptr(), "TENSORFERRY_HUGE_PAGES=0 still made a mapping of its own"
    monkeypatch.setenv("TENSORFERRY_HUGE_PAGES", "yes")
    with pytest.raises(ConfigurationError, match="TENSORFERRY_HUGE_PAGES='yes'"):
        _memory.new_host_bytes(16 << 20)
    assert _memory.new_host_bytes(4096).numel() == 4096  # small ones never ask


def test_a_bad_huge_pages_setting_fails_when_the_receiver_is_made(monkeypatch):
    from tensorferry import Receiver

    monkeypatch.setenv("TENSORFERRY_HUGE_PAGES", "2")
    with pytest.raises(ConfigurationError, match="expected 1"):
        Receiver("shm")
