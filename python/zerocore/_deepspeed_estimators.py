"""DeepSpeed's model-state memory estimators (``estimate_zero2_model_states_mem_needs_all_live`` and its siblings
in ``deepspeed.runtime.zero.stage_1_and_2`` and ``stage3``), answered by zerocore's own planner.

Note [DeepSpeed's estimators]
-----------------------------
DeepSpeed's estimators multiply the parameter count by fixed factors (18 bytes per parameter on the GPU without
offload, 4 x the largest layer for stage 3's gathers, x1.5 on the CPU) and print a table of offload options:
memory per CPU (a node's host memory) and per GPU. A script switched to zerocore keeps calling them, so they are
here with DeepSpeed's names, arguments and table, but every figure is :func:`zerocore.estimate_memory` for that
option at ``num_gpus_per_node * num_nodes`` ranks on ``cuda``, in bf16 mixed precision with Adam (what
DeepSpeed's factors assume): the bytes zerocore's engine would allocate, not a rule of thumb.

* per GPU: the state between steps on the device plus a step's transients (reduce buckets, stage 3's gathered
  units at their planned peak), as ``estimate_memory(...)["step"]`` plans them. Activations are not counted, as
  DeepSpeed's "model states" do not count them.
* per CPU: the host bytes of every rank on a node (offloaded master, moments and staging; stage 3's parameter
  shards with ``offload_param: cpu``), times ``additional_buffer_factor`` as DeepSpeed applies it (slack for the
  allocator).
* ``zero_init=1`` is construction under ``torch.device("meta")`` (zerocore's ``zero.Init``: stage 3 materializes
  unit by unit on the GPU). ``zero_init=0`` is a model each process builds whole on the CPU (in its own dtype;
  4 bytes a parameter for a count, as DeepSpeed assumes) and moves to its GPU, where the engine trains
  (``zerocore.deepspeed.initialize`` moves it, as DeepSpeed does): the node's CPU holds the larger of those models
  and the offloaded state, as DeepSpeed counts, and the GPU the larger of the step's peak and the whole model
  beside the engine's own state while ``initialize`` shards it (an upper bound: DeepSpeed casts to 16 bits first
  and does not count this). Stages 1-2 take no meta-device model, so their rows are ``zero_init=0``'s, as
  DeepSpeed's are.

``_all_live`` plans the model itself (its real buckets and stage-3 units, nothing allocated); ``_all_cold`` and the
single-option functions have only counts, so they plan a stand-in built under ``torch.device("meta")``: stage 3 a
list of identical layers of ``largest_layer_params`` each (one unit per layer, as a transformer's blocks), stages
1-2 a list of matrices of 2**20 elements (many small parameters, as the layers of a real model fill buckets). A
stand-in that would have more than ``MAX_LAYERS`` layers (1024 at stage 3) has fewer, larger ones, which can only
raise the gathered peak it plans.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._units import frozen_storage_dtype, resolve_units
from .estimate import _positive_int, estimate_memory

__all__ = ["MAX_LAYERS", "STAGE2_PIECE", "EstimateRow", "built_bytes", "model_states_rows", "model_to_params",
           "param_count", "print_model_states_table", "stand_in_model"]

# A stand-in's layers at most: planning stage 3 costs about 0.2 ms a unit here (1024: 0.15 s a row of the table,
# six rows), stages 1-2 less per parameter; more layers would change no figure a user reads.
MAX_LAYERS = {1: 8192, 2: 8192, 3: 1024}
STAGE2_PIECE = 1 << 20  # a stages-1-2 stand-in's parameter: a 1024 x 1024 matrix
_COMPUTE = torch.bfloat16  # what the planned configs train in (DeepSpeed's factors assume 16-bit parameters)


@dataclass(frozen=True)
class EstimateRow:
    """One option of DeepSpeed's table: host bytes per node, device bytes per GPU, and the options."""

    cpu_bytes: int
    gpu_bytes: int
    cpu_offload: bool
    cpu_offload_params: bool
    zero_init: bool
    largest_unit_bytes: int  # stage 3: the largest unit gathered in the compute dtype; else 0


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """DeepSpeed's counts: distinct parameters (tied ones once) and the most any one module holds directly."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    total = sum(p.numel() for p in model.parameters())  # (parameters() yields a tied one once)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def built_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s distinct parameters in their own dtypes: what building it on the CPU holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


class _Layer(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel, device="meta"))


def stand_in_model(total_params: int, layer_params: int, stage: int) -> nn.Module:
    """A meta-device model of ``total_params`` elements in layers of ``layer_params`` (the last one holds the
    rest), widened so there are at most ``MAX_LAYERS[stage]`` layers (Note [DeepSpeed's estimators])."""
    layer_params = max(layer_params, math.ceil(total_params / MAX_LAYERS[stage]))
    full, rest = divmod(total_params, layer_params)
    sizes = [layer_params] * full + ([rest] if rest else [])
    return nn.Sequential(*(_Layer(n) for n in sizes))


def model_states_rows(model: nn.Module, stage: int, num_gpus_per_node: Any, num_nodes: Any,
                      additional_buffer_factor: Any, options: list[tuple[bool, bool, bool]] | None = None,
                      model_bytes: int | None = None) -> list[EstimateRow]:
    """zerocore's figures for DeepSpeed's table rows (``options``: (cpu_offload, cpu_offload_params, zero_init),
    by default DeepSpeed's rows for ``stage``). ``model_bytes``: the model's bytes as built on the CPU (default:
    its parameters in fp32, DeepSpeed's assumption for a model it has not seen)."""
    per_node = _positive_int(num_gpus_per_node, "num_gpus_per_node")
    nodes = _positive_int(num_nodes, "num_nodes")
    factor = _factor(additional_buffer_factor)
    total, _ = model_to_params(model)
    if model_bytes is None:
        model_bytes = 4 * total
    if options is None:
        options = ([(True, True, True), (True, True, False), (True, False, True), (True, False, False),
                    (False, False, True), (False, False, False)] if stage == 3
                   else [(True, False, False), (False, False, False)])
    largest_unit = _largest_unit_bytes(model, _COMPUTE) if stage == 3 else 0  # the same for every option
    rows = []
    for cpu_offload, cpu_offload_params, zero_init in options:
        zero = {"stage": stage}
        if cpu_offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        if cpu_offload_params:
            zero["offload_param"] = {"device": "cpu"}
        # (bf16: _COMPUTE)
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        plan = estimate_memory(model, config, per_node * nodes, device="cuda")
        step = plan["step"]
        gpu = plan["device_bytes"] if step is None else step["peak_bytes"] - plan["host_bytes"]
        host = plan["host_bytes"]
        if not zero_init:  # built whole on the CPU, then moved to the GPU (Note [DeepSpeed's estimators])
            host = max(host, model_bytes)
            gpu = max(gpu, model_bytes + plan["device_bytes"])
        cpu = int(host * per_node * factor)
        rows.append(EstimateRow(cpu, gpu, cpu_offload, cpu_offload_params, zero_init, largest_unit))
    return rows


def print_model_states_table(rows: list[EstimateRow], stage: int, total_params: int, num_gpus_per_node: int,
                             num_nodes: int, largest_layer_params: int | None = None) -> None:
    """DeepSpeed's table, with zerocore's figures (Note [DeepSpeed's estimators])."""
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    if largest_layer_params is not None:
        model += f", {int(largest_layer_params / 1e6)}M largest layer params"
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
          f"{model}.\n"
          f"(zerocore's plan for ZeRO stage {stage}, bf16 mixed precision with Adam: zerocore.estimate_memory)")
    print("  per CPU  |  per GPU |   Options")
    for row in rows:
        options = []
        if stage == 3:
            options.append(f"offload_param={'cpu ' if row.cpu_offload_params else 'none'}")
        options.append(f"offload_optimizer={'cpu ' if row.cpu_offload else 'none'}")
        if stage == 3:
            options.append(f"zero_init={int(row.zero_init)}")
        print(f" {row.cpu_bytes / 2**30:7.2f}GB | {row.gpu_bytes / 2**30:6.2f}GB | {', '.join(options)}")


def _largest_unit_bytes(model: nn.Module, compute: torch.dtype) -> int:
    """The largest stage-3 unit's parameters gathered in the compute dtype (DeepSpeed's ``largest_layer_memory``)."""
    return max((sum(p.numel() for p in spec.params) * compute.itemsize
                + sum(p.numel() * frozen_storage_dtype(p, compute).itemsize for p in spec.frozen)
                for spec in resolve_units(model, None)), default=0)


def _factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"additional_buffer_factor must be a finite number > 0, got {value!r}")
    return float(value)


def param_count(value: Any, name: str) -> int:
    """A parameter count as DeepSpeed's cold estimators take it: an int, or an integral float (``7e9``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _positive_int(value, name)
