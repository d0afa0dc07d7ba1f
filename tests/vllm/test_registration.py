"""The plugin entry point, the factories' registrations and the infos, in this process.

Proves: the package's ``vllm.general_plugins`` entry point names
``tensorferry.vllm:register``; vLLM's plugin loader runs it and both of
vLLM's factories then build our engines (twice is harmless); the infos are
JSON-safe, every trainer field but ``rank`` has a default, and bad values
are ``ConfigurationError``s (``ValueError``s too, as vLLM's parse expects).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import metadata

import pytest
import torch

import _vllm_support

_vllm_support.skip_without_vllm()

from vllm.config import VllmConfig  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory  # noqa: E402

import tensorferry.vllm as tv  # noqa: E402
from tensorferry.errors import ConfigurationError, TensorferryError, TransferError  # noqa: E402


def test_entry_point_is_declared_and_registers_both_factories() -> None:
    points = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "tensorferry"]
    assert [ep.value for ep in points] == ["tensorferry.vllm:register"], "reinstall the package: pip install --no-deps -e ."
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's own loader, as in its engine core and workers
    assert WeightTransferEngineFactory._registry["tensorferry"]() is tv.TensorferryWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["tensorferry"]() is tv.TensorferryTrainerWeightTransferEngine
    points[0].load()()  # a second registration (vLLM may load plugins again) changes nothing
    tv.register()
    assert WeightTransferEngineFactory._registry["tensorferry"]() is tv.TensorferryWeightTransferEngine


def test_factory_builds_the_worker_engine_from_the_config() -> None:
    tv.register()
    config = WeightTransferConfig(backend="tensorferry")
    engine = WeightTransferEngineFactory.create_engine(config, VllmConfig(weight_transfer_config=config), torch.device("cpu"), torch.nn.Linear(2, 2))
    assert isinstance(engine, tv.TensorferryWeightTransferEngine)
    assert engine.supports_draft_weight_update
    with pytest.raises(TransferError, match="init_weight_transfer_engine"):
        engine.update_weights({"tickets": ["AAAA"], "round": 1})
    engine.shutdown()


def test_infos_are_json_safe_with_defaults_for_one_host() -> None:
    trainer = tv.TensorferryTrainerInitInfo(rank=0)
    assert trainer.backend == "tensorferry" and trainer.is_sender
    assert json.loads(json.dumps(asdict(trainer)))["transport"] == "shm"
    worker = tv.TensorferryInitInfo()
    assert tv.TensorferryInitInfo(**json.loads(json.dumps(asdict(worker)))) == worker
    update = tv.TensorferryUpdateInfo(tickets=["AAAA"], round=3)
    assert tv.TensorferryUpdateInfo(**json.loads(json.dumps(asdict(update)))) == update


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"transport": "udp"}, "shm, tcp, nixl"),
        ({"dtype": "int8"}, "bfloat16"),
        ({"fanout": 0}, "from 1 up"),
        ({"fanout": 2}, "need no relay"),
        ({"world_size": 2, "delta": True}, "not deltas"),
        ({"rank": 3, "world_size": 2}, "rank < world_size"),
        ({"timeout_seconds": 0}, "above 0"),
    ],
)
def test_trainer_info_refuses_what_cannot_work(kwargs: dict, match: str) -> None:
    kwargs = {"rank": 0, **kwargs}
    with pytest.raises(ConfigurationError, match=match) as err:
        tv.TensorferryTrainerInitInfo(**kwargs)
    assert isinstance(err.value, (TensorferryError, ValueError))


def test_worker_parse_names_unknown_fields_and_bad_tickets() -> None:
    tv.register()
    config = WeightTransferConfig(backend="tensorferry")
    engine = WeightTransferEngineFactory.create_engine(config, VllmConfig(weight_transfer_config=config), torch.device("cpu"), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match=r"unknown fields \['master_port'\]"):
        engine.parse_init_info({"master_port": 1})
    with pytest.raises(ConfigurationError, match="base64 ticket strings"):
        engine.parse_update_info({"tickets": []})
    engine.init_transfer_engine(engine.parse_init_info({}))
    from tensorferry.errors import TicketError

    with pytest.raises(TicketError, match="not base64"):
        engine.update_weights({"tickets": ["not base64!"], "round": 1})
    engine.shutdown()


def test_trainer_init_needs_a_source() -> None:
    tv.register()
    with pytest.raises(ConfigurationError, match="ModuleSource"):
        WeightTransferTrainerFactory.trainer_init(tv.TensorferryTrainerInitInfo(rank=0), client=object(), source=None)


def test_importing_the_package_imports_no_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, tensorferry, tensorferry.vllm; print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_installed_release_is_read_from_its_classes():
    # vLLM 0.33: the trainer engine takes the rank, ParamMeta declares placements
    # (tests/vllm_engine/test_sources.py reads 0.32's, in vLLM's CPU build).
    from tensorferry.vllm._sources import installed_release, trainer_base_kwargs

    assert installed_release() == (True, True)
    assert trainer_base_kwargs(3) == {"rank": 3}
