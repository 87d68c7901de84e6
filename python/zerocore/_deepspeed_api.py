"""The ``DeepSpeedEngine`` accessors training scripts call (``get_lr()``, ``was_step_applied()``, the batch
sizes, the ranks, the ``nn.Module`` methods it forwards to its module, and any other attribute of the module:
Note [Attributes of the module]), so a loop written for DeepSpeed runs on a zerocore engine unchanged. Each
answers from the engine's own state; none communicates."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ._autocast_config import DEFAULT_SAFE_MODULES

if TYPE_CHECKING:
    from ._buckets import BucketSizes
    from ._loss_scaler import LossScaler
    from .config import ZeroConfig
    from .optimizer import ZeroOptimizer


# Note [Attributes of the module]
# DeepSpeed's engine passes an attribute it does not have to its module, and DeepSpeed scripts rely on it:
# ``engine.gradient_checkpointing_enable()`` (DeepSpeed-Chat), ``engine.generate(...)``, a model's own helpers.
# zerocore's engine does the same, except for torch's ``nn.Module`` methods that move, cast or overwrite the
# parameters (``to``, ``cuda``, ``half``, ``apply``, ``load_state_dict``, ...): the engine owns the parameters (at
# stages 1-2 they are views into its buffers, at stage 3 gathered from its shards), so such a call through it would
# change the module's tensors while the engine trains on its own; they raise, naming what to do instead.
# ``generate`` is passed with one default changed at stage 3 (Note [Generation at stage 3]).
_PLACEMENT = ("the engine owns the parameters' device and dtype: the config's bf16/fp16 sections and "
              "initialize(device=...) set them")
_REFUSED_MODULE_METHODS = {
    **dict.fromkeys(("to", "cuda", "cpu", "xpu", "mps", "half", "float", "double", "bfloat16", "type", "to_empty",
                     "share_memory"), _PLACEMENT),
    "apply": "write parameters inside zerocore.gathered(engine.parameters(), modifier_rank=0), or initialize a model "
             "built on the meta device with initialize(..., init_fn=...)",
    "load_state_dict": "load weights with engine.load_hf_weights(...) or engine.load_checkpoint(...), or copy them in "
                       "inside zerocore.gathered(engine.parameters(), modifier_rank=0)",
}


# Note [Generation at stage 3]
# A stage-3 forward gathers each unit, a collective, so every rank must run as many forwards as its peers. A
# generation loop breaks that when ranks stop at different lengths (one batch meets its end token first): the
# rank that stopped issues its next collectives while the others still gather for their next token, and they
# wait for each other until the process group's timeout. Hugging Face's ``generate`` has the remedy,
# ``synced_gpus=True`` (a rank that is done keeps running forwards until every rank is), and turns it on by
# itself only where it detects DeepSpeed's ZeRO-3 through the Trainer's config or FSDP, never for a zerocore
# engine. So ``engine.generate(...)`` at stage 3 on more than one rank passes ``synced_gpus=True`` unless the
# call sets it. ``model.generate`` called on the module itself is Hugging Face's own: pass ``synced_gpus=True``
# there, or generate inside ``zerocore.gathered(model.parameters())`` (or DeepSpeed's
# ``unwrap_model_for_generation``), where the forwards gather nothing and ranks may stop when they like.
def _synced_generate(generate: Any) -> Any:
    try:
        signature = inspect.signature(generate)
    except (TypeError, ValueError):
        return generate
    if "synced_gpus" not in signature.parameters:
        return generate  # not Hugging Face's generate: passed as it is

    @functools.wraps(generate)
    def synced(*args: Any, **kwargs: Any) -> Any:
        if "synced_gpus" not in signature.bind_partial(*args, **kwargs).arguments:
            kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    return synced


class DeepSpeedAccessors:
    """Mixed into :class:`zerocore.Engine`."""

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine does not have, from its module (Note [Attributes of the module])."""
        own = getattr(type(self), name, None)
        if isinstance(own, property):  # the engine's own property raised AttributeError inside: raise that one,
            return own.__get__(self)   # never the module's attribute of the same name in its place
        module = self.__dict__.get("module")
        if module is None or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name in _REFUSED_MODULE_METHODS:
            raise AttributeError(f"engine.{name} is not passed to the module: {_REFUSED_MODULE_METHODS[name]}")
        try:
            attribute = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}, nor has its module "
                                 f"({type(module).__name__})") from None
        if name == "generate" and self.stage == 3 and self.world_size > 1 and callable(attribute):
            return _synced_generate(attribute)
        return attribute

    config: ZeroConfig
    buckets: BucketSizes
    # the class name of the optimizer deepspeed.initialize was given (what DeepSpeed's optimizer_name() says)
    _client_optimizer_name: str | None = None
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

    def get_batch_info(self) -> tuple[Callable[[], int | None], Callable[[], int | None], Callable[[], int]]:
        """DeepSpeed's: the three batch-size accessors themselves (``train_batch_size``,
        ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``), which its scripts call."""
        return self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps

    def optimizer_name(self) -> str:
        """The optimizer's name as DeepSpeed gives it: a client optimizer's class name (``deepspeed.initialize``'s
        ``optimizer=``), else the config's type in lower case (``"adamw"``)."""
        return self._client_optimizer_name or self.config.optimizer.type.lower()

    def optimizer_params(self) -> dict[str, Any]:
        """The optimizer's hyperparameters (the engine's defaults for its param groups)."""
        optimizer = self.config.optimizer
        return {"lr": optimizer.lr, "betas": list(optimizer.betas), "eps": optimizer.eps,
                "weight_decay": optimizer.weight_decay, "adam_w_mode": optimizer.adamw_mode,
                "bias_correction": optimizer.bias_correction}

    def scheduler_name(self) -> str | None:
        """The config's ``scheduler.type`` (None without a scheduler section)."""
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> dict[str, Any] | None:
        return None if self.config.scheduler is None else dict(self.config.scheduler.params_dict)

    def zero_reduce_bucket_size(self) -> int:
        """Elements per gradient bucket: the config's, or the size zerocore picked (``comm_report()["buckets"]``)."""
        return self.buckets.reduce

    def zero_overlap_comm(self) -> bool:
        return self.config.zero_optimization.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero_optimization.contiguous_gradients

    def zero_sub_group_size(self) -> int:
        return self.config.zero_optimization.sub_group_size

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

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """DeepSpeed's (model dtype, gradient-accumulation dtype): the compute dtype and ``data_types.grad_accum_dtype``
        (the compute dtype when unset)."""
        return self.config.compute_dtype, self.config.accumulation_dtype

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

    def torch_autocast_enabled(self) -> bool:
        """Whether the forward runs under ``torch.autocast`` (the config's ``torch_autocast`` section)."""
        return self.config.torch_autocast is not None

    def torch_autocast_dtype(self) -> torch.dtype | None:
        return self.config.autocast_dtype

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The module classes DeepSpeed reduces the gradients of in the autocast dtype (its default list when the
        config names none); zerocore reduces every gradient in ``communication_data_type`` (Note [torch_autocast])."""
        modules = self.config.torch_autocast_lower_precision_safe_modules
        return list(DEFAULT_SAFE_MODULES if modules is None else modules)

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
