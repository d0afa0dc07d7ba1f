"""Loading NIXL and its UCX so that a process that used them exits cleanly.

nixl 1.5.1's wheel carries its own UCX and, renamed, the rdma-core and
libnl libraries that UCX's InfiniBand modules need (``libibverbs-1de1263b``,
``libnl-3-47cd035c``, ``libnl-route-3-3ad497a3``), except one: UCX's EFA
module (``ucx/libuct_ib_efa.so``) needs ``libefa.so.1``, which the wheel
lacks. On a host with rdma-core's user libraries (``apt-get install
libibverbs1`` brings ``ibverbs-providers``, which has ``libefa.so.1``; every
InfiniBand or RoCE node has them) UCX loads that module, the system's
``libefa`` brings the system's ``libibverbs.so.1``, and that brings a second
``libnl-3`` and ``libnl-route-3``. The second libnl-route's constructors
register their traffic-control operations through the first copy's
``rtnl_tc_register`` (the symbols have the same names), which refuses them as
duplicates; at exit its destructors unregister operations that were never
listed, and the process dies in ``rtnl_tc_unregister`` from ``_dl_fini``
(SIGSEGV, status 139) after all its work succeeded.

UCX reads ``UCX_MODULES`` (a list of glob patterns, ``^`` denies) once, when
its ``libucs`` loads, which NIXL does when it creates its UCX backend. So
before NIXL is imported, :func:`import_nixl` sets ``UCX_MODULES=^efa``
unless the environment already names the modules: nothing else the wheel's
UCX loads leaves the wheel for the system's rdma-core. The price: UCX's EFA
transport (AWS EFA adapters) is off, and with this wheel it could only be
had with the crash. A user who sets ``UCX_MODULES`` keeps their value.

:func:`libnl_route_copies` lists the libnl-route files mapped in this
process; after the first backend starts, :func:`warn_on_second_libnl` logs
a warning with the fix where there are two (another path out of the wheel,
or UCX loaded before tensorferry could set the variable).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..errors import BackendUnavailableError

__all__ = ["UCX_MODULES", "import_nixl", "libnl_route_copies", "ucx_environment", "warn_on_second_libnl"]

log = logging.getLogger("tensorferry.transports.nixl")

# The UCX modules tensorferry lets load, as UCX_MODULES says it (glob
# patterns, ^: all but). efa: the only module of nixl 1.5.1's UCX that needs
# a library outside the wheel that links the system's libibverbs (see above).
UCX_MODULES = "^efa"

_INSTALL_FIX = (
    "install the nixl extra: `pip install torch==2.13.0` first, then `pip install nixl==1.5.1` "
    "(installing nixl before torch pulls about 3 GB of CUDA packages; 1.5.2 is not installable)"
)

_warned = False


def ucx_environment() -> dict[str, str]:
    """The variables a process must have before it loads the wheel's UCX.

    For processes that load NIXL without tensorferry (Ray's own nixl
    transport, a raw NIXL agent): give them to the process's environment
    (e.g. a Ray ``runtime_env``'s ``env_vars``). This process's own
    ``UCX_MODULES``, where it has one, is passed on instead of ours.
    """
    return {"UCX_MODULES": os.environ.get("UCX_MODULES", UCX_MODULES)}


def import_nixl() -> Any:
    """Import ``nixl._api`` (only it: importing ``nixl_cu12`` too in one process fails),
    after setting ``UCX_MODULES`` in this process where it is unset.

    Raises:
        BackendUnavailableError: NIXL is not installed or cannot be imported.
    """
    if "UCX_MODULES" not in os.environ:
        if _mapped("libucs"):
            log.warning(
                "UCX was loaded in this process before tensorferry could set UCX_MODULES=%s; on a host with rdma-core "
                "(libibverbs1) the process may crash at exit (SIGSEGV in rtnl_tc_unregister): set UCX_MODULES=%s "
                "in the environment before the process starts",
                UCX_MODULES, UCX_MODULES,
            )
        os.environ["UCX_MODULES"] = UCX_MODULES
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except ImportError as exc:
        raise BackendUnavailableError(f"the nixl transport needs NIXL, which cannot be imported ({exc}); {_INSTALL_FIX}") from exc
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL's Python logger writes INFO lines (one per agent and backend)
        # to stdout, which corrupts the tables our CLI prints there.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return _api


def libnl_route_copies() -> list[str]:
    """The distinct libnl-route-3 files mapped in this process (two: it will crash at exit)."""
    return sorted({path for path in _mapped_paths() if os.path.basename(path).startswith("libnl-route-3")})


def warn_on_second_libnl() -> None:
    """Log once per process a warning with the fix where two libnl-route copies are mapped."""
    global _warned
    if _warned:
        return
    _warned = True
    copies = libnl_route_copies()
    if len(copies) > 1:
        log.warning(
            "this process has two copies of libnl-route loaded (%s), nixl's and the system's; it will likely crash at "
            "exit with SIGSEGV in rtnl_tc_unregister. UCX_MODULES is %r; set it to %r before the process starts, or "
            "see docs/transfer.md (nixl on hosts with rdma-core)",
            ", ".join(copies), os.environ.get("UCX_MODULES", "unset"), UCX_MODULES,
        )


def _mapped(stem: str) -> bool:
    return any(os.path.basename(path).startswith(stem) for path in _mapped_paths())


def _mapped_paths() -> set[str]:
    try:
        with open("/proc/self/maps", "rb") as maps:
            lines = maps.read().decode(errors="replace").splitlines()
    except OSError:  # not Linux, or no /proc: nothing to check
        return set()
    # address perms offset dev inode [path]: the path is the sixth field.
    fields = (line.split(None, 5) for line in lines)
    return {f[5] for f in fields if len(f) == 6 and f[5].startswith("/")}
