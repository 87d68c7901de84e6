"""The modules a DeepSpeed script imports beside ``deepspeed.initialize``, under ``import zerocore.deepspeed as
deepspeed``: ``accelerator.get_accelerator``, ``comm``, ``ops.adam`` (FusedAdam, DeepSpeedCPUAdam) and ``utils``
(the safe_get accessors, log_dist, the ZeRO-3 leaf marks, RepeatingLoader). DeepSpeed's CIFAR tutorial, its import
switched, trains at stages 1-3 with the optimizer from the config or built by the script alike, bit for bit."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore
import zerocore.deepspeed as deepspeed
import zerocore.deepspeed.accelerator as accelerator_module
import zerocore.deepspeed.comm as ds_comm
from zerocore.deepspeed.accelerator import get_accelerator
from zerocore.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from zerocore.deepspeed.utils import (RepeatingLoader, get_z3_leaf_modules, log_dist, safe_get_full_fp32_param,
                                      set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module)
from _dist import run_ranks
from _models import ResidualBlock

pytestmark = pytest.mark.timeout(300)

_HYPER = {"lr": 3e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-2}


class Net(nn.Module):
    """The tutorial's network, smaller (8x8 images)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 2)
        self.fc1 = nn.Linear(8 * 2 * 2, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(self.pool(F.relu(self.conv1(x)))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _trainset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(48, 3, 8, 8, generator=g), torch.randint(0, 10, (48,), generator=g))


def tutorial_worker(rank: int, world: int, config_path: str) -> bytes:
    """DeepSpeed's CIFAR tutorial loop, three ways: the config's optimizer, the script's FusedAdam, the script's
    DeepSpeedCPUAdam (DeepSpeed-Chat's choice by offload); returns each way's parameters and the local device."""
    results = {}
    for how in ("config", "fused", "cpu"):
        parser = argparse.ArgumentParser(description="CIFAR")
        parser.add_argument("--local_rank", type=int, default=-1)
        parser = deepspeed.add_config_arguments(parser)
        args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
        deepspeed.init_distributed()  # (the group exists: nothing)
        if ds_comm.get_rank() != 0:  # the tutorial's "rank 0 downloads first"
            ds_comm.barrier()
        trainset = _trainset()
        if ds_comm.get_rank() == 0:
            ds_comm.barrier()
        torch.manual_seed(0)
        net = Net()
        parameters = filter(lambda p: p.requires_grad, net.parameters())
        optimizer = None
        if how != "config":
            kind = FusedAdam if how == "fused" else DeepSpeedCPUAdam
            optimizer = kind(parameters, lr=_HYPER["lr"], betas=tuple(_HYPER["betas"]), eps=_HYPER["eps"],
                             weight_decay=_HYPER["weight_decay"])
        with open(config_path) as f:
            config = json.load(f)
        if how != "config":  # the script's optimizer, so none in the config
            del config["optimizer"]
            args.deepspeed_config = None
        engine, _, trainloader, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters,
                                                         training_data=trainset, optimizer=optimizer,
                                                         config=None if how == "config" else config)
        assert isinstance(engine, deepspeed.DeepSpeedEngine)
        local_device = get_accelerator().device_name(engine.local_rank)
        bf16 = engine.bfloat16_enabled()
        criterion = nn.CrossEntropyLoss()
        losses = []
        for _ in range(2):
            for data in trainloader:
                inputs, labels = data[0].to(local_device), data[1].to(local_device)
                if bf16:
                    inputs = inputs.to(torch.bfloat16)
                loss = criterion(engine(inputs).float(), labels)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        total = torch.tensor([losses[-1]])
        ds_comm.all_reduce(total, prof=False, log_name="loss")  # DeepSpeed's profiling keywords pass
        log_dist(f"loss {total.item() / world:.4f}", ranks=[0])
        with torch.no_grad():  # the tutorial evaluates through the model itself after training
            images = trainset.tensors[0][:4].to(local_device)
            predicted = net(images.to(torch.bfloat16) if bf16 else images).argmax(1)
        results[how] = {"params": {n: safe_get_full_fp32_param(p).clone() for n, p in net.named_parameters()},
                        "losses": losses, "predicted": predicted, "device": local_device,
                        "adamw": [g["adamw_mode"] for g in engine.optimizer.param_groups]}
        engine.close()
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("stage,bf16", [(1, False), (2, True), (3, False), (3, True)])
def test_deepspeeds_cifar_tutorial_trains_alike_with_the_scripts_optimizer(stage, bf16, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_batch_size": 8, "steps_per_print": 2000, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": _HYPER}, "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0}}))
    results = [torch.load(io.BytesIO(r), weights_only=False) for r in run_ranks(tutorial_worker, 2, str(path))]
    for rank, result in enumerate(results):
        config = result["config"]
        assert config["device"] == "cpu" and config["adamw"] == [True]
        half = len(config["losses"]) // 2  # two epochs over the same batches (the sampler's epoch is not moved)
        assert sum(config["losses"][half:]) < sum(config["losses"][:half])
        for how in ("fused", "cpu"):
            assert result[how]["losses"] == config["losses"], how
            assert torch.equal(result[how]["predicted"], config["predicted"]), how
            for name, value in config["params"].items():
                assert torch.equal(result[how]["params"][name], value), (how, name)
    for name, value in results[0]["config"]["params"].items():
        assert torch.equal(results[1]["config"]["params"][name], value), name


# ---- ops.adam as optimizers of their own ---------------------------------------------------------------------------


def _train(optimizer_of, steps: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    optimizer = optimizer_of(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(4, 6, generator=g)), torch.randn(4, 2, generator=g)).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("ours,torchs", [
    (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    (lambda p: FusedAdam(p, 1e-2, True, (0.8, 0.99), 1e-6, False, 0.1),  # DeepSpeed's positional order, L2
     lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    (lambda p: DeepSpeedCPUAdam(p, 1e-2, True, (0.8, 0.99), 1e-6, 0.1, False, True),
     lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    (lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=0.1, adamw_mode=False),
     lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
])
def test_deepspeeds_adam_classes_step_as_torchs_adam(ours, torchs):
    mine, reference = _train(ours), _train(lambda p: _foreach_off(torchs(p)))
    for name, value in reference.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _foreach_off(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        group["foreach"] = False
    return optimizer


def test_fused_adam_without_bias_correction_follows_the_formula():
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.999, 1e-8, 0.05
    mine = _train(lambda p: FusedAdam(p, lr=lr, bias_correction=False, weight_decay=wd), steps=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    g = torch.Generator().manual_seed(1)
    F.mse_loss(model(torch.randn(4, 6, generator=g).double()), torch.randn(4, 2, generator=g).double()).backward()
    for name, p in model.named_parameters():
        m, v = (1 - beta1) * p.grad, (1 - beta2) * p.grad ** 2  # uncorrected moments after one step
        expected = p.detach() * (1 - lr * wd) - lr * m / (v.sqrt() + eps)
        torch.testing.assert_close(mine[name].double(), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_adam_keeps_deepspeeds_attributes_and_refusals():
    model = nn.Linear(3, 2)
    optimizer = FusedAdam(model.parameters(), set_grad_none=False, adam_w_mode=False)
    assert optimizer.adam_w_mode is False and optimizer.param_groups[0]["weight_decay"] == 0.0  # DeepSpeed's default
    model(torch.ones(1, 3)).sum().backward()
    optimizer.zero_grad()
    assert model.weight.grad is not None and not model.weight.grad.any()  # zeroed, not None
    for kind in (FusedAdam, DeepSpeedCPUAdam):
        with pytest.raises(RuntimeError, match="AMSGrad"):
            kind(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="meta"):
        bad = nn.Parameter(torch.empty(2, device="meta"))
        bad.grad = torch.empty(2, device="meta")
        FusedAdam([bad]).step()


@pytest.mark.parametrize("make,adamw", [
    (lambda p: zerocore.optim.CPUAdam(p, lr=1e-3, weight_decay=0.01), True),  # zerocore's own was refused before
    (lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01, adam_w_mode=False), False),
    (lambda p: DeepSpeedCPUAdam(p, lr=1e-3, weight_decay=0.01, bias_correction=False), True),
])
def test_initialize_takes_these_optimizers_with_their_settings(make, adamw):
    model = nn.Linear(4, 3)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=make(model.parameters()),
                                                   config={"train_micro_batch_size_per_gpu": 2})
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["adamw_mode"]) == (1e-3, 0.01, adamw)
    assert group["bias_correction"] == (not isinstance(make(nn.Linear(1, 1).parameters()), DeepSpeedCPUAdam))
    engine.close()


# ---- accelerator, comm, utils ---------------------------------------------------------------------------------------


def test_the_cpu_accelerator(monkeypatch):
    monkeypatch.setattr(accelerator_module, "_ACCELERATOR", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    acc = get_accelerator()
    assert get_accelerator() is acc and deepspeed.get_accelerator() is acc
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name(), acc.device(0)) == \
        ("cpu", "cpu", "cpu", torch.device("cpu"))
    assert (acc.device_count(), acc.current_device(), acc.communication_backend_name()) == (3, 2, "gloo")
    assert acc.is_available() and acc.is_bf16_supported() and acc.on_accelerator(torch.ones(1))
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated() and acc.available_memory() < acc.total_memory()
    acc.manual_seed(7)
    first = torch.rand(3)
    state = acc.get_rng_state()
    second = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), second) and acc.initial_seed() == 7 and not torch.equal(first, second)
    assert acc.Stream is None and acc.current_stream() is None
    with acc.stream(None):
        acc.synchronize()
        acc.empty_cache()


@pytest.mark.parametrize("value,error", [("npu", "'cpu' or 'cuda'"), ("cuda", "no CUDA device")])
def test_an_accelerator_zerocore_cannot_use_is_named(monkeypatch, value, error):
    if value == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    monkeypatch.setattr(accelerator_module, "_ACCELERATOR", None)
    monkeypatch.setenv("DS_ACCELERATOR", value)
    with pytest.raises((ValueError, RuntimeError), match=error):
        get_accelerator()


def test_comm_local_rank_and_log_dist_by_deepspeeds_rule(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ds_comm.get_local_rank() == 1 and ds_comm.has_all_gather_into_tensor()
    with caplog.at_level(logging.INFO, logger="zerocore.deepspeed"):
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
        log_dist("alone", ranks=[3])  # no group: logged whatever the ranks
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
        for ranks in (None, [0], [0, 1], [-1]):
            log_dist(f"ranks {ranks}", ranks=ranks)
    assert [r.getMessage() for r in caplog.records] == ["[Rank -1] alone", "[Rank 1] ranks [0, 1]", "[Rank 1] ranks [-1]"]


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ResidualBlock() for _ in range(3)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return h


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.encoder, self.out = nn.Linear(4, 8), Encoder(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(self.inp(x)))


def leaf_worker(rank: int, world: int, leaves: list) -> bytes:
    torch.manual_seed(0)
    model = Model()
    if leaves:
        assert set_z3_leaf_modules(model, leaves)
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    units = [unit.name for unit in engine.stage3.units]
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.backward(F.mse_loss(engine(torch.randn(4, 4, generator=g)), torch.randn(4, 2, generator=g)))
        engine.step()
    with pytest.raises(ValueError, match="before initialize"):
        set_z3_leaf_modules(model, [ResidualBlock])
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    buffer = io.BytesIO()
    torch.save({"units": units, "state": state}, buffer)
    return buffer.getvalue()


def test_a_leaf_is_gathered_whole_and_trains_as_before():
    def run(leaves: list) -> dict:
        return torch.load(io.BytesIO(run_ranks(leaf_worker, 2, leaves)[0]), weights_only=False)

    default, encoder, blocks = run([]), run([Encoder]), run(["ResidualBlock"])
    assert default["units"] == ["<root>", "encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]
    assert encoder["units"] == ["<root>", "encoder"]  # the leaf in place of the units inside it
    assert blocks["units"] == default["units"]  # leaves that are units already
    for name, value in default["state"].items():
        assert torch.equal(encoder["state"][name], value), name
        assert torch.equal(blocks["state"][name], value), name


def test_leaf_marks_by_class_name_and_refusals():
    model = Model()
    qualified = f"{ResidualBlock.__module__}.{ResidualBlock.__qualname__}"
    assert len(set_z3_leaf_modules(model, [qualified])) == 3 and all(z3_leaf_module(b) for b in model.encoder.layers)
    assert get_z3_leaf_modules(model) == list(model.encoder.layers)
    assert len(unset_z3_leaf_modules(model, [ResidualBlock])) == 3 and not get_z3_leaf_modules(model)
    with pytest.raises(ValueError, match="no module of"):
        set_z3_leaf_modules(model, [nn.GRU])
    assert set_z3_leaf_modules(model, [nn.GRU], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(model, [3])
    set_z3_leaf_modules(model, [Encoder])
    with pytest.raises(ValueError, match="inside 'encoder'"):  # units that contradict the mark
        zerocore.initialize(model, {"zero_optimization": {"stage": 3}}, units=[ResidualBlock])


def test_repeating_loader_starts_again():
    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def test_deepspeeds_own_leaf_marks_are_read():
    """A model marked by DeepSpeed's own set_z3_leaf_modules (with DeepSpeed installed; `.venv-ds` here, skipped in
    CI) is gathered as zerocore's marks gather it."""
    ds_utils = pytest.importorskip("deepspeed.utils")
    model = Model()
    ds_utils.set_z3_leaf_modules(model, [Encoder])
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3}})
    assert [unit.name for unit in engine.stage3.units] == ["<root>", "encoder"]
    engine.close()



def checkpointing_worker(rank: int, world: int, how: str) -> bytes:
    """A stage-3 model whose blocks run under deepspeed.checkpointing.checkpoint, against the same without it, with a
    warmup built from deepspeed.runtime.lr_schedules on the script's optimizer."""
    from zerocore.deepspeed import checkpointing
    from zerocore.deepspeed.runtime.lr_schedules import WarmupLR

    torch.manual_seed(0)
    model = Model()
    if how == "checkpointed":
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=3, synchronize=True)
        assert checkpointing.is_configured()

        def checkpointed(h: torch.Tensor) -> torch.Tensor:
            for layer in model.encoder.layers:
                h = checkpointing.checkpoint(layer, h)
            return h

        model.encoder.forward = checkpointed
    calls = []
    model.encoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    optimizer = FusedAdam(model.parameters(), lr=1e-2)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=3)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    g = torch.Generator().manual_seed(rank)
    lrs = []
    for _ in range(3):
        engine.backward(F.mse_loss(engine(torch.randn(4, 4, generator=g)), torch.randn(4, 2, generator=g)))
        engine.step()
        lrs.append(engine.get_lr()[0])
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    buffer = io.BytesIO()
    torch.save({"state": state, "lrs": lrs, "calls": len(calls)}, buffer)
    return buffer.getvalue()


def test_checkpointing_and_lr_schedules_modules(tmp_path):
    plain, checkpointed = (torch.load(io.BytesIO(run_ranks(checkpointing_worker, 2, how)[0]), weights_only=False)
                           for how in ("plain", "checkpointed"))
    assert (plain["calls"], checkpointed["calls"]) == (3, 6)  # each checkpointed forward run again in the backward
    assert plain["lrs"] == checkpointed["lrs"] and plain["lrs"][0] < plain["lrs"][-1]  # the warmup moved the engine's
    for name, value in plain["state"].items():
        assert torch.equal(checkpointed["state"][name], value), name
    from zerocore.deepspeed import checkpointing

    for kwargs, error in (({"mpu_": object()}, "model parallelism"), ({"checkpoint_in_cpu": True}, "checkpoint_in_cpu"),
                          ({"deepspeed_config": {"activation_checkpointing": {"cpu_checkpointing": True}}},
                           "cpu_checkpointing")):
        with pytest.raises(ValueError, match=error):
            checkpointing.configure(**kwargs)
    # over one model-parallel rank partitioning activations changes nothing (as in DeepSpeed without an mpu_), and
    # an explicit argument overrides the config's section, as DeepSpeed's configure has it
    checkpointing.configure(None, partition_activations=True)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                            checkpoint_in_cpu=False)
    section = {"partition_activations": True, "contiguous_memory_optimization": True}
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
    path = tmp_path / "ds.json"  # as Megatron-DeepSpeed passes it: the config's path
    path.write_text(json.dumps({"activation_checkpointing": {"cpu_checkpointing": True}}))
    with pytest.raises(ValueError, match="cpu_checkpointing"):
        checkpointing.configure(None, deepspeed_config=str(path))


def test_checkpoint_passes_keyword_arguments_to_the_function_as_deepspeeds_does():
    """DeepSpeed's checkpoint(function, *args, **kwargs) calls function(*args, **kwargs) (a Hugging Face layer's
    attention_mask=): a keyword tensor gets its gradient, and a keyword named like torch's checkpoint options
    reaches the function."""
    from zerocore.deepspeed import checkpointing

    layer = torch.nn.Linear(4, 4)
    x, mask = torch.randn(3, 4, requires_grad=True), torch.rand(3, 4, requires_grad=True)

    def function(h, mask, debug=False):
        assert debug == "mine"
        return torch.tanh(layer(h)) * mask

    grads = []
    for run in (lambda: function(x, mask=mask, debug="mine"),
                lambda: checkpointing.checkpoint(function, x, mask=mask, debug="mine")):
        x.grad = mask.grad = None
        run().square().sum().backward()
        grads.append((x.grad.clone(), mask.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class Switchable(Model):
    """A model with Hugging Face's gradient_checkpointing_enable(): its encoder's blocks rerun in the backward."""

    def gradient_checkpointing_enable(self) -> None:
        from zerocore.deepspeed import checkpointing

        def checkpointed(h: torch.Tensor) -> torch.Tensor:
            for layer in self.encoder.layers:
                h = checkpointing.checkpoint(layer, h)
            return h

        self.encoder.forward = checkpointed


def passthrough_worker(rank: int, world: int, enable: bool) -> bytes:
    """DeepSpeed-Chat's order: initialize, then engine.gradient_checkpointing_enable() (the engine passes what it
    does not have to its module, as DeepSpeed's does)."""
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Switchable(), model_parameters=None, config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    calls = []
    engine.encoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))  # (an attribute of the module)
    if enable:
        engine.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(torch.randn(4, 4, generator=g)), torch.randn(4, 2, generator=g)))
        engine.step()
    refusals = []
    for name in ("to", "half", "apply", "load_state_dict"):
        with pytest.raises(AttributeError, match=f"engine.{name} is not passed to the module") as info:
            getattr(engine, name)
        refusals.append(str(info.value))
    with pytest.raises(AttributeError, match="nor has its module"):
        engine.no_such_attribute
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    buffer = io.BytesIO()
    torch.save({"state": state, "calls": len(calls), "refusals": refusals}, buffer)
    return buffer.getvalue()


def test_the_engine_passes_other_attributes_to_its_module_as_deepspeeds_does():
    plain, enabled = (torch.load(io.BytesIO(run_ranks(passthrough_worker, 2, enable)[0]), weights_only=False)
                      for enable in (False, True))
    assert (plain["calls"], enabled["calls"]) == (2, 4)  # enabled through the engine: each block ran again
    for name, value in plain["state"].items():
        assert torch.equal(enabled["state"][name], value), name
    assert "bf16/fp16" in enabled["refusals"][0] and "gathered" in enabled["refusals"][2]


def save_like_deepspeed_chat(model: nn.Module, zero: object, rank: int) -> dict[str, torch.Tensor]:
    """DeepSpeed-Chat's way of saving a ZeRO-3 model, written out here: a parameter with ``ds_id`` whose status is
    NOT_AVAILABLE is gathered alone and read through ``.data``; any other is read directly."""
    status = zero.partition_parameters.ZeroParamStatus
    saved = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id"):
            fetch = [param] if param.ds_status == status.NOT_AVAILABLE else []
            with zero.GatheredParameters(fetch, enabled=bool(fetch)):
                assert param.ds_status == status.AVAILABLE
                value = param.data.cpu().clone()
        else:
            value = param.cpu().clone()
        if rank == 0:
            saved[name] = value
    return saved


def chat_worker(rank: int, world: int, which: str, dtype: str) -> bytes:
    """DeepSpeed-Chat's step-1 loop on a tiny Llama: the script's FusedAdam over decay / no-decay groups, a Hugging
    Face cosine schedule built on it, gradient accumulation and clipping, gradient_checkpointing_enable() called on
    the engine; on DeepSpeed itself (``which="deepspeed"``) or on zerocore.deepspeed."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import importlib

    import transformers

    ds = importlib.import_module("deepspeed" if which == "deepspeed" else "zerocore.deepspeed")
    adam = importlib.import_module(ds.__name__ + ".ops.adam")
    utils = importlib.import_module(ds.__name__ + ".utils")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64))
    plain = ("norm.weight", "layernorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(plain)], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if n.endswith(plain)], "weight_decay": 0.0}]
    optimizer = adam.FusedAdam(groups, lr=5e-3, betas=(0.9, 0.95))
    scheduler = transformers.get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=2, num_training_steps=8)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "steps_per_print": 10**9, "bf16": {"enabled": dtype == "bf16"}, "zero_optimization": {"stage": 3}}
    engine, _, _, _ = ds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    engine.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(8):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
        engine.step()
    params = {n: utils.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    saved = save_like_deepspeed_chat(engine.module, ds.zero, rank)
    buffer = io.BytesIO()
    torch.save({"params": params, "lr": engine.get_lr(), "saved": saved}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype,tolerance", [("fp32", 1e-6), ("bf16", 1e-2)])
def test_a_deepspeed_chat_loop_lands_on_deepspeeds_weights(dtype, tolerance):
    """With DeepSpeed and transformers installed (`.venv-ds` here; skipped in CI): the same loop on DeepSpeed 0.19.8
    and on zerocore.deepspeed ends at the same weights (fp32: rounding; bf16: DeepSpeed reduces bf16 gradients in
    bf16) and the same lr after 4 optimizer steps."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    theirs, ours = (torch.load(io.BytesIO(run_ranks(chat_worker, 2, which, dtype, timeout=600)[0]), weights_only=False)
                    for which in ("deepspeed", "zerocore"))
    assert ours["lr"] == theirs["lr"]
    for name, value in theirs["params"].items():
        assert float((ours["params"][name] - value).norm() / value.norm()) < tolerance, name
    assert sorted(ours["saved"]) == sorted(theirs["saved"])  # DeepSpeed-Chat's ZeRO-3 save (ds_id, ds_status)
    for name, value in theirs["saved"].items():
        assert ours["saved"][name].dtype == value.dtype, name
        assert float((ours["saved"][name] - value).float().norm() / value.float().norm()) < tolerance, name


def test_an_engine_property_that_fails_is_not_answered_by_the_module():
    """An AttributeError inside one of the engine's own properties must surface, not make Python fall back to
    __getattr__ and hand out the module's attribute of the same name."""
    model = Model()
    model.loss_scale = 123.0  # the module's own attribute named as the engine's property
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 2}})
    assert engine.loss_scale == 1.0
    scaler = engine.loss_scaler
    del engine.loss_scaler
    with pytest.raises(AttributeError, match="loss_scaler"):
        engine.loss_scale
    engine.loss_scaler = scaler
    engine.close()


def test_register_external_parameter_is_accepted_and_checked():
    """zerocore gathers a parameter used outside its module by itself (Note [External parameters]), so DeepSpeed's
    registration only has its arguments checked."""
    model = Model()
    deepspeed.zero.register_external_parameter(model.out, model.inp.weight)
    deepspeed.zero.unregister_external_parameter(model.out, model.inp.weight)
    with pytest.raises(TypeError, match="must be an nn.Parameter"):
        deepspeed.zero.register_external_parameter(model.out, model.inp.weight.detach())
    with pytest.raises(TypeError, match="must be an nn.Module"):
        deepspeed.zero.register_external_parameter("out", model.inp.weight)


def ds_attributes_worker(rank: int, world: int, stage: int) -> bytes:
    torch.manual_seed(0)
    model = Model()
    model.encoder.layers[1].requires_grad_(False)  # frozen parameters are sharded at stage 3 too
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(torch.randn(4, 4, generator=g)), torch.randn(4, 2, generator=g)))
        engine.step()
    attributes = {name: {key: getattr(p, key) for key in ("ds_id", "ds_numel", "ds_shape", "ds_status")
                         if hasattr(p, key)} for name, p in model.named_parameters()}
    saved = save_like_deepspeed_chat(model, deepspeed.zero, rank)
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    left = [name for name, p in model.named_parameters() if any(k.startswith("ds_") for k in vars(p))]
    buffer = io.BytesIO()
    torch.save({"attributes": attributes, "saved": saved, "state": state, "left": left}, buffer)
    return buffer.getvalue()


def test_stage3_parameters_carry_deepspeeds_attributes_and_deepspeed_chats_save_works():
    """Scripts written for DeepSpeed find the parameters to gather by ``ds_id`` and ``ds_status`` (Note
    [DeepSpeed's parameter attributes]): at stage 3 every sharded parameter, frozen ones too, has them, the same on
    every rank; DeepSpeed-Chat's save then gives the engine's full state dict. Stages 1-2 set none (as DeepSpeed),
    so the same script reads the whole parameters directly; close() takes them off."""
    status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
    assert status is deepspeed.zero.ZeroParamStatus
    from zerocore.deepspeed.zero import GatheredParameters  # the module path earlier versions had
    assert GatheredParameters is deepspeed.runtime.zero.GatheredParameters
    assert [s.value for s in status] == [1, 2, 3]  # DeepSpeed's values
    for stage in (2, 3):
        runs = [torch.load(io.BytesIO(out), weights_only=False) for out in run_ranks(ds_attributes_worker, 2, stage)]
        first = runs[0]
        names = list(first["state"])
        for name, value in first["saved"].items():
            assert torch.equal(value, first["state"][name]), (stage, name)
        assert sorted(first["saved"]) == sorted(n for n, _ in Model().named_parameters())
        assert first["left"] == [] and runs[1]["attributes"] == first["attributes"]
        if stage == 2:
            assert all(not attrs for attrs in first["attributes"].values())
            continue
        shapes = {name: value.shape for name, value in first["state"].items()}
        ids = [first["attributes"][name]["ds_id"] for name in first["attributes"]]
        assert ids == sorted(set(ids))  # unique, in the model's order
        for name, attrs in first["attributes"].items():
            assert attrs["ds_shape"] == shapes[name] and attrs["ds_numel"] == shapes[name].numel(), name
            # after a step: the blocks sharded, the root's gather for the next forward in flight (Note [Gathers
            # started in the step]); inside the save's block the parameter is AVAILABLE (save_like_deepspeed_chat)
            assert attrs["ds_status"] is status.NOT_AVAILABLE, name
        assert len(names) == len(ids)


def generation_worker(rank: int, world: int) -> bytes:
    torch.manual_seed(0)
    model = Model()
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    engine.backward(F.mse_loss(engine(x), torch.zeros(4, 2)))
    engine.step()
    engine.eval()
    with torch.no_grad():
        expected = engine(x)
        engine.reset_comm_stats()
        with deepspeed.zero.unwrap_model_for_generation(engine) as unwrapped:
            assert unwrapped is engine
            outputs = [unwrapped(x) for _ in range(5)]  # a decode loop's forwards
        held = engine.comm_report()["collectives"]
    status = deepspeed.zero.ZeroParamStatus
    assert all(p.ds_status is status.NOT_AVAILABLE for p in model.encoder.parameters())  # released on exit
    engine.close()
    return {"equal": all(torch.equal(out, expected) for out in outputs),
            "forward_gathers": held.get("all_gather_forward", {}).get("calls", 0),
            "user_gathers": held["all_gather_user"]["calls"]}


def test_unwrap_model_for_generation_gathers_once_for_the_loop():
    """TRL's generation under ZeRO-3 runs inside DeepSpeed's unwrap_model_for_generation: the forwards inside
    gather nothing (each unit is gathered once, on entry) and compute what a plain stage-3 forward computes."""
    for out in run_ranks(generation_worker, 2):
        assert out["equal"] and out["forward_gathers"] == 0 and out["user_gathers"] >= 1, out


class Generating(Model):
    """A model with a generate() taking Hugging Face's ``synced_gpus``, which reports what it was given."""

    def generate(self, x: torch.Tensor, max_new_tokens: int = 4, synced_gpus: bool | None = None) -> bool | None:
        return synced_gpus


class GeneratingElsewise(Model):
    def generate(self, x: torch.Tensor, **kwargs: object) -> dict:
        return kwargs


def synced_generate_worker(rank: int, world: int, stage: int) -> list:
    engines = [zerocore.initialize(cls(), {"zero_optimization": {"stage": stage}}) for cls in (Generating,
                                                                                               GeneratingElsewise)]
    x = torch.zeros(1, 4)
    got = [engines[0].generate(x), engines[0].generate(x, synced_gpus=False), engines[0].generate(x, 4, False),
           engines[1].generate(x)]
    for engine in engines:
        engine.close()
    return got


def test_engine_generate_keeps_stage3_ranks_in_step():
    """Note [Generation at stage 3]: engine.generate passes synced_gpus=True at stage 3 on more than one rank unless
    the call sets it (positionally too); not at stage 2, not on one rank, and not to a generate without it."""
    assert run_ranks(synced_generate_worker, 2, 3) == [[True, False, False, {}]] * 2
    assert run_ranks(synced_generate_worker, 2, 2) == [[None, False, False, {}]] * 2
    assert run_ranks(synced_generate_worker, 1, 3) == [[None, False, False, {}]]


def hf_generate_worker(rank: int, world: int) -> list:
    """Rank 0's generation meets its end token after one new token, rank 1's runs 12; then a training step."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=0))
    ids = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    model.eval()
    with torch.no_grad():
        if rank == 0:
            settings["eos_token_id"] = int(model(input_ids=ids).logits[0, -1].argmax())
        expected = model.generate(ids, **settings)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.eval()
    generated = engine.generate(ids, **settings)
    engine.train()
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.close()
    return [generated.shape[1], torch.equal(generated, expected)]


def test_hugging_face_generation_of_different_lengths_at_stage3():
    """With transformers installed (`.venv-ds` here; skipped in CI): ranks whose generations end at different
    lengths finish and go on training; without synced_gpus they waited for each other until the timeout."""
    pytest.importorskip("transformers")
    assert run_ranks(hf_generate_worker, 2, timeout=120) == [[6, True], [17, True]]


def deepspeed_built_worker(rank: int, world: int) -> list[str]:
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import deepspeed as real_deepspeed

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}}
    errors = []
    with real_deepspeed.zero.Init(config_dict_or_path=config):
        model = Model()
    for attempt in (lambda: deepspeed.initialize(model=model, config=config),
                    lambda: zerocore.estimate_memory(model, config, world_size=world)):
        with pytest.raises(ValueError) as info:
            attempt()
        errors.append(str(info.value))
    engine, *_ = real_deepspeed.initialize(model=Model(), config={**config, "zero_optimization": {"stage": 1}})
    with pytest.raises(ValueError) as info:
        zerocore.initialize(engine, config)
    errors.append(str(info.value))
    return errors


def test_what_deepspeed_built_is_refused_naming_what_to_pass():
    """With DeepSpeed installed (`.venv-ds` here; skipped in CI): a model built under DeepSpeed's own zero.Init
    (what transformers' HfDeepSpeedConfig makes from_pretrained do, as DeepSpeed-Chat's stage-3 scripts do) holds
    DeepSpeed's partitions, and DeepSpeed's engine owns its model; both are refused at initialize, naming the fix,
    instead of failing in the first forward."""
    pytest.importorskip("deepspeed")
    errors = run_ranks(deepspeed_built_worker, 2, timeout=300)[0]
    assert "partitioned by DeepSpeed's zero.Init" in errors[0] and "HfDeepSpeedConfig" in errors[0]
    assert errors[1] == errors[0]
    assert "DeepSpeed's engine" in errors[2]
