"""``offload_param: {device: cpu}`` on a GPU keeps stage-3 parameter shards in host memory (Note [Host parameter
shards]). On this CPU-only machine the option changes nothing (the parameters already are in host memory), so
the workers give the engine the GPU path's host shards by hand: their copies then run host to host, through
the same protocol (the gathers, the step's one shard at a time, checkpoints, writes inside gathered())."""

from __future__ import annotations

import pytest

import zerocore
import zerocore.engine
from _dist import run_ranks
from _models import build
from test_offload import _train
from test_param_offload import _config, _state
from zerocore._host_params import HostParamShards

pytestmark = pytest.mark.timeout(300)


def _with_host_shards(config: dict) -> dict:
    """``config`` with offload_param cpu, and this process's engines given the GPU path's host shards."""
    config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    zerocore.engine.param_file_for_config = lambda config, device, rank: HostParamShards(pin_memory=True)
    return config


def train_worker(rank: int, world: int, dtype: str, host: bool, optimizer: str | None, path: str) -> dict:
    config = _config(dtype, None)
    if optimizer == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif optimizer == "nvme":
        config["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": path},
                                           sub_group_size=37)
    engine = zerocore.initialize(build("transformer"), _with_host_shards(config) if host else config)
    at_init = engine.memory_report()["bytes"]
    losses = _train(engine, rank, 0, 3)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    with zerocore.gathered(params[:3], modifier_rank=0):  # a write reaches the host shards too
        for p in params[:3]:
            p.data.mul_(0.5)
    losses += _train(engine, rank, 3, 2)
    result = {"losses": losses, "state": _state(engine), "at_init": at_init, "bytes": engine.memory_report()["bytes"],
              "params": {k: v.float().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()},
              "shards": sum(u.buffer.shard_size * u.buffer.shard.element_size() for u in engine.stage3.units)}
    engine.close()
    return result


@pytest.mark.parametrize("dtype,world,optimizer", [("fp32", 1, None), ("bf16", 2, None), ("fp32", 2, "cpu"),
                                                   ("bf16", 2, "nvme")])
def test_parameter_shards_in_host_memory_train_bitwise_like_on_the_device(dtype, world, optimizer, tmp_path):
    expected = run_ranks(train_worker, world, dtype, False, optimizer, str(tmp_path))
    actual = run_ranks(train_worker, world, dtype, True, optimizer, str(tmp_path))
    for rank, (got, want) in enumerate(zip(actual, expected)):
        assert got["losses"] == want["losses"] and got["params"] == want["params"], rank
        assert got["state"] == want["state"], rank
        for report in (got["at_init"], got["bytes"]):  # no shard stays where the parameters are computed
            assert report["params"] == 0 and report["param_offload"] == want["bytes"]["params"] == got["shards"] > 0
        assert want["bytes"]["param_offload"] == 0


def checkpoint_worker(rank: int, world: int, directory: str, save_host: bool, load_host: bool) -> None:
    def config(host: bool) -> dict:
        return _with_host_shards(_config("bf16", None)) if host else _config("bf16", None)

    engine = zerocore.initialize(build("transformer"), config(save_host))
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(directory)
    expected = _train(engine, rank, 2, 2)
    engine.close()
    engine = zerocore.initialize(build("transformer", seed=7), config(load_host))
    engine.load_checkpoint(directory)
    assert _train(engine, rank, 2, 2) == expected
    engine.close()


@pytest.mark.parametrize("save_host,load_host", [(True, False), (False, True)])
def test_checkpoints_resume_bitwise_with_parameter_shards_in_host_memory(save_host, load_host, tmp_path):
    run_ranks(checkpoint_worker, 2, str(tmp_path), save_host, load_host)


def test_the_estimate_plans_host_shards_for_a_gpu(tmp_path):
    """estimate_memory(device="cuda") with offload_param cpu (refused before this was built): the shards
    leave the device for host memory, byte for byte as planned without the offload."""
    config = _config("bf16", None)
    without = zerocore.estimate_memory(build("transformer"), config, 4, device="cuda")
    config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    with_host = zerocore.estimate_memory(build("transformer"), config, 4, device="cuda")
    assert with_host["bytes"]["params"] == 0 and with_host["where"]["param_offload"] == "host"
    assert with_host["bytes"]["param_offload"] == without["bytes"]["params"] > 0
    assert with_host["device_bytes"] == without["device_bytes"] - without["bytes"]["params"]
    on_cpu = zerocore.estimate_memory(build("transformer"), config, 4, device="cpu")  # nothing to move there
    assert on_cpu["bytes"]["param_offload"] == 0 and on_cpu["bytes"]["params"] == without["bytes"]["params"]
