"""A process that used nixl exits with its own status, rdma-core or not.

On a host with rdma-core's user libraries (``libibverbs1`` and its
``ibverbs-providers``, which CI installs), UCX's EFA module used to bring
the system's libnl beside the copy in nixl's wheel, and every process that
had used nixl died at exit with SIGSEGV (status 139) in
``rtnl_tc_unregister``. Each test runs a real put and get over nixl in a
child process and reads its exit status and the libnl-route files it had
mapped; see :mod:`tensorferry.transports._nixl_load` for the cause.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
from _transfer_helpers import require

pytestmark = pytest.mark.nixl

# A child's import of torch and NIXL takes 3-10 s on this shared machine.
_CHILD_TIMEOUT_SECONDS = 180.0

_CHILD = r"""
import json, os, sys, torch
from tensorferry import Receiver, Sender
from tensorferry.transports._nixl_load import libnl_route_copies

x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(48))
with Sender("nixl") as sender, Receiver() as receiver:
    y = receiver.get(sender.put({"x": x, "n": torch.arange(7)}))
    exact = torch.equal(y["x"], x) and torch.equal(y["n"], torch.arange(7))
print(json.dumps({"exact": bool(exact), "libnl_route": libnl_route_copies()}), flush=True)
if sys.argv[1:] == ["--skip-exit"]:
    os._exit(0)  # the control: two libnl copies would crash in _dl_fini; skip the finalizers
"""


def _no_core_dump() -> None:
    # Should a child crash at exit after all (a regression): no core file.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_child(ucx_modules: str | None, *, skip_exit: bool = False) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}  # this process's nixl may have set it
    env["UCX_NET_DEVICES"] = "lo"
    if ucx_modules is not None:
        env["UCX_MODULES"] = ucx_modules
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *(["--skip-exit"] if skip_exit else [])], env=env, capture_output=True, text=True,
        timeout=_CHILD_TIMEOUT_SECONDS, preexec_fn=_no_core_dump,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the child printed no result (status {_status(proc.returncode)}); stderr:\n{proc.stderr[-3000:]}"
    return proc, json.loads(lines[-1])


def _status(returncode: int) -> str:
    return f"{returncode} ({signal.Signals(-returncode).name})" if returncode < 0 else str(returncode)


def test_a_process_that_used_nixl_exits_with_status_0() -> None:
    require("nixl")
    proc, result = _run_child(ucx_modules=None)
    assert result["exact"], "the child's get was not bit-exact"
    assert len(result["libnl_route"]) == 1, f"the child mapped {result['libnl_route']}: nixl's libnl and the system's"
    assert proc.returncode == 0, f"exit status {_status(proc.returncode)} after a verified get; stderr:\n{proc.stderr[-3000:]}"


def test_with_every_ucx_module_allowed_the_second_libnl_is_named_with_the_fix() -> None:
    """The control: where the host has rdma-core, letting every UCX module
    load (what nixl does alone) maps the system's libnl too, which is what
    made the test above fail before the fix; the warning says what to set.
    It leaves with ``os._exit`` after its report, so that it does not crash
    on purpose (which would leave a segfault line in the kernel's log)."""
    require("nixl")
    proc, result = _run_child(ucx_modules="all", skip_exit=True)
    assert result["exact"], "the child's get was not bit-exact"
    if len(result["libnl_route"]) < 2:
        pytest.skip(
            f"no system rdma-core here (libefa.so.1 -> libibverbs.so.1 -> libnl): the child mapped only "
            f"{result['libnl_route']}, so the exit crash cannot arise on this host (CI installs libibverbs1)"
        )
    assert "two copies of libnl-route" in proc.stderr and "UCX_MODULES" in proc.stderr, proc.stderr[-3000:]
