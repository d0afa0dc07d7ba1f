"""``tensorferry.ray.runtime_env``: the transport works from an actor's first
task; settings are checked and bad ones named; foreign metadata is refused
clearly. A cluster of its own, started with the job-level runtime env."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
torch = pytest.importorskip("torch")

import tensorferry.ray as tfr  # noqa: E402
from conftest import shutdown_ray, worker_runtime_env  # noqa: E402
from tensorferry.errors import ConfigurationError, TransferError  # noqa: E402
from tensorferry.ray._settings import Settings, settings  # noqa: E402

import _ray_helpers as H  # noqa: E402

ray.cloudpickle.register_pickle_by_value(H)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

tfr.register()


@pytest.fixture(scope="module")
def hooked_ray():
    """A cluster whose every worker registers tensorferry before its first task."""
    if ray.is_initialized():
        ray.shutdown()
    env = tfr.runtime_env(extra_env_vars=worker_runtime_env()["env_vars"])
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=env)
    try:
        yield ray
    finally:
        shutdown_ray()


@ray.remote(enable_tensor_transport=True)
class Reader:
    def check(self, refs, seed):
        return H.mismatches(ray.get(refs[0]), H.make_nested(seed))


@ray.remote(enable_tensor_transport=True)
class Putter:
    def first(self, reader, seed):
        # This actor's very first task: Ray registers custom transports on a
        # new actor asynchronously, so without the setup hook this put fails
        # with "Invalid tensor transport: TENSORFERRY".
        ref = ray.put(H.make_nested(seed), _tensor_transport="tensorferry")
        return ray.get(reader.check.remote([ref], seed))

    def register_again(self):
        from ray.experimental.rdt import util

        tfr.register()
        tfr.register()
        return tfr.NAME.upper() in util.transport_manager_info

    @ray.method(tensor_transport="tensorferry")
    def ones(self, numel):
        return torch.ones(numel)

    def env(self, name):
        import os

        return os.environ.get(name)


@pytest.fixture(scope="module")
def reader(hooked_ray):
    return Reader.remote()


def test_an_actor_puts_through_tensorferry_in_its_first_task_and_another_reads_it(reader):
    putter = Putter.remote()
    assert ray.get(putter.first.remote(reader, 41)) == []
    # The reader's comparison can fail: another seed differs.
    assert ray.get(reader.check.remote([ray.put(H.make_nested(43), _tensor_transport="tensorferry")], 44)) != []
    # Registering again in a worker that the hook registered changes nothing.
    assert ray.get(putter.register_again.remote()) is True


def test_an_actor_level_runtime_env_registers_and_configures_that_actor(reader):
    env = tfr.runtime_env(pool_nbytes=8 << 20)
    putter = Putter.options(runtime_env=env).remote()
    assert ray.get(putter.first.remote(reader, 45)) == []
    assert ray.get(putter.env.remote("TENSORFERRY_RAY_POOL_BYTES")) == str(8 << 20)
    assert torch.equal(ray.get(putter.ones.remote(4)), torch.ones(4))
    assert ray.get(putter.__ray_call__.remote(H.sender_stats))["capacity_nbytes"] == 8 << 20


def test_a_bad_setting_in_an_actor_fails_its_transfer_naming_the_variable(hooked_ray):
    # Set by hand: runtime_env() would refuse it in the driver.
    bad = Putter.options(runtime_env={"env_vars": {"TENSORFERRY_RAY_POOL_BYTES": "1GiB"}}).remote()
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(bad.ones.remote(4))
    assert isinstance(info.value, ConfigurationError)
    assert "TENSORFERRY_RAY_POOL_BYTES='1GiB'" in str(info.value)
    ray.kill(bad)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("TENSORFERRY_RAY_POOL_BYTES", "1G"),
        ("TENSORFERRY_RAY_POOL_BYTES", "0"),
        ("TENSORFERRY_RAY_POOL_MAX_BYTES", "-1"),
        ("TENSORFERRY_RAY_RECV_POOL_BYTES", "lots"),
        ("TENSORFERRY_RAY_TRANSPORT", "udp"),
        ("TENSORFERRY_RAY_TIMEOUT", "0"),
        ("TENSORFERRY_RAY_TIMEOUT", "nan"),
        ("TENSORFERRY_RAY_ZERO_COPY", "maybe"),
        ("TENSORFERRY_RAY_HOST", ""),
    ],
)
def test_each_bad_value_is_a_configuration_error_naming_variable_and_value(variable, value):
    with pytest.raises(ConfigurationError) as info:
        settings({variable: value})
    assert isinstance(info.value, ValueError)
    assert f"{variable}={value!r}" in str(info.value)


def test_a_cap_below_the_first_segment_is_refused_with_both_numbers():
    with pytest.raises(ConfigurationError) as info:
        tfr.env_vars(pool_nbytes=1 << 20, pool_max_nbytes=1 << 19)
    assert f"TENSORFERRY_RAY_POOL_MAX_BYTES={1 << 19}" in str(info.value) and f"TENSORFERRY_RAY_POOL_BYTES={1 << 20}" in str(info.value)


def test_an_unknown_keyword_is_a_configuration_error_naming_it_and_the_settings():
    with pytest.raises(ConfigurationError) as info:
        tfr.runtime_env(bogus=1, pool_nbytes=1 << 20)
    message = str(info.value)
    assert "'bogus'" in message and "runtime_env()" in message and "env_vars()" not in message
    for name in ("extra_env_vars", "pool_nbytes", "pool_max_nbytes", "transport", "host", "token", "zero_copy",
                 "timeout_seconds", "recv_pool_nbytes"):
        assert name in message


def test_good_values_read_back_and_the_defaults_hold():
    assert settings({}) == Settings()
    env = tfr.env_vars(pool_nbytes=1 << 20, pool_max_nbytes=1 << 30, transport="tcp", host="10.0.0.1", token="t-is-a-token-of-24-bytes",
                       zero_copy=True, timeout_seconds=2.5, recv_pool_nbytes=0)
    assert settings(env) == Settings(pool_nbytes=1 << 20, transport="tcp", host="10.0.0.1", token="t-is-a-token-of-24-bytes", zero_copy=True,
                                     timeout_seconds=2.5, recv_pool_nbytes=0, pool_max_nbytes=1 << 30)
    env = tfr.runtime_env(transport="shm")
    assert env["worker_process_setup_hook"] == "tensorferry.ray.register"
    assert env["env_vars"]["TENSORFERRY_RAY_TRANSPORT"] == "shm"


def test_foreign_metadata_is_a_transfer_error_naming_its_transport():
    from ray.experimental.rdt.nixl_tensor_transport import NixlTransportMetadata
    from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata

    from tensorferry.ray._transport import TensorferryTransport

    meta = NixlTransportMetadata(tensor_meta=[((4,), torch.float32)], tensor_device="cpu")
    with pytest.raises(TransferError) as info:
        TensorferryTransport().recv_multiple_tensors("obj-1", meta, CommunicatorMetadata())
    assert "NixlTransportMetadata, made by Ray's nixl transport" in str(info.value)
    assert "obj-1" in str(info.value)
