"""The trainer's reading of vLLM 0.32's ``WeightSource`` (no engine needed, but vLLM's CPU build installed).

0.32's sources are iterated whole and declare no placements; a rank's state
comes from ``__iter__`` on one rank and from a ``ModuleSource``'s DTensors on
several. A 0.32 source that is no ``ModuleSource`` cannot say what a rank
holds of a sharded parameter: several ranks are refused, naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from tensorferry.errors import ConfigurationError
from tensorferry.vllm._sources import installed_release, source_state, trainer_base_kwargs


class _Source:
    """A 0.32-style source of the user's own: whole tensors, None for names this rank does not hold."""

    def __init__(self, tensors: dict, held: set) -> None:
        self.tensors, self.held = tensors, held

    def metadata(self) -> list:
        return []

    def __iter__(self):
        for name, t in self.tensors.items():
            yield name, (t if name in self.held else None)


def _vllm_032() -> bool:
    return not installed_release().placements


pytestmark = pytest.mark.skipif(not _vllm_032(), reason="these read vLLM 0.32's API; the installed vLLM is a later release")


def test_the_release_is_read_from_its_classes():
    assert installed_release() == (False, False)
    assert trainer_base_kwargs(3) == {}


def test_one_rank_takes_what_the_source_yields_and_skips_what_it_does_not_hold():
    a, b = torch.ones(3), torch.zeros(2, 2)
    state = source_state(_Source({"a": a, "b": b}, held={"a"}), rank=0, world_size=1)
    assert list(state) == ["a"] and state["a"] is a


def test_several_ranks_with_a_source_of_whole_tensors_are_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match=r"ModuleSource\(model\).*vLLM 0.33 or later"):
        source_state(_Source({"a": torch.ones(3)}, held={"a"}), rank=1, world_size=2)


def test_several_ranks_put_a_plain_module_once():
    from vllm.distributed.weight_transfer import ModuleSource

    model = torch.nn.Linear(4, 3)
    assert sorted(source_state(ModuleSource(model), rank=0, world_size=2)) == ["bias", "weight"]
    assert source_state(ModuleSource(model), rank=1, world_size=2) == {}  # replicated: rank 0 puts it
