"""tensorferry: move many PyTorch tensors between processes and hosts at memory speed.

Importing the package is cheap and does not import torch: the public names
below are loaded on first use. ``tensorferry.monitor`` works without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AccessDenied,
    AuthenticationError,
    BackendUnavailableError,
    ConfigurationError,
    LayoutMismatchError,
    MonitorError,
    NoSuchProcess,
    PeerGoneError,
    PlanBusyError,
    PlanStaleError,
    PoolCreationError,
    PoolExhaustedError,
    ProtocolError,
    TensorferryError,
    TicketError,
    TransferError,
    TransferTimeoutError,
    UnsupportedTensorError,
    ZombieProcess,
)

__version__ = "0.1.0"

# name -> module that defines it; loaded lazily (they import torch).
_LAZY = {
    "MemoryPool": "tensorferry.memory",
    "Packed": "tensorferry.memory",
    "Block": "tensorferry.memory",
    "PoolStats": "tensorferry.memory",
    "unpack": "tensorferry.memory",
    "Lease": "tensorferry.memory",
    "Layout": "tensorferry.wire",
    "Ticket": "tensorferry.wire",
    "Sender": "tensorferry.sender",
    "Receiver": "tensorferry.receiver",
    "SendPlan": "tensorferry.plans",
    "RecvPlan": "tensorferry.plans",
    "ShardedPlan": "tensorferry.plans",
    "Box": "tensorferry.shards",
    "new_token": "tensorferry.transports",
}

__all__ = [
    "__version__",
    "MemoryPool",
    "Packed",
    "Block",
    "PoolStats",
    "unpack",
    "Lease",
    "Layout",
    "Ticket",
    "Sender",
    "Receiver",
    "SendPlan",
    "RecvPlan",
    "ShardedPlan",
    "Box",
    "new_token",
    "TensorferryError",
    "PoolExhaustedError",
    "PoolCreationError",
    "LayoutMismatchError",
    "UnsupportedTensorError",
    "TicketError",
    "TransferError",
    "PeerGoneError",
    "TransferTimeoutError",
    "AuthenticationError",
    "ProtocolError",
    "BackendUnavailableError",
    "ConfigurationError",
    "PlanStaleError",
    "PlanBusyError",
    "MonitorError",
    "NoSuchProcess",
    "ZombieProcess",
    "AccessDenied",
]

if TYPE_CHECKING:
    from .memory import Block, Lease, MemoryPool, Packed, PoolStats, unpack
    from .plans import RecvPlan, SendPlan, ShardedPlan
    from .receiver import Receiver
    from .sender import Sender
    from .shards import Box
    from .transports import new_token
    from .wire import Layout, Ticket


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorferry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
