"""``deepspeed.runtime.zero.stage3`` for scripts switched to zerocore: ``unwrap_model_for_generation`` (TRL's
generation under ZeRO-3 calls it) and the ZeRO-3 memory estimators, DeepSpeed's names, arguments and table with
zerocore's planned bytes (Note [DeepSpeed's estimators] in ``_deepspeed_estimators.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ...._deepspeed_estimators import (built_bytes, model_states_rows, model_to_params, param_count,
                                       print_model_states_table, stand_in_model)
from .partition_parameters import GatheredParameters

__all__ = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
           "estimate_zero3_model_states_mem_needs_all_live", "model_to_params", "unwrap_model_for_generation"]


@contextlib.contextmanager
def unwrap_model_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """DeepSpeed's: ``model`` (the engine, or its module) with every parameter gathered for the whole block, so a
    generation loop's forwards gather nothing (a stage-3 forward otherwise gathers each unit once per token); the
    parameters are released on exit, discarding writes, as ``GatheredParameters`` without a modifier rank. Every
    rank enters it, as it is a collective. DeepSpeed also takes its ZeRO-3 hooks off inside; zerocore's do nothing
    on gathered units, so they stay."""
    with GatheredParameters(model.parameters()):
        yield model


def estimate_zero3_model_states_mem_needs(total_params: Any, largest_layer_params: Any, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True,
                                          cpu_offload_params: bool = True, zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """DeepSpeed's: ``(cpu_bytes, gpu_bytes, largest_layer_bytes)`` per node, per GPU, and for the largest layer
    gathered, for ZeRO-3 with the given offload options, planned by zerocore for a stand-in of ``total_params``
    parameters in layers of ``largest_layer_params``."""
    total, largest = _cold_counts(total_params, largest_layer_params)
    if cpu_offload_params and not cpu_offload:
        raise ValueError("cpu_offload_params=True needs cpu_offload=True (offload_param: cpu without "
                         "offload_optimizer), as DeepSpeed's table has no such row")
    row, = model_states_rows(stand_in_model(total, largest, 3), 3, num_gpus_per_node, num_nodes,
                             additional_buffer_factor, [(bool(cpu_offload), bool(cpu_offload_params), bool(zero_init))])
    return row.cpu_bytes, row.gpu_bytes, row.largest_unit_bytes


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's: prints the table of per-CPU and per-GPU bytes for ``model`` under ZeRO-3 for each offload
    option, from zerocore's plan of the model itself (its units; nothing is allocated)."""
    total, largest = model_to_params(model)
    rows = model_states_rows(model, 3, num_gpus_per_node, num_nodes, additional_buffer_factor,
                             model_bytes=built_bytes(model))
    print_model_states_table(rows, 3, total, num_gpus_per_node, num_nodes, largest)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: Any, largest_layer_params: Any,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's: the same table for a model of ``total_params`` parameters whose largest layer holds
    ``largest_layer_params`` (a stand-in of such layers is planned)."""
    total, largest = _cold_counts(total_params, largest_layer_params)
    rows = model_states_rows(stand_in_model(total, largest, 3), 3, num_gpus_per_node, num_nodes,
                             additional_buffer_factor)
    print_model_states_table(rows, 3, total, num_gpus_per_node, num_nodes, largest)


def _cold_counts(total_params: Any, largest_layer_params: Any) -> tuple[int, int]:
    total = param_count(total_params, "total_params")
    largest = param_count(largest_layer_params, "largest_layer_params")
    if largest > total:
        raise ValueError(f"largest_layer_params ({largest}) must not exceed total_params ({total})")
    return total, largest
