"""Whether vLLM's weight transfer imports here, and the skip that says why not."""

from __future__ import annotations

import pytest


def _missing() -> str | None:
    try:
        import vllm.distributed.weight_transfer  # noqa: F401
        import vllm.model_executor.layers.linear  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure of vLLM's import chain is the reason
        return (
            f"vLLM's weight transfer cannot be imported ({type(exc).__name__}: {exc}); "
            "`make test` installs vllm==0.33.0 with --no-deps (see the Makefile's vllm step)"
        )
    return None


MISSING = _missing()


def skip_without_vllm() -> None:
    """Skip the calling test module, with the reason, where vLLM cannot be imported."""
    if MISSING is not None:
        pytest.skip(MISSING, allow_module_level=True)
