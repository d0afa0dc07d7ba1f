"""tensorferry for Ray: a tensor transport plug-in and weight sync.

Register it in every process of the job: in the driver before any actor
class that uses it is defined, and in every worker through the job's
``runtime_env``, so an actor can use it from its very first task:

    import ray, tensorferry.ray
    ray.init(runtime_env=tensorferry.ray.runtime_env())
    tensorferry.ray.register()

    @ray.remote(enable_tensor_transport=True)
    class Trainer:
        @ray.method(tensor_transport="tensorferry")
        def weights(self): ...

The receiving actor must be created with ``enable_tensor_transport=True``
too. Configuration (pool size and cap, transport, host, token, zero copy)
comes from ``TENSORFERRY_*`` environment variables:
``runtime_env(...)`` takes them as arguments, for the whole job or for one
actor (``Actor.options(runtime_env=tensorferry.ray.runtime_env(...))``);
``env_vars(...)`` gives the variables alone.

Needs the ``ray`` extra (``ray==2.60.*``).

An integration layer: may import the user API (``Sender``, ``Receiver``),
plans, transports, memory, tensors, wire and
[``tensorferry.errors``][tensorferry.errors]; nothing in the core imports it.
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailableError

__all__ = [
    "register",
    "runtime_env",
    "env_vars",
    "NAME",
    "WeightSync",
    "SyncReport",
    "WeightVersion",
    "publish",
    "update",
]

if TYPE_CHECKING:  # loaded on first use (__getattr__); named here for type checkers and the API reference
    from ._weight_sync import WeightSync
    from ._weights import SyncReport, WeightVersion, publish, update

NAME = "tensorferry"
# What Ray imports and calls in each new worker process before its first task.
SETUP_HOOK = "tensorferry.ray.register"
# Ray 2.60 turns the job's worker_process_setup_hook into this variable of the
# workers' environment, and runs the hook of any worker that has it; an
# actor-level runtime_env's worker_process_setup_hook field is ignored, so
# runtime_env() sets the variable itself and works at both levels.
_SETUP_HOOK_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"

_REGISTER_LOCK = threading.Lock()


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
    ``tensor_transport=name``; [``runtime_env``][tensorferry.ray.runtime_env]
    has Ray call it in every worker. Registers for CPU, and CUDA where present.
    Calling it again, or after Ray registered the transport on an actor itself,
    changes nothing (Ray's own ``register_tensor_transport`` raises
    ``ValueError`` then).

    Args:
        name: the transport's name, as methods give it in
            ``tensor_transport=`` (default ``"tensorferry"``,
            ``tensorferry.ray.NAME``). Ray keeps names in upper case, so
            ``"tensorferry"`` and ``"TENSORFERRY"`` are one name. If a
            transport of that name is registered in this process already,
            nothing is registered, so a name Ray uses itself (``"nixl"``,
            ``"gloo"``, ``"nccl"``, ``"cuda_ipc"``) does not work. The hook
            [``runtime_env``][tensorferry.ray.runtime_env] installs calls
            ``register()`` with the default name; for another name, call
            ``register(name)`` in every worker (from the job's own setup
            hook).

    Raises:
        BackendUnavailableError: Ray is not installed.
    """
    _require_ray()
    import torch
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt import util

    from ._transport import TensorferryTransport

    with _REGISTER_LOCK:
        if name.upper() in util.transport_manager_info:
            return
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        try:
            register_tensor_transport(name, devices, TensorferryTransport, torch.Tensor)
        except ValueError:
            # Ray's registration task on a new actor runs in a thread of its
            # own and may have registered it between our check and here.
            if name.upper() not in util.transport_manager_info:
                raise


def env_vars(
    *,
    pool_nbytes: int | None = None,
    pool_max_nbytes: int | None = None,
    transport: str | None = None,
    host: str | None = None,
    token: str | None = None,
    zero_copy: bool | None = None,
    timeout_seconds: float | None = None,
    recv_pool_nbytes: int | None = None,
) -> dict[str, str]:
    """The ``TENSORFERRY_*`` variables for a Ray ``runtime_env``, checked here.

    Args:
        pool_nbytes: a source actor's first pool segment
            (``TENSORFERRY_RAY_POOL_BYTES``, default 1 GiB, kept for the
            process's life).
        pool_max_nbytes: cap on all its segments together
            (``TENSORFERRY_RAY_POOL_MAX_BYTES``, default 0: only the machine's
            memory bounds them).
        transport: ``auto``, ``shm``, ``tcp`` or ``nixl`` (``TENSORFERRY_RAY_TRANSPORT``).
        host: the address a source's tcp server binds (``TENSORFERRY_RAY_HOST``).
        token: shared secret (``TENSORFERRY_TOKEN``).
        zero_copy: same-node receivers get views of the source's pool
            (``TENSORFERRY_RAY_ZERO_COPY``).
        timeout_seconds: per-get timeout (``TENSORFERRY_RAY_TIMEOUT``).
        recv_pool_nbytes: a prefaulted receive pool per destination actor
            (``TENSORFERRY_RAY_RECV_POOL_BYTES``).

    Raises:
        ConfigurationError: a value that cannot work (named, with the variable).
    """
    from ._settings import settings

    out: dict[str, str] = {}
    if pool_nbytes is not None:
        out["TENSORFERRY_RAY_POOL_BYTES"] = str(pool_nbytes)
    if pool_max_nbytes is not None:
        out["TENSORFERRY_RAY_POOL_MAX_BYTES"] = str(pool_max_nbytes)
    if transport is not None:
        out["TENSORFERRY_RAY_TRANSPORT"] = str(transport)
    if host is not None:
        out["TENSORFERRY_RAY_HOST"] = str(host)
    if token is not None:
        out["TENSORFERRY_TOKEN"] = token
    if zero_copy is not None:
        out["TENSORFERRY_RAY_ZERO_COPY"] = "1" if zero_copy else "0"
    if timeout_seconds is not None:
        out["TENSORFERRY_RAY_TIMEOUT"] = str(timeout_seconds)
    if recv_pool_nbytes is not None:
        out["TENSORFERRY_RAY_RECV_POOL_BYTES"] = str(recv_pool_nbytes)
    settings(out)  # fail in the driver, not in every actor
    return out


# The keyword arguments of env_vars(), which runtime_env() passes on.
_SETTINGS = tuple(inspect.signature(env_vars).parameters)


def runtime_env(*, extra_env_vars: dict[str, str] | None = None, **settings: Any) -> dict[str, Any]:
    """A Ray ``runtime_env`` that registers tensorferry in every worker and carries its settings.

    Ray runs [``register``][tensorferry.ray.register] in each new worker
    process before its first task, so an actor can return or ``ray.put``
    through tensorferry from its very first task. Use it for the whole job
    (``ray.init(runtime_env=...)``) or for one actor
    (``Actor.options(runtime_env=...)``). A job that has a setup hook of its
    own should call [``register``][tensorferry.ray.register] from that hook and
    pass [``env_vars``][tensorferry.ray.env_vars] instead.

    Args:
        extra_env_vars: more environment variables for the workers, kept as given.
        **settings: the keyword arguments of
            [``env_vars``][tensorferry.ray.env_vars].

    Returns:
        ``{"worker_process_setup_hook": "tensorferry.ray.register", "env_vars": {...}}``.

    Raises:
        ConfigurationError: a setting that cannot work, or a keyword that
            is not one (named, with the ones it takes).
    """
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        from ..errors import ConfigurationError

        raise ConfigurationError(
            f"tensorferry.ray.runtime_env() got {', '.join(map(repr, unknown))}, which "
            f"{'is not a setting' if len(unknown) == 1 else 'are not settings'}; it takes extra_env_vars= "
            f"and the settings {', '.join(_SETTINGS)} (see tensorferry.ray.env_vars)"
        )
    out = {**(extra_env_vars or {}), **env_vars(**settings), _SETUP_HOOK_VAR: SETUP_HOOK}
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": out}


def __getattr__(name: str) -> Any:
    if name == "WeightSync":
        from ._weight_sync import WeightSync

        return WeightSync
    if name in ("SyncReport", "WeightVersion", "publish", "update"):
        from . import _weights

        return getattr(_weights, name)
    raise AttributeError(f"module 'tensorferry.ray' has no attribute {name!r}")
