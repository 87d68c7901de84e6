"""Hugging Face DeepSpeed configs as users pass them (issue 9, items 27-29): ``initialize(..., strict=False)``,
``"auto"`` values, ``offload_*: {"device": "none"}``, and the ``scheduler`` section as torch LR schedulers with
DeepSpeed's values, stepped by ``engine.step()`` after every applied optimizer step."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _models import MLP, batch, build, loss_fn
from _parity import ReferencePair
from zerocore.config import OffloadOptimizerConfig, OffloadParamConfig, SchedulerConfig, ZeroConfig, hidden_size_of
from zerocore.lr_schedules import (LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, apply_current_values,
                                  build_lr_scheduler)

pytestmark = pytest.mark.timeout(600)

# transformers' tests/deepspeed/ds_config_zero3.json, as the Hugging Face docs publish it.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _filled(config: dict, **top) -> dict:
    """HF_ZERO3 with what TrainingArguments would give filled in, and no offload."""
    out = copy.deepcopy(config)
    out["fp16"]["enabled"] = False
    out["optimizer"]["params"] = {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    out["scheduler"]["params"]["warmup_num_steps"] = 10
    out["gradient_clipping"] = 1.0
    out["zero_optimization"]["offload_optimizer"] = {"device": "none"}
    out["zero_optimization"]["offload_param"] = {"device": "none"}
    out.update(top)
    return out


# ---- item 27: strict=False -----------------------------------------------------------------------------
def test_initialize_takes_the_strict_the_error_message_names():
    with pytest.raises(ValueError, match="memory_breakdown.*pass strict=False"):
        ZeroConfig.from_deepspeed(_filled(HF_ZERO3, gradient_accumulation_steps=1, memory_breakdown=True))
    assert inspect.signature(zerocore.initialize).parameters["strict"].default is True


# ---- offload "none" --------------------------------------------------------------------------------------
@pytest.mark.parametrize("offload", [{"device": "none"}, {"device": "none", "pin_memory": True}, {}, None,
                                     {"device": "NONE", "buffer_count": 4}])
def test_offload_device_none_means_no_offload(offload):
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": offload,
                                    "cpu_offload": False, "cpu_offload_param": False}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = ZeroConfig.from_deepspeed(config).zero_optimization
    assert z.offload_optimizer.device == z.offload_param.device == "none"
    # The other settings of a device-"none" section are kept (and unused): apart from them, the default config.
    z = dataclasses.replace(z, offload_optimizer=OffloadOptimizerConfig(), offload_param=OffloadParamConfig())
    assert z == ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}}).zero_optimization


def test_real_offload_parses_and_bad_devices_are_named():
    z = ZeroConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}).zero_optimization
    assert z.offload_optimizer.device == "cpu"
    assert ZeroConfig.from_deepspeed({"zero_optimization": {"cpu_offload": True}}).zero_optimization == z
    with pytest.raises(ValueError, match=r"^zero_optimization\.offload_param\.device: expected 'none', 'cpu'"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"offload_param": {"device": "gpu"}}})
    with pytest.raises(ValueError, match=r"^zero_optimization\.offload_optimizer: expected a JSON object"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"offload_optimizer": "none"}})


# ---- item 28: "auto" -------------------------------------------------------------------------------------
@given(st.integers(1, 16384), st.sampled_from([1, 2, 3]))
def test_auto_bucket_sizes_follow_the_hidden_size(hidden, stage):
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": "auto",
                                    "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}
    z = ZeroConfig.from_deepspeed(config, hidden_size=hidden).zero_optimization
    assert z.reduce_bucket_size == hidden * hidden
    assert z.stage3_prefetch_bucket_size == int(0.9 * hidden * hidden)
    assert z.stage3_param_persistence_threshold == 10 * hidden


def test_hidden_size_comes_from_the_models_config_as_the_trainer_reads_it():
    assert hidden_size_of(SimpleNamespace(config=SimpleNamespace(hidden_size=768))) == 768
    assert hidden_size_of(SimpleNamespace(config=SimpleNamespace(hidden_sizes=[64, 512, 128]))) == 512
    assert hidden_size_of(nn.Linear(2, 2)) is None
    z = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "prefetch_bucket_size": "auto"}},
                                  hidden_size=768).zero_optimization
    assert z.stage3_prefetch_bucket_size == 530841  # int(0.9 * 768**2), through the alias too
    with pytest.raises(ValueError, match=r'^zero_optimization\.reduce_bucket_size: "auto" .* no hidden size is known'):
        ZeroConfig.from_deepspeed({"zero_optimization": {"reduce_bucket_size": "auto"}})
    with pytest.raises(ValueError, match=r"hidden_size \(the model's config.hidden_size\)"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"reduce_bucket_size": "auto"}}, hidden_size=0)


@given(micro=st.integers(1, 64), gas=st.integers(1, 16), world=st.integers(1, 64))
def test_auto_batch_sizes_follow_deepspeeds_rule(micro, gas, world):
    batch_size = micro * gas * world
    derive = lambda **keys: ZeroConfig.from_deepspeed(keys).for_world_size(world)  # noqa: E731
    for c in (derive(train_batch_size="auto", train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas),
              derive(train_batch_size=batch_size, train_micro_batch_size_per_gpu="auto",
                     gradient_accumulation_steps=gas),
              derive(train_batch_size=batch_size, train_micro_batch_size_per_gpu=micro,
                     gradient_accumulation_steps="auto")):
        assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (
            batch_size, micro, gas)
    # One batch size given: gradient_accumulation_steps is 1 and the other follows (DeepSpeed's rule).
    c = derive(train_batch_size=micro * world, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (
        micro * world, micro, 1)
    c = derive(train_batch_size="auto", train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps="auto")
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (
        micro * world, micro, 1)
    # gradient_accumulation_steps given, both batch sizes "auto": zerocore needs neither.
    c = derive(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=gas)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (None, None, gas)


def test_auto_batch_sizes_round_trip_and_bad_divisions_name_the_key():
    source = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}
    c = ZeroConfig.from_deepspeed(source)
    assert c.to_deepspeed()["train_micro_batch_size_per_gpu"] == "auto"
    assert ZeroConfig.from_deepspeed(c.to_deepspeed()) == c and hash(c) == hash(ZeroConfig.from_deepspeed(source))
    assert c.for_world_size(3).train_micro_batch_size_per_gpu == 2
    with pytest.raises(ValueError, match=r'^train_micro_batch_size_per_gpu: "auto" is train_batch_size \(12\) / '
                                         r"\(gradient_accumulation_steps \(2\) \* world_size \(4\)\)"):
        c.for_world_size(4)
    with pytest.raises(ValueError, match=r'^gradient_accumulation_steps: "auto" .*TrainingArguments\.'
                                         r"gradient_accumulation_steps.*neither is given"):
        ZeroConfig.from_deepspeed({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                   "gradient_accumulation_steps": "auto"})


def test_the_rest_of_the_autos_are_named_together_with_their_training_argument():
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_deepspeed(HF_ZERO3, strict=False, hidden_size=64)
    message = str(info.value)
    expected = {"optimizer.params.lr": "learning_rate", "optimizer.params.betas": "adam_beta1 and adam_beta2",
                "optimizer.params.eps": "adam_epsilon", "optimizer.params.weight_decay": "weight_decay",
                "gradient_clipping": "max_grad_norm", "fp16.enabled": "fp16",
                "gradient_accumulation_steps": "gradient_accumulation_steps",
                "scheduler.params.warmup_max_lr": "learning_rate", "scheduler.params.warmup_num_steps": "warmup_steps"}
    for path, argument in expected.items():
        assert re.search(f'^{re.escape(path)}: "auto" .*TrainingArguments\\.{re.escape(argument)}', message,
                         re.MULTILINE), (path, message)
    assert message.startswith(f'{len(expected)} "auto" values that zerocore cannot fill in:')
    for derived in ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                    "scheduler.params.warmup_min_lr", "train_batch_size", "train_micro_batch_size_per_gpu"):
        assert not re.search(f"^{re.escape(derived)}:", message, re.MULTILINE)  # filled, or not needed


def test_a_filled_hf_config_reads_with_the_derived_values():
    source = _filled(HF_ZERO3, gradient_accumulation_steps=2, train_micro_batch_size_per_gpu=4)
    before = copy.deepcopy(source)
    with warnings.catch_warnings():  # its stage3_max_reuse_distance and gather_16bit keys ask for what zerocore does
        warnings.simplefilter("error")
        c = ZeroConfig.from_deepspeed(source, hidden_size=64)
    assert c.zero_optimization.sub_group_size == 1_000_000_000
    assert source == before  # the user's dict is never changed
    assert c.zero_optimization.reduce_bucket_size == 4096
    assert c.scheduler == SchedulerConfig("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4,
                                                       "warmup_num_steps": 10})
    assert c.for_world_size(8).train_batch_size == 64
    assert ZeroConfig.from_deepspeed(c.to_deepspeed()) == c


# ---- item 29: the scheduler section ----------------------------------------------------------------------
@pytest.mark.parametrize("scheduler,path,accepted", [
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, "scheduler.params.warmup_num_steps", ">= 1"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, "scheduler.params.warmup_type", "'linear'"),
    ({"type": "WarmupLR", "params": {"warmup_type": "LINEAR"}}, "scheduler.params.warmup_type", "lower case"),
    ({"type": "WarmupLR", "params": {"warmup_steps": 5}}, "scheduler.params.warmup_steps", "'warmup_num_steps'"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": -1e-3}}, "scheduler.params.warmup_max_lr", ">= 0"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, float("nan")]}}, "scheduler.params.warmup_max_lr[1]",
     "finite"),
    ({"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_num_steps": 1.5}},
     "scheduler.params.warmup_num_steps", "integer"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}}, "scheduler.params.last_batch_iteration",
     "load_state_dict"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}, "scheduler.params.total_num_steps", "required"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "cos_min_ratio": -0.1}},
     "scheduler.params.cos_min_ratio", ">= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "scheduler.params.cycle_max_lr", "required"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_max_mom": 1.0}},
     "scheduler.params.cycle_max_mom", "< 1"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}},
     "scheduler.params.cycle_first_step_size", ">= 1"),
    ({"type": "Cosine", "params": {}}, "scheduler.type", "'WarmupLR'"),
    ({"type": "LambdaLR", "params": {}}, "scheduler.type", "plain values"),
    ({"params": {}}, "scheduler.type", "missing"),
    ({"type": "WarmupLR", "params": [1]}, "scheduler.params", "mapping"),
    ({"type": "WarmupLR", "param": {}}, "scheduler.param", "unknown key"),
])
def test_bad_scheduler_values_name_the_key(scheduler, path, accepted):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_deepspeed({"scheduler": scheduler})
    message = str(info.value)
    assert message.startswith(path + ":") or message.startswith(path + " "), message
    assert accepted in message, message


def test_scheduler_config_round_trips_and_hashes():
    for scheduler in ({"type": "warmuplr", "params": {"warmup_max_lr": [1e-3, 2e-3], "warmup_type": "linear"}},
                      {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                      "cycle_second_step_size": None}},
                      {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}):
        c = ZeroConfig.from_deepspeed({"scheduler": scheduler})
        assert ZeroConfig.from_deepspeed(c.to_deepspeed()) == c
        assert hash(c) == hash(ZeroConfig.from_deepspeed({"scheduler": scheduler}))
    assert ZeroConfig.from_deepspeed({"scheduler": {"type": "warmuplr"}}).scheduler.type == "WarmupLR"
    assert ZeroConfig.from_deepspeed({"scheduler": None}).scheduler is None


def _optimizer(groups: int = 1, lr: float = 1.0, betas=(0.9, 0.999)) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr, betas=betas)


def _lrs_used(scheduler, steps: int) -> list[float]:
    """The lr each of ``steps`` optimizer steps would use: the group's lr, then scheduler.step()."""
    used = []
    for _ in range(steps):
        used.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return used


def test_warmup_values_by_hand():
    # DeepSpeed: the lr of optimizer step k is get_lr() at last_batch_iteration k - 1 (min_lr before the start).
    linear = _lrs_used(WarmupLR(_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
                                warmup_type="linear"), 7)
    assert linear == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    log = _lrs_used(WarmupLR(_optimizer(), warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4), 6)
    assert log == pytest.approx([0.0, 0.0, 0.5, math.log(3) / math.log(4), 1.0, 1.0], rel=1e-15, abs=0)
    shifted = _lrs_used(WarmupLR(_optimizer(), warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=4,
                                 warmup_type="linear"), 4)
    assert shifted == pytest.approx([0.1, 0.1, 0.35, 0.6], rel=1e-15)
    # warmup_num_steps below 2 counts as 2; warmup_max_lr defaults to the first group's lr.
    assert _lrs_used(WarmupLR(_optimizer(lr=0.5), warmup_num_steps=1, warmup_type="linear"), 4) == [
        0.0, 0.0, 0.25, 0.5]
    decay = _lrs_used(WarmupDecayLR(_optimizer(), total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=1.0,
                                    warmup_num_steps=2, warmup_type="linear"), 9)
    assert decay == [0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    per_group = WarmupLR(_optimizer(groups=2), warmup_min_lr=[0.0, 1.0], warmup_max_lr=[1.0, 3.0],
                         warmup_num_steps=2, warmup_type="linear")
    per_group.optimizer.step()
    per_group.step()
    per_group.optimizer.step()
    per_group.step()
    assert [g["lr"] for g in per_group.optimizer.param_groups] == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"^scheduler\.params\.warmup_max_lr: one value per optimizer param group"):
        WarmupLR(_optimizer(groups=3), warmup_max_lr=[1.0, 2.0])


def test_warmup_cosine_values_by_hand():
    values = _lrs_used(WarmupCosineLR(_optimizer(lr=2.0), total_num_steps=6, warmup_min_ratio=0.2, warmup_num_steps=2,
                                      cos_min_ratio=0.1, warmup_type="linear"), 9)
    ratios = [0.0, 0.2, 0.6, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55,
              0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1, 0.1, 0.1]
    assert values == pytest.approx([2.0 * r for r in ratios], rel=1e-14, abs=1e-15)
    log = _lrs_used(WarmupCosineLR(_optimizer(), total_num_steps=100, warmup_min_ratio=0.5, warmup_num_steps=4), 4)
    assert log == pytest.approx([0.0, 0.5, 0.75, 0.5 + 0.5 * math.log(3) / math.log(4)], rel=1e-15)


def test_one_cycle_values_by_hand():
    opt = _optimizer(betas=(0.9, 0.99))
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=4, decay_step_size=2,
                     decay_lr_rate=1.0, cycle_min_mom=0.8, cycle_max_mom=0.9)
    lrs, moms = [], []
    for _ in range(11):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"])
        opt.step()
        sched.step()
    # Up over 4 steps, down over 4 (cycle_second_step_size defaults to the first), then min / (1 + rate * d / 2).
    assert lrs == pytest.approx([0.1, 0.35, 0.6, 0.85, 1.1, 0.85, 0.6, 0.35, 0.1, 0.1 / 1.5, 0.05], rel=1e-14)
    # Momentum inversely, (beta1, 0.99) as DeepSpeed sets it; before the first step, cycle_min_mom.
    assert [b for _, b in moms] == [0.99] * 11
    assert [m for m, _ in moms] == pytest.approx([0.8, 0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9, 0.9, 0.9],
                                                 rel=1e-14)
    stairs = _lrs_used(OneCycle(_optimizer(), cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=4,
                                cycle_first_stair_count=2, cycle_momentum=False), 9)
    assert stairs == pytest.approx([0.1, 0.1, 0.6, 0.6, 1.1, 0.6, 0.6, 0.1, 0.1], rel=1e-14)
    asymmetric = _lrs_used(OneCycle(_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=2,
                                    cycle_second_step_size=4, cycle_momentum=False), 8)
    assert asymmetric == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0], rel=1e-14, abs=1e-15)


_RESUMABLE = {
    "WarmupLR": lambda o, **k: WarmupLR(o, warmup_min_lr=0.1, warmup_max_lr=1.0, warmup_num_steps=5, **k),
    "WarmupDecayLR": lambda o, **k: WarmupDecayLR(o, total_num_steps=12, warmup_num_steps=4, **k),
    "WarmupCosineLR": lambda o, **k: WarmupCosineLR(o, total_num_steps=12, warmup_num_steps=4, **k),
    "OneCycle": lambda o, **k: OneCycle(o, cycle_min_lr=0.1, cycle_max_lr=1.1, cycle_first_step_size=3,
                                        decay_step_size=2, decay_lr_rate=0.5, **k),
    "LRRangeTest": lambda o, **k: LRRangeTest(o, lr_range_test_step_size=2, lr_range_test_step_rate=0.5, **k),
}


@pytest.mark.parametrize("name", sorted(_RESUMABLE))
def test_a_schedule_built_at_a_last_batch_iteration_resumes_as_deepspeeds(name):
    """DeepSpeed's schedules take last_batch_iteration=k (a script resuming builds them so): the optimizer keeps
    its lr and betas until the next step, which sets those of iteration k + 1; and step(j) sets those of j."""
    make = _RESUMABLE[name]
    reference, opt = [], _optimizer(betas=(0.9, 0.99))
    sched = make(opt)
    for _ in range(10):
        reference.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))  # values at iteration i - 1
        opt.step()
        sched.step()
    for k in (0, 3, 7):
        # (WarmupCosineLR scales the lr the optimizer has when it is built, DeepSpeed's too: 1.0 in both runs)
        opt = _optimizer(lr=1.0, betas=(0.5, 0.99))
        resumed = make(opt, last_batch_iteration=k)
        assert (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]) == (1.0, (0.5, 0.99))
        assert resumed.last_batch_iteration == k and resumed.get_last_lr() == [1.0]
        opt.step()
        resumed.step()
        lr, betas = reference[k + 2]
        assert opt.param_groups[0]["lr"] == lr
        assert opt.param_groups[0]["betas"] == (betas if name == "OneCycle" else (0.5, 0.99))
        opt = _optimizer(lr=1.0, betas=(0.5, 0.99))
        loaded = make(opt)
        lr, betas = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
        loaded.load_state_dict({"last_batch_iteration": k})  # DeepSpeed's state_dict(): the position only
        assert (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]) == (lr, betas)
        opt.step()
        loaded.step()
        assert opt.param_groups[0]["lr"] == reference[k + 2][0]
    opt = _optimizer(betas=(0.9, 0.99))
    jumped = make(opt)
    for j in (5, 2):
        jumped.step(j)  # DeepSpeed's step(last_batch_iteration)
        assert jumped.last_batch_iteration == j and opt.param_groups[0]["lr"] == reference[j + 1][0]
    with pytest.raises(ValueError, match="last_batch_iteration"):
        make(_optimizer(betas=(0.9, 0.99)), last_batch_iteration=-2)


@pytest.mark.parametrize("make", [
    lambda o: OneCycle(o, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=3, cycle_min_mom=0.8,
                       cycle_max_mom=0.95),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=20, base_momentum=0.8,
                                                  max_momentum=0.95),
    lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.1, max_lr=1.0, step_size_up=3, base_momentum=0.8,
                                                max_momentum=0.95),
    lambda o: WarmupDecayLR(o, total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=3),
], ids=["OneCycle", "OneCycleLR", "CyclicLR", "WarmupDecayLR"])
def test_a_loaded_schedule_gives_fresh_groups_the_lr_and_momentum_it_had_reached(make):
    """A checkpoint loaded with load_optimizer_states=False: load_state_dict restores the schedule's position
    and sets no group, so apply_current_values must give the fresh optimizer what the schedule last set."""
    opt = _optimizer(groups=2, betas=(0.9, 0.99))
    sched = make(opt)
    for _ in range(4):
        opt.step()
        sched.step()
    fresh = _optimizer(groups=2, betas=(0.9, 0.99))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # OneCycle's beta2 advice
        loaded = make(fresh)
    loaded.load_state_dict(sched.state_dict())
    apply_current_values(loaded)
    for mine, theirs in zip(fresh.param_groups, opt.param_groups):
        assert (mine["lr"], mine["betas"]) == (theirs["lr"], theirs["betas"])
    assert opt.param_groups[0]["betas"] != (0.9, 0.99) or isinstance(sched, WarmupDecayLR)  # momentum did move


def test_one_cycle_momentum_warns_about_beta2_and_can_be_turned_off():
    with pytest.warns(UserWarning, match=r"betas to \(momentum, 0\.99\).*cycle_momentum to false"):
        OneCycle(_optimizer(betas=(0.9, 0.999)), cycle_min_lr=0.1, cycle_max_lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OneCycle(_optimizer(betas=(0.9, 0.99)), cycle_min_lr=0.1, cycle_max_lr=1.0)
        opt = _optimizer(betas=(0.9, 0.999))
        sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2, cycle_momentum=False)
        opt.step()
        sched.step()
        assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    # A momentum decay that would take beta1 to 1 or past raises, naming the key, instead of training on it.
    opt = _optimizer(betas=(0.9, 0.99))
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=1, decay_step_size=1,
                     decay_mom_rate=0.05)
    with pytest.raises(ValueError, match=r"^scheduler\.params\.decay_mom_rate: at step \d+ OneCycle's momentum"):
        for _ in range(10):
            opt.step()
            sched.step()


def test_lr_range_test_values_by_hand():
    assert _lrs_used(LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2), 5) == (
        pytest.approx([0.01, 0.015, 0.02, 0.025, 0.03], rel=1e-15))
    assert _lrs_used(LRRangeTest(_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                                 lr_range_test_staircase=True), 5) == pytest.approx([0.01, 0.01, 0.02, 0.02, 0.03])


# DeepSpeed's formulas, as functions of its last_batch_iteration (deepspeed/runtime/lr_schedules.py), for the
# properties below: the schedulers' lr at optimizer step k must be these at k - 1, bit for bit.
def _ds_warmup_gamma(it: int, n: int, kind: str) -> float:
    return (1.0 / math.log(n)) * math.log(it + 1) if kind == "log" else it / n


def _ds_warmup_decay(it: int, lo: float, hi: float, n: int, kind: str, total: int | None) -> float:
    n = max(2, n)
    if it < 0:
        return lo
    if it < n:
        gamma = _ds_warmup_gamma(it, n, kind)
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, float(total - it) / float(max(1.0, total - n)))
    return lo + ((hi - lo) * gamma)


def _ds_cosine(it: int, lr: float, total: int, min_ratio: float, n: int, cos_min: float, kind: str) -> float:
    n = max(2, n)
    if it < 0:
        return 0.0
    if it < n:
        ratio = min_ratio + _ds_warmup_gamma(it, n, kind) * (1.0 - min_ratio)
    else:
        progress = min(1.0, (it - n + 1) / max(1, total - n))
        ratio = max(0.0, cos_min + (1.0 - cos_min) * ((1 + math.cos(math.pi * progress)) / 2))
    return lr * ratio


@given(lo=st.floats(0, 1), hi=st.floats(0, 1), n=st.integers(1, 50), kind=st.sampled_from(["log", "linear"]),
       total=st.one_of(st.none(), st.integers(1, 80)))
def test_warmup_schedules_are_deepspeeds_formulas(lo, hi, n, kind, total):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # total_num_steps < warmup_num_steps warns, as in DeepSpeed
        if total is None:
            sched = WarmupLR(_optimizer(), warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n, warmup_type=kind)
        else:
            sched = WarmupDecayLR(_optimizer(), total, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n,
                                  warmup_type=kind)
    used = _lrs_used(sched, 100)
    assert used == [_ds_warmup_decay(k - 1, lo, hi, n, kind, total) for k in range(100)]
    assert min(used) >= 0.0


@given(lr=st.floats(1e-6, 1), total=st.integers(1, 80), min_ratio=st.floats(0, 1), n=st.integers(1, 40),
       cos_min=st.floats(0, 1), kind=st.sampled_from(["log", "linear"]))
def test_warmup_cosine_is_deepspeeds_formula(lr, total, min_ratio, n, cos_min, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = WarmupCosineLR(_optimizer(lr=lr), total, warmup_min_ratio=min_ratio, warmup_num_steps=n,
                               cos_min_ratio=cos_min, warmup_type=kind)
    assert _lrs_used(sched, 100) == [_ds_cosine(k - 1, lr, total, min_ratio, n, cos_min, kind) for k in range(100)]


@given(lo=st.floats(0, 1), hi=st.floats(0, 1), first=st.integers(1, 20), second=st.integers(1, 20),
       stairs=st.integers(0, 5))
def test_one_cycle_stays_between_its_bounds_and_peaks_after_the_first_phase(lo, hi, first, second, stairs):
    opt = _optimizer(betas=(0.9, 0.99))
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, cycle_first_step_size=first,
                     cycle_second_step_size=second, cycle_first_stair_count=stairs, cycle_min_mom=0.85,
                     cycle_max_mom=0.95)
    lrs, moms = [], []
    for _ in range(first + second + 5):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    low, high = min(lo, hi), max(lo, hi)
    assert all(low - 1e-12 <= v <= high + 1e-12 for v in lrs)
    assert all(0.85 - 1e-12 <= m <= 0.95 + 1e-12 for m in moms)
    # the peak: step first_step_size (lo + (hi - lo) * 1.0 rounds like the bounds above: 1e-12 absolute)
    assert lrs[first] == pytest.approx(hi, rel=1e-12, abs=1e-12)
    assert lrs[first + second:] == [lo] * 5  # after the cycle, without decay: cycle_min_lr


def test_build_torch_scheduler_by_name_and_report_its_errors():
    opt = _optimizer()
    sched = build_lr_scheduler(SchedulerConfig("StepLR", {"step_size": 2, "gamma": 0.5}), opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert _lrs_used(sched, 5) == [1.0, 1.0, 0.5, 0.5, 0.25]
    with pytest.raises(ValueError, match=r"^scheduler\.params: torch\.optim\.lr_scheduler\.StepLR rejected"):
        build_lr_scheduler(SchedulerConfig("StepLR", {"step_sizes": 2}), _optimizer())
    assert build_lr_scheduler(None, opt) is None


# ---- through the engine (2 Gloo ranks) -------------------------------------------------------------------
def _hf_model() -> nn.Module:
    torch.manual_seed(0)
    model = MLP()
    model.config = SimpleNamespace(hidden_size=24)  # as a Hugging Face model carries its config
    return model


def hf_config_worker(rank: int, world: int) -> dict:
    out = {}
    # item 27: strict=False through initialize; item 28: "auto" from the model and the world; offload "none".
    config = _filled(HF_ZERO3, train_micro_batch_size_per_gpu=2, memory_breakdown=True)
    with pytest.warns(UserWarning, match="zerocore ignores these DeepSpeed keys, not supported yet: memory_breakdown$"):
        engine = zerocore.initialize(_hf_model(), config, strict=False)
    c = engine.config
    out["derived"] = (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                      c.zero_optimization.reduce_bucket_size, c.zero_optimization.stage3_prefetch_bucket_size,
                      c.zero_optimization.stage3_param_persistence_threshold)
    out["scheduler"] = type(engine.lr_scheduler).__name__
    x, y = batch("mlp", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("mlp", engine(x), y))
    engine.step()
    engine.close()
    try:
        zerocore.initialize(_hf_model(), config)
    except ValueError as e:
        out["strict_error"] = str(e)
    # No scheduler section: engine.lr_scheduler is None and the lr stays.
    engine = zerocore.initialize(_hf_model(), {"optimizer": {"params": {"lr": 0.01}}})
    out["no_scheduler"] = engine.lr_scheduler is None
    engine.backward(loss_fn("mlp", engine(x), y))
    engine.step()
    out["lr_after"] = engine.optimizer.param_groups[0]["lr"]
    engine.close()
    return out


def test_hf_config_through_initialize():
    for out in run_ranks(hf_config_worker, 2):
        assert out["derived"] == (4, 2, 1, 24 * 24, int(0.9 * 24 * 24), 240)
        assert out["scheduler"] == "WarmupLR"
        assert "pass strict=False" in out["strict_error"]
        assert out["no_scheduler"] and out["lr_after"] == 0.01


# LLaMA-Factory's examples/deepspeed/ds_z0_config.json (open-instruct's stage-0 config is the same idea).
LLAMA_FACTORY_Z0 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True, "round_robin_gradients": True},
}


def test_stage_0_is_read_as_stage_1_with_a_warning_that_says_what_differs():
    """Note [Stage 0 runs as stage 1]: the same config in every other key, and the warning names what a
    stage-0 script could see differently (.grad empty after backward, torch's clip_grad_norm_)."""
    with pytest.warns(UserWarning, match=r"stage 0 .* runs as stage 1.*torch.nn.utils.clip_grad_norm_"):
        zero = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 0, "reduce_bucket_size": 100}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 1, "reduce_bucket_size": 100}})
        assert zero == one and zero.zero_optimization.stage == 1
        assert ZeroConfig.from_deepspeed(zero.to_deepspeed()) == one  # (round trips without a second warning)
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": "auto"}})


def stage_0_worker(rank: int, world: int) -> None:
    """LLaMA-Factory's stage-0 config, filled in as the Trainer would, trains as DDP + torch AdamW with
    clipping does, over two accumulated micro-batches per step."""
    gas, micro = 2, 2
    config = copy.deepcopy(LLAMA_FACTORY_Z0)
    config.update(train_batch_size=micro * gas * world, train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=gas, gradient_clipping=0.05,
                  optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}})
    config["fp16"]["enabled"] = config["bf16"]["enabled"] = False
    model = build("mlp")
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                                                                 foreach=False), wrap=DDP)
    with pytest.warns(UserWarning, match="stage 0"):
        engine = zerocore.initialize(model, config, strict=False)
    assert engine.zero_optimization_stage() == 1
    for step in range(4):
        pieces = [batch("mlp", torch.Generator().manual_seed(100 * step + 10 * rank + m), micro) for m in range(gas)]
        for x, y in pieces:
            engine.backward(loss_fn("mlp", engine(x), y))
            engine.step()
        x, y = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        reference.train_step(lambda module, dtype: loss_fn("mlp", module(x.to(dtype)), y.to(dtype)), clip=0.05)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label="stage 0")
    engine.close()


def test_llama_factorys_stage_0_config_trains_as_ddp():
    run_ranks(stage_0_worker, 2)


SCHEDULES = {
    "WarmupDecayLR": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 5e-3,
                                                          "warmup_num_steps": 3, "total_num_steps": 7,
                                                          "warmup_type": "linear"}},
    "WarmupCosineLR": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                            "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}},
    "OneCycle": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 6e-3,
                                                "cycle_first_step_size": 3, "cycle_min_mom": 0.8,
                                                "cycle_max_mom": 0.95}},
}


def schedule_parity_worker(rank: int, world: int, stage: int, name: str) -> list[tuple[float, tuple]]:
    """The engine with a scheduler section against DDP + torch AdamW given DeepSpeed's lr (and betas) at every
    optimizer step; two micro-steps per optimizer step, so the scheduler must move once per boundary."""
    gas, steps = 2, 8
    model = build("mlp")
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.99),
                                                                 eps=1e-8, weight_decay=0.01, foreach=False), wrap=DDP)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                        "weight_decay": 0.01}},
              "gradient_accumulation_steps": gas, "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
              "scheduler": SCHEDULES[name]}
    engine = zerocore.initialize(model, config)
    # DeepSpeed's own scheduler over the reference optimizers gives the expected values (the values are checked
    # against DeepSpeed's formulas above); here the engine must apply them at the right optimizer steps.
    expected = [build_lr_scheduler(engine.config.scheduler, o) for o in reference.optimizers]
    used = []
    for step in range(steps):
        group = engine.optimizer.param_groups[0]
        used.append((group["lr"], tuple(group["betas"])))
        assert used[-1] == (reference.optimizers[0].param_groups[0]["lr"],
                            tuple(reference.optimizers[0].param_groups[0]["betas"]))
        micro = [batch("mlp", torch.Generator().manual_seed(1000 * step + 10 * rank + m)) for m in range(gas)]
        for x, y in micro:
            engine.backward(loss_fn("mlp", engine(x), y))
            engine.step()
            assert engine.optimizer.param_groups[0]["lr"] == used[-1][0] or engine.micro_steps % gas == 0
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        reference.train_step(lambda module, dtype: loss_fn("mlp", module(x.to(dtype)), y.to(dtype)))
        for s in expected:
            s.step()
    assert engine.lr_scheduler.last_epoch == steps
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"{name}, stage {stage}")
    engine.close()
    return used


@pytest.mark.parametrize("stage,name", [(1, "WarmupDecayLR"), (2, "WarmupCosineLR"), (3, "OneCycle"),
                                        (1, "OneCycle")])
def test_scheduler_section_drives_the_engines_lr_like_deepspeed(stage, name):
    used = run_ranks(schedule_parity_worker, 2, stage, name)
    assert used[0] == used[1]
    lrs = [lr for lr, _ in used[0]]
    assert len(set(lrs)) > 3  # the lr really moved
    if name == "WarmupDecayLR":
        assert lrs == pytest.approx([1e-4, 1e-4, 1e-4 + 4.9e-3 / 3, 1e-4 + 2 * 4.9e-3 / 3, 5e-3, 1e-4 + 4.9e-3 * 0.75, 1e-4 + 4.9e-3 * 0.5, 1e-4 + 4.9e-3 * 0.25], rel=1e-12)
    if name == "OneCycle":
        assert [b for _, b in used[0]][:2] == [(0.8, 0.99), (0.95 - 0.15 / 3, 0.99)]


def overflow_worker(rank: int, world: int) -> list[tuple[int, float]]:
    model = build("mlp")
    config = {"optimizer": {"params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}}
    engine = zerocore.initialize(model, config)
    seen = []
    for step in range(5):
        x, y = batch("mlp", torch.Generator().manual_seed(step + 10 * rank))
        loss = loss_fn("mlp", engine(x.half()), y)  # fp16 inputs for the fp16 model, as in DeepSpeed
        if step == 2 and rank == 0:
            loss = loss * float("inf")  # one rank overflows: every rank skips the step
        engine.backward(loss)
        engine.step()
        assert engine.get_lr() == [engine.optimizer.param_groups[0]["lr"]]
        seen.append((engine.lr_scheduler.last_epoch, engine.get_lr()[0], engine.skipped_steps,
                     engine.was_step_applied()))
        # DeepSpeed's optimizer attributes, which Accelerate's wrapper reads
        assert engine.optimizer.overflow == (step == 2) and engine.optimizer.loss_scale == engine.loss_scale
    engine.close()
    return seen


def test_fp16_overflow_skipped_step_does_not_advance_the_scheduler():
    for seen in run_ranks(overflow_worker, 2):
        # DeepSpeed steps its scheduler only after an applied step: the skipped step 2 leaves it where it was.
        assert seen == [(1, 0.0, 0, True), (2, 2.5e-4, 0, True), (2, 2.5e-4, 1, False), (3, 5e-4, 1, True),
                        (4, 7.5e-4, 1, True)]


def accessors_worker(rank: int, world: int, config: dict) -> list:
    engine = zerocore.initialize(build("mlp"), config)
    applied = []
    for step in range(4):
        x, y = batch("mlp", torch.Generator().manual_seed(step + 10 * rank))
        engine.backward(loss_fn("mlp", engine(x.to(engine.compute_dtype)).float(), y))
        engine.step()
        applied.append(engine.was_step_applied())
    return [applied, engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(), engine.get_mom(),
            [engine.zero_optimization_stage(), engine.fp16_enabled(), engine.bfloat16_enabled(),
             engine.gradient_clipping(), engine.dp_world_size, engine.global_rank == rank, engine.local_rank,
             engine.global_samples]]


@pytest.mark.parametrize("given", [{"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
                                   {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3},
                                   {"train_batch_size": 12, "gradient_accumulation_steps": 2}])
def test_deepspeed_engine_accessors(given):
    config = {"optimizer": {"params": {"lr": 1e-3, "betas": [0.8, 0.9]}}, "zero_optimization": {"stage": 2},
              "bf16": {"enabled": True}, "gradient_clipping": 0.5, **given}
    for result in run_ranks(accessors_worker, 2, config):
        # not applied inside the accumulation window, applied at its boundary; the batch sizes as DeepSpeed
        # derives them (12 = 3 per rank x 2 accumulation steps x 2 ranks); 2 updates of 12 samples
        assert result == [[False, True, False, True], 12, 3, 2, [(0.8, 0.9)], [2, False, True, 0.5, 2, True, 0, 24]]


def test_hugging_face_model_config_when_transformers_is_installed():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                                                 n_positions=16))
    assert hidden_size_of(model) == 32  # GPT-2's n_embd, read through config.hidden_size as the Trainer does
    c = ZeroConfig.from_deepspeed(_filled(HF_ZERO3, gradient_accumulation_steps=1), strict=False,
                                  hidden_size=hidden_size_of(model))
    assert c.zero_optimization.stage3_param_persistence_threshold == 320


def zero_accessors_worker(rank: int, world: int, config: dict) -> list:
    engine = zerocore.initialize(build("mlp"), config)
    answers = [engine.zero_optimization(), engine.zero_optimization_partition_gradients(),
               engine.zero_optimization_partition_weights(), engine.zero_offload_optimizer().device,
               engine.zero_offload_param().device, engine.zero_cpu_offload(), engine.zero_use_cpu_optimizer(),
               str(engine.communication_data_type), engine.steps_per_print(), engine.dynamic_loss_scale()]
    engine.close()
    return answers


@pytest.mark.parametrize("stage,offload,extra,expected", [
    (1, None, {}, [True, False, False, "none", "none", False, False, "torch.float32", 10, True]),
    (2, "cpu", {"communication_data_type": "bf16", "steps_per_print": 5, "bf16": {"enabled": True}},
     [True, True, False, "cpu", "none", True, True, "torch.bfloat16", 5, True]),
    (3, "nvme", {"fp16": {"enabled": True, "loss_scale": 128}},
     [True, True, True, "nvme", "none", False, True, "torch.float32", 10, False]),
])
def test_deepspeed_zero_accessors(stage, offload, extra, expected, tmp_path):
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path)} if offload == "nvme" else \
            {"device": offload}
    config = {"optimizer": {"params": {"lr": 1e-3}}, "zero_optimization": zero, **extra}
    for result in run_ranks(zero_accessors_worker, 2, config):
        assert result == expected, result
