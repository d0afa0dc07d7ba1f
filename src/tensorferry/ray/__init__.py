"""tensorferry for Ray: a tensor transport plug-in and weight sync.

Register once in the driver, before any actor class that uses it is
defined::

    import tensorferry.ray
    tensorferry.ray.register()

    @ray.remote(enable_tensor_transport=True)
    class Trainer:
        @ray.method(tensor_transport="tensorferry")
        def weights(self): ...

The receiving actor must be created with ``enable_tensor_transport=True``
too. Configuration (pool size, transport, host, token, zero copy) comes from
``TENSORFERRY_*`` environment variables; pass them to actors with
``runtime_env={"env_vars": tensorferry.ray.env_vars(...)}``.

Needs the ``ray`` extra (``ray==2.60.*``).
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailableError

__all__ = ["register", "env_vars", "NAME", "WeightSync", "SyncReport", "WeightVersion", "publish", "update"]

NAME = "tensorferry"


def _require_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise BackendUnavailableError(
            "tensorferry.ray needs Ray: pip install 'tensorferry[ray]' (ray==2.60.*)"
        ) from exc
    return ray


def register(name: str = NAME) -> None:
    """Register tensorferry as Ray tensor transport ``name`` (idempotent).

    Call it in the driver before defining classes whose methods say
    ``tensor_transport=name``. Registers for CPU, and CUDA where present.
    """
    _require_ray()
    import torch
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util

    from ._transport import TensorferryTransport

    if name.upper() in util.transport_manager_info:
        return
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    register_tensor_transport(name, devices, TensorferryTransport, torch.Tensor)


def env_vars(
    *,
    pool_nbytes: int | None = None,
    transport: str | None = None,
    host: str | None = None,
    token: str | None = None,
    zero_copy: bool | None = None,
    timeout_seconds: float | None = None,
    recv_pool_nbytes: int | None = None,
) -> dict[str, str]:
    """The ``TENSORFERRY_*`` variables for a Ray ``runtime_env``."""
    out: dict[str, str] = {}
    if pool_nbytes is not None:
        out["TENSORFERRY_RAY_POOL_BYTES"] = str(int(pool_nbytes))
    if transport is not None:
        if transport not in ("auto", "shm", "tcp", "nixl"):
            raise ValueError(f"transport must be auto, shm, tcp or nixl, got {transport!r}")
        out["TENSORFERRY_RAY_TRANSPORT"] = transport
    if host is not None:
        out["TENSORFERRY_RAY_HOST"] = host
    if token is not None:
        out["TENSORFERRY_TOKEN"] = token
    if zero_copy is not None:
        out["TENSORFERRY_RAY_ZERO_COPY"] = "1" if zero_copy else "0"
    if timeout_seconds is not None:
        out["TENSORFERRY_RAY_TIMEOUT"] = str(float(timeout_seconds))
    if recv_pool_nbytes is not None:
        out["TENSORFERRY_RAY_RECV_POOL_BYTES"] = str(int(recv_pool_nbytes))
    return out


def __getattr__(name: str) -> Any:
    if name in ("WeightSync", "SyncReport", "WeightVersion", "publish", "update"):
        from . import _weights

        return getattr(_weights, name)
    raise AttributeError(f"module 'tensorferry.ray' has no attribute {name!r}")
