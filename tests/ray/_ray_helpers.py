"""Deterministic objects, exact comparisons and in-actor probes for the Ray tests.

Imported by the test modules here and, by name, inside Ray workers (Ray
hands workers the driver's ``sys.path``): every object a test sends can be
regenerated on the receiving side from its seed, and compared there bit for
bit, so only booleans and small reports travel back to the driver.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

import torch

# -- deterministic objects -----------------------------------------------------------


def make_nested(seed: int) -> dict:
    """A dict of lists of tensors, a tuple, a 0-dim and an empty tensor, and
    plain data beside them; eight dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "weights": [
            torch.randn(17, 3, generator=g),
            torch.randint(-1000, 1000, (5,), generator=g, dtype=torch.int64),
            torch.randn(3, 4, generator=g, dtype=torch.float64),
            torch.empty(0, 7),
        ],
        "pair": (
            torch.randn(9, generator=g).to(torch.float16),
            torch.rand(11, generator=g) > 0.5,
        ),
        "scalar": torch.tensor(seed, dtype=torch.int32),
        "deep": {"deeper": [[torch.randn(2, 3, generator=g).to(torch.bfloat16)], torch.randn(4, generator=g, dtype=torch.complex64)]},
        "step": seed,
        "name": f"version-{seed}",
    }


def make_many(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` separate small tensors (1 to 8 elements) of four dtypes."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1 + (i * 7919) % 8 for i in range(n)]
    base = torch.randn(sum(sizes), generator=g)
    dtypes = (torch.float32, torch.int64, torch.float16, torch.uint8)
    out = []
    for i, part in enumerate(base.split(sizes)):
        dtype = dtypes[i % len(dtypes)]
        t = part * 100 if dtype in (torch.int64, torch.uint8) else part
        out.append(t.to(dtype).clone())  # its own storage, not a view of base
    return out


# Views of one 16 MiB storage: 64 contiguous slices spread over it, one
# strided view, one transposed view and one that overlaps a slice.
VIEW_STORAGE_NUMEL = 4 << 20
_VIEW_STRIDE = VIEW_STORAGE_NUMEL // 64


def make_views() -> tuple[torch.Tensor, list[torch.Tensor]]:
    storage = torch.arange(VIEW_STORAGE_NUMEL, dtype=torch.float32)
    views = [storage[i * _VIEW_STRIDE : i * _VIEW_STRIDE + 256] for i in range(64)]
    views.append(storage[::4096][:100])
    views.append(storage[:512].view(16, 32).t())
    views.append(storage[100:356])
    return storage, views


def view_nbytes(views: list[torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in views)


def make_numbered(i: int) -> dict:
    """Object number ``i`` of a batch: its size and its bytes depend on ``i``."""
    g = torch.Generator().manual_seed(1000 + i)
    return {
        "id": torch.tensor(i, dtype=torch.int64),
        "data": torch.randn(100 * (i + 1), generator=g, dtype=torch.float64),
        "mask": torch.arange(i + 7) % 3 == 0,
    }


# -- exact comparison -------------------------------------------------------------------


def mismatches(got: Any, want: Any, path: str = "obj") -> list[str]:
    """Every difference between two nested objects; tensors compared exactly
    (dtype, shape and every element)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: a {type(got).__name__}, not a tensor"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}"]
        return [] if torch.equal(got, want) else [f"{path}: values differ"]
    if type(got) is not type(want):
        return [f"{path}: a {type(got).__name__}, expected a {type(want).__name__}"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{path}: keys {list(got)}, expected {list(want)}"]
        return [m for k in want for m in mismatches(got[k], want[k], f"{path}[{k!r}]")]
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, expected {len(want)}"]
        return [m for i, (a, b) in enumerate(zip(got, want)) for m in mismatches(a, b, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r}, expected {want!r}"]


# -- probes run inside actors through actor.__ray_call__ ------------------------------------


def sender_stats(actor_self: Any) -> dict | None:
    """The actor's Ray transport pool stats, summed over its segments (None
    before its first RDT return)."""
    from tensorferry.ray._transport import _process

    proc = _process()
    return None if proc.segments is None else proc.segments.stats()


def gets_by_transport(actor_self: Any = None) -> dict:
    """How many RDT objects this process received over each transport."""
    from tensorferry.ray._transport import _process

    return dict(_process().gets_by_transport)


def sender_connections(actor_self: Any) -> dict:
    """Receiver connections open to the actor's Ray transport segments, per transport."""
    from tensorferry.ray._transport import _process

    proc = _process()
    if proc.segments is None:
        return {}
    out: dict = {}
    for servers in proc.segments.servers():
        for name, server in servers.items():
            out[name] = out.get(name, 0) + len(server._conns)
    return out


def node_id(actor_self: Any = None) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def wait_until(probe: Callable[[], Any], ok: Callable[[Any], bool], *, seconds: float, every: float = 0.05) -> Any:
    """Poll ``probe`` until ``ok`` holds; return the last value either way."""
    deadline = time.monotonic() + seconds
    value = probe()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(every)
        value = probe()
    return value


def pool_is_empty(stats: dict | None) -> bool:
    return stats is None or (stats["used_nbytes"] == 0 and stats["live_tickets"] == 0)


def state_digest(state: Any) -> str:
    """sha256 over a state dict's (or a module's) names and every tensor's
    bytes, in order: one flipped bit anywhere changes it."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
