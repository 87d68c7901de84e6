"""DeepSpeed's model-state memory estimators under ``import zerocore.deepspeed as deepspeed``
(``deepspeed.runtime.zero.stage_1_and_2`` and ``stage3``): DeepSpeed's names, arguments and table, every figure
zerocore's own plan (Note [DeepSpeed's estimators])."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import zerocore
from zerocore.deepspeed.runtime.zero import stage3, stage_1_and_2
from zerocore.deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                                    estimate_zero3_model_states_mem_needs_all_cold,
                                                    estimate_zero3_model_states_mem_needs_all_live)
from zerocore.deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                           estimate_zero2_model_states_mem_needs_all_cold,
                                                           estimate_zero2_model_states_mem_needs_all_live)

_ROW = re.compile(r"^ +([0-9.]+)GB \| +([0-9.]+)GB \| (.*)$")
# DeepSpeed's option strings, in its order (deepspeed/runtime/zero/stage3.py, stage_1_and_2.py)
_STAGE3_OPTIONS = ["offload_param=cpu , offload_optimizer=cpu , zero_init=1",
                   "offload_param=cpu , offload_optimizer=cpu , zero_init=0",
                   "offload_param=none, offload_optimizer=cpu , zero_init=1",
                   "offload_param=none, offload_optimizer=cpu , zero_init=0",
                   "offload_param=none, offload_optimizer=none, zero_init=1",
                   "offload_param=none, offload_optimizer=none, zero_init=0"]
_STAGE2_OPTIONS = ["offload_optimizer=cpu ", "offload_optimizer=none"]


def _layers(count: int = 8, width: int = 256) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(count)))


def _table(out: str) -> list[tuple[float, float, str]]:
    return [(float(m.group(1)), float(m.group(2)), m.group(3)) for m in map(_ROW.match, out.splitlines()) if m]


def _gib(value: int) -> float:
    return round(value / 2**30, 2)


def _plan(model: nn.Module, stage: int, world: int, optimizer: bool, params: bool) -> dict:
    zero: dict = {"stage": stage}
    if optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if params:
        zero["offload_param"] = {"device": "cpu"}
    return zerocore.estimate_memory(model, {"bf16": {"enabled": True}, "zero_optimization": zero,
                                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
                                    world, device="cuda")


def test_the_stage3_table_is_deepspeeds_with_the_engines_planned_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    model = _layers(16, 1024)  # 16.8M parameters, 1M per layer
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=2,
                                                   additional_buffer_factor=1.0)
    out = capsys.readouterr().out
    assert "HW: Setup with 2 nodes, 2 GPUs per node." in out
    assert "SW: Model with 16M total params, 1M largest layer params." in out
    rows = _table(out)
    assert [options for _, _, options in rows] == _STAGE3_OPTIONS
    built = 16 * 1024 * 1024 * 4  # the fp32 model a process builds without zero_init
    for (cpu, gpu, options), (optimizer, params, zero_init) in zip(rows, [
            (True, True, True), (True, True, False), (True, False, True), (True, False, False),
            (False, False, True), (False, False, False)]):
        plan = _plan(model, 3, 4, optimizer, params)
        peak = plan["step"]["peak_bytes"] - plan["host_bytes"]
        if zero_init:  # built under torch.device("meta")
            assert (cpu, gpu) == (_gib(2 * plan["host_bytes"]), _gib(peak)), options
        else:  # built whole on the CPU, then moved to the GPU whole
            assert cpu == _gib(2 * max(plan["host_bytes"], built)), options
            assert gpu == _gib(max(peak, built + plan["device_bytes"])), options
    # what each option moves: parameters off the GPU, the optimizer state off the GPU
    (_, full, _), (_, _, _), (_, optimizer_only, _), _, (none_cpu, none_gpu, _), _ = rows
    assert full < optimizer_only < none_gpu and none_cpu == 0.0


def test_the_stage2_table_and_its_rows(capsys: pytest.CaptureFixture[str]) -> None:
    model = _layers(16, 1024)
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4)
    rows = _table(capsys.readouterr().out)
    assert [options for _, _, options in rows] == _STAGE2_OPTIONS
    for (cpu, gpu, options), optimizer in zip(rows, (True, False)):
        plan = _plan(model, 2, 4, optimizer, False)
        built = 16 * 1024 * 1024 * 4
        assert gpu == _gib(max(plan["step"]["peak_bytes"] - plan["host_bytes"], built + plan["device_bytes"])), options
        assert cpu == _gib(int(max(plan["host_bytes"], built) * 4 * 1.5)), options
    # ZeRO-2 without offload: bf16 parameters whole (2 bytes each), gradients, master and moments sharded
    # (2 + 4 + 8 over 4 ranks) and the reduce buckets on top
    assert rows[1][1] >= _gib(16 * 1024 * 1024 * (2 + 14 / 4))


def test_cold_estimates_plan_a_model_of_those_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """Given only counts, the plan is that of a model of identical layers: here the same numbers as the live
    model they describe."""
    model = _layers(12, 512)
    total, largest = 12 * 512 * 512, 512 * 512
    assert stage3.model_to_params(model) == (total, largest)
    assert stage_1_and_2.model_to_params(model) == total
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=8)
    live = _table(capsys.readouterr().out)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=8)
    assert _table(capsys.readouterr().out) == live
    cpu, gpu, largest_bytes = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=8,
                                                                    cpu_offload=True, cpu_offload_params=False,
                                                                    zero_init=True)
    assert (_gib(cpu), _gib(gpu)) == live[2][:2]
    assert largest_bytes == largest * 2  # the largest unit, gathered in bf16
    cpu2, gpu2 = estimate_zero2_model_states_mem_needs(float(total), num_gpus_per_node=8, cpu_offload=False)
    assert cpu2 == int(total * 4 * 8 * 1.5) and gpu2 > 2 * total
    # a count beyond what a stand-in's layers hold at that size plans larger layers, quickly
    estimate_zero3_model_states_mem_needs_all_cold(7e9, 1, num_gpus_per_node=8)
    assert len(_table(capsys.readouterr().out)) == 6


def test_tied_parameters_count_once(capsys: pytest.CaptureFixture[str]) -> None:
    model = _layers(4, 64)
    model[3].weight = model[0].weight
    assert stage3.model_to_params(model) == (3 * 64 * 64, 64 * 64)


@pytest.mark.parametrize("call, match", [
    (lambda: estimate_zero3_model_states_mem_needs_all_cold(0, 1), "total_params"),
    (lambda: estimate_zero3_model_states_mem_needs_all_cold(10, 11), "largest_layer_params"),
    (lambda: estimate_zero3_model_states_mem_needs_all_cold(1.5, 1), "total_params"),
    (lambda: estimate_zero2_model_states_mem_needs_all_cold(100, num_gpus_per_node=0), "num_gpus_per_node"),
    (lambda: estimate_zero2_model_states_mem_needs_all_cold(100, num_nodes=True), "num_nodes"),
    (lambda: estimate_zero2_model_states_mem_needs_all_cold(100, additional_buffer_factor=0), "additional_buffer"),
    (lambda: estimate_zero3_model_states_mem_needs(100, 10, cpu_offload=False, cpu_offload_params=True),
     "cpu_offload_params"),
    (lambda: estimate_zero2_model_states_mem_needs_all_live("model"), "nn.Module"),
])
def test_bad_arguments_are_named(call, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_a_meta_model_is_planned_without_memory(capsys: pytest.CaptureFixture[str]) -> None:
    with torch.device("meta"):
        model = _layers(4, 4096)
    estimate_zero3_model_states_mem_needs_all_live(model)
    assert len(_table(capsys.readouterr().out)) == 6
    assert all(p.is_meta for p in model.parameters())
