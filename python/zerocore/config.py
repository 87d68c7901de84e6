"""Engine configuration: frozen dataclasses, validated once at construction, and a DeepSpeed JSON reader.

Every invalid value raises ``ValueError`` naming its DeepSpeed key path (``"zero_optimization.stage"``) and
what is accepted. :meth:`ZeroConfig.from_deepspeed` reads a DeepSpeed config (a JSON file or a dict): keys
zerocore supports are parsed, real DeepSpeed keys it does not support yet are an error (or with
``strict=False`` one warning), unknown keys always an error.

This module holds :class:`ZeroConfig` and its optimizer, fp16 and ZeRO sections; the other parts are
    _offload_config.py   offload_optimizer / offload_param (and the deprecated cpu_offload* flags), aio
    _scheduler_config.py the scheduler section
    _deepspeed_json.py   the DeepSpeed JSON reader and writer (from_deepspeed / to_deepspeed)
    _hf_auto.py          Hugging Face "auto" values (Note [Hugging Face "auto" values] is there)
    _config_values.py    the value checks every section uses
and their public classes are importable from here.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._autocast_config import autocast_dtype_name, check_safe_modules
from ._config_values import INT64_MAX, as_bool, as_choice, as_float, as_int, fail, no_auto
from ._hf_auto import BATCH_KEYS, fill_auto_batch_sizes, hidden_size_of
from ._monitor import MONITOR_SECTIONS, CsvMonitorConfig, TensorBoardConfig, WandbConfig
from ._offload_config import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from ._scheduler_config import SchedulerConfig
from ._user_frames import user_stacklevel

__all__ = ["OptimizerConfig", "FP16Config", "OffloadOptimizerConfig", "OffloadParamConfig",
           "ZeroOptimizationConfig", "AioConfig", "SchedulerConfig", "ZeroConfig", "hidden_size_of"]

OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW"}
# sizes that may be left unset: the engine then chooses one for the model (python/zerocore/_buckets.py)
_UNSET_MEANS_CHOSEN = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
# DeepSpeed's dtype names (communication_data_type, data_types.grad_accum_dtype)
DEEPSPEED_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class OptimizerConfig:
    """Adam / AdamW hyperparameters (DeepSpeed ``optimizer``: ``{"type": ..., "params": {...}}``).

    Attributes:
        type: ``"Adam"`` or ``"AdamW"``; case-insensitive on input, stored in this spelling.
        lr: learning rate, >= 0.
        betas: ``(beta1, beta2)``, each in ``[0, 1)``; any 2-sequence is accepted and stored as a tuple.
        eps: added to the denominator, >= 0.
        weight_decay: >= 0; 0.0 by default, as in DeepSpeed (whose FusedAdam defaults to 0.0 for both types).
        adamw_mode: decoupled (AdamW) weight decay if True, L2 added to the gradient if False. DeepSpeed's
            ``adam_w_mode``: ``"Adam"`` defaults to True as in DeepSpeed; ``"AdamW"`` requires True.
        bias_correction: apply Adam's bias correction.

    Raises:
        ValueError: naming the key path of the first invalid value.
    """

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    bias_correction: bool = True

    def __post_init__(self) -> None:
        p = "optimizer.params."
        object.__setattr__(self, "type", as_choice(self.type, "optimizer.type", OPTIMIZER_TYPES))
        object.__setattr__(self, "lr", as_float(self.lr, p + "lr", 0.0))
        no_auto(self.betas, p + "betas")
        if isinstance(self.betas, (str, bytes)) or not isinstance(self.betas, Sequence) or len(self.betas) != 2:
            fail(p + "betas", f"expected two numbers [beta1, beta2], each in [0, 1), got {self.betas!r}")
        betas = tuple(as_float(b, f"{p}betas[{i}]", 0.0, below=1.0) for i, b in enumerate(self.betas))
        object.__setattr__(self, "betas", betas)
        object.__setattr__(self, "eps", as_float(self.eps, p + "eps", 0.0))
        object.__setattr__(self, "weight_decay", as_float(self.weight_decay, p + "weight_decay", 0.0))
        adamw_mode = as_bool(self.adamw_mode, p + "adam_w_mode (adamw_mode)")
        if self.type == "AdamW" and not adamw_mode:
            fail(p + "adam_w_mode (adamw_mode)", 'type "AdamW" always uses decoupled weight decay; for L2 '
                 'weight decay use type "Adam" with adam_w_mode false')
        object.__setattr__(self, "adamw_mode", adamw_mode)
        object.__setattr__(self, "bias_correction", as_bool(self.bias_correction, p + "bias_correction"))


@dataclass(frozen=True)
class FP16Config:
    """fp16 mixed precision and its loss scaler (DeepSpeed ``fp16``).

    Attributes:
        enabled: train in fp16 with fp32 master weights.
        loss_scale: a static loss scale (> 0), or 0 for dynamic loss scaling.
        initial_scale_power: the dynamic scaler starts at ``2**initial_scale_power`` (0..127).
        loss_scale_window: overflow-free steps before the dynamic scale doubles (>= 1).
        hysteresis: overflows tolerated before the dynamic scale halves (>= 1).
        consecutive_hysteresis: every overflow-free step restores the hysteresis (not only a scale raise).
        min_loss_scale: the dynamic scale never drops below this (> 0).
        auto_cast: the engine casts floating-point positional inputs to fp16 before the forward (DeepSpeed's
            rule; keyword arguments are never cast).

    Raises:
        ValueError: naming the key path of the first invalid value.
    """

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    auto_cast: bool = False
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        set_, p = object.__setattr__, "fp16."
        set_(self, "enabled", as_bool(self.enabled, p + "enabled"))
        set_(self, "auto_cast", as_bool(self.auto_cast, p + "auto_cast"))
        set_(self, "loss_scale", as_float(self.loss_scale, p + "loss_scale", 0.0))
        set_(self, "initial_scale_power", as_int(self.initial_scale_power, p + "initial_scale_power", 0, 127))
        set_(self, "loss_scale_window", as_int(self.loss_scale_window, p + "loss_scale_window", 1))
        set_(self, "hysteresis", as_int(self.hysteresis, p + "hysteresis", 1))
        set_(self, "consecutive_hysteresis", as_bool(self.consecutive_hysteresis, p + "consecutive_hysteresis"))
        set_(self, "min_loss_scale", as_float(self.min_loss_scale, p + "min_loss_scale", 0.0, above=True))


# Note [Stage 0 runs as stage 1]
# DeepSpeed's stage 0 keeps every rank's optimizer state whole and all-reduces the gradients. Stage 1 computes
# the same update from the same averaged gradients and sends the same bytes (a reduce-scatter and an all-gather
# are an all-reduce cut in two), while each rank keeps 1/world of the optimizer state: a stage-0 config gets
# all of what it asked for and less memory, as a config without a zero_optimization section (DeepSpeed's stage
# 0 too) already did. What a stage-0 script could see differently is said in the warning: the reduced
# gradients are not left in the parameters' .grad, as at DeepSpeed's stages 1-3, so torch's clip_grad_norm_
# after engine.backward would find none (and return 0) where DeepSpeed's stage 0 clips them.
STAGE_0_RUNS_AS_STAGE_1 = (
    "zero_optimization.stage 0 (DeepSpeed's plain data parallelism) runs as stage 1: the same update from the same "
    "averaged gradients and the same bytes on the wire, with each rank keeping 1/world of the optimizer state "
    "instead of all of it. As at DeepSpeed's stages 1-3, the reduced gradients are not left in the parameters' "
    ".grad after engine.backward: clip with the gradient_clipping key or engine.clip_grad_norm_, not "
    "torch.nn.utils.clip_grad_norm_ (which finds no gradient there and returns 0)")


@dataclass(frozen=True)
class ZeroOptimizationConfig:
    """ZeRO stage and communication buckets (DeepSpeed ``zero_optimization``). Sizes count elements.

    Attributes:
        stage: 1 (optimizer states partitioned), 2 (+ gradients) or 3 (+ parameters). DeepSpeed's stage 0
            (plain data parallelism, what LLaMA-Factory's and open-instruct's ``ds_z0`` configs ask for) runs as
            stage 1, with a warning saying so (Note [Stage 0 runs as stage 1]).
        reduce_bucket_size: elements per gradient reduce-scatter bucket (>= 1; integral floats such as 5e8
            are accepted). None (unset): ~25 MiB of gradients per bucket, DDP's default, so reduction overlaps
            with backward; ``comm_report()["buckets"]`` says which size was used and why.
        allgather_bucket_size: stages 1-2: elements of the post-step parameter all-gathers in flight at once
            (>= 1; the gathers follow the gradient buckets). None (unset): no cap.
        overlap_comm: overlap gradient reduction with the backward pass; False waits for each bucket's
            reduction as soon as it is launched.
        contiguous_gradients: gradients are copied into contiguous buckets as they are produced; zerocore
            always does this, so only True is accepted.
        reduce_scatter: reduce-scatter gradients; False reduces them with all-reduce (each rank then keeps
            its shard), the ``"all_reduce"`` algorithm of Note [Collective algorithms].
        stage3_prefetch_bucket_size: stage 3: parameter elements kept gathered ahead of the computing unit in
            forward (>= 0; 0 = no prefetch; units already gathered ahead count, and a unit larger than what is
            left of the budget is still fetched). None (unset): one unit
            ahead, as FSDP prefetches and as DeepSpeed's 5e7 default does on models whose blocks exceed 5e7
            elements (hidden size >= 2048); ``comm_report()["buckets"]`` says which budget was used and why.
        stage3_max_live_parameters: stage 3: gathered parameter elements prefetching keeps per GPU (>= 0; 0:
            no prefetching, each unit gathered when it runs).
        stage3_param_persistence_threshold: stage 3: parameters with fewer elements stay unpartitioned (>= 0).
        sub_group_size: elements per optimizer sub-group, the tile the NVMe-offloaded optimizer step works
            through at a time (>= 1; DeepSpeed's default 1e9). DeepSpeed's 0 (a sub-group per parameter) is
            accepted where it changes nothing here, without ``offload_optimizer: nvme``.
        offload_optimizer: optimizer-state offload (:class:`OffloadOptimizerConfig`); also set by DeepSpeed's
            deprecated ``cpu_offload: true`` (device ``"cpu"``).
        offload_param: parameter offload, stage 3 only (:class:`OffloadParamConfig`); also set by DeepSpeed's
            deprecated ``cpu_offload_param: true`` (device ``"cpu"``). ``cpu_offload_use_pin_memory`` sets the
            ``pin_memory`` of both.
        zero_quantized_weights: ZeRO++ qwZ, stage 3: parameters are all-gathered as int8 with one fp32 scale
            per quantization group (the fp32 master is never quantized).
        zero_quantized_nontrainable_weights: ZeRO++ qwZ for frozen parameters, stage 3: their all-gathers
            (Note [Frozen shards]) go as int8 with one fp32 scale per group, with or without
            ``zero_quantized_weights``; at stages 1-2 frozen parameters are whole and it changes nothing.
        zero_hpz_partition_size: ZeRO++ hpZ, stage 3: ranks per secondary partition (a node's GPUs; 1 = off).
            After a unit's forward gather each rank keeps its 1/hpz slice of it, and backward gathers run
            inside those groups of consecutive ranks only.
        zero_quantized_gradients: ZeRO++ qgZ, stages 2-3: gradients are reduce-scattered as int4 with one fp32
            scale per group, inside each node first, then across nodes, summed in fp32.
        zero_quantization_group_size: elements per quantization scale of qwZ and qgZ (zerocore's; even, >= 2).
        zero_node_size: ranks per node for qgZ (zerocore's; default the ``LOCAL_WORLD_SIZE`` torchrun sets,
            else one node); lets one machine act as several nodes.
        allgather_partitions: stages 1-2: all-gather the updated parameters after the step; False gathers them
            as one broadcast per rank instead, the ``"broadcast"`` algorithm of Note [Collective algorithms]
            (DeepSpeed's meaning). Stage 3 ignores it, as DeepSpeed does.
        use_all_reduce_for_fetch_params: stage 3: gather units' parameters by an all-reduce of a zero-filled
            buffer holding this rank's shard, the ``"all_reduce"`` algorithm of Note [Collective algorithms]
            (DeepSpeed's ``stage3_use_all_reduce_for_fetch_params``; as in DeepSpeed, qwZ's quantized gathers and
            hpZ's secondary ones keep their own). Stages 1-2 ignore it, as DeepSpeed does.
        stage3_gather_16bit_weights_on_model_save: stage 3: ``save_16bit_model()`` gathers the whole weights
            and writes them (True, the default here); False writes nothing and returns False, as DeepSpeed does
            (its default; a run that consolidates its checkpoints offline instead, and does not want rank 0 to
            hold the whole model). DeepSpeed's other spellings, ``gather_16bit_weights_on_model_save`` and the
            deprecated ``stage3_gather_fp16_weights_on_model_save``, are read too. Stages 1-2 always write, as
            DeepSpeed's do: their weights are whole on every rank.

    Raises:
        ValueError: naming the key path of the first invalid value.
    """

    stage: int = 1
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int | None = None
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_hpz_partition_size: int = 1
    zero_quantized_gradients: bool = False
    zero_quantization_group_size: int = 256
    zero_node_size: int | None = None
    allgather_partitions: bool = True  # (these last: positional construction keeps its meaning)
    use_all_reduce_for_fetch_params: bool = False
    stage3_gather_16bit_weights_on_model_save: bool = True

    def __post_init__(self) -> None:
        p = "zero_optimization."
        no_auto(self.stage, p + "stage")
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            fail(p + "stage", f"accepted values are 0, 1, 2, 3, got {self.stage!r}")
        if self.stage == 0:
            warnings.warn(STAGE_0_RUNS_AS_STAGE_1, UserWarning, stacklevel=user_stacklevel())
        object.__setattr__(self, "stage", max(1, int(self.stage)))
        minimums = {"reduce_bucket_size": 1, "allgather_bucket_size": 1, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_live_parameters": 0, "stage3_param_persistence_threshold": 0}
        for name, minimum in minimums.items():
            if getattr(self, name) is not None or name not in _UNSET_MEANS_CHOSEN:
                # Element counts reach the C++ core as int64: a larger one must fail here, by name.
                object.__setattr__(self, name, as_int(getattr(self, name), p + name, minimum, INT64_MAX))
        for name in ("overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                     "use_all_reduce_for_fetch_params", "stage3_gather_16bit_weights_on_model_save"):
            object.__setattr__(self, name, as_bool(getattr(self, name), p + name))
        if not self.contiguous_gradients:
            fail(p + "contiguous_gradients", "zerocore always copies gradients into contiguous buckets as they "
                 "are produced; only true is accepted (remove the key or set it to true)")
        object.__setattr__(self, "sub_group_size", as_int(self.sub_group_size, p + "sub_group_size", 0, INT64_MAX))
        for name, cls in (("offload_optimizer", OffloadOptimizerConfig), ("offload_param", OffloadParamConfig)):
            if not isinstance(getattr(self, name), cls):
                fail(p + name, f"expected an {cls.__name__}, got {type(getattr(self, name)).__name__} "
                     "(use ZeroConfig.from_deepspeed to read a DeepSpeed dict)")
        if self.sub_group_size == 0 and self.offload_optimizer.device == "nvme":
            fail(p + "sub_group_size", "0 is DeepSpeed's sub-group per parameter; zerocore's NVMe-offloaded step "
                 "works through sub-groups of a number of elements: give one (DeepSpeed's default is 1e9; "
                 "python -m zerocore.doctor says what fits)")
        if self.offload_param.device != "none" and self.stage < 3:
            fail(p + "offload_param", f"parameter offload needs stage 3 (device is {self.offload_param.device!r}, "
                 f"zero_optimization.stage is {self.stage}); use stage 3, or device 'none'")
        for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
            object.__setattr__(self, name, as_bool(getattr(self, name), p + name))
        object.__setattr__(self, "zero_hpz_partition_size",
                           as_int(self.zero_hpz_partition_size, p + "zero_hpz_partition_size", 1, 1 << 20))
        group = as_int(self.zero_quantization_group_size, p + "zero_quantization_group_size", 2, 1 << 30)
        if group % 2:
            fail(p + "zero_quantization_group_size", f"must be even (int4 packs two values per byte), got {group}")
        object.__setattr__(self, "zero_quantization_group_size", group)
        if self.zero_node_size is not None:
            object.__setattr__(self, "zero_node_size", as_int(self.zero_node_size, p + "zero_node_size", 1, 1 << 20))
        if self.stage < 3:
            for name, on, what in (("zero_quantized_weights", self.zero_quantized_weights, "qwZ"),
                                   ("zero_hpz_partition_size", self.zero_hpz_partition_size > 1, "hpZ")):
                if on:
                    fail(p + name, f"ZeRO++ {what} works on the parameter gathers of stage 3, but "
                         f"zero_optimization.stage is {self.stage}; use stage 3 or remove it")
        if self.zero_quantized_gradients and self.stage < 2:
            fail(p + "zero_quantized_gradients", "ZeRO++ qgZ quantizes the gradient reduce-scatter of stages 2-3, "
                 "but zero_optimization.stage is 1; use stage 2 or 3, or remove it")
        if self.zero_quantized_gradients and not self.reduce_scatter:
            fail(p + "zero_quantized_gradients", "qgZ is a reduce-scatter, but zero_optimization.reduce_scatter is "
                 "false (all-reduce); drop one of them")


@dataclass(frozen=True)
class ZeroConfig:
    """Everything the zerocore engine reads; build it directly or with :meth:`from_deepspeed`.

    Attributes:
        optimizer: Adam / AdamW hyperparameters.
        gradient_accumulation_steps: micro-batches per optimizer step (>= 1).
        gradient_clipping: clip the global gradient norm to this (>= 0; 0 = off). 1.0 by default, DeepSpeed's
            default since 0.19 (deepspeedai/DeepSpeed#8068; 0.0 before), so a JSON that leaves it out trains
            as under DeepSpeed.
        bf16: train in bfloat16 (DeepSpeed ``"bf16": {"enabled": true}``). Exclusive with ``fp16.enabled``.
        fp16: fp16 mixed precision and loss scaling.
        zero_optimization: ZeRO stage and buckets.
        communication_data_type: gradient-reduction dtype, ``"fp32"``, ``"fp16"`` or ``"bf16"``
            (case-insensitive, stored lower case); None reduces in fp32.
        train_batch_size: global batch size (>= 1) or None; see :meth:`check_batch_sizes`.
        train_micro_batch_size_per_gpu: per-rank micro-batch size (>= 1) or None.
        steps_per_print: log every this many optimizer steps (>= 1).
        derive_accumulation_steps: DeepSpeed's rule for a config that gives ``train_batch_size`` and
            ``train_micro_batch_size_per_gpu`` but not ``gradient_accumulation_steps``: the steps are
            ``train_batch_size / (micro * world_size)``, worked out by :meth:`for_world_size` once the world
            size is known (``from_deepspeed`` sets it).
        scheduler: the learning-rate schedule (DeepSpeed ``scheduler``), or None for a constant lr.
        auto_batch_sizes: batch-size keys the DeepSpeed config gave as ``"auto"`` (Note [Hugging Face "auto"
            values] in _hf_auto.py); :meth:`for_world_size` fills in ``train_batch_size`` /
            ``train_micro_batch_size_per_gpu`` among them from the others and the world size
            (``gradient_accumulation_steps`` among them was already settled by ``from_deepspeed``; it is listed
            so ``to_deepspeed`` writes ``"auto"`` back).
        aio: the asynchronous file I/O engine's settings (DeepSpeed ``aio``).
        load_universal: DeepSpeed ``checkpoint.load_universal``: ``load_checkpoint`` without a tag follows
            ``latest_universal`` (which DeepSpeed's ``ds_to_universal`` writes) instead of ``latest``.
        grad_accum_dtype: the dtype gradients accumulate in across micro-steps (DeepSpeed
            ``data_types.grad_accum_dtype``): the compute dtype's name or ``"fp32"`` (case-insensitive, stored
            lower case); None accumulates in the compute dtype, as DeepSpeed does by default. ``"fp32"`` with
            bf16 or fp16 compute keeps stage 1's gradient buffer and the gradient shards of stages 2-3 in fp32
            (Note [fp32 gradient accumulation] in _sharded_buffer.py).
        check_grad_overflow: skip the update of a window whose global gradient norm is inf or NaN (a NaN loss
            on any rank), counting it in ``skipped_steps``, as DeepSpeed 0.19 does at every stage and dtype
            (DeepSpeed ``bf16.check_grad_overflow``, default true). False applies it, as torch's AdamW does
            (the parameters become non-finite); fp16 always skips (its loss scale needs the overflow).
        torch_autocast: DeepSpeed ``torch_autocast`` with ``enabled: true``: the autocast dtype's name
            (``"bf16"``; DeepSpeed's spellings such as ``"bfloat16"`` are read as it), else None. The parameters
            stay fp32 and the forward runs under ``torch.autocast`` (Note [torch_autocast] in _autocast_config.py).
        torch_autocast_lower_precision_safe_modules: DeepSpeed ``torch_autocast.lower_precision_safe_modules``,
            the module classes (``"torch.nn.Linear"``) whose gradients DeepSpeed reduces in the autocast dtype;
            checked and kept for ``to_deepspeed`` (zerocore reduces every gradient in ``communication_data_type``).
        tensorboard, csv_monitor, wandb: DeepSpeed's monitor sections (Note [Monitors] in _monitor.py): each
            accumulation boundary's lr (and fp16 loss scale) logged from rank 0, and ``engine.monitor``.

    Raises:
        ValueError: naming the key path of the first invalid value, or bf16 and fp16 both enabled.
    """

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 1.0
    bf16: bool = False
    fp16: FP16Config = field(default_factory=FP16Config)
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    communication_data_type: str | None = None
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    steps_per_print: int = 10
    derive_accumulation_steps: bool = False
    scheduler: SchedulerConfig | None = None
    auto_batch_sizes: tuple[str, ...] = ()
    aio: AioConfig = field(default_factory=AioConfig)
    load_universal: bool = False
    grad_accum_dtype: str | None = None
    check_grad_overflow: bool = True
    torch_autocast: str | None = None
    torch_autocast_lower_precision_safe_modules: tuple[str, ...] | None = None
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        for name, cls in (("optimizer", OptimizerConfig), ("fp16", FP16Config),
                          ("zero_optimization", ZeroOptimizationConfig), ("aio", AioConfig),
                          *MONITOR_SECTIONS.items()):
            if not isinstance(getattr(self, name), cls):
                fail(name, f"expected a {cls.__name__}, got {type(getattr(self, name)).__name__} "
                     "(use ZeroConfig.from_deepspeed to read a DeepSpeed dict)")
        ints = {"gradient_accumulation_steps": False, "train_batch_size": True,
                "train_micro_batch_size_per_gpu": True, "steps_per_print": False}
        for name, optional in ints.items():
            value = getattr(self, name)
            if not (optional and value is None):
                object.__setattr__(self, name, as_int(value, name, 1))
        object.__setattr__(self, "gradient_clipping", as_float(self.gradient_clipping, "gradient_clipping", 0.0))
        object.__setattr__(self, "bf16", as_bool(self.bf16, "bf16.enabled"))
        object.__setattr__(self, "check_grad_overflow", as_bool(self.check_grad_overflow, "bf16.check_grad_overflow"))
        object.__setattr__(self, "load_universal", as_bool(self.load_universal, "checkpoint.load_universal"))
        if self.communication_data_type is not None:
            dtype = as_choice(self.communication_data_type, "communication_data_type", {k: k for k in DEEPSPEED_DTYPES})
            object.__setattr__(self, "communication_data_type", dtype)
        if self.bf16 and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
        if self.grad_accum_dtype is not None:
            name = as_choice(self.grad_accum_dtype, "data_types.grad_accum_dtype", {k: k for k in DEEPSPEED_DTYPES})
            compute = next(k for k, v in DEEPSPEED_DTYPES.items() if v == self.compute_dtype)
            if name not in ("fp32", compute):
                fail("data_types.grad_accum_dtype",
                     f"{name!r} with {compute} compute: gradients accumulate in the compute dtype or in fp32 (as "
                     "DeepSpeed's); give one of those")
            object.__setattr__(self, "grad_accum_dtype", name)
        self._check_torch_autocast()
        as_bool(self.derive_accumulation_steps, "derive_accumulation_steps")
        if self.derive_accumulation_steps and (self.train_batch_size is None
                                               or self.train_micro_batch_size_per_gpu is None):
            raise ValueError("derive_accumulation_steps needs train_batch_size and train_micro_batch_size_per_gpu")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            fail("scheduler", f"expected a SchedulerConfig or None, got {type(self.scheduler).__name__} "
                 "(use ZeroConfig.from_deepspeed to read a DeepSpeed dict)")
        auto = self.auto_batch_sizes
        if (isinstance(auto, (str, bytes)) or not isinstance(auto, Sequence)
                or any(name not in BATCH_KEYS for name in auto)):
            fail("auto_batch_sizes", f"expected a tuple of names among {', '.join(BATCH_KEYS)}, got {auto!r}")
        object.__setattr__(self, "auto_batch_sizes", tuple(sorted(set(auto))))
        for name in self.auto_batch_sizes:
            if name != "gradient_accumulation_steps" and getattr(self, name) is not None:
                fail(name, f"listed in auto_batch_sizes (to be derived) but also given: {getattr(self, name)!r}")

    def _check_torch_autocast(self) -> None:
        if self.torch_autocast is not None:
            object.__setattr__(self, "torch_autocast", autocast_dtype_name(self.torch_autocast))
            if self.bf16 or self.fp16.enabled:
                fail("torch_autocast", "keeps the parameters fp32 and runs the forward under torch.autocast, but "
                     f"{'bf16' if self.bf16 else 'fp16'}.enabled makes them 16-bit: enable one of the two")
            if self.zero_optimization.zero_quantized_weights:
                fail("torch_autocast", "does not combine with zero_optimization.zero_quantized_weights (nor does "
                     "it in DeepSpeed): drop one of them")
        modules = self.torch_autocast_lower_precision_safe_modules
        if modules is not None:
            object.__setattr__(self, "torch_autocast_lower_precision_safe_modules", check_safe_modules(modules))

    def for_world_size(self, world_size: int) -> ZeroConfig:
        """This config with DeepSpeed's batch-size rule applied for ``world_size`` ranks: the derived
        ``gradient_accumulation_steps`` filled in (see ``derive_accumulation_steps``), and the batch sizes given
        as ``"auto"`` (see ``auto_batch_sizes``), then checked; a ``train_micro_batch_size_per_gpu`` left out
        is ``train_batch_size / (gradient_accumulation_steps * world_size)``, as DeepSpeed derives it.

        Raises:
            ValueError: when the batch sizes do not fit ``world_size`` (see :meth:`check_batch_sizes`).
        """
        config = self
        if self.auto_batch_sizes:
            config = fill_auto_batch_sizes(config, as_int(world_size, "world_size", 1))
        if config.derive_accumulation_steps:
            batch, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
            world = as_int(world_size, "world_size", 1)
            if batch % (micro * world):
                raise ValueError(f"train_batch_size ({batch}) is not divisible by train_micro_batch_size_per_gpu "
                                 f"({micro}) * world_size ({world}); no gradient_accumulation_steps fits")
            config = dataclasses.replace(config, gradient_accumulation_steps=batch // (micro * world),
                                         derive_accumulation_steps=False)
        config.check_batch_sizes(world_size)
        if config.train_batch_size is not None and config.train_micro_batch_size_per_gpu is None:
            # DeepSpeed derives the micro-batch from the other two, and scripts multiply by it
            # (engine.train_micro_batch_size_per_gpu() * n): None there would be a TypeError mid-training.
            world = as_int(world_size, "world_size", 1)
            micro = config.train_batch_size // (config.gradient_accumulation_steps * world)
            config = dataclasses.replace(config, train_micro_batch_size_per_gpu=micro)
        return config

    @property
    def compute_dtype(self) -> torch.dtype:
        """bfloat16 if ``bf16``, float16 if ``fp16.enabled``, else float32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16.enabled else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward computes in under ``torch_autocast``; None without it."""
        return None if self.torch_autocast is None else DEEPSPEED_DTYPES[self.torch_autocast]

    @property
    def accumulation_dtype(self) -> torch.dtype:
        """The dtype gradients accumulate in across micro-steps: ``grad_accum_dtype``, the compute dtype when None."""
        return self.compute_dtype if self.grad_accum_dtype is None else DEEPSPEED_DTYPES[self.grad_accum_dtype]

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``communication_data_type``, float32 when it is None."""
        return torch.float32 if self.communication_data_type is None else DEEPSPEED_DTYPES[self.communication_data_type]

    def check_batch_sizes(self, world_size: int) -> None:
        """Checks DeepSpeed's rule ``train_batch_size == micro * gradient_accumulation_steps * world_size``.

        Nothing is checked without ``train_batch_size``; without ``train_micro_batch_size_per_gpu`` the
        batch must divide by ``gradient_accumulation_steps * world_size``.

        Args:
            world_size: number of data-parallel ranks (>= 1).

        Raises:
            ValueError: naming train_batch_size, train_micro_batch_size_per_gpu and
                gradient_accumulation_steps with their values.
        """
        world = as_int(world_size, "world_size", 1)
        batch, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps
        if batch is None:
            return
        if micro is None:
            if batch % (gas * world):
                raise ValueError(f"train_batch_size ({batch}) is not divisible by gradient_accumulation_steps "
                                 f"({gas}) * world_size ({world}), so no train_micro_batch_size_per_gpu fits")
            return
        if batch != micro * gas * world:
            hint = ""
            if batch % (micro * world) == 0:
                hint = f"; gradient_accumulation_steps = {batch // (micro * world)} would satisfy it"
            raise ValueError(f"train_batch_size ({batch}) must equal train_micro_batch_size_per_gpu ({micro}) "
                             f"* gradient_accumulation_steps ({gas}) * world_size ({world}) "
                             f"= {micro * gas * world}{hint}")

    @classmethod
    def from_deepspeed(cls, source: str | os.PathLike[str] | Mapping[str, Any], *, strict: bool = True,
                       hidden_size: int | None = None) -> ZeroConfig:
        """Reads a DeepSpeed config: a path to a JSON file, or an already-loaded mapping (never mutated).

        Args:
            source: the JSON file's path, or the config as a mapping.
            strict: if False, real DeepSpeed keys that zerocore does not support yet are ignored with one
                ``UserWarning`` listing them all, instead of raising. Unknown keys raise either way.
            hidden_size: the model's hidden size, for the ``"auto"`` bucket sizes (Note [Hugging Face "auto"
                values] in _hf_auto.py); ``zerocore.initialize`` passes :func:`hidden_size_of` its model.

        Returns:
            The validated config. Missing keys take the dataclass defaults, except ``weight_decay``, which
            defaults to 0.0 for both optimizer types, as DeepSpeed does.

        Raises:
            ValueError: an invalid value, an unknown key, an unsupported key (with ``strict``), ``"auto"``
                placeholders zerocore cannot fill in (all named in one error), or a file that is not valid JSON.
            TypeError: ``source`` is neither a path nor a mapping.
        """
        from ._deepspeed_json import from_deepspeed

        config, unsupported = from_deepspeed(cls, source, strict=strict, hidden_size=hidden_size)
        if unsupported:
            warnings.warn(f"zerocore ignores these DeepSpeed keys, not supported yet: {', '.join(unsupported)}",
                          UserWarning, stacklevel=user_stacklevel())
        return config

    def to_deepspeed(self) -> dict[str, Any]:
        """Returns a DeepSpeed config dict (JSON-serializable); ``from_deepspeed`` of it equals ``self``."""
        from ._deepspeed_json import to_deepspeed

        return to_deepspeed(self)
