"""``deepspeed.runtime.zero.stage_1_and_2``'s memory estimators for scripts switched to zerocore: DeepSpeed's names,
arguments and table, zerocore's planned bytes (Note [DeepSpeed's estimators] in ``_deepspeed_estimators.py``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...._deepspeed_estimators import (STAGE2_PIECE, built_bytes, model_states_rows, param_count,
                                       print_model_states_table, stand_in_model)
from ...._deepspeed_estimators import model_to_params as _model_to_params

__all__ = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
           "estimate_zero2_model_states_mem_needs_all_live", "model_to_params"]


def model_to_params(model: nn.Module) -> int:
    """DeepSpeed's: the model's distinct parameters (tied ones counted once)."""
    return _model_to_params(model)[0]


def estimate_zero2_model_states_mem_needs(total_params: Any, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """DeepSpeed's: ``(cpu_bytes, gpu_bytes)`` per node and per GPU for ZeRO-2 with or without
    ``offload_optimizer: cpu``, planned by zerocore for a stand-in of ``total_params`` parameters."""
    total = param_count(total_params, "total_params")
    row, = model_states_rows(stand_in_model(total, STAGE2_PIECE, 2), 2, num_gpus_per_node, num_nodes,
                             additional_buffer_factor, [(bool(cpu_offload), False, False)])
    return row.cpu_bytes, row.gpu_bytes


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's: prints the table of per-CPU and per-GPU bytes for ``model`` under ZeRO-2, with and without
    ``offload_optimizer: cpu``, from zerocore's plan of the model itself (nothing is allocated)."""
    total, _ = _model_to_params(model)
    rows = model_states_rows(model, 2, num_gpus_per_node, num_nodes, additional_buffer_factor,
                             model_bytes=built_bytes(model))
    print_model_states_table(rows, 2, total, num_gpus_per_node, num_nodes)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: Any, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """DeepSpeed's: the same table for a model of ``total_params`` parameters (a stand-in is planned)."""
    total = param_count(total_params, "total_params")
    rows = model_states_rows(stand_in_model(total, STAGE2_PIECE, 2), 2, num_gpus_per_node, num_nodes,
                             additional_buffer_factor)
    print_model_states_table(rows, 2, total, num_gpus_per_node, num_nodes)
