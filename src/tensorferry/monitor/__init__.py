"""Process memory monitoring that costs the watched processes nothing.

Cheap figures (RSS split into anon/file/shmem, swap, peak, CPU) come from
counters the kernel keeps and are read every tick. Exact figures (USS, PSS)
need a page-table walk that stalls the target;
[``Agent``][tensorferry.monitor.Agent] spends a bounded CPU budget on them
and never walks a process whose walk would stall it too long. Every sample
says where its USS came from and how old it is:
"RSS - shared" is reported as ``anon_bytes``, never as USS.

Imports neither torch nor the transfer stack; prometheus_client and rich
load only when their parts are used.

May import: [``tensorferry.errors``][tensorferry.errors], the standard
library, psutil, prometheus_client and rich; never another layer of the
package (the memory layer registers its pools here, not the reverse).

Example:
    >>> from tensorferry.monitor import Agent, Selection, sample
    >>> sample(os.getpid(), exact=True).uss_bytes        # doctest: +SKIP
    >>> agent = Agent(Selection(pattern=r"ray::"))      # doctest: +SKIP
    >>> agent.start(); serve_prometheus(agent)         # :21464  # doctest: +SKIP
"""

from __future__ import annotations

__all__ = [
    "Agent",
    "AgentConfig",
    "AgentStats",
    "CgroupMemory",
    "ExactMemory",
    "GroupMemory",
    "MonitorCollector",
    "PoolFigures",
    "ProcessMemory",
    "PrometheusServer",
    "Selection",
    "Snapshot",
    "UssSource",
    "build_table",
    "group_samples",
    "register_pool_source",
    "run_top",
    "sample",
    "serve_prometheus",
    "unregister_pool_source",
]

from typing import TYPE_CHECKING, Any

from ._agent import Agent, AgentConfig, AgentStats, Selection, Snapshot
from ._cgroup import CgroupMemory
from ._group import GroupMemory, group_samples
from ._pools import PoolFigures, register_pool_source, unregister_pool_source
from ._sample import sample
from ._types import ExactMemory, ProcessMemory, UssSource

if TYPE_CHECKING:
    from ._prometheus import MonitorCollector
    from ._server import PrometheusServer, serve_prometheus
    from ._top import build_table, run_top

# prometheus_client (the "monitor" extra) and rich load on first use only.
_LAZY = {
    "MonitorCollector": "._prometheus",
    "PrometheusServer": "._server",
    "serve_prometheus": "._server",
    "build_table": "._top",
    "run_top": "._top",
    # the `tensorferry top` / `monitor` verbs of the command line
    "add_subcommands": "._cli",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
