"""The ``DeepSpeedEngine`` accessors training scripts call (``get_lr()``, ``was_step_applied()``, the batch
sizes, the ranks, the ``nn.Module`` methods it forwards to its module), so a loop written for DeepSpeed runs
on a zerocore engine unchanged. Each answers from the engine's own state; none communicates."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from ._loss_scaler import LossScaler
    from .config import ZeroConfig
    from .optimizer import ZeroOptimizer


class DeepSpeedAccessors:
    """Mixed into :class:`zerocore.Engine`."""

    config: ZeroConfig
    optimizer: ZeroOptimizer
    world_size: int
    step_applied: bool
    module: nn.Module
    loss_scaler: LossScaler
    stage: int
    rank: int
    global_steps: int
    skipped_steps: int
    _samples_mark: tuple[int, int]

    def get_lr(self) -> list[float]:
        """Each param group's learning rate now (what the next update uses)."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each param group's Adam ``betas``."""
        return [group["betas"] for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters: False inside an accumulation window and after an
        fp16 overflow skipped the update, as DeepSpeed answers."""
        return self.step_applied

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """The per-rank micro-batch size: the config's, or derived from ``train_batch_size`` as DeepSpeed does
        (None when the config gives no batch size)."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        """The global batch size: the config's, or micro-batch x accumulation steps x ranks when only the
        micro-batch size is given (None when the config gives neither)."""
        if self.config.train_batch_size is not None:
            return self.config.train_batch_size
        micro = self.config.train_micro_batch_size_per_gpu
        return None if micro is None else micro * self.config.gradient_accumulation_steps * self.world_size

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on: always, on a zerocore engine (stage 1 at least)."""
        return True

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are sharded: stage 2 and up."""
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Whether parameters are sharded (gather them with ``zerocore.gathered`` to read them): stage 3."""
        return self.stage >= 3

    def zero_offload_optimizer(self) -> Any:
        """The ``offload_optimizer`` section (``.device``: ``"none"``, ``"cpu"`` or ``"nvme"``)."""
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        """The ``offload_param`` section (``.device``: ``"none"``, ``"cpu"`` or ``"nvme"``)."""
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to host memory (``offload_optimizer: cpu``)."""
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer steps on the CPU because its state is offloaded (``cpu`` or ``nvme``)."""
        return self.config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's ``communication_data_type``, else float32 (where
        DeepSpeed's default is the compute dtype, zerocore reduces 16-bit gradients in fp32 unless told)."""
        return self.config.reduce_dtype

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16's loss scale is dynamic (``fp16.loss_scale`` 0), as DeepSpeed answers it."""
        return self.config.fp16.loss_scale == 0

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16

    def gradient_clipping(self) -> float:
        """The config's global-norm clipping threshold (0.0: off)."""
        return self.config.gradient_clipping

    @property
    def dp_world_size(self) -> int:
        """Ranks in the data-parallel group (the engine's process group)."""
        return self.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group (``rank`` is its rank in the engine's group)."""
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: ``LOCAL_RANK`` as torchrun sets it, else 0 (DeepSpeed's answer)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_samples(self) -> int:
        """Samples trained on, counted as DeepSpeed counts them: applied and skipped steps x the global batch
        each was taken at (``set_train_batch_size`` changes it for the steps after it)."""
        samples, steps = self._samples_mark
        return samples + (self.global_steps - steps) * (self.train_batch_size() or 0)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def train(self, mode: bool = True) -> DeepSpeedAccessors:
        self.module.train(mode)
        return self

    def eval(self) -> DeepSpeedAccessors:
        return self.train(False)

    def module_state_dict(self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """DeepSpeed's: the module's ``state_dict()`` (at stage 3 it raises while parameters are sharded, naming
        ``full_state_dict()``, where DeepSpeed's would hold placeholders), without the frozen parameters with
        ``exclude_frozen_parameters``."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
                if not param.requires_grad:
                    state.pop(name, None)
        return state

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()
