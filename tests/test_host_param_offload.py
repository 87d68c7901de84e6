"""``offload_param: {device: cpu}`` on a GPU keeps stage-3 parameter shards in host memory (Note [Host parameter
shards]). On this CPU-only machine the option changes nothing (the parameters already are in host memory), so
the workers give the engine the GPU path's host shards by hand: their copies then run host to host, through
the same protocol (the gathers, the step's one shard at a time, checkpoints, writes inside gathered())."""

from __future__ import annotations

import pytest
import torch

import zerocore
import zerocore.engine
from _dist import run_ranks
from _models import batch, build, loss_fn
from test_param_offload import _config, _state
from zerocore._host_params import HostParamShards

pytestmark = pytest.mark.timeout(300)


def _train(engine: zerocore.Engine, rank: int, first: int, steps: int, model: str = "transformer") -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = batch(model, torch.Generator().manual_seed(100 * step + rank))
        loss = loss_fn(model, engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _with_host_shards(config: dict) -> dict:
    """``config`` with offload_param cpu, and this process's engines given the GPU path's host shards."""
    config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    zerocore.engine.param_file_for_config = lambda config, device, rank: HostParamShards(pin_memory=True)
    return config


def train_worker(rank: int, world: int, dtype: str, host: bool, optimizer: str | None, path: str,
                 zeropp: dict | None = None, model: str = "transformer") -> dict:
    config = _config(dtype, None)
    config["zero_optimization"].update(zeropp or {})
    if optimizer == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif optimizer == "nvme":
        config["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": path},
                                           sub_group_size=37)
    engine = zerocore.initialize(build(model), _with_host_shards(config) if host else config)
    at_init = engine.memory_report()["bytes"]
    losses = _train(engine, rank, 0, 3, model)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    with zerocore.gathered(params[:3], modifier_rank=0):  # a write reaches the host shards too
        for p in params[:3]:
            p.data.mul_(0.5)
    losses += _train(engine, rank, 3, 2, model)
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


def test_host_shards_under_zeropp_and_with_frozen_parameters_train_bitwise_like_on_the_device(tmp_path):
    """qwZ gathers and hpZ's kept slices over host shards (2 nodes of 2 ranks); a model with a frozen layer,
    a tied weight and an unused layer, whose frozen shards go to host memory too."""
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_node_size": 2}
    cases = [(4, "transformer", zeropp), (2, "odd", None)]
    for world, model, extra in cases:
        expected = run_ranks(train_worker, world, "bf16", False, None, str(tmp_path), extra, model, timeout=240)
        actual = run_ranks(train_worker, world, "bf16", True, None, str(tmp_path), extra, model, timeout=240)
        for rank, (got, want) in enumerate(zip(actual, expected)):
            assert got["losses"] == want["losses"] and got["params"] == want["params"], (model, rank)
            assert got["bytes"]["params"] == 0, model
            shards = want["bytes"]["params"] + want["bytes"]["frozen_params"] - got["bytes"]["frozen_params"]
            assert got["bytes"]["param_offload"] == shards, model
        if model == "odd":
            assert got["bytes"]["frozen_params"] < want["bytes"]["frozen_params"], "frozen shards left too"


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
    assert with_host["pinned_host"] and not without["pinned_host"]  # the doctor's memlock check reads it
    config["zero_optimization"]["offload_param"]["pin_memory"] = False
    assert not zerocore.estimate_memory(build("transformer"), config, 4, device="cuda")["pinned_host"]
    on_cpu = zerocore.estimate_memory(build("transformer"), config, 4, device="cpu")  # nothing to move there
    assert on_cpu["bytes"]["param_offload"] == 0 and on_cpu["bytes"]["params"] == without["bytes"]["params"]


def test_shards_that_cannot_be_pinned_stay_in_pageable_memory_with_a_warning(monkeypatch):
    """A memlock limit below the shards (ulimit -l) makes pinning fail: the shard goes to pageable memory, the
    same values, and a warning names the key and the fix, instead of initialize failing on one rank."""
    shards = HostParamShards(pin_memory=True)
    shards.pin_memory = True  # as on a GPU machine
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    values = torch.arange(10, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"offload_param.pin_memory: pinning 20 more bytes .* `ulimit -l`"):
        offset = shards.place(10, torch.bfloat16)
    monkeypatch.undo()
    shards.write(offset, values)
    out = torch.zeros(10, dtype=torch.bfloat16)
    shards.read(offset, out)
    assert torch.equal(out, values) and not shards.pin_memory and shards.host_bytes == 20
