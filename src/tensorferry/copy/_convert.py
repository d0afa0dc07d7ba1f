"""dtype conversions on the copy threads (sender side: a kept plan's ``dtype=``).

float32 into bfloat16 and float16 go through the C loop
(``_memcpy.convert_runs``), bit for bit what torch writes; the rest through
torch's ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _native, _threads
from ._memmove import _STREAM_MIN_NBYTES, _parts
from ._threads import copy_threads, run_parts

__all__ = ["copy_converting", "native_nan_bits"]


def copy_converting(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair of 1-D host tensors of one length
    (a dtype conversion, sender side: a kept plan's ``dtype=``), split into
    equal parts on the copy threads when large.

    float32 into bfloat16 or float16, dense on both sides, goes through
    ``_memcpy.convert_runs`` (a vectorised C loop, streaming stores for
    large outputs, bit for bit what torch writes: see
    :func:`_native_conversions`); the rest through torch's ``copy_``, which
    converts without the GIL too.
    """
    kinds = _native_conversions()
    native: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    rest = []
    for d, src in pairs:
        kind = kinds.get(d.dtype) if src.dtype == torch.float32 else None
        if kind is not None and d.numel() == src.numel() and _dense_host(d) and _dense_host(src):
            if d.numel():
                native.setdefault(kind, []).append((d, src))
        else:
            rest.append((d, src))
    for (kind, nan), group in native.items():
        _convert_native(group, kind, nan)
    if rest:
        _convert_torch(rest)


def _dense_host(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous() and not t.is_neg()


def _convert_native(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], kind: int, nan: int) -> None:
    """float32 pairs converted by ``convert_runs`` (``kind``, ``nan`` from
    :func:`_native_conversions`), in element-equal parts on the copy threads."""
    count = len(pairs)
    dst = np.fromiter((d.data_ptr() for d, _ in pairs), dtype=np.int64, count=count)
    src = np.fromiter((s.data_ptr() for _, s in pairs), dtype=np.int64, count=count)
    nelems = np.fromiter((d.numel() for d, _ in pairs), dtype=np.int64, count=count)
    out_nbytes = 2 * int(nelems.sum())
    stream = out_nbytes >= _STREAM_MIN_NBYTES
    threads = copy_threads() if out_nbytes >= _threads.PARALLEL_MIN_NBYTES else 1
    parts = [(dst, src, nelems)] if threads == 1 else _parts(dst, src, nelems, threads, dst_size=2, src_size=4)
    run_parts(_convert_serial, [(d, s, n, kind, stream, nan) for d, s, n in parts])


def _convert_serial(dst: np.ndarray, src: np.ndarray, nelems: np.ndarray, kind: int, stream: bool, nan: int) -> None:
    _native.loop.convert_runs(dst.ctypes.data, src.ctypes.data, nelems.ctypes.data, int(nelems.size), kind, stream, 0, 0, nan)


def _convert_torch(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    total = sum(d.numel() * d.element_size() for d, _ in pairs)
    threads = copy_threads() if total >= _threads.PARALLEL_MIN_NBYTES else 1
    if threads == 1:
        for d, src in pairs:
            d.copy_(src)
        return
    step = -(-sum(d.numel() for d, _ in pairs) // threads)
    parts = []
    for d, src in pairs:
        for i in range(0, d.numel(), step):
            parts.append((d[i : i + step], src[i : i + step]))
    run_parts(_copy_into, parts)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


# float32 bit patterns of every class a conversion treats apart: NaNs of
# both signs, quiet and signalling, with payloads above and below the 16
# bits bfloat16 keeps; infinities; zeros; float32 denormals; ties that round
# to even down and up; the largest finite values, which round to inf in
# bfloat16 (0x7f7f8000 and up) or float16 (65520 and up, 0x477ff000); float16's
# denormal range and its smallest tie (2**-25).
_PROBE_BITS = (
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA5A5A5, 0xFFFFFFFF, 0x7F80FFFF, 0x7FBF0000,
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00400000,
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF818000,
    0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000,
    0x33800000, 0x33000000, 0x33000001, 0xB3000000, 0x387FC000, 0x38800000, 0x38801000, 0x38803000,
)

# dtype -> (convert_runs kind, bfloat16 NaN bits) where the C loop matches
# torch; None until first use.
_native_kinds: dict[torch.dtype, tuple[int, int]] | None = None


def _native_conversions() -> dict[torch.dtype, tuple[int, int]]:
    """The conversions from float32 that ``convert_runs`` makes exactly as
    torch's ``copy_`` does in this process, learnt once: torch's bfloat16
    NaN (one pattern whatever the payload; 0xffff from its vectorised CPU
    kernels, 0x7fc0 from its scalar one, so it depends on the CPU and on
    ``ATEN_CPU_CAPABILITY``), then every kind checked against torch on
    ``_PROBE_BITS`` and random values, at an unaligned destination, through
    the vector body, head and tail. A kind that differs stays with torch."""
    global _native_kinds
    if _native.loop is None:
        return {}
    if _native_kinds is None:
        rng = np.random.default_rng(0)
        bits = np.concatenate([np.array(_PROBE_BITS, dtype=np.uint32), rng.integers(0, 1 << 32, size=700, dtype=np.uint32)])
        values = torch.from_numpy(bits.view(np.float32))
        nan = int(torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF
        found = {}
        for dtype, kind in ((torch.bfloat16, _native.loop.BFLOAT16), (torch.float16, _native.loop.FLOAT16)):
            want = values.to(dtype)
            got = torch.empty(values.numel() + 1, dtype=dtype)[1:]
            try:
                _convert_serial(*(np.array([x], dtype=np.int64) for x in (got.data_ptr(), values.data_ptr(), values.numel())), kind, True, nan)
            except ValueError:  # float16 on a CPU without F16C
                continue
            if torch.equal(got.view(torch.int16), want.view(torch.int16)):
                found[dtype] = (kind, nan)
        _native_kinds = found
    return _native_kinds


def native_nan_bits(dtype: torch.dtype) -> int | None:
    """The bits torch writes for a NaN converted from float32 to ``dtype``
    here, where the C conversion matches torch for ``dtype`` (else None)."""
    kind = _native_conversions().get(dtype)
    return kind[1] if kind is not None else None
