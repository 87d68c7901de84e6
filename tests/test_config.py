"""zerocore.config: defaults, validation, and the DeepSpeed JSON reader/writer (fast, no distributed)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zerocore.config import (AioConfig, FP16Config, OffloadOptimizerConfig, OffloadParamConfig, OptimizerConfig,
                             ZeroConfig, ZeroOptimizationConfig)

# Every key zerocore supports, none at its default.
FULL = {
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                             "adam_w_mode": False, "bias_correction": False}},
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": False},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 0.5},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8,
                          "overlap_comm": False, "contiguous_gradients": True, "reduce_scatter": False,
                          "allgather_partitions": False, "stage3_use_all_reduce_for_fetch_params": True,
                          "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 1e8,
                          "stage3_param_persistence_threshold": 1e4, "sub_group_size": 1e8,
                          "offload_optimizer": {"device": "NVMe", "nvme_path": "/local_nvme", "pin_memory": False,
                                                "buffer_count": 8, "fast_init": True, "ratio": 1.0},
                          "offload_param": {"device": "cpu", "nvme_path": "/local_nvme/params", "pin_memory": False,
                                            "buffer_count": 6, "buffer_size": 2e7, "max_in_cpu": 0}},
    "aio": {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 4, "single_submit": True,
            "overlap_events": False, "use_gds": False},
    "communication_data_type": "FP16",
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
    "steps_per_print": 100,
    "wall_clock_breakdown": True,
}


def ds(**sections):
    """A DeepSpeed dict with the given top-level keys."""
    return dict(sections)


def test_defaults():
    c = ZeroConfig()
    assert c.optimizer == OptimizerConfig(type="AdamW", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                          adamw_mode=True, bias_correction=True)
    assert c.fp16 == FP16Config(enabled=False, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000,
                                hysteresis=2, min_loss_scale=1.0)
    z = c.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size) == (1, None, None)  # the engine chooses
    assert (z.overlap_comm, z.contiguous_gradients, z.reduce_scatter) == (True, True, True)
    assert (z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters,
            z.stage3_param_persistence_threshold) == (None, 1_000_000_000, 100_000)  # None: one unit ahead
    # gradient_clipping 1.0: DeepSpeed's default since 0.19 (deepspeedai/DeepSpeed#8068)
    assert (c.gradient_accumulation_steps, c.gradient_clipping, c.bf16, c.steps_per_print) == (1, 1.0, False, 10)
    assert c.communication_data_type is c.train_batch_size is c.train_micro_batch_size_per_gpu is None
    assert c.compute_dtype == c.reduce_dtype == torch.float32
    # Offload and aio: DeepSpeed 0.19.8's defaults (test_defaults_are_deepspeeds checks them against it).
    assert z.sub_group_size == 1_000_000_000
    assert z.offload_optimizer == OffloadOptimizerConfig(device="none", nvme_path=None, pin_memory=True,
                                                         buffer_count=4, fast_init=False, ratio=1.0)
    assert z.offload_param == OffloadParamConfig(device="none", nvme_path=None, pin_memory=True, buffer_count=5,
                                                 buffer_size=100_000_000, max_in_cpu=1_000_000_000)
    assert c.aio == AioConfig(block_size=1048576, queue_depth=8, thread_count=1, single_submit=False,
                              overlap_events=True)
    assert ZeroConfig.from_deepspeed({}) == c
    assert hash(c) == hash(ZeroConfig())


def test_dtypes():
    assert ZeroConfig(bf16=True).compute_dtype == torch.bfloat16
    assert ZeroConfig(fp16=FP16Config(enabled=True)).compute_dtype == torch.float16
    for name, dtype in [("fp32", torch.float32), ("FP16", torch.float16), ("Bf16", torch.bfloat16)]:
        c = ZeroConfig(communication_data_type=name)
        assert (c.communication_data_type, c.reduce_dtype) == (name.lower(), dtype)


def test_full_round_trip(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(FULL))
    c = ZeroConfig.from_deepspeed(FULL)
    assert ZeroConfig.from_deepspeed(path) == ZeroConfig.from_deepspeed(str(path)) == c
    assert c.optimizer == OptimizerConfig("Adam", 3e-4, (0.8, 0.95), 1e-6, 0.1, False, False)
    assert c.fp16 == FP16Config(True, 0.0, 12, 500, 3, 0.5)
    assert c.zero_optimization == ZeroOptimizationConfig(
        3, 50_000_000, 200_000_000, False, True, False, 0, 100_000_000, 10_000, sub_group_size=100_000_000,
        allgather_partitions=False, use_all_reduce_for_fetch_params=True,
        offload_optimizer=OffloadOptimizerConfig("nvme", "/local_nvme", False, 8, True, 1.0),
        offload_param=OffloadParamConfig("cpu", "/local_nvme/params", False, 6, 20_000_000, 0))
    assert c.aio == AioConfig(block_size=262144, queue_depth=32, thread_count=4, single_submit=True,
                              overlap_events=False)
    assert (c.gradient_accumulation_steps, c.gradient_clipping, c.communication_data_type) == (4, 1.0, "fp16")
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.steps_per_print) == (64, 2, 100)
    assert (c.compute_dtype, c.reduce_dtype) == (torch.float16, torch.float16)
    out = c.to_deepspeed()
    assert ZeroConfig.from_deepspeed(out) == c
    assert ZeroConfig.from_deepspeed(json.loads(json.dumps(out))) == c
    for other in (ZeroConfig(), ZeroConfig(bf16=True, communication_data_type="bf16"),
                  ZeroConfig(optimizer=OptimizerConfig(type="adam", weight_decay=0.01, adamw_mode=False))):
        assert ZeroConfig.from_deepspeed(other.to_deepspeed()) == other


def test_integral_floats():
    c = ZeroConfig.from_deepspeed(ds(zero_optimization={"reduce_bucket_size": 5e8, "stage": 2.0}))
    assert c.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(c.zero_optimization.reduce_bucket_size) is int and type(c.zero_optimization.stage) is int
    assert type(ZeroOptimizationConfig(allgather_bucket_size=2e8).allgather_bucket_size) is int
    with pytest.raises(ValueError, match=r"zero_optimization\.reduce_bucket_size.*1\.5"):
        ZeroConfig.from_deepspeed(ds(zero_optimization={"reduce_bucket_size": 1.5}))
    with pytest.raises(ValueError, match=r"zero_optimization\.allgather_bucket_size"):
        ZeroOptimizationConfig(allgather_bucket_size=1.5)


BAD = [  # (DeepSpeed dict, key path named in the error, a fragment of the accepted values)
    (ds(optimizer={"type": "Lamb"}), "optimizer.type", "'Adam', 'AdamW'"),
    (ds(optimizer={"type": 1}), "optimizer.type", "'Adam', 'AdamW'"),
    (ds(optimizer={"params": {"lr": -1e-3}}), "optimizer.params.lr", ">= 0"),
    (ds(optimizer={"params": {"lr": float("nan")}}), "optimizer.params.lr", "finite"),
    (ds(optimizer={"params": {"lr": "1e-3"}}), "optimizer.params.lr", ">= 0"),
    (ds(optimizer={"params": {"betas": [0.9, 1.0]}}), "optimizer.params.betas[1]", "< 1"),
    (ds(optimizer={"params": {"betas": [-0.1, 0.9]}}), "optimizer.params.betas[0]", ">= 0"),
    (ds(optimizer={"params": {"betas": [0.9]}}), "optimizer.params.betas", "two numbers"),
    (ds(optimizer={"params": {"betas": "0.9"}}), "optimizer.params.betas", "two numbers"),
    (ds(optimizer={"params": {"eps": -1.0}}), "optimizer.params.eps", ">= 0"),
    (ds(optimizer={"params": {"weight_decay": -0.1}}), "optimizer.params.weight_decay", ">= 0"),
    (ds(optimizer={"type": "Adam", "params": {"adam_w_mode": 1}}), "optimizer.params.adam_w_mode", "true or false"),
    (ds(optimizer={"params": {"adam_w_mode": "yes"}}), "optimizer.params.adam_w_mode", "true or false"),
    (ds(optimizer={"params": {"bias_correction": 0}}), "optimizer.params.bias_correction", "true or false"),
    (ds(optimizer=[]), "optimizer", "JSON object"),
    (ds(optimizer={"params": None}), "optimizer.params", "JSON object"),
    (ds(gradient_accumulation_steps=0), "gradient_accumulation_steps", ">= 1"),
    (ds(gradient_accumulation_steps=True), "gradient_accumulation_steps", ">= 1"),
    (ds(gradient_clipping=-1.0), "gradient_clipping", ">= 0"),
    (ds(gradient_clipping=float("inf")), "gradient_clipping", "finite"),
    (ds(bf16={"enabled": "true"}), "bf16.enabled", "true or false"),
    (ds(bf16=True), "bf16", "JSON object"),
    (ds(fp16={"enabled": 1}), "fp16.enabled", "true or false"),
    (ds(fp16={"loss_scale": -1}), "fp16.loss_scale", ">= 0"),
    (ds(fp16={"initial_scale_power": -1}), "fp16.initial_scale_power", ">= 0"),
    (ds(fp16={"initial_scale_power": 200}), "fp16.initial_scale_power", "<= 127"),
    (ds(fp16={"loss_scale_window": 0}), "fp16.loss_scale_window", ">= 1"),
    (ds(fp16={"hysteresis": 0}), "fp16.hysteresis", ">= 1"),
    (ds(fp16={"min_loss_scale": 0}), "fp16.min_loss_scale", "> 0"),
    (ds(zero_optimization={"stage": 4}), "zero_optimization.stage", "0, 1, 2, 3"),
    (ds(zero_optimization={"stage": -1}), "zero_optimization.stage", "0, 1, 2, 3"),
    (ds(zero_optimization={"stage": True}), "zero_optimization.stage", "0, 1, 2, 3"),
    (ds(zero_optimization={"stage": False}), "zero_optimization.stage", "0, 1, 2, 3"),
    (ds(zero_optimization={"stage": "2"}), "zero_optimization.stage", "0, 1, 2, 3"),
    (ds(zero_optimization={"reduce_bucket_size": 0}), "zero_optimization.reduce_bucket_size", ">= 1"),
    (ds(zero_optimization={"allgather_bucket_size": 0}), "zero_optimization.allgather_bucket_size", ">= 1"),
    (ds(zero_optimization={"overlap_comm": None}), "zero_optimization.overlap_comm", "true or false"),
    (ds(zero_optimization={"contiguous_gradients": 1}), "zero_optimization.contiguous_gradients", "true or false"),
    (ds(zero_optimization={"contiguous_gradients": False}), "zero_optimization.contiguous_gradients",
     "only true is accepted"),
    (ds(zero_optimization={"reduce_scatter": "no"}), "zero_optimization.reduce_scatter", "true or false"),
    (ds(zero_optimization={"stage3_prefetch_bucket_size": -1}), "zero_optimization.stage3_prefetch_bucket_size",
     ">= 0"),
    (ds(zero_optimization={"stage3_max_live_parameters": -1}), "zero_optimization.stage3_max_live_parameters",
     ">= 0"),
    (ds(zero_optimization={"stage3_param_persistence_threshold": -5}),
     "zero_optimization.stage3_param_persistence_threshold", ">= 0"),
    (ds(zero_optimization=True), "zero_optimization", "JSON object"),
    (ds(communication_data_type="fp8"), "communication_data_type", "'fp32', 'fp16', 'bf16'"),
    (ds(communication_data_type=16), "communication_data_type", "'fp32', 'fp16', 'bf16'"),
    (ds(train_batch_size=0), "train_batch_size", ">= 1"),
    (ds(train_micro_batch_size_per_gpu=2.5), "train_micro_batch_size_per_gpu", ">= 1"),
    (ds(steps_per_print=0), "steps_per_print", ">= 1"),
    # offload_optimizer / offload_param / sub_group_size / aio
    (ds(zero_optimization={"offload_optimizer": {"device": "gpu"}}), "zero_optimization.offload_optimizer.device",
     "'none', 'cpu' or 'nvme'"),
    (ds(zero_optimization={"offload_optimizer": {"device": 1}}), "zero_optimization.offload_optimizer.device",
     "'none', 'cpu' or 'nvme'"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": None}}), "zero_optimization.offload_param.device",
     "'none', 'cpu' or 'nvme'"),
    (ds(zero_optimization={"offload_optimizer": {"device": "nvme"}}), "zero_optimization.offload_optimizer.nvme_path",
     "required when device is 'nvme'"),
    (ds(zero_optimization={"offload_optimizer": {"device": "NVME", "nvme_path": None}}),
     "zero_optimization.offload_optimizer.nvme_path", "required when device is 'nvme'"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
     "zero_optimization.offload_param.nvme_path", "required when device is 'nvme'"),
    (ds(zero_optimization={"offload_optimizer": {"device": "nvme", "nvme_path": ""}}),
     "zero_optimization.offload_optimizer.nvme_path", "non-empty string"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"nvme_path": 7}}), "zero_optimization.offload_param.nvme_path",
     "non-empty string"),
    (ds(zero_optimization={"offload_optimizer": {"buffer_count": "4"}}),
     "zero_optimization.offload_optimizer.buffer_count", ">= 1"),
    (ds(zero_optimization={"offload_optimizer": {"buffer_count": True}}),
     "zero_optimization.offload_optimizer.buffer_count", ">= 1"),
    (ds(zero_optimization={"offload_optimizer": {"buffer_count": -1}}),
     "zero_optimization.offload_optimizer.buffer_count", ">= 1"),
    (ds(zero_optimization={"offload_optimizer": {"buffer_count": 2.5}}),
     "zero_optimization.offload_optimizer.buffer_count", "integral"),
    (ds(zero_optimization={"offload_optimizer": {"pin_memory": "true"}}),
     "zero_optimization.offload_optimizer.pin_memory", "true or false"),
    (ds(zero_optimization={"offload_optimizer": {"fast_init": 1}}), "zero_optimization.offload_optimizer.fast_init",
     "true or false"),
    (ds(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}),
     "zero_optimization.offload_optimizer.ratio", "supports only ratio 1.0"),
    (ds(zero_optimization={"offload_optimizer": {"ratio": 1.5}}), "zero_optimization.offload_optimizer.ratio",
     "supports only ratio 1.0"),
    (ds(zero_optimization={"offload_optimizer": {"ratio": "1"}}), "zero_optimization.offload_optimizer.ratio",
     ">= 0"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"buffer_count": 0}}),
     "zero_optimization.offload_param.buffer_count", ">= 1"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"buffer_size": -1}}),
     "zero_optimization.offload_param.buffer_size", ">= 1"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"buffer_size": "1e8"}}),
     "zero_optimization.offload_param.buffer_size", ">= 1"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"max_in_cpu": -1}}),
     "zero_optimization.offload_param.max_in_cpu", ">= 0"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"max_in_cpu": False}}),
     "zero_optimization.offload_param.max_in_cpu", ">= 0"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"pin_memory": None}}),
     "zero_optimization.offload_param.pin_memory", "true or false"),
    (ds(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}), "zero_optimization.offload_param",
     "parameter offload needs stage 3"),
    (ds(zero_optimization={"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}),
     "zero_optimization.offload_param", "parameter offload needs stage 3"),
    (ds(zero_optimization={"offload_optimizer": "none"}), "zero_optimization.offload_optimizer", "JSON object"),
    (ds(zero_optimization={"offload_optimizer": True}), "zero_optimization.offload_optimizer", "JSON object"),
    (ds(zero_optimization={"stage": 3, "offload_param": ["cpu"]}), "zero_optimization.offload_param", "JSON object"),
    (ds(zero_optimization={"sub_group_size": -1}), "zero_optimization.sub_group_size", ">= 0"),
    (ds(zero_optimization={"sub_group_size": 0, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}),
     "zero_optimization.sub_group_size", "sub-group per parameter"),
    (ds(zero_optimization={"sub_group_size": 1.5}), "zero_optimization.sub_group_size", "integral"),
    (ds(zero_optimization={"sub_group_size": "1e9"}), "zero_optimization.sub_group_size", ">= 0"),
    (ds(zero_optimization={"sub_group_size": True}), "zero_optimization.sub_group_size", ">= 0"),
    (ds(zero_optimization={"sub_group_size": 2**63}), "zero_optimization.sub_group_size", "<= "),
    (ds(zero_optimization={"cpu_offload": "true"}), "zero_optimization.cpu_offload", "true or false"),
    (ds(zero_optimization={"cpu_offload_param": 1}), "zero_optimization.cpu_offload_param", "true or false"),
    (ds(zero_optimization={"cpu_offload_use_pin_memory": "no"}), "zero_optimization.cpu_offload_use_pin_memory",
     "true or false"),
    (ds(zero_optimization={"cpu_offload_param": True}), "zero_optimization.offload_param",
     "parameter offload needs stage 3"),
    (ds(aio={"block_size": 1000}), "aio.block_size", ">= 4096"),
    (ds(aio={"block_size": 0}), "aio.block_size", ">= 4096"),
    (ds(aio={"block_size": 6144}), "aio.block_size", "multiple of 4096"),
    (ds(aio={"block_size": "1M"}), "aio.block_size", ">= 4096"),
    (ds(aio={"block_size": True}), "aio.block_size", ">= 4096"),
    (ds(aio={"queue_depth": 0}), "aio.queue_depth", ">= 1"),
    (ds(aio={"queue_depth": 2**31}), "aio.queue_depth", "<= 2147483647"),
    (ds(aio={"queue_depth": 8.5}), "aio.queue_depth", "integral"),
    (ds(aio={"intra_op_parallelism": 0}), "aio.intra_op_parallelism", ">= 1"),
    (ds(aio={"thread_count": -2}), "aio.intra_op_parallelism", ">= 1"),
    (ds(aio={"thread_count": "4"}), "aio.intra_op_parallelism", ">= 1"),
    (ds(aio={"single_submit": "false"}), "aio.single_submit", "true or false"),
    (ds(aio={"overlap_events": None}), "aio.overlap_events", "true or false"),
    (ds(aio={"use_gds": True}), "aio.use_gds", "GPUDirect Storage is not supported"),
    (ds(aio={"use_gds": "no"}), "aio.use_gds", "true or false"),
    (ds(aio=[]), "aio", "JSON object"),
    (ds(aio={"thread_count": 2, "intra_op_parallelism": 2}), "aio.thread_count", "given twice"),
]


@pytest.mark.parametrize("config,path,accepted", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_value_names_key_path(config, path, accepted):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_deepspeed(config, strict=False)
    message = str(info.value)
    assert message.startswith(path + ":") or message.startswith(path + " "), message
    assert accepted in message


@pytest.mark.parametrize("make,path", [
    (lambda: OptimizerConfig(lr=-1.0), "optimizer.params.lr"),
    (lambda: OptimizerConfig(type="SGD"), "optimizer.type"),
    (lambda: OptimizerConfig(type="AdamW", adamw_mode=False), "optimizer.params.adam_w_mode"),
    (lambda: FP16Config(hysteresis=0), "fp16.hysteresis"),
    (lambda: ZeroOptimizationConfig(stage=4), "zero_optimization.stage"),
    (lambda: ZeroConfig(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (lambda: ZeroConfig(bf16=1), "bf16.enabled"),
    (lambda: ZeroConfig(optimizer={"lr": 1.0}), "optimizer"),
    (lambda: ZeroConfig(zero_optimization={"stage": 2}), "zero_optimization"),
    (lambda: OffloadOptimizerConfig(device="nvme"), "zero_optimization.offload_optimizer.nvme_path"),
    (lambda: OffloadOptimizerConfig(ratio=0.5), "zero_optimization.offload_optimizer.ratio"),
    (lambda: OffloadOptimizerConfig(device="disk"), "zero_optimization.offload_optimizer.device"),
    (lambda: OffloadParamConfig(buffer_size=0), "zero_optimization.offload_param.buffer_size"),
    (lambda: OffloadParamConfig(device="nvme", nvme_path=b"/nvme"), "zero_optimization.offload_param.nvme_path"),
    (lambda: ZeroOptimizationConfig(stage=2, offload_param=OffloadParamConfig(device="cpu")),
     "zero_optimization.offload_param"),
    (lambda: ZeroOptimizationConfig(offload_optimizer={"device": "cpu"}), "zero_optimization.offload_optimizer"),
    (lambda: ZeroOptimizationConfig(stage=3, offload_param=None), "zero_optimization.offload_param"),
    (lambda: ZeroOptimizationConfig(sub_group_size=0, offload_optimizer=OffloadOptimizerConfig("nvme", "/nvme")),
     "zero_optimization.sub_group_size"),
    (lambda: AioConfig(block_size=4095), "aio.block_size"),
    (lambda: AioConfig(thread_count=0), "aio.intra_op_parallelism"),
    (lambda: ZeroConfig(aio={"block_size": 4096}), "aio"),
])
def test_direct_construction_validates(make, path):
    with pytest.raises(ValueError, match="^" + re.escape(path)):
        make()


def test_optimizer_types_and_deepspeed_defaults():
    opt = lambda d: ZeroConfig.from_deepspeed(ds(optimizer=d)).optimizer  # noqa: E731
    assert opt({"type": "adamw"}).type == "AdamW" and opt({"type": "ADAM"}).type == "Adam"
    assert OptimizerConfig(type="adamW").type == "AdamW"
    # A DeepSpeed JSON without weight_decay gets DeepSpeed's 0.0 for both types (its FusedAdam default).
    assert opt({"type": "Adam"}).weight_decay == 0.0 and opt({"type": "AdamW"}).weight_decay == 0.0
    assert opt({}).type == "AdamW" and opt({}).weight_decay == 0.0 and OptimizerConfig().weight_decay == 0.0
    assert opt({"type": "Adam"}).adamw_mode is True  # DeepSpeed's adam_w_mode defaults to True
    assert opt({"type": "Adam", "params": {"adam_w_mode": False}}).adamw_mode is False
    assert opt({"type": "AdamW", "params": {"adam_w_mode": False}}).adamw_mode is True  # DeepSpeed forces it
    assert opt({"params": {"betas": (0.5, 0.6)}}).betas == (0.5, 0.6)
    assert OptimizerConfig(betas=[0.5, 0.6], lr=1).betas == (0.5, 0.6)
    assert type(OptimizerConfig(lr=1).lr) is float


def test_auto_where_deepspeed_reads_its_default_is_absent():
    """DeepSpeed's zero_optimization models read "auto" as the default and the Trainer fills in only the bucket
    sizes: OpenRLHF's configs leave these "auto" (its get_train_ds_config)."""
    config = ds(zero_optimization={"stage": 3, "offload_param": {"device": "none"},
                                   "offload_optimizer": {"device": "cpu", "pin_memory": "auto"},
                                   "sub_group_size": "auto", "stage3_max_live_parameters": "auto",
                                   "stage3_max_reuse_distance": "auto", "allgather_bucket_size": "auto",
                                   "zero_hpz_partition_size": 1, "zero_quantized_weights": False},
                data_types={"grad_accum_dtype": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero = ZeroConfig.from_deepspeed(config).zero_optimization
    default = ZeroOptimizationConfig(stage=3)
    assert (zero.sub_group_size, zero.stage3_max_live_parameters, zero.allgather_bucket_size) == (
        default.sub_group_size, default.stage3_max_live_parameters, default.allgather_bucket_size)
    assert zero.offload_optimizer.pin_memory == OffloadOptimizerConfig(device="cpu").pin_memory


def test_auto_placeholder_rejected():
    for config, path in [(ds(gradient_accumulation_steps="auto"), "gradient_accumulation_steps"),
                         (ds(optimizer={"params": {"lr": "auto"}}), "optimizer.params.lr"),
                         (ds(optimizer={"params": {"betas": "auto"}}), "optimizer.params.betas"),
                         (ds(zero_optimization={"stage": "auto"}), "zero_optimization.stage"),
                         (ds(zero_optimization={"reduce_bucket_size": "auto"}), "zero_optimization.reduce_bucket_size"),
                         (ds(fp16={"enabled": "auto"}), "fp16.enabled")]:
        with pytest.raises(ValueError, match=re.escape(path) + r': "auto" is a Hugging Face Trainer placeholder'):
            ZeroConfig.from_deepspeed(config)


@pytest.mark.parametrize("config,path,suggestion", [
    (ds(zero_optimization={"stagee": 2}), "zero_optimization.stagee", "stage"),
    (ds(optimzer={}), "optimzer", "optimizer"),
    (ds(optimizer={"params": {"learning_rate": 1e-3}}), "optimizer.params.learning_rate", None),
    (ds(optimizer={"params": {"weight_decy": 0.1}}), "optimizer.params.weight_decy", "weight_decay"),
    (ds(fp16={"loss_scale_windw": 10}), "fp16.loss_scale_windw", "loss_scale_window"),
    (ds(bf16={"enable": True}), "bf16.enable", "enabled"),
    (ds(gradient_acumulation_steps=2), "gradient_acumulation_steps", "gradient_accumulation_steps"),
    (ds(zero_optimization={"offload_optimizer": {"device": "cpu", "pin_memroy": True}}),
     "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"buffer_sise": 10}}),
     "zero_optimization.offload_param.buffer_sise", "buffer_size"),
    (ds(zero_optimization={"stage": 3, "offload_param": {"ratio": 1.0}}), "zero_optimization.offload_param.ratio",
     None),
    (ds(zero_optimization={"sub_group_sise": 10}), "zero_optimization.sub_group_sise", "sub_group_size"),
    (ds(zero_optimization={"cpu_ofload": True}), "zero_optimization.cpu_ofload", "cpu_offload"),
    (ds(aio={"queue_dept": 4}), "aio.queue_dept", "queue_depth"),
    (ds(aio={"intra_op_paralelism": 4}), "aio.intra_op_paralelism", "intra_op_parallelism"),
])
def test_unknown_key(config, path, suggestion):
    for strict in (True, False):  # unknown keys are errors either way
        with pytest.raises(ValueError) as info:
            ZeroConfig.from_deepspeed(config, strict=strict)
        message = str(info.value)
        assert message.startswith(path + ": unknown key")
        assert "accepted keys here:" in message
        if suggestion is not None:
            assert f"did you mean {suggestion!r}" in message
    if path.startswith("zero_optimization.") and path.count(".") == 1:
        assert "stage3_param_persistence_threshold" in message  # lists the accepted keys at that level


def test_top_level_comment_keys_are_ignored_and_other_unknown_keys_named():
    config = ZeroConfig.from_deepspeed({"_comment": "supported models: ...", "_notes": ["a"],
                                        "zero_optimization": {"stage": 2}})
    assert config.zero_optimization.stage == 2
    with pytest.raises(ValueError, match=r"zero_optimization\._comment: unknown key"):  # only at the top, as there
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "_comment": "x"}})
    with pytest.raises(ValueError, match="comment: unknown key"):
        ZeroConfig.from_deepspeed({"comment": "x"})


def test_max_grad_norm_hint():
    with pytest.raises(ValueError, match=r"optimizer\.params\.max_grad_norm: unknown key.*gradient_clipping"):
        ZeroConfig.from_deepspeed(ds(optimizer={"params": {"max_grad_norm": 1.0}}))


UNSUPPORTED = {
    "flops_profiler": {"enabled": True},  # (the scheduler section is supported: tests/test_hf_configs.py)
    "activation_checkpointing": {"cpu_checkpointing": True, "offload": True},
    "memory_breakdown": True,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": True}},
    "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True},
                          "zeropp_loco_param": {"err_beta": 0.8}, "sub_group_size": 1e9},
}
UNSUPPORTED_PATHS = ["flops_profiler", "activation_checkpointing", "memory_breakdown",
                     "optimizer.params.amsgrad", "fp16.fp16_master_weights_and_grads",
                     "zero_optimization.offload_optimizer.super_offload",
                     "zero_optimization.zeropp_loco_param"]
# The same keys at values that ask for what zerocore does (Note [DeepSpeed keys at what zerocore does]).
LIKE_ZEROCORE = {
    "flops_profiler": {"enabled": False, "profile_step": 1}, "tensorboard": {"enabled": False},
    "wandb": {"enabled": False}, "comms_logger": {"enabled": False, "verbose": False},
    # deepspeed.checkpointing's own buffers and count: zerocore's checkpointing is torch's
    # (DeepSpeed's engine never reads the section; zerocore.deepspeed.checkpointing.configure does)
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                 "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                 "synchronize_checkpoint_boundary": True, "profile": False},
    # (the same average however DeepSpeed splits the division; sparse gradients refused at initialize by module)
    "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "prescale_gradients": True,
    "gradient_predivide_factor": 2.0, "sparse_gradients": True, "memory_breakdown": False,
    "checkpoint": {"tag_validation": "Warn", "load_universal": False, "use_node_local_storage": False},
    "data_types": {"grad_accum_dtype": None},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "amsgrad": False}},
    "fp16": {"enabled": True, "fp16_master_weights_and_grads": False},
    # (pipeline_read/pipeline_write either way: zerocore's NVMe step always overlaps its reads and writes)
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pipeline_read": True,
                                                            "pipeline_write": False, "cpuadam_cores_perc": 0.75},
                          "stage3_gather_16bit_weights_on_model_save": True, "stage3_max_reuse_distance": 1e9,
                          "round_robin_gradients": True, "allgather_partitions": True, "elastic_checkpoint": True,
                          "memory_efficient_linear": False, "use_multi_rank_bucket_allreduce": False,
                          "ignore_unused_parameters": True, "sub_group_size": 1e9,
                          # any threshold: zerocore fetches whole blocks, never a module inside one alone
                          "stage3_module_granularity_threshold": 16},
}


def test_deepspeed_keys_at_what_zerocore_does_are_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = ZeroConfig.from_deepspeed(LIKE_ZEROCORE)
    assert (c.optimizer.lr, c.fp16.enabled, c.zero_optimization.stage) == (1e-4, True, 3)
    # a value other than what zerocore does is still named, whichever key carries it
    for path, value in [("comms_logger", {"enabled": True}), ("gradient_predivide_factor", 0.0),
                        ("gradient_predivide_factor", "2"), ("sparse_gradients", 1),
                        ("zero_optimization.offload_optimizer.cpuadam_cores_perc", 1.5),
                        ("zero_optimization.stage3_max_reuse_distance", -1),
                        ("zero_optimization.stage3_module_granularity_threshold", -1),
                        ("zero_optimization.module_granularity_threshold", "16"),
                        ("zero_optimization.load_from_fp32_weights", False),
                        ("zero_optimization.round_robin_gradients", "yes"),  # either boolean, nothing else
                        ("zero_optimization.ignore_unused_parameters", 1),  # a number is not a boolean
                        ("checkpoint", {"tag_validation": "Ignore"}),
                        ("activation_checkpointing", {"cpu_checkpointing": "yes"}),
                        ("activation_checkpointing", {"partition_activations": 1}),
                        ("activation_checkpointing", {"number_checkpoints": 4, "offload": True})]:
        config = copy.deepcopy(LIKE_ZEROCORE)
        *parents, key = path.split(".")
        section = config
        for parent in parents:
            section = section[parent]
        section[key] = value
        with pytest.raises(ValueError, match="not supported yet") as info:
            ZeroConfig.from_deepspeed(config)
        assert path in str(info.value), (path, str(info.value))


def test_gather_16bit_weights_on_model_save_in_every_spelling():
    """DeepSpeed reads stage3_gather_16bit_weights_on_model_save also without its prefix and under its deprecated
    fp16 name; zerocore keeps it (True when absent or "auto": save_16bit_model writes the weights) and writes it
    back for DeepSpeed."""
    def read(zero: dict) -> bool:
        config = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, **zero}})
        return config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    assert read({}) and read({"stage3_gather_16bit_weights_on_model_save": "auto"})
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        assert read({key: True}) and not read({key: False}), key
    with pytest.raises(ValueError, match="stage3_gather_16bit_weights_on_model_save: expected true or false"):
        read({"stage3_gather_16bit_weights_on_model_save": "no"})
    with pytest.raises(ValueError, match="given twice"):
        read({"stage3_gather_16bit_weights_on_model_save": True, "gather_16bit_weights_on_model_save": True})
    written = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3,
                                                               "gather_16bit_weights_on_model_save": False}})
    again = ZeroConfig.from_deepspeed(written.to_deepspeed())
    assert written.to_deepspeed()["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert again == written


def test_deepspeed_sections_that_change_nothing_here_load_and_others_are_named():
    """compile without DeepCompile, the throughput timers, one rank of sequence parallelism: accepted as
    DeepSpeed's configs spell them; DeepCompile or Ulysses over several ranks are named as unsupported."""
    quiet = [{"compile": {"deepcompile": False, "free_activation": True, "double_buffer": True}}, {"compile": {}},
             {"timers": {"throughput": {"enabled": True, "synchronized": False}}}, {"sequence_parallel_size": 1}]
    for extra in quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}, **extra})
    for key, value in [("compile", {"deepcompile": True}), ("timers", {"throughput": {"enabled": "yes"}}),
                       ("timers", {"other": {}}), ("sequence_parallel_size", 2)]:
        with pytest.raises(ValueError, match=f"not supported yet by zerocore: {key}"):
            ZeroConfig.from_deepspeed({key: value})


def test_axolotls_zero3_config_loads():
    """axolotl's deepspeed_configs/zero3.json, its "auto" values as the Trainer fills them: DeepSpeed's zeros for
    sub_group_size (a sub-group per parameter: nothing without NVMe offload), stage3_max_live_parameters (no
    prefetching) and stage3_max_reuse_distance (release at once)."""
    config = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
                                    "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 1e6,
                                    "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True},
              "bf16": {"enabled": True}, "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 0,
                                                  "initial_scale_power": 32, "loss_scale_window": 1000,
                                                  "hysteresis": 2, "min_loss_scale": 1},
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 2,
              "wall_clock_breakdown": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero = ZeroConfig.from_deepspeed(config).zero_optimization
    assert (zero.sub_group_size, zero.stage3_max_live_parameters) == (0, 0)


@pytest.mark.parametrize("precision,accum,dtype", [
    ({}, "fp32", torch.float32), ({"bf16": {"enabled": True}}, "bf16", torch.bfloat16),
    ({"fp16": {"enabled": True}}, "FP16", torch.float16), ({}, None, torch.float32),
    ({"bf16": {"enabled": True}}, None, torch.bfloat16), ({"bf16": {"enabled": True}}, "fp32", torch.float32),
    ({"fp16": {"enabled": True}}, "FP32", torch.float32)])
def test_grad_accum_dtype_is_the_compute_dtype_or_fp32(precision, accum, dtype):
    """DeepSpeed's data_types.grad_accum_dtype: null (its default) or the compute dtype's name accumulate in the
    compute dtype; "fp32" with 16-bit compute in fp32 (Note [fp32 gradient accumulation]), and the config says so
    when written back."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ZeroConfig.from_deepspeed({**precision, "data_types": {"grad_accum_dtype": accum}})
    assert config.accumulation_dtype == dtype
    back = config.to_deepspeed()
    assert back.get("data_types") == (None if accum is None else {"grad_accum_dtype": accum.lower()})
    assert ZeroConfig.from_deepspeed(back) == config


@pytest.mark.parametrize("bf16,check", [
    ({"enabled": True}, True), ({"enabled": True, "check_grad_overflow": True}, True),
    ({"enabled": True, "check_grad_overflow": False}, False),
    ({"enabled": False, "check_grad_overflow": False}, False)])
def test_bf16_check_grad_overflow_is_read_and_written_back(bf16, check):
    """DeepSpeed's bf16.check_grad_overflow (default true: a step with a non-finite gradient norm is skipped);
    bf16.immediate_grad_update at either value changes no sum here."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ZeroConfig.from_deepspeed({"bf16": {**bf16, "immediate_grad_update": not check}})
    assert config.check_grad_overflow is check
    assert ZeroConfig.from_deepspeed(config.to_deepspeed()) == config
    with pytest.raises(ValueError, match=r"bf16\.check_grad_overflow: expected true or false"):
        ZeroConfig.from_deepspeed({"bf16": {"enabled": True, "check_grad_overflow": "no"}})
    with pytest.raises(ValueError, match="check_grad_overflow: unknown key"):  # a bf16 key, not a top-level one
        ZeroConfig.from_deepspeed({"check_grad_overflow": False})


def test_grad_accum_dtype_other_than_the_compute_dtype_or_fp32_is_refused_with_the_reason():
    for precision, accum in [({"fp16": {"enabled": True}}, "bf16"), ({"bf16": {"enabled": True}}, "fp16"),
                             ({}, "bf16")]:
        with pytest.raises(ValueError, match=rf"data_types\.grad_accum_dtype: '{accum}' with \w+ compute: gradients "
                                             "accumulate in the compute dtype or in fp32"):
            ZeroConfig.from_deepspeed({**precision, "data_types": {"grad_accum_dtype": accum}})
    with pytest.raises(ValueError, match=r"data_types\.grad_accum_dtype: expected one of"):
        ZeroConfig.from_deepspeed({"data_types": {"grad_accum_dtype": "int8"}})
    with pytest.raises(ValueError, match=r"data_types\.other: unknown key"):
        ZeroConfig.from_deepspeed({"data_types": {"other": 1}})


def test_unsupported_keys_strict():
    with pytest.raises(ValueError, match="not supported yet") as info:
        ZeroConfig.from_deepspeed(UNSUPPORTED)
    assert all(path in str(info.value) for path in UNSUPPORTED_PATHS)
    assert "strict=False" in str(info.value)


def test_unsupported_keys_non_strict_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = ZeroConfig.from_deepspeed(UNSUPPORTED, strict=False)
    assert len(caught) == 1 and caught[0].category is UserWarning
    assert all(path in str(caught[0].message) for path in UNSUPPORTED_PATHS)
    expected = ZeroConfig(optimizer=OptimizerConfig(type="AdamW", lr=1e-4), fp16=FP16Config(enabled=True),
                          zero_optimization=ZeroOptimizationConfig(
                              stage=3, offload_optimizer=OffloadOptimizerConfig(device="cpu")))
    assert c == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroConfig.from_deepspeed(FULL, strict=False)  # nothing unsupported: no warning


def test_aliases_and_ignored_keys():
    c = ZeroConfig.from_deepspeed(ds(bfloat16={"enabled": True}, wall_clock_breakdown=False,
                                     zero_optimization={"prefetch_bucket_size": 7, "max_live_parameters": 8,
                                                        "param_persistence_threshold": 9}))
    z = c.zero_optimization
    assert c.bf16 and (z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters,
                       z.stage3_param_persistence_threshold) == (7, 8, 9)
    with pytest.raises(ValueError, match=r"zero_optimization\.stage3_prefetch_bucket_size: given twice"):
        ZeroConfig.from_deepspeed(ds(zero_optimization={"prefetch_bucket_size": 7, "stage3_prefetch_bucket_size": 7}))
    for value in ("4", -1, {}, [1]):  # an ignored key is still checked: a typo in it is not silent
        with pytest.raises(ValueError, match="wall_clock_breakdown: expected true or false"):
            ZeroConfig.from_deepspeed(ds(wall_clock_breakdown=value))


def test_users_dict_not_mutated():
    for config, strict in [(FULL, True), (UNSUPPORTED, False),
                           (ds(bfloat16={"enabled": True}, zero_optimization={"prefetch_bucket_size": 1}), True),
                           (ds(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}), True),
                           (ds(optimizer={"type": "adam"}), True),
                           (ds(zero_optimization={"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                  "cpu_offload_use_pin_memory": False,
                                                  "offload_optimizer": {"device": "cpu"}},
                               aio={"thread_count": 2, "use_gds": False}), True)]:
        before = copy.deepcopy(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            c = ZeroConfig.from_deepspeed(config, strict=strict)
        assert config == before
        out = c.to_deepspeed()
        out["optimizer"]["params"]["betas"][0] = 0.0  # to_deepspeed hands out a fresh dict
        assert c.to_deepspeed() != out
    bad = ds(zero_optimization={"stage": 3, "reduce_bucket_size": 1.5})
    before = copy.deepcopy(bad)
    with pytest.raises(ValueError):
        ZeroConfig.from_deepspeed(bad)
    assert bad == before


def test_bf16_and_fp16_rejected():
    with pytest.raises(ValueError, match=r"bf16\.enabled and fp16\.enabled"):
        ZeroConfig(bf16=True, fp16=FP16Config(enabled=True))
    with pytest.raises(ValueError, match=r"bf16\.enabled and fp16\.enabled"):
        ZeroConfig.from_deepspeed(ds(bf16={"enabled": True}, fp16={"enabled": True}))
    ZeroConfig.from_deepspeed(ds(bf16={"enabled": True}, fp16={"enabled": False}))


def test_check_batch_sizes():
    ZeroConfig().check_batch_sizes(8)  # nothing given: nothing to check
    ZeroConfig(train_micro_batch_size_per_gpu=4).check_batch_sizes(8)
    ZeroConfig(train_batch_size=64, train_micro_batch_size_per_gpu=2,
               gradient_accumulation_steps=4).check_batch_sizes(8)
    ZeroConfig(train_batch_size=64, gradient_accumulation_steps=4).check_batch_sizes(8)
    with pytest.raises(ValueError) as info:
        ZeroConfig(train_batch_size=64, train_micro_batch_size_per_gpu=2).check_batch_sizes(8)
    message = str(info.value)
    for name in ("train_batch_size (64)", "train_micro_batch_size_per_gpu (2)", "gradient_accumulation_steps (1)",
                 "world_size (8)", "gradient_accumulation_steps = 4 would satisfy it"):
        assert name in message
    with pytest.raises(ValueError, match=r"train_batch_size \(60\) is not divisible by gradient_accumulation_steps"):
        ZeroConfig(train_batch_size=60, gradient_accumulation_steps=4).check_batch_sizes(8)
    with pytest.raises(ValueError, match="world_size"):
        ZeroConfig().check_batch_sizes(0)


def test_frozen():
    c = ZeroConfig()
    for obj, name, value in [(c, "bf16", True), (c.optimizer, "lr", 1.0), (c.fp16, "enabled", True),
                             (c.zero_optimization, "stage", 3),
                             (c.zero_optimization.offload_optimizer, "device", "cpu"),
                             (c.zero_optimization.offload_param, "buffer_size", 1), (c.aio, "queue_depth", 1)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, value)
    assert dataclasses.replace(c, bf16=True).bf16 and not c.bf16
    with pytest.raises(ValueError, match=r"^zero_optimization\.stage"):
        dataclasses.replace(c.zero_optimization, stage=7)  # replace() validates too
    with pytest.raises(ValueError, match=r"^zero_optimization\.offload_optimizer\.nvme_path: required"):
        dataclasses.replace(c.zero_optimization.offload_optimizer, device="nvme")


def test_bad_sources(tmp_path):
    with pytest.raises(TypeError):
        ZeroConfig.from_deepspeed(42)
    with pytest.raises(FileNotFoundError):
        ZeroConfig.from_deepspeed(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 8,}')
    with pytest.raises(ValueError, match="not valid JSON"):
        ZeroConfig.from_deepspeed(broken)
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(ValueError, match="'stage' appears twice"):
        ZeroConfig.from_deepspeed(twice)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="^config: expected a JSON object"):
        ZeroConfig.from_deepspeed(listed)


def test_accumulation_steps_derived_from_batch_sizes_as_deepspeed_does():
    source = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    config = ZeroConfig.from_deepspeed(source)
    assert config.derive_accumulation_steps and config.gradient_accumulation_steps == 1
    assert config.for_world_size(2).gradient_accumulation_steps == 4
    assert config.for_world_size(8).gradient_accumulation_steps == 1
    with pytest.raises(ValueError, match="train_batch_size \\(32\\)"):
        config.for_world_size(3)
    assert ZeroConfig.from_deepspeed(config.to_deepspeed()) == config
    explicit = ZeroConfig.from_deepspeed({**source, "gradient_accumulation_steps": 2})
    assert not explicit.derive_accumulation_steps
    with pytest.raises(ValueError, match="gradient_accumulation_steps = 4 would satisfy it"):
        explicit.for_world_size(2)


# ---- offload_optimizer, offload_param, sub_group_size, aio (issue 11) ------------------------------------
def _zero(**keys) -> ZeroOptimizationConfig:
    return ZeroConfig.from_deepspeed({"zero_optimization": keys}).zero_optimization


def test_offload_sections_parse():
    z = _zero(stage=3, offload_optimizer={"device": "CPU", "pin_memory": False, "buffer_count": 6.0},
              offload_param={"device": "Nvme", "nvme_path": "/local_nvme", "buffer_count": 2, "buffer_size": 1e7,
                             "max_in_cpu": 5e8}, sub_group_size=1e9)
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=False, buffer_count=6)
    assert z.offload_param == OffloadParamConfig(device="nvme", nvme_path="/local_nvme", buffer_count=2,
                                                 buffer_size=10_000_000, max_in_cpu=500_000_000)
    assert z.sub_group_size == 1_000_000_000
    for value in (z.sub_group_size, z.offload_optimizer.buffer_count, z.offload_param.buffer_size,
                  z.offload_param.max_in_cpu):
        assert type(value) is int  # integral floats (1e9) are stored as ints
    ratio = _zero(offload_optimizer={"ratio": 1}).offload_optimizer.ratio
    assert type(ratio) is float and ratio == 1.0
    # Optimizer offload works at every stage; nvme takes an nvme_path (a str, or any os.PathLike when built directly).
    for stage in (1, 2, 3):
        z = _zero(stage=stage, offload_optimizer={"device": "nvme", "nvme_path": "/nvme", "fast_init": True})
        assert z.offload_optimizer == OffloadOptimizerConfig("nvme", "/nvme", True, 4, True, 1.0)
    assert OffloadParamConfig(device="nvme", nvme_path=Path("/nvme")).nvme_path == "/nvme"
    # A section given as null (or false) is no offload; an nvme_path with device cpu is kept (and unused).
    assert _zero(stage=3, offload_optimizer=None, offload_param=False) == ZeroOptimizationConfig(stage=3)
    assert _zero(offload_optimizer={"device": "cpu", "nvme_path": "/x"}).offload_optimizer.nvme_path == "/x"


@pytest.mark.parametrize("offload", [{"device": "none"}, {"device": "NONE"}, {}, None])
def test_offload_device_none_is_still_accepted(offload):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = _zero(stage=3, offload_optimizer=offload, offload_param=offload, cpu_offload=False, cpu_offload_param=False)
    assert z == ZeroOptimizationConfig(stage=3)
    for stage in (1, 2):  # device none never needs stage 3
        assert _zero(stage=stage, offload_param={"device": "none", "buffer_count": 3}).offload_param.device == "none"


def test_legacy_cpu_offload_flags():
    cpu_opt, cpu_param = OffloadOptimizerConfig(device="cpu"), OffloadParamConfig(device="cpu")
    assert _zero(cpu_offload=True).offload_optimizer == cpu_opt
    assert _zero(stage=2, cpu_offload=True) == ZeroOptimizationConfig(stage=2, offload_optimizer=cpu_opt)
    assert _zero(stage=3, cpu_offload_param=True).offload_param == cpu_param
    assert _zero(stage=3, cpu_offload=False, cpu_offload_param=None) == ZeroOptimizationConfig(stage=3)
    z = _zero(stage=3, cpu_offload=True, cpu_offload_param=True, cpu_offload_use_pin_memory=False)
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=False)
    assert z.offload_param == OffloadParamConfig(device="cpu", pin_memory=False)
    z = _zero(cpu_offload_use_pin_memory=False)  # pin_memory of both, offloaded or not
    assert not z.offload_optimizer.pin_memory and not z.offload_param.pin_memory
    # A flag and a section that agree: the section's other settings are kept.
    z = _zero(stage=3, cpu_offload=True, offload_optimizer={"device": "CPU", "buffer_count": 7},
              cpu_offload_param=False, offload_param={"device": "none", "pin_memory": True},
              cpu_offload_use_pin_memory=True)
    assert z.offload_optimizer == OffloadOptimizerConfig(device="cpu", buffer_count=7)
    assert z.offload_param == OffloadParamConfig()
    assert _zero(cpu_offload=True, offload_optimizer={"buffer_count": 3}).offload_optimizer == OffloadOptimizerConfig(
        device="cpu", buffer_count=3)  # a section without a device takes the flag's


@pytest.mark.parametrize("keys,flag,other", [
    ({"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}, "cpu_offload",
     "zero_optimization.offload_optimizer.device 'nvme'"),
    ({"cpu_offload": True, "offload_optimizer": {"device": "none"}}, "cpu_offload",
     "zero_optimization.offload_optimizer.device 'none'"),
    ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}, "cpu_offload",
     "zero_optimization.offload_optimizer.device 'cpu'"),
    ({"stage": 3, "cpu_offload_param": True, "offload_param": {"device": "none"}}, "cpu_offload_param",
     "zero_optimization.offload_param.device 'none'"),
    ({"cpu_offload_use_pin_memory": True, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
     "cpu_offload_use_pin_memory", "zero_optimization.offload_optimizer.pin_memory false"),
    ({"stage": 3, "cpu_offload_use_pin_memory": False, "offload_param": {"pin_memory": True}},
     "cpu_offload_use_pin_memory", "zero_optimization.offload_param.pin_memory true"),
])
def test_legacy_flag_and_section_that_disagree_are_named_together(keys, flag, other):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_deepspeed({"zero_optimization": keys})
    message = str(info.value)
    assert message.startswith(f"zero_optimization.{flag}: ") and "disagrees with " + other in message, message


def test_aio_section():
    assert ZeroConfig.from_deepspeed({"aio": None}).aio == AioConfig()
    aio = ZeroConfig.from_deepspeed({"aio": {"block_size": 4096, "queue_depth": 64.0, "thread_count": 8,
                                             "single_submit": True, "overlap_events": False, "use_gds": False}}).aio
    assert aio == AioConfig(4096, 64, 8, True, False) and type(aio.queue_depth) is int
    # DeepSpeed 0.19.8's name for thread_count is intra_op_parallelism: read either, write DeepSpeed's.
    c = ZeroConfig.from_deepspeed({"aio": {"intra_op_parallelism": 3}})
    assert c.aio.thread_count == 3
    assert c.to_deepspeed()["aio"] == {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 3,
                                       "single_submit": False, "overlap_events": True}
    assert ZeroConfig.from_deepspeed(c.to_deepspeed()) == c
    assert ZeroConfig.from_deepspeed({"aio": {"block_size": 2**40}}).aio.block_size == 2**40


def test_offload_written_back():
    c = ZeroConfig.from_deepspeed(FULL)
    zero = c.to_deepspeed()["zero_optimization"]
    assert zero["sub_group_size"] == 100_000_000
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False,
                                         "buffer_count": 8, "fast_init": True, "ratio": 1.0}
    assert zero["offload_param"] == {"device": "cpu", "nvme_path": "/local_nvme/params", "pin_memory": False,
                                     "buffer_count": 6, "buffer_size": 20_000_000, "max_in_cpu": 0}
    assert "nvme_path" not in ZeroConfig().to_deepspeed()["zero_optimization"]["offload_optimizer"]  # unset: left out
    for key in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        assert key not in zero  # the deprecated flags are read, never written


_SIZES = st.integers(1, 2**63 - 1)
_PATHS = st.text(min_size=1, max_size=12)


@st.composite
def _offload_optimizers(draw):
    device = draw(st.sampled_from(["none", "cpu", "nvme", "NVMe", "Cpu"]))
    path = draw(_PATHS if device.lower() == "nvme" else st.none() | _PATHS)
    return OffloadOptimizerConfig(device, path, draw(st.booleans()), draw(_SIZES), draw(st.booleans()),
                                  draw(st.sampled_from([1, 1.0])))


@st.composite
def _offload_params(draw, stage):
    device = draw(st.sampled_from(["none", "cpu", "nvme", "NONE"] if stage == 3 else ["none", "None"]))
    path = draw(_PATHS if device.lower() == "nvme" else st.none() | _PATHS)
    return OffloadParamConfig(device, path, draw(st.booleans()), draw(_SIZES), draw(_SIZES),
                              draw(st.integers(0, 2**63 - 1)))


@st.composite
def _configs(draw):
    stage = draw(st.sampled_from([1, 2, 3]))
    zero = ZeroOptimizationConfig(stage=stage, sub_group_size=draw(_SIZES | st.sampled_from([1e9, 5e8])),
                                  offload_optimizer=draw(_offload_optimizers()),
                                  offload_param=draw(_offload_params(stage)))
    counts = st.integers(1, 2**31 - 1)
    aio = AioConfig(draw(st.integers(1, 2**40)) * 4096, draw(counts), draw(counts), draw(st.booleans()),
                    draw(st.booleans()))
    return ZeroConfig(zero_optimization=zero, aio=aio, bf16=draw(st.booleans()))


@given(_configs())
def test_offload_and_aio_round_trip(c):
    out = c.to_deepspeed()
    assert ZeroConfig.from_deepspeed(out) == c
    assert ZeroConfig.from_deepspeed(json.loads(json.dumps(out))) == c
    assert hash(ZeroConfig.from_deepspeed(out)) == hash(c)


_DEEPSPEED_PYTHON = Path(os.environ.get("ZEROCORE_DEEPSPEED_PYTHON",
                                        Path(__file__).resolve().parents[1] / ".venv-ds" / "bin" / "python"))
_DEEPSPEED_CHECK = r"""
import json, sys
from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
written = json.loads(sys.stdin.read())
zero = DeepSpeedZeroConfig(**written["zero_optimization"])  # zerocore's to_deepspeed(), as DeepSpeed reads it
print(json.dumps({
    "optimizer": DeepSpeedZeroOffloadOptimizerConfig().model_dump(mode="json"),
    "param": DeepSpeedZeroOffloadParamConfig().model_dump(mode="json"),
    "sub_group_size": DeepSpeedZeroConfig().sub_group_size,
    "aio": get_aio_config({}),
    "gradient_clipping": GRADIENT_CLIPPING_DEFAULT,
    "read_back": {"optimizer": zero.offload_optimizer.model_dump(mode="json"),
                  "param": zero.offload_param.model_dump(mode="json"), "sub_group_size": zero.sub_group_size,
                  "aio": get_aio_config(written)},
}))
"""


@pytest.mark.skipif(not _DEEPSPEED_PYTHON.exists(), reason="no DeepSpeed venv (.venv-ds) to compare with")
def test_defaults_are_deepspeeds():
    """zerocore's offload / aio defaults are DeepSpeed's, and DeepSpeed reads zerocore's to_deepspeed() of them
    (and of FULL's non-default ones) to the same values."""
    fields = dataclasses.asdict
    for config in (ZeroConfig(), ZeroConfig.from_deepspeed(FULL)):
        written = config.to_deepspeed()
        done = subprocess.run([str(_DEEPSPEED_PYTHON), "-c", _DEEPSPEED_CHECK], input=json.dumps(written), check=False,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert done.returncode == 0, done.stderr[-3000:]
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
        z = ZeroConfig().zero_optimization
        assert {k: theirs["optimizer"][k] for k in fields(z.offload_optimizer)} == fields(z.offload_optimizer)
        assert {k: theirs["param"][k] for k in fields(z.offload_param)} == fields(z.offload_param)
        assert theirs["sub_group_size"] == z.sub_group_size
        assert theirs["gradient_clipping"] == ZeroConfig().gradient_clipping  # what a JSON without the key means
        assert theirs["aio"] == {**ZeroConfig().to_deepspeed()["aio"], "use_gds": False}
        ours = config.zero_optimization
        back = theirs["read_back"]
        assert {k: back["optimizer"][k] for k in fields(ours.offload_optimizer)} == fields(ours.offload_optimizer)
        assert {k: back["param"][k] for k in fields(ours.offload_param)} == fields(ours.offload_param)
        assert back["sub_group_size"] == ours.sub_group_size
        assert back["aio"] == {**written["aio"], "use_gds": False}
