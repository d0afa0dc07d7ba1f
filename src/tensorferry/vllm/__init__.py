"""tensorferry as a vLLM weight-transfer backend (``backend="tensorferry"``).

This integration layer owns the adapter between vLLM's pluggable weight
transfer (``vllm.distributed.weight_transfer``, vLLM 0.33) and tensorferry's
kept plans: the worker engine
([``TensorferryWeightTransferEngine``][tensorferry.vllm.TensorferryWeightTransferEngine],
receives with a kept ``RecvPlan`` or ``ShardedPlan`` and feeds vLLM's
``model.load_weights``), the trainer engine
([``TensorferryTrainerWeightTransferEngine``][tensorferry.vllm.TensorferryTrainerWeightTransferEngine],
puts a kept ``SendPlan`` per trainer rank and drives vLLM's four-method client
from rank 0), their JSON-safe init and update infos,
[``LLMClient``][tensorferry.vllm.LLMClient] (vLLM's weight-sync client
over an offline ``LLM`` in the trainer's process), and
[``register``][tensorferry.vllm.register], the ``vllm.general_plugins`` entry
point that names both in vLLM's factories.

What it may import: vLLM (only here, and only when one of these names is
used: importing ``tensorferry`` never imports vLLM), torch, and tensorferry's
public names (``tensorferry``, ``tensorferry.errors``, ``tensorferry.plans``,
``tensorferry.shards``). Nothing in tensorferry imports this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "BACKEND",
    "register",
    "TensorferryInitInfo",
    "TensorferryUpdateInfo",
    "TensorferryTrainerInitInfo",
    "TensorferryWeightTransferEngine",
    "TensorferryTrainerWeightTransferEngine",
    "RoundReport",
    "LLMClient",
    "EnginesClient",
]

BACKEND = "tensorferry"
"""The name users select (``WeightTransferConfig(backend=...)``) and the key of both of vLLM's factories."""

if TYPE_CHECKING:  # loaded on first use (__getattr__); named here for type checkers and the API reference
    from ._client import EnginesClient, LLMClient
    from ._infos import TensorferryInitInfo, TensorferryTrainerInitInfo, TensorferryUpdateInfo
    from ._trainer import RoundReport, TensorferryTrainerWeightTransferEngine
    from ._worker import TensorferryWeightTransferEngine

_LAZY = {
    "TensorferryInitInfo": "tensorferry.vllm._infos",
    "TensorferryUpdateInfo": "tensorferry.vllm._infos",
    "TensorferryTrainerInitInfo": "tensorferry.vllm._infos",
    "TensorferryWeightTransferEngine": "tensorferry.vllm._worker",
    "TensorferryTrainerWeightTransferEngine": "tensorferry.vllm._trainer",
    "RoundReport": "tensorferry.vllm._trainer",
    "LLMClient": "tensorferry.vllm._client",
    "EnginesClient": "tensorferry.vllm._client",
}


def register() -> None:
    """Register ``"tensorferry"`` in vLLM's worker and trainer factories.

    The ``vllm.general_plugins`` entry point: vLLM calls it in the engine core
    and in every worker (and a trainer that imports
    [``TensorferryTrainerInitInfo``][tensorferry.vllm.TensorferryTrainerInitInfo]
    gets it too). The classes are registered by module path, so nothing of this
    package beyond this function is imported until vLLM builds an engine. A
    second call changes nothing.

    Raises:
        BackendUnavailableError: vLLM is not installed.
    """
    from ..errors import BackendUnavailableError

    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except ImportError as exc:
        raise BackendUnavailableError(
            f"tensorferry.vllm needs vLLM's weight transfer (vllm>=0.33; `pip install --no-deps vllm==0.33.0`, "
            f"see docs/vllm.md): {exc}"
        ) from exc
    _register_once(WeightTransferEngineFactory, "tensorferry.vllm._worker", "TensorferryWeightTransferEngine")
    _register_once(WeightTransferTrainerFactory, "tensorferry.vllm._trainer", "TensorferryTrainerWeightTransferEngine")


# vLLM's factories this process registered us in (they are class attributes
# of vLLM's, per process as this set is, inherited alike by a fork).
_REGISTERED: set[str] = set()


def _register_once(factory: Any, module: str, class_name: str) -> None:
    # vLLM's register_engine refuses a name it holds (ValueError), and the
    # plugin loader may run more than once a process: a name we registered
    # is fine; one another plugin took is an error.
    if factory.__name__ in _REGISTERED:
        return
    try:
        factory.register_engine(BACKEND, module, class_name)
    except ValueError:
        from ..errors import ConfigurationError

        raise ConfigurationError(
            f"vLLM's {factory.__name__} already holds another engine under {BACKEND!r}; "
            "remove the other registration (another plugin of the same name)"
        ) from None
    _REGISTERED.add(factory.__name__)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorferry.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
