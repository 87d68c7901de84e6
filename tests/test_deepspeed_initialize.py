"""``import zerocore.deepspeed as deepspeed``: DeepSpeed's ``initialize`` (Note [DeepSpeed's initialize] in
python/zerocore/deepspeed.py). A script written for DeepSpeed, passing its own AdamW and a scheduler factory as
the Hugging Face Trainer does, trains as zerocore.initialize with the same settings in the config, and as DDP
with torch's AdamW; the script that wrote tests/fixtures/deepspeed under DeepSpeed reaches DeepSpeed's weights."""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
import zerocore.deepspeed as deepspeed
from _dist import run_ranks
from _ds_fixture import run_fixture_script
from _models import build

pytestmark = pytest.mark.timeout(300)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed")

_BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(64, 12, generator=g), torch.randn(64, 5, generator=g))


def _warmup(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def script_worker(rank: int, world: int, how: str) -> bytes:
    """The same training three ways: a DeepSpeed-style script on zerocore.deepspeed, zerocore.initialize with the
    settings in the config, and DDP with torch's AdamW; returns the parameters after 4 steps and the batches seen."""
    torch.manual_seed(0)
    model = build("mlp")
    if how.startswith("deepspeed"):
        optimizer = torch.optim.AdamW(_groups(model), lr=1e-2, betas=(0.8, 0.99), eps=1e-7)
        # the Hugging Face Trainer's way (a callable), or a script's (a scheduler built on its own optimizer)
        scheduler = _warmup if how == "deepspeed" else _warmup(optimizer)
        engine, engine_optimizer, loader, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, training_data=_dataset(), lr_scheduler=scheduler, config=_BASE)
        assert engine_optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    elif how == "zerocore":
        config = {**_BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-7}}}
        engine = zerocore.initialize(model, config, param_groups=_groups(model))
        engine.lr_scheduler = _warmup(engine.optimizer)
        sampler = torch.utils.data.DistributedSampler(_dataset(), num_replicas=world, rank=rank)
        loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, sampler=sampler)
    else:
        engine = DDP(model)
        optimizer = torch.optim.AdamW(_groups(model), lr=1e-2, betas=(0.8, 0.99), eps=1e-7, foreach=False)
        scheduler = _warmup(optimizer)
        sampler = torch.utils.data.DistributedSampler(_dataset(), num_replicas=world, rank=rank)
        loader = torch.utils.data.DataLoader(_dataset(), batch_size=4, sampler=sampler)
    seen = []
    warnings.simplefilter("error", UserWarning)  # (torch's "lr_scheduler.step() before optimizer.step()" too)
    for step, (x, y) in zip(range(4), loader):
        seen.append(x[:, 0].tolist())
        loss = torch.nn.functional.mse_loss(engine(x), y)
        if how == "ddp":
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        else:
            engine.backward(loss)
            engine.step()
    params = {n: p.detach().clone() for n, p in (model.named_parameters())} if how == "ddp" else \
        {n: zerocore.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    lr = [g["lr"] for g in (optimizer if how == "ddp" else engine.optimizer).param_groups]
    buffer = io.BytesIO()  # (tensors through the result queue: serialized)
    torch.save({"params": params, "seen": seen, "lr": lr}, buffer)
    return buffer.getvalue()


def _run(how: str) -> list[dict]:
    return [torch.load(io.BytesIO(b), weights_only=False) for b in run_ranks(script_worker, 2, how)]


def test_a_deepspeed_script_trains_as_zerocore_and_ddp():
    ds, zc, ddp = _run("deepspeed"), _run("zerocore"), _run("ddp")
    rebound = _run("deepspeed_instance")
    for rank in range(2):
        assert rebound[rank]["lr"] == ds[rank]["lr"]
        assert all(torch.equal(rebound[rank]["params"][n], v) for n, v in ds[rank]["params"].items())
        assert ds[rank]["seen"] == zc[rank]["seen"] == ddp[rank]["seen"]  # DeepSpeed's sampler: each rank its part
        assert ds[rank]["lr"] == zc[rank]["lr"] == pytest.approx(ddp[rank]["lr"])  # the warmup stepped alike
        for name, value in zc[rank]["params"].items():
            assert torch.equal(ds[rank]["params"][name], value), name
            assert torch.allclose(value, ddp[rank]["params"][name], rtol=1e-5, atol=1e-6), name
    assert ds[0]["seen"] != ds[1]["seen"]


def test_an_optimizer_callable_is_called_with_the_parameters():
    model = build("mlp")
    made = []

    def adam(params):
        made.append(torch.optim.Adam(params, lr=3e-3, weight_decay=0.01))  # L2, as torch's Adam has it
        return made[-1]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=adam, config=_BASE)
    assert len(made) == 1
    group = engine.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["adamw_mode"]) == (3e-3, 0.01, False)
    engine.close()


def test_a_groups_own_keys_reach_the_engines_groups_from_either_argument():
    """BEiT's DeepSpeed fine-tuning passes param groups carrying ``lr_scale`` (layer-wise lr decay) and sets each
    group's lr from it every step: they reach the engine's groups whether given as model_parameters or in a
    client optimizer; torch's flags (foreach, amsgrad=False, ...) do not."""
    def groups(model):
        return [{"params": [model.net[0].weight], "lr_scale": 0.25, "layer_id": 1},
                {"params": [p for n, p in model.named_parameters() if n != "net.0.weight"], "lr_scale": 1.0}]

    config = {**_BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = build("mlp")
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups(model), config=config)
    assert [(g["lr_scale"], g.get("layer_id")) for g in optimizer.param_groups] == [(0.25, 1), (1.0, None)]
    engine.close()
    model = build("mlp")
    client = torch.optim.AdamW(groups(model), lr=1e-3, foreach=False)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_BASE)
    assert [g["lr_scale"] for g in optimizer.param_groups] == [0.25, 1.0]
    flags = {"foreach", "amsgrad", "maximize", "fused", "capturable", "differentiable", "decoupled_weight_decay"}
    assert not flags & set(optimizer.param_groups[0])
    engine.close()


def reference_model_worker(rank: int, world: int, stage: int) -> bool:
    """TRL's prepare_deepspeed: the reference model, frozen, through deepspeed.initialize with the Trainer's own
    config (optimizer and scheduler sections included) and stage 0 below ZeRO-3, then eval(); its forwards are
    the plain model's in bf16."""
    torch.manual_seed(0)
    model = build("transformer").requires_grad_(False)
    plain = copy.deepcopy(model).bfloat16()
    config = {**_BASE, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (stage 0's note about clipping)
        engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    tokens = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        same = torch.equal(engine(tokens), plain(tokens))
    engine.close()
    return same


@pytest.mark.parametrize("stage", [0, 3])
def test_a_frozen_reference_model_initializes_as_trl_gives_it(stage):
    assert all(run_ranks(reference_model_worker, 2, stage))


def test_a_plateau_scheduler_steps_with_the_metrics_step_is_given():
    """DeepSpeed's engine.step(lr_kwargs=...) reaches the scheduler's step: a ReduceLROnPlateau built on the
    client optimizer cuts the engine's lr once the metric stops improving; a step without the metric it needs
    is refused before the parameters move."""
    model = build("mlp")
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(client, factor=0.5, patience=0)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=plateau,
                                                           config=_BASE)
    assert scheduler is plateau and plateau.optimizer is engine.optimizer
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    lrs = []
    for _ in range(3):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step(lr_kwargs={"metrics": 1.0})  # never improves after the first
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == [1e-2, 5e-3, 2.5e-3]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    before = {n: zerocore.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match="metrics.*nothing was changed"):
        engine.step()
    assert all(torch.equal(zerocore.safe_get_full_fp32_param(p), before[n]) for n, p in model.named_parameters())
    engine.step(lr_kwargs={"metrics": 0.5})  # the same micro-step, now with its metric
    assert engine.global_steps == 4
    engine.close()


def test_deepspeeds_config_accessors_answer_from_the_config():
    """get_batch_info() (DeepSpeed's examples unpack it and call each), optimizer_name() (a client optimizer's
    class name, else the config's type in lower case), the scheduler's name and params, the bucket size used."""
    config = {**_BASE, "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    engine, *_ = deepspeed.initialize(model=build("mlp"), config=config)
    total, micro, accumulation = engine.get_batch_info()
    assert (total(), micro(), accumulation()) == (8, 4, 2)
    assert engine.optimizer_name() == "adamw" and engine.optimizer_params()["lr"] == 1e-3
    assert (engine.scheduler_name(), engine.scheduler_params()) == ("WarmupLR", {"warmup_num_steps": 5})
    assert engine.zero_reduce_bucket_size() == engine.comm_report()["buckets"]["reduce_bucket_elements"]
    assert engine.zero_overlap_comm() is True and engine.zero_contiguous_gradients() is True
    engine.close()
    model = build("mlp")
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=_BASE)
    assert engine.optimizer_name() == "AdamW" and engine.scheduler_name() is None
    engine.close()


def test_lr_kwargs_without_a_scheduler_are_refused():
    engine = zerocore.initialize(build("mlp"), _BASE)
    engine.backward(engine(torch.randn(4, 12)).square().mean())
    with pytest.raises(ValueError, match="no lr scheduler"):
        engine.step(lr_kwargs={"metrics": 1.0})
    engine.step()
    engine.close()


def config_worker(rank: int, world: int, path: str) -> tuple:
    model = build("mlp")
    args = argparse.Namespace(deepspeed_config=path, local_rank=rank)
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model,
                                                                model_parameters=model.parameters())
    return engine.stage, type(optimizer).__name__, loader, scheduler, len(engine.optimizer.param_groups)


def test_the_config_comes_from_args_deepspeed_config_as_in_deepspeed(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**_BASE, "zero_optimization": {"stage": 3},
                                "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}))
    stage, optimizer, loader, scheduler, groups = run_ranks(config_worker, 2, str(path))[0]
    assert (stage, optimizer, loader, scheduler, groups) == (3, "ZeroOptimizer", None, None, 1)


@pytest.mark.parametrize("kwargs,error", [
    ({"optimizer": "sgd"}, "optimizer is a SGD"),
    ({"optimizer": "amsgrad"}, "amsgrad=True"),
    ({"optimizer": "adamw", "config": {**_BASE, "optimizer": {"type": "AdamW"}}}, "both in the config and as an arg"),
    ({"lr_scheduler": "instance"}, "not the one passed as optimizer="),
    ({"lr_scheduler": _warmup, "config": {**_BASE, "scheduler": {"type": "WarmupLR", "params": {}}}}, "both in the"),
    ({"config": None}, "no DeepSpeed config"),
    ({"mpu": object()}, "model parallelism"),
])
def test_what_the_engine_does_not_do_is_refused_by_name(kwargs, error):
    model = build("mlp")
    client = {"sgd": torch.optim.SGD(model.parameters(), lr=0.1),
              "amsgrad": torch.optim.AdamW(model.parameters(), amsgrad=True),
              "adamw": torch.optim.AdamW(model.parameters())}
    if kwargs.get("optimizer") in client:
        kwargs = {**kwargs, "optimizer": client[kwargs["optimizer"]]}
    if kwargs.get("lr_scheduler") == "instance":
        kwargs = {**kwargs, "lr_scheduler": _warmup(torch.optim.AdamW(model.parameters()))}
    kwargs = {"config": _BASE, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ValueError, TypeError), match=error):
            deepspeed.initialize(model=model, **kwargs)


def fixture_script_worker(rank: int, world: int, name: str) -> bytes:
    """The loop tests/fixtures/deepspeed/make_fixtures.py ran under DeepSpeed, on zerocore.deepspeed."""
    engine, model = run_fixture_script(deepspeed, name, rank)
    masters = {n: zerocore.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters() if p.requires_grad}
    buffer = io.BytesIO()
    torch.save({"masters": masters, "skipped": engine.skipped_steps}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("name,tolerance", [("stage1-fp32", 1e-5), ("stage3-fp32", 1e-5),
                                            ("stage2-bf16-groups-warmup", 1e-2), ("stage2-fp16-overflow", 2e-3)])
def test_deepspeeds_own_script_switched_by_one_import_reaches_deepspeeds_weights(name, tolerance):
    """DeepSpeed 0.19.8 ran this script to write the fixtures and saved its fp32 masters after the 3 steps; the
    same script with ``import zerocore.deepspeed as deepspeed`` lands on them within rounding (bf16: the
    gradients' rounding; fp16: its first step skipped for the overflow, as DeepSpeed's was). The unused layer is
    left out: DeepSpeed decays a parameter that got no gradient, zerocore leaves it (Note [Parameters without
    gradients])."""
    result = torch.load(io.BytesIO(run_ranks(fixture_script_worker, 2, name)[0]), weights_only=False)
    expected = load_file(os.path.join(FIXTURES, name, "expected.safetensors"))
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        assert result["skipped"] == json.load(f).get("skipped_steps", 0)
    for param, value in result["masters"].items():
        if not param.startswith("unused."):
            theirs = expected[f"master/{param}"]
            assert float((value - theirs).norm() / theirs.norm()) < tolerance, param


def gathered_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = build("mlp")
    outside = build("mlp")  # no engine's: DeepSpeed's GatheredParameters passes such parameters over
    with deepspeed.zero.GatheredParameters(outside.parameters(), modifier_rank=0):
        pass
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config={**_BASE, "zero_optimization": {"stage": 3}})
    weight = next(model.parameters())
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=0):
        shape = list(weight.shape)
        with torch.no_grad():
            weight.fill_(float(rank + 1))  # rank 0's write is kept, as DeepSpeed keeps it
    kept = zerocore.safe_get_full_fp32_param(weight).unique().tolist()
    with deepspeed.zero.GatheredParameters(weight, enabled=False):
        disabled_numel = weight.numel()  # (the global shape either way: a sharded parameter reports it)
    engine.close()
    return {"shape": shape, "kept": kept, "disabled_numel": disabled_numel}


def test_zero_gathered_parameters_is_zerocores_gathered():
    for result in run_ranks(gathered_worker, 2):
        assert result["kept"] == [1.0] and result["shape"] == [24, 12] and result["disabled_numel"] == 24 * 12


def test_zero_init_is_refused_unless_it_asks_for_nothing():
    with pytest.raises(RuntimeError, match="torch.device\\('meta'\\)"):
        deepspeed.zero.Init(config_dict_or_path=_BASE)
    with deepspeed.zero.Init(config_dict_or_path=_BASE, enabled=False):
        model = build("mlp")
    with deepspeed.zero.Init(module=model):
        pass
    assert next(model.parameters()).device.type == "cpu"


def test_add_config_arguments_and_init_distributed(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_BASE))
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    # one process, not under torchrun: a group of one on the given port (a fresh interpreter: this one may hold one)
    from _dist import free_port

    code = ("import torch.distributed as dist, zerocore.deepspeed as ds; ds.init_distributed(distributed_port="
            f"{free_port()}); ds.init_distributed(); print(dist.get_world_size(), dist.get_rank(), dist.get_backend())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "gloo"]


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_data_loader_splits_as_deepspeeds(drop_last):
    """DeepSpeed's loader: a DistributedSampler at its defaults, which pads the dataset to a multiple of the ranks
    (repeating samples) whatever dataloader_drop_last says; that drops only the last incomplete batch."""
    from types import SimpleNamespace

    from zerocore.deepspeed import _data_loader

    data = torch.utils.data.TensorDataset(torch.arange(7.0))
    for rank in range(2):
        engine = SimpleNamespace(config=SimpleNamespace(train_micro_batch_size_per_gpu=2), world_size=2, rank=rank)
        batches = [b[0].tolist() for b in _data_loader(engine, data, None, drop_last)]
        order = list(torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank))  # 4 per rank, one repeated
        assert [x for b in batches for x in b] == [float(i) for i in order]
        assert len(batches) == 2 and all(len(b) == 2 for b in batches)  # 4 samples: nothing incomplete to drop
    data = torch.utils.data.TensorDataset(torch.arange(5.0))  # 3 per rank: the last batch is one sample
    engine = SimpleNamespace(config=SimpleNamespace(train_micro_batch_size_per_gpu=2), world_size=2, rank=0)
    assert [len(b[0]) for b in _data_loader(engine, data, None, drop_last)] == ([2] if drop_last else [2, 1])


def test_the_data_loader_yields_deepspeeds_batches():
    """Against DeepSpeed's own DeepSpeedDataLoader (with DeepSpeed installed; `.venv-ds` here, skipped in CI)."""
    from types import SimpleNamespace

    from zerocore.deepspeed import _data_loader

    loader = pytest.importorskip("deepspeed.runtime.dataloader")
    for n, drop_last, rank in [(n, d, r) for n in (5, 7, 10) for d in (False, True) for r in range(2)]:
        data = torch.utils.data.TensorDataset(torch.arange(float(n)))
        theirs = loader.DeepSpeedDataLoader(data, 2, False, 0, None, data_parallel_world_size=2, data_parallel_rank=rank,
                                            dataloader_drop_last=drop_last, num_local_io_workers=0)
        engine = SimpleNamespace(config=SimpleNamespace(train_micro_batch_size_per_gpu=2), world_size=2, rank=rank)
        ours = _data_loader(engine, data, None, drop_last)
        assert [b[0].tolist() for b in ours] == [b[0].tolist() for b in theirs], (n, drop_last, rank)


class _FakeCuda:
    """torch.cuda as a machine with ``count`` GPUs shows it, recording the device set; module moves recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.current: list[int] = []
        self.moved: list[torch.device] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.current.append)

    def watch(self, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(model, "to", lambda device: self.moved.append(device))


@pytest.mark.parametrize("local_rank, device_rank, expected", [("1", None, 1), ("1", 0, 0), (None, None, 0)])
def test_a_model_built_on_the_cpu_is_moved_to_the_local_rank_gpu_as_deepspeed_does(
        monkeypatch: pytest.MonkeyPatch, local_rank: str | None, device_rank: int | None, expected: int) -> None:
    """Where CUDA is, DeepSpeed trains on the local rank's GPU whatever device the model was built on (a Hugging
    Face script leaves the move to it); the engine trains on its model's device, so the switched script would
    run on the CPU over Gloo unless initialize moves the model first."""
    cuda = _FakeCuda(monkeypatch, 2)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    model = build("mlp")
    cuda.watch(model, monkeypatch)
    args = None if device_rank is None else argparse.Namespace(device_rank=device_rank)
    deepspeed._place_on_local_gpu(model, args)
    assert cuda.current == [expected] and cuda.moved == [torch.device("cuda", expected)]


def test_a_meta_model_is_left_for_the_engine_to_materialize_on_the_local_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda(monkeypatch, 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with torch.device("meta"):
        model = build("mlp")
    cuda.watch(model, monkeypatch)
    deepspeed._place_on_local_gpu(model, None)
    assert cuda.current == [3] and cuda.moved == []


@pytest.mark.parametrize("local_rank, match", [("2", "LOCAL_RANK=2 names GPU 2, but this process sees 2"),
                                               ("x", "LOCAL_RANK='x' is not a GPU index")])
def test_a_local_rank_without_its_gpu_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, local_rank: str,
                                                         match: str) -> None:
    cuda = _FakeCuda(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    model = build("mlp")
    cuda.watch(model, monkeypatch)
    with pytest.raises(ValueError, match=match):
        deepspeed.initialize(model=model, config={**_BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert cuda.current == [] and cuda.moved == []
