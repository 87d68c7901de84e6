"""Engine configuration: frozen dataclasses, validated once at construction, and a DeepSpeed JSON reader.

Every invalid value raises ``ValueError`` naming its DeepSpeed key path (``"zero_optimization.stage"``) and
what is accepted. :meth:`ZeroConfig.from_deepspeed` reads a DeepSpeed config (a JSON file or a dict) and
sorts its keys into three classes: keys zerocore supports (parsed), real DeepSpeed keys zerocore does not
support yet (an error, or with ``strict=False`` one warning listing them all, and then ignored), and unknown
keys (always an error, with a "did you mean" suggestion).

Note [Hugging Face "auto" values]
---------------------------------
Hugging Face's published DeepSpeed configs use ``"auto"``, which its Trainer fills in before DeepSpeed sees
the config (transformers' ``HfTrainerDeepSpeedConfig``). zerocore fills in the ones the Trainer derives from
the model and the world, as it does: ``reduce_bucket_size`` = hidden^2, ``stage3_prefetch_bucket_size`` =
int(0.9 hidden^2), ``stage3_param_persistence_threshold`` = 10 hidden (hidden: the model's
``config.hidden_size``, else the largest of ``config.hidden_sizes``); the batch sizes from each other and the
world size by DeepSpeed's rule (an ``"auto"`` counts as absent; ``gradient_accumulation_steps`` is 1 when
only one batch size is given); ``scheduler.params.warmup_min_lr`` = 0 and ``warmup_max_lr`` = the optimizer's
lr. The rest come from the user's ``TrainingArguments``, which zerocore does not see: one ``ValueError`` names
every such key and the training argument it stands for.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OptimizerConfig", "FP16Config", "OffloadOptimizerConfig", "OffloadParamConfig",
           "ZeroOptimizationConfig", "AioConfig", "SchedulerConfig", "ZeroConfig", "hidden_size_of"]

_OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW"}
_INT64_MAX = 2**63 - 1  # the largest element count the C++ core (int64_t) takes
_INT32_MAX = 2**31 - 1  # the largest queue depth / thread count the C++ I/O engine (int) takes
_AIO_ALIGN = 4096  # aio.block_size must be a multiple of this (O_DIRECT-aligned I/O)
_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# weight_decay when a DeepSpeed JSON leaves it out, per optimizer type.
_DEFAULT_WEIGHT_DECAY = {"Adam": 0.0, "AdamW": 0.0}  # DeepSpeed builds FusedAdam, whose default is 0.0
_BATCH_KEYS = ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu")


def _fail(path: str, message: str) -> None:
    raise ValueError(f"{path}: {message}")


def _no_auto(value: Any, path: str) -> None:
    if isinstance(value, str) and value == "auto":
        _fail(path, '"auto" is a Hugging Face Trainer placeholder that the Trainer fills in before DeepSpeed '
              "sees the config; zerocore needs the actual value")


def _bool(value: Any, path: str) -> bool:
    _no_auto(value, path)
    if not isinstance(value, bool):
        _fail(path, f"expected true or false, got {value!r}")
    return value


def _int(value: Any, path: str, minimum: int, maximum: int | None = None) -> int:
    _no_auto(value, path)
    wanted = f"an integer >= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(path, f"expected {wanted}, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if not (math.isfinite(value) and float(value).is_integer()):
            _fail(path, f"expected {wanted} (a float only when integral, like 5e8), got {value!r}")
    result = int(value)
    if result < minimum or (maximum is not None and result > maximum):
        _fail(path, f"expected {wanted}, got {value!r}")
    return result


def _float(value: Any, path: str, minimum: float, *, above: bool = False, below: float | None = None) -> float:
    _no_auto(value, path)
    wanted = f"a finite number {'>' if above else '>='} {minimum:g}" + ("" if below is None else f" and < {below:g}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(path, f"expected {wanted}, got {value!r}")
    result = float(value)
    if (not math.isfinite(result) or result < minimum or (above and result == minimum)
            or (below is not None and result >= below)):
        _fail(path, f"expected {wanted}, got {value!r}")
    return result


def _choice(value: Any, path: str, choices: Mapping[str, str]) -> str:
    _no_auto(value, path)
    if not isinstance(value, str) or value.lower() not in choices:
        accepted = ", ".join(repr(c) for c in choices.values())
        _fail(path, f"expected one of {accepted} (case-insensitive), got {value!r}")
    return choices[value.lower()]


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
        object.__setattr__(self, "type", _choice(self.type, "optimizer.type", _OPTIMIZER_TYPES))
        object.__setattr__(self, "lr", _float(self.lr, p + "lr", 0.0))
        _no_auto(self.betas, p + "betas")
        if isinstance(self.betas, (str, bytes)) or not isinstance(self.betas, Sequence) or len(self.betas) != 2:
            _fail(p + "betas", f"expected two numbers [beta1, beta2], each in [0, 1), got {self.betas!r}")
        betas = tuple(_float(b, f"{p}betas[{i}]", 0.0, below=1.0) for i, b in enumerate(self.betas))
        object.__setattr__(self, "betas", betas)
        object.__setattr__(self, "eps", _float(self.eps, p + "eps", 0.0))
        object.__setattr__(self, "weight_decay", _float(self.weight_decay, p + "weight_decay", 0.0))
        adamw_mode = _bool(self.adamw_mode, p + "adam_w_mode (adamw_mode)")
        if self.type == "AdamW" and not adamw_mode:
            _fail(p + "adam_w_mode (adamw_mode)", 'type "AdamW" always uses decoupled weight decay; for L2 '
                  'weight decay use type "Adam" with adam_w_mode false')
        object.__setattr__(self, "adamw_mode", adamw_mode)
        object.__setattr__(self, "bias_correction", _bool(self.bias_correction, p + "bias_correction"))


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
        set_(self, "enabled", _bool(self.enabled, p + "enabled"))
        set_(self, "auto_cast", _bool(self.auto_cast, p + "auto_cast"))
        set_(self, "loss_scale", _float(self.loss_scale, p + "loss_scale", 0.0))
        set_(self, "initial_scale_power", _int(self.initial_scale_power, p + "initial_scale_power", 0, 127))
        set_(self, "loss_scale_window", _int(self.loss_scale_window, p + "loss_scale_window", 1))
        set_(self, "hysteresis", _int(self.hysteresis, p + "hysteresis", 1))
        set_(self, "consecutive_hysteresis", _bool(self.consecutive_hysteresis, p + "consecutive_hysteresis"))
        set_(self, "min_loss_scale", _float(self.min_loss_scale, p + "min_loss_scale", 0.0, above=True))


def _offload_device(value: Any, path: str) -> str:
    _no_auto(value, path)
    if not isinstance(value, str) or value.lower() not in ("none", "cpu", "nvme"):
        _fail(path, f"expected 'none', 'cpu' or 'nvme' (case-insensitive), got {value!r}")
    return value.lower()


def _nvme_path(value: Any, device: str, path: str) -> str | None:
    if value is None:
        if device == "nvme":
            _fail(path, "required when device is 'nvme': the directory (on the NVMe drive) to swap to")
        return None
    _no_auto(value, path)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        _fail(path, f"expected a directory path (a non-empty string) or null, got {value!r}")
    return value


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """Optimizer-state offload (DeepSpeed ``zero_optimization.offload_optimizer``); any ZeRO stage.
    Defaults are DeepSpeed 0.19.8's.

    Attributes:
        device: ``"none"`` (no offload), ``"cpu"`` or ``"nvme"``; case-insensitive on input, stored lower case.
        nvme_path: the directory to swap optimizer state to; required when ``device`` is ``"nvme"``.
        pin_memory: keep the offloaded state in page-locked CPU memory (DeepSpeed's default: true).
        buffer_count: buffers in the NVMe swap pool (>= 1).
        fast_init: DeepSpeed's fast optimizer initialization when offloading to NVMe.
        ratio: the fraction of the optimizer state offloaded; only 1.0 is accepted (DeepSpeed's partial
            offload, ZeRO-3 only, is not supported).

    Raises:
        ValueError: naming the key path (``zero_optimization.offload_optimizer.nvme_path``) of the first invalid
            value.
    """

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0

    def __post_init__(self) -> None:
        set_, p = object.__setattr__, "zero_optimization.offload_optimizer."
        set_(self, "device", _offload_device(self.device, p + "device"))
        set_(self, "nvme_path", _nvme_path(self.nvme_path, self.device, p + "nvme_path"))
        set_(self, "pin_memory", _bool(self.pin_memory, p + "pin_memory"))
        set_(self, "buffer_count", _int(self.buffer_count, p + "buffer_count", 1, _INT64_MAX))
        set_(self, "fast_init", _bool(self.fast_init, p + "fast_init"))
        ratio = _float(self.ratio, p + "ratio", 0.0)
        if ratio != 1.0:
            _fail(p + "ratio", f"zerocore supports only ratio 1.0 (the whole optimizer state offloaded), got "
                  f"{self.ratio!r}; DeepSpeed's partial offload (ZeRO-3 only) is not supported")
        set_(self, "ratio", ratio)


@dataclass(frozen=True)
class OffloadParamConfig:
    """Parameter offload (DeepSpeed ``zero_optimization.offload_param``); stage 3 only. Defaults are
    DeepSpeed 0.19.8's.

    Attributes:
        device: ``"none"`` (no offload), ``"cpu"`` or ``"nvme"``; case-insensitive on input, stored lower case.
            Anything but ``"none"`` needs ``zero_optimization.stage`` 3.
        nvme_path: the directory to swap parameters to; required when ``device`` is ``"nvme"``.
        pin_memory: keep offloaded parameters in page-locked CPU memory (DeepSpeed's default: true).
        buffer_count: buffers in the NVMe swap pool (>= 1).
        buffer_size: elements per NVMe swap buffer (>= 1).
        max_in_cpu: parameter elements kept in CPU memory when offloading to NVMe (>= 0).

    Raises:
        ValueError: naming the key path (``zero_optimization.offload_param.buffer_size``) of the first invalid
            value.
    """

    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        set_, p = object.__setattr__, "zero_optimization.offload_param."
        set_(self, "device", _offload_device(self.device, p + "device"))
        set_(self, "nvme_path", _nvme_path(self.nvme_path, self.device, p + "nvme_path"))
        set_(self, "pin_memory", _bool(self.pin_memory, p + "pin_memory"))
        set_(self, "buffer_count", _int(self.buffer_count, p + "buffer_count", 1, _INT64_MAX))
        set_(self, "buffer_size", _int(self.buffer_size, p + "buffer_size", 1, _INT64_MAX))
        set_(self, "max_in_cpu", _int(self.max_in_cpu, p + "max_in_cpu", 0, _INT64_MAX))


@dataclass(frozen=True)
class ZeroOptimizationConfig:
    """ZeRO stage and communication buckets (DeepSpeed ``zero_optimization``). Sizes count elements.

    Attributes:
        stage: 1 (optimizer states partitioned), 2 (+ gradients) or 3 (+ parameters). DeepSpeed's stage 0
            (plain data parallelism) is rejected.
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
        stage3_prefetch_bucket_size: stage 3: parameter elements fetched ahead of use (>= 0; 0 = no prefetch).
        stage3_max_live_parameters: stage 3: gathered parameter elements kept per GPU (>= 1).
        stage3_param_persistence_threshold: stage 3: parameters with fewer elements stay unpartitioned (>= 0).
        sub_group_size: elements per optimizer sub-group, the tile the optimizer step (and its offload) works
            through at a time (>= 1; DeepSpeed's default 1e9).
        offload_optimizer: optimizer-state offload (:class:`OffloadOptimizerConfig`); also set by DeepSpeed's
            deprecated ``cpu_offload: true`` (device ``"cpu"``).
        offload_param: parameter offload, stage 3 only (:class:`OffloadParamConfig`); also set by DeepSpeed's
            deprecated ``cpu_offload_param: true`` (device ``"cpu"``). ``cpu_offload_use_pin_memory`` sets the
            ``pin_memory`` of both.
        zero_quantized_weights: ZeRO++ qwZ, stage 3: parameters are all-gathered as int8 with one fp32 scale
            per quantization group (the fp32 master is never quantized).
        zero_quantized_nontrainable_weights: accepted for DeepSpeed configs; zerocore never gathers frozen
            parameters (they stay replicated, like buffers), so there is nothing to quantize.
        zero_hpz_partition_size: ZeRO++ hpZ, stage 3: ranks per secondary partition (a node's GPUs; 1 = off).
            After a unit's forward gather each rank keeps its 1/hpz slice of it, and backward gathers run
            inside those groups of consecutive ranks only.
        zero_quantized_gradients: ZeRO++ qgZ, stages 2-3: gradients are reduce-scattered as int4 with one fp32
            scale per group, inside each node first, then across nodes, summed in fp32.
        zero_quantization_group_size: elements per quantization scale of qwZ and qgZ (zerocore's; even, >= 2).
        zero_node_size: ranks per node for qgZ (zerocore's; default the ``LOCAL_WORLD_SIZE`` torchrun sets,
            else one node); lets one machine act as several nodes.

    Raises:
        ValueError: naming the key path of the first invalid value.
    """

    stage: int = 1
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
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

    def __post_init__(self) -> None:
        p = "zero_optimization."
        _no_auto(self.stage, p + "stage")
        if isinstance(self.stage, bool) or self.stage not in (1, 2, 3):
            why = " (DeepSpeed's stage 0 is plain data parallelism; zerocore starts at stage 1)"
            why = why if self.stage == 0 else ""
            _fail(p + "stage", f"accepted values are 1, 2, 3, got {self.stage!r}{why}")
        object.__setattr__(self, "stage", int(self.stage))
        minimums = {"reduce_bucket_size": 1, "allgather_bucket_size": 1, "stage3_prefetch_bucket_size": 0,
                    "stage3_max_live_parameters": 1, "stage3_param_persistence_threshold": 0}
        for name, minimum in minimums.items():
            if getattr(self, name) is not None or name not in ("reduce_bucket_size", "allgather_bucket_size"):
                # Element counts reach the C++ core as int64: a larger one must fail here, by name.
                object.__setattr__(self, name, _int(getattr(self, name), p + name, minimum, _INT64_MAX))
        for name in ("overlap_comm", "contiguous_gradients", "reduce_scatter"):
            object.__setattr__(self, name, _bool(getattr(self, name), p + name))
        if not self.contiguous_gradients:
            _fail(p + "contiguous_gradients", "zerocore always copies gradients into contiguous buckets as they "
                  "are produced; only true is accepted (remove the key or set it to true)")
        object.__setattr__(self, "sub_group_size", _int(self.sub_group_size, p + "sub_group_size", 1, _INT64_MAX))
        for name, cls in (("offload_optimizer", OffloadOptimizerConfig), ("offload_param", OffloadParamConfig)):
            if not isinstance(getattr(self, name), cls):
                _fail(p + name, f"expected an {cls.__name__}, got {type(getattr(self, name)).__name__} "
                      "(use ZeroConfig.from_deepspeed to read a DeepSpeed dict)")
        if self.offload_param.device != "none" and self.stage < 3:
            _fail(p + "offload_param", f"parameter offload needs stage 3 (device is {self.offload_param.device!r}, "
                  f"zero_optimization.stage is {self.stage}); use stage 3, or device 'none'")
        for name in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
            object.__setattr__(self, name, _bool(getattr(self, name), p + name))
        object.__setattr__(self, "zero_hpz_partition_size",
                           _int(self.zero_hpz_partition_size, p + "zero_hpz_partition_size", 1, 1 << 20))
        group = _int(self.zero_quantization_group_size, p + "zero_quantization_group_size", 2, 1 << 30)
        if group % 2:
            _fail(p + "zero_quantization_group_size", f"must be even (int4 packs two values per byte), got {group}")
        object.__setattr__(self, "zero_quantization_group_size", group)
        if self.zero_node_size is not None:
            object.__setattr__(self, "zero_node_size", _int(self.zero_node_size, p + "zero_node_size", 1, 1 << 20))
        if self.stage < 3:
            for name, on, what in (("zero_quantized_weights", self.zero_quantized_weights, "qwZ"),
                                   ("zero_hpz_partition_size", self.zero_hpz_partition_size > 1, "hpZ")):
                if on:
                    _fail(p + name, f"ZeRO++ {what} works on the parameter gathers of stage 3, but "
                          f"zero_optimization.stage is {self.stage}; use stage 3 or remove it")
        if self.zero_quantized_gradients and self.stage < 2:
            _fail(p + "zero_quantized_gradients", "ZeRO++ qgZ quantizes the gradient reduce-scatter of stages 2-3, "
                  "but zero_optimization.stage is 1; use stage 2 or 3, or remove it")
        if self.zero_quantized_gradients and not self.reduce_scatter:
            _fail(p + "zero_quantized_gradients", "qgZ is a reduce-scatter, but zero_optimization.reduce_scatter is "
                  "false (all-reduce); drop one of them")


@dataclass(frozen=True)
class AioConfig:
    """The asynchronous file I/O engine used for NVMe offload and checkpoint reads (DeepSpeed's top-level
    ``aio``). Defaults are DeepSpeed 0.19.8's.

    Attributes:
        block_size: bytes per I/O request, a positive multiple of 4096.
        queue_depth: I/O requests in flight at once (>= 1).
        thread_count: I/O worker threads (>= 1); DeepSpeed 0.19.8 calls it ``intra_op_parallelism``, older
            versions ``thread_count``: both are read (not both at once), ``intra_op_parallelism`` is written.
        single_submit: submit requests one at a time rather than in batches.
        overlap_events: start the next request as soon as one completes, rather than in waves.

    DeepSpeed's ``use_gds`` (GPUDirect Storage) is accepted only as false.

    Raises:
        ValueError: naming the key path (``aio.block_size``) of the first invalid value.
    """

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        block_size = _int(self.block_size, "aio.block_size", _AIO_ALIGN, _INT64_MAX)
        if block_size % _AIO_ALIGN:
            _fail("aio.block_size", f"expected a positive multiple of {_AIO_ALIGN} (bytes), got {self.block_size!r}")
        set_(self, "block_size", block_size)
        set_(self, "queue_depth", _int(self.queue_depth, "aio.queue_depth", 1, _INT32_MAX))
        set_(self, "thread_count", _int(self.thread_count, "aio.intra_op_parallelism (thread_count)", 1, _INT32_MAX))
        set_(self, "single_submit", _bool(self.single_submit, "aio.single_submit"))
        set_(self, "overlap_events", _bool(self.overlap_events, "aio.overlap_events"))


# scheduler.params per DeepSpeed schedule type: name -> (kind, minimum); kinds: "lr" (a number >= 0, or one per
# param group), "float", "int", "int?" (an int or null), "bool", "mom" (in [0, 1)), "warmup_type".
_WARMUP = {"warmup_min_lr": ("lr", 0), "warmup_max_lr": ("lr", 0), "warmup_num_steps": ("int", 1),
           "warmup_type": ("warmup_type", None), "last_batch_iteration": ("start", None)}
_SCHEDULE_PARAMS: dict[str, dict[str, tuple[str, Any]]] = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": ("int", 1)},
    "WarmupCosineLR": {"total_num_steps": ("int", 1), "warmup_min_ratio": ("float", 0), "warmup_num_steps": ("int", 1),
                       "cos_min_ratio": ("float", 0), "warmup_type": ("warmup_type", None),
                       "last_batch_iteration": ("start", None)},
    "OneCycle": {"cycle_min_lr": ("float", 0), "cycle_max_lr": ("float", 0), "decay_lr_rate": ("float", 0),
                 "cycle_first_step_size": ("int", 1), "cycle_second_step_size": ("int?", 0),
                 "cycle_first_stair_count": ("int", -1), "cycle_second_stair_count": ("int?", -1),
                 "decay_step_size": ("int", 0), "cycle_momentum": ("bool", None), "cycle_min_mom": ("mom", None),
                 "cycle_max_mom": ("mom", None), "decay_mom_rate": ("float", 0),
                 "last_batch_iteration": ("start", None)},
    "LRRangeTest": {"lr_range_test_min_lr": ("lr", 0), "lr_range_test_step_size": ("int", 1),
                    "lr_range_test_step_rate": ("float", 0), "lr_range_test_staircase": ("bool", None),
                    "last_batch_iteration": ("start", None)},
}
_REQUIRED_PARAMS = {"WarmupDecayLR": ("total_num_steps",), "WarmupCosineLR": ("total_num_steps",),
                    "OneCycle": ("cycle_min_lr", "cycle_max_lr")}
# Schedulers torch has that a JSON config cannot drive (they take callables, other schedulers, or a metric).
_TORCH_SCHEDULERS_NOT_FROM_JSON = frozenset({"LRScheduler", "_LRScheduler", "LambdaLR", "MultiplicativeLR",
                                             "SequentialLR", "ChainedScheduler", "ReduceLROnPlateau"})


def _scheduler_value(value: Any, path: str, kind: str, minimum: Any) -> Any:
    if kind == "lr":
        if isinstance(value, (list, tuple)):
            if not value:
                _fail(path, "expected a number >= 0, or a non-empty list of them (one per param group), got []")
            return tuple(_float(v, f"{path}[{i}]", 0.0) for i, v in enumerate(value))
        return _float(value, path, 0.0)
    if kind == "float":
        return _float(value, path, float(minimum))
    if kind == "mom":
        return _float(value, path, 0.0, below=1.0)
    if kind == "int":
        return _int(value, path, minimum)
    if kind == "int?":
        return None if value is None else _int(value, path, minimum)
    if kind == "bool":
        return _bool(value, path)
    if kind == "warmup_type":
        _no_auto(value, path)
        if value not in ("log", "linear"):  # DeepSpeed would fall back to "log" for anything else
            _fail(path, f"expected 'log' or 'linear' (lower case), got {value!r}")
        return value
    # "start": DeepSpeed's last_batch_iteration; only a fresh start (-1) is accepted.
    _no_auto(value, path)
    if value != -1 or isinstance(value, bool):
        _fail(path, f"only -1 (start from the beginning) is accepted, got {value!r}; to resume a schedule, "
              "call engine.lr_scheduler.load_state_dict(...) with the state_dict() saved from it")
    return None


@dataclass(frozen=True)
class SchedulerConfig:
    """A learning-rate schedule (DeepSpeed ``scheduler``: ``{"type": ..., "params": {...}}``), built by the
    engine as ``engine.lr_scheduler`` and stepped after every applied optimizer step (see
    :mod:`zerocore.lr_schedules`).

    Attributes:
        type: one of DeepSpeed's ``"WarmupLR"``, ``"WarmupDecayLR"``, ``"WarmupCosineLR"``, ``"OneCycle"``,
            ``"LRRangeTest"`` (case-insensitive on input, stored in this spelling), or, as DeepSpeed allows,
            the name of a ``torch.optim.lr_scheduler`` class whose arguments JSON can give (e.g. ``"StepLR"``).
        params: the schedule's keyword arguments; a mapping on input, stored as sorted ``(name, value)`` pairs
            (so the config stays hashable); :attr:`params_dict` gives them as a dict. DeepSpeed schedules'
            params are validated here (unknown or missing keys, ranges); a torch scheduler's when it is built.

    Raises:
        ValueError: naming the key path (``scheduler.params.warmup_num_steps``) of the first invalid value.
    """

    type: str
    params: Any = ()

    def __post_init__(self) -> None:
        _no_auto(self.type, "scheduler.type")
        names = {name.lower(): name for name in _SCHEDULE_PARAMS}
        if isinstance(self.type, str) and self.type.lower() in names:
            object.__setattr__(self, "type", names[self.type.lower()])
        elif not (isinstance(self.type, str) and self.type not in _TORCH_SCHEDULERS_NOT_FROM_JSON
                  and isinstance(getattr(torch.optim.lr_scheduler, self.type, None), type)
                  and issubclass(getattr(torch.optim.lr_scheduler, self.type), torch.optim.lr_scheduler.LRScheduler)):
            _fail("scheduler.type", f"expected one of {', '.join(repr(n) for n in _SCHEDULE_PARAMS)} (DeepSpeed's "
                  "schedules, case-insensitive) or the name of a torch.optim.lr_scheduler class that takes "
                  f"plain values (such as 'StepLR'), got {self.type!r}")
        params = self.params
        if isinstance(params, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in params):
            params = dict(params)
        if not isinstance(params, Mapping):
            _fail("scheduler.params", f"expected a JSON object (a mapping), got {params!r}")
        schema = _SCHEDULE_PARAMS.get(self.type)
        out: dict[str, Any] = {}
        for key, value in params.items():
            path = f"scheduler.params.{key}"
            if not isinstance(key, str):
                _fail("scheduler.params", f"keys must be strings, got {key!r}")
            if schema is None:  # a torch scheduler: its constructor checks the values when the engine builds it
                _no_auto(value, path)
                out[key] = tuple(value) if isinstance(value, list) else value
                continue
            if key not in schema:
                close = difflib.get_close_matches(key, list(schema), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                _fail(path, f"unknown key for {self.type}{hint}; accepted keys: {', '.join(sorted(schema))}")
            kind, minimum = schema[key]
            checked = _scheduler_value(value, path, kind, minimum)
            if kind != "start":
                out[key] = checked
        for key in _REQUIRED_PARAMS.get(self.type, ()):
            if key not in out:
                _fail(f"scheduler.params.{key}", f"required by {self.type} (DeepSpeed has no default for it)")
        object.__setattr__(self, "params", tuple(sorted(out.items())))

    @property
    def params_dict(self) -> dict[str, Any]:
        """The params as keyword arguments (per-group lists as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params}


def hidden_size_of(model: Any) -> int | None:
    """The hidden size Hugging Face's Trainer derives ``"auto"`` bucket sizes from: the model's
    ``config.hidden_size``, else the largest of ``config.hidden_sizes``; None when the model has neither."""
    model_config = getattr(model, "config", None)
    hidden = getattr(model_config, "hidden_size", None)
    if hidden is None:
        sizes = getattr(model_config, "hidden_sizes", None)
        if isinstance(sizes, Sequence) and not isinstance(sizes, str) and len(sizes) > 0:
            hidden = max(sizes)
    return hidden


@dataclass(frozen=True)
class ZeroConfig:
    """Everything the zerocore engine reads; build it directly or with :meth:`from_deepspeed`.

    Attributes:
        optimizer: Adam / AdamW hyperparameters.
        gradient_accumulation_steps: micro-batches per optimizer step (>= 1).
        gradient_clipping: clip the global gradient norm to this (>= 0; 0 = off).
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
            values]); :meth:`for_world_size` fills in ``train_batch_size`` / ``train_micro_batch_size_per_gpu``
            among them from the others and the world size (``gradient_accumulation_steps`` among them was
            already settled by ``from_deepspeed``; it is listed so ``to_deepspeed`` writes ``"auto"`` back).
        aio: the asynchronous file I/O engine's settings (DeepSpeed ``aio``).

    Raises:
        ValueError: naming the key path of the first invalid value, or bf16 and fp16 both enabled.
    """

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
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

    def __post_init__(self) -> None:
        for name, cls in (("optimizer", OptimizerConfig), ("fp16", FP16Config),
                          ("zero_optimization", ZeroOptimizationConfig), ("aio", AioConfig)):
            if not isinstance(getattr(self, name), cls):
                _fail(name, f"expected a {cls.__name__}, got {type(getattr(self, name)).__name__} "
                      "(use ZeroConfig.from_deepspeed to read a DeepSpeed dict)")
        ints = {"gradient_accumulation_steps": False, "train_batch_size": True,
                "train_micro_batch_size_per_gpu": True, "steps_per_print": False}
        for name, optional in ints.items():
            value = getattr(self, name)
            if not (optional and value is None):
                object.__setattr__(self, name, _int(value, name, 1))
        object.__setattr__(self, "gradient_clipping", _float(self.gradient_clipping, "gradient_clipping", 0.0))
        object.__setattr__(self, "bf16", _bool(self.bf16, "bf16.enabled"))
        if self.communication_data_type is not None:
            dtype = _choice(self.communication_data_type, "communication_data_type", {k: k for k in _COMM_DTYPES})
            object.__setattr__(self, "communication_data_type", dtype)
        if self.bf16 and self.fp16.enabled:
            raise ValueError("bf16.enabled and fp16.enabled are both true; enable at most one")
        _bool(self.derive_accumulation_steps, "derive_accumulation_steps")
        if self.derive_accumulation_steps and (self.train_batch_size is None
                                               or self.train_micro_batch_size_per_gpu is None):
            raise ValueError("derive_accumulation_steps needs train_batch_size and train_micro_batch_size_per_gpu")
        if self.scheduler is not None and not isinstance(self.scheduler, SchedulerConfig):
            _fail("scheduler", f"expected a SchedulerConfig or None, got {type(self.scheduler).__name__} "
                  "(use ZeroConfig.from_deepspeed to read a DeepSpeed dict)")
        auto = self.auto_batch_sizes
        if (isinstance(auto, (str, bytes)) or not isinstance(auto, Sequence)
                or any(name not in _BATCH_KEYS for name in auto)):
            _fail("auto_batch_sizes", f"expected a tuple of names among {', '.join(_BATCH_KEYS)}, got {auto!r}")
        object.__setattr__(self, "auto_batch_sizes", tuple(sorted(set(auto))))
        for name in self.auto_batch_sizes:
            if name != "gradient_accumulation_steps" and getattr(self, name) is not None:
                _fail(name, f"listed in auto_batch_sizes (to be derived) but also given: {getattr(self, name)!r}")

    def for_world_size(self, world_size: int) -> ZeroConfig:
        """This config with DeepSpeed's batch-size rule applied for ``world_size`` ranks: the derived
        ``gradient_accumulation_steps`` filled in (see ``derive_accumulation_steps``), and the batch sizes given
        as ``"auto"`` (see ``auto_batch_sizes``), then checked.

        Raises:
            ValueError: when the batch sizes do not fit ``world_size`` (see :meth:`check_batch_sizes`).
        """
        config = self
        if self.auto_batch_sizes:
            config = config._fill_auto_batch_sizes(_int(world_size, "world_size", 1))
        if config.derive_accumulation_steps:
            batch, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
            world = _int(world_size, "world_size", 1)
            if batch % (micro * world):
                raise ValueError(f"train_batch_size ({batch}) is not divisible by train_micro_batch_size_per_gpu "
                                 f"({micro}) * world_size ({world}); no gradient_accumulation_steps fits")
            config = dataclasses.replace(config, gradient_accumulation_steps=batch // (micro * world),
                                         derive_accumulation_steps=False)
        config.check_batch_sizes(world_size)
        return config

    def _fill_auto_batch_sizes(self, world: int) -> ZeroConfig:
        """DeepSpeed's batch-size rule for the keys given as ``"auto"``: ``train_batch_size = micro * gas *
        world``; ``micro = train_batch_size / (gas * world)``; neither is filled when both are ``"auto"``."""
        auto, gas = self.auto_batch_sizes, self.gradient_accumulation_steps
        batch, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        if "train_batch_size" in auto and micro is not None:
            batch = micro * gas * world
        elif "train_micro_batch_size_per_gpu" in auto and batch is not None:
            if batch % (gas * world):
                raise ValueError(f'train_micro_batch_size_per_gpu: "auto" is train_batch_size ({batch}) / '
                                 f"(gradient_accumulation_steps ({gas}) * world_size ({world})), which is not an "
                                 "integer; give train_micro_batch_size_per_gpu, or a train_batch_size that divides")
            micro = batch // (gas * world)
        return dataclasses.replace(self, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                                   auto_batch_sizes=())

    @property
    def compute_dtype(self) -> torch.dtype:
        """bfloat16 if ``bf16``, float16 if ``fp16.enabled``, else float32."""
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16.enabled else torch.float32

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``communication_data_type``, float32 when it is None."""
        return torch.float32 if self.communication_data_type is None else _COMM_DTYPES[self.communication_data_type]

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
        world = _int(world_size, "world_size", 1)
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
                values]); ``zerocore.initialize`` passes :func:`hidden_size_of` its model.

        Returns:
            The validated config. Missing keys take the dataclass defaults, except ``weight_decay``, which
            defaults to 0.0 for both optimizer types, as DeepSpeed does.

        Raises:
            ValueError: an invalid value, an unknown key, an unsupported key (with ``strict``), ``"auto"``
                placeholders zerocore cannot fill in (all named in one error), or a file that is not valid JSON.
            TypeError: ``source`` is neither a path nor a mapping.
        """
        if isinstance(source, (str, os.PathLike)):
            data = _load_json(source)
        elif isinstance(source, Mapping):
            data = source
        else:
            raise TypeError(f"source must be a path or a mapping, got {type(source).__name__}")
        unsupported: list[str] = []
        top = _section(data, "", unsupported)
        optimizer = _section(top.get("optimizer", {}), "optimizer", unsupported)
        params = _section(optimizer.get("params", {}), "optimizer.params", unsupported)
        fp16 = _section(top.get("fp16", {}), "fp16", unsupported)
        bf16 = _section(top.get("bf16", {}), "bf16", unsupported)
        zero = _section(top.get("zero_optimization", {}), "zero_optimization", unsupported)
        offload = {name: _section(zero[name], f"zero_optimization.{name}", unsupported)
                   for name in ("offload_optimizer", "offload_param")
                   if zero.get(name) is not None and zero.get(name) is not False}  # null / false: no offload
        aio = {} if top.get("aio") is None else _section(top["aio"], "aio", unsupported)
        scheduler = top.get("scheduler")
        if scheduler is not None:
            scheduler = _section(scheduler, "scheduler", unsupported)
            if "type" not in scheduler:
                _fail("scheduler.type", "missing; a scheduler section needs a type (such as \"WarmupLR\")")
            scheduler_params = scheduler.get("params", {})
            if not isinstance(scheduler_params, Mapping):
                _fail("scheduler.params", f"expected a JSON object (a mapping), got {scheduler_params!r}")
            scheduler["params"] = dict(scheduler_params)  # a copy: "auto" values are filled in below
        if unsupported and strict:
            raise ValueError(f"DeepSpeed keys not supported yet by zerocore: {', '.join(unsupported)}; remove them, "
                             "or pass strict=False to ignore them with a warning")
        plain = {k: v for k, v in top.items()
                 if k not in ("optimizer", "fp16", "bf16", "zero_optimization", "scheduler", "aio")}
        _fill_auto(plain=plain, optimizer=optimizer, params=params, fp16=fp16, bf16=bf16, zero=zero,
                   scheduler=scheduler, hidden_size=hidden_size)

        opt_type = _choice(optimizer.get("type", "AdamW"), "optimizer.type", _OPTIMIZER_TYPES)
        opt_kwargs = {("adamw_mode" if k == "adam_w_mode" else k): v for k, v in params.items()}
        opt_kwargs.setdefault("weight_decay", _DEFAULT_WEIGHT_DECAY[opt_type])
        if opt_type == "AdamW" and "adamw_mode" in opt_kwargs:  # DeepSpeed: type AdamW forces adam_w_mode on
            _bool(opt_kwargs.pop("adamw_mode"), "optimizer.params.adam_w_mode")
        if ("gradient_accumulation_steps" not in plain and plain.get("train_batch_size") is not None
                and plain.get("train_micro_batch_size_per_gpu") is not None):
            plain["derive_accumulation_steps"] = True  # DeepSpeed derives it once the world size is known
        schedule = None if scheduler is None else SchedulerConfig(scheduler["type"], scheduler["params"])
        zero.update(_offload_configs(zero, offload))
        if _bool(aio.pop("use_gds", False), "aio.use_gds"):
            _fail("aio.use_gds", "GPUDirect Storage is not supported: zerocore's NVMe I/O goes through (pinned) CPU "
                  "memory; set it to false or remove it")
        config = cls(optimizer=OptimizerConfig(type=opt_type, **opt_kwargs), bf16=bf16.get("enabled", False),
                     fp16=FP16Config(**fp16), zero_optimization=ZeroOptimizationConfig(**zero), scheduler=schedule,
                     aio=AioConfig(**aio), **plain)
        if unsupported:
            warnings.warn(f"zerocore ignores these DeepSpeed keys, not supported yet: {', '.join(unsupported)}",
                          UserWarning, stacklevel=2)
        return config

    def to_deepspeed(self) -> dict[str, Any]:
        """Returns a DeepSpeed config dict (JSON-serializable); ``from_deepspeed`` of it equals ``self``."""
        o, a = self.optimizer, self.aio
        zero = {k: v for k, v in dataclasses.asdict(self.zero_optimization).items()
                if v is not None and k not in _ZEROCORE_ONLY}  # DeepSpeed refuses keys it does not know
        for name in ("offload_optimizer", "offload_param"):
            zero[name] = {k: v for k, v in zero[name].items() if v is not None}  # nvme_path unset: left out
        out: dict[str, Any] = {
            "optimizer": {"type": o.type, "params": {
                "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                "adam_w_mode": o.adamw_mode, "bias_correction": o.bias_correction}},
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_clipping": self.gradient_clipping,
            "bf16": {"enabled": self.bf16},
            "fp16": dataclasses.asdict(self.fp16),
            "zero_optimization": zero,
            "steps_per_print": self.steps_per_print,
            "aio": {"block_size": a.block_size, "queue_depth": a.queue_depth, "intra_op_parallelism": a.thread_count,
                    "single_submit": a.single_submit, "overlap_events": a.overlap_events},
        }
        for name in ("communication_data_type", "train_batch_size", "train_micro_batch_size_per_gpu"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.derive_accumulation_steps:
            del out["gradient_accumulation_steps"]  # left for DeepSpeed's rule, as in the source config
        for name in self.auto_batch_sizes:
            out[name] = "auto"  # still to be derived (by for_world_size), as in the source config
        if self.scheduler is not None:
            out["scheduler"] = {"type": self.scheduler.type, "params": self.scheduler.params_dict}
        return out


# DeepSpeed's deprecated zero_optimization flags -> what each one sets (cpu_offload*: true is device "cpu").
_LEGACY_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                   "cpu_offload_use_pin_memory": "pin_memory"}
# Per section (key path, "" = top level): supported keys, aliases DeepSpeed also accepts, keys accepted and
# ignored, and real DeepSpeed keys that zerocore does not support yet.
_ZEROCORE_ONLY = frozenset({"zero_quantization_group_size", "zero_node_size"})  # zero_optimization keys
_Z3 = ("max_reuse_distance model_persistence_threshold gather_16bit_weights_on_model_save "
       "module_granularity_threshold use_all_reduce_for_fetch_params allgather_sequential").split()
_SCHEMA: dict[str, tuple[frozenset[str], dict[str, str], frozenset[str], frozenset[str]]] = {
    "": (frozenset(f.name for f in dataclasses.fields(ZeroConfig)) - {"auto_batch_sizes"}, {"bfloat16": "bf16"},
         frozenset({"wall_clock_breakdown"}), frozenset((
             "activation_checkpointing flops_profiler tensorboard wandb csv_monitor comms_logger amp "
             "zero_allow_untested_optimizer zero_force_ds_cpu_optimizer elasticity autotuning prescale_gradients "
             "gradient_predivide_factor sparse_gradients sparse_attention pipeline data_efficiency "
             "curriculum_learning compression_training checkpoint nebula data_types memory_breakdown "
             "dump_state disable_allgather torch_autocast compile hybrid_engine eigenvalue progressive_layer_drop "
             "quantize_training weight_quantization seq_parallel_communication_data_type dataloader_drop_last "
             "tensor_parallel").split())),
    "optimizer": (frozenset({"type", "params"}), {}, frozenset(), frozenset({"legacy_fusion"})),
    "optimizer.params": (frozenset({"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}), {},
                         frozenset(), frozenset({"torch_adam", "amsgrad"})),
    "fp16": (frozenset(f.name for f in dataclasses.fields(FP16Config)), {}, frozenset(),
             frozenset({"fp16_master_weights_and_grads"})),
    "bf16": (frozenset({"enabled"}), {}, frozenset(), frozenset({"immediate_grad_update"})),
    "scheduler": (frozenset({"type", "params"}), {}, frozenset(), frozenset()),
    "zero_optimization": (
        frozenset(f.name for f in dataclasses.fields(ZeroOptimizationConfig)) | frozenset(_LEGACY_OFFLOAD),
        {name: "stage3_" + name for name in ("prefetch_bucket_size", "max_live_parameters",
                                             "param_persistence_threshold")},
        frozenset(),
        frozenset((
            "load_from_fp32_weights elastic_checkpoint allgather_partitions use_multi_rank_bucket_allreduce "
            "ignore_unused_parameters legacy_stage1 round_robin_gradients zeropp_loco_param "
            "mics_shard_size mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint "
            "override_module_apply log_trace_cache_warnings stage3_gather_fp16_weights_on_model_save zenflow "
            "leaf_module").split() + _Z3 + ["stage3_" + name for name in _Z3])),
    "zero_optimization.offload_optimizer": (
        frozenset(f.name for f in dataclasses.fields(OffloadOptimizerConfig)), {}, frozenset(),
        frozenset({"pipeline_read", "pipeline_write", "super_offload", "cpuadam_cores_perc"})),
    "zero_optimization.offload_param": (
        frozenset(f.name for f in dataclasses.fields(OffloadParamConfig)), {}, frozenset(), frozenset()),
    "aio": (frozenset(f.name for f in dataclasses.fields(AioConfig)) | {"use_gds"},
            {"intra_op_parallelism": "thread_count"}, frozenset(), frozenset()),
}
_HINTS = {"optimizer.params.max_grad_norm": "DeepSpeed clips with the top-level gradient_clipping"}


def _offload_configs(zero: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``offload_optimizer`` / ``offload_param`` configs from their sections (the ones given, already
    key-checked) and DeepSpeed's deprecated ``cpu_offload*`` flags, which are popped from ``zero``.

    ``cpu_offload: true`` is ``offload_optimizer`` device ``"cpu"`` (false: ``"none"``), likewise
    ``cpu_offload_param`` for ``offload_param``; ``cpu_offload_use_pin_memory`` is ``pin_memory`` of both.
    A flag and a section that disagree are an error naming both."""
    z = "zero_optimization."
    legacy = {key: zero.pop(key) for key in _LEGACY_OFFLOAD if key in zero}
    legacy = {key: _bool(value, z + key) for key, value in legacy.items() if value is not None}
    sections = {name: dict(sections.get(name, {})) for name in ("offload_optimizer", "offload_param")}
    for key in ("cpu_offload", "cpu_offload_param"):
        if key not in legacy:
            continue
        name = _LEGACY_OFFLOAD[key]
        device = "cpu" if legacy[key] else "none"
        if "device" in sections[name]:
            given = _offload_device(sections[name]["device"], f"{z}{name}.device")
            if given != device:
                _fail(z + key, f"{str(legacy[key]).lower()} (deprecated; means {z}{name}.device {device!r}) "
                      f"disagrees with {z}{name}.device {given!r}; remove {z}{key}")
        sections[name]["device"] = device
    if "cpu_offload_use_pin_memory" in legacy:
        pin = legacy["cpu_offload_use_pin_memory"]
        for name, section in sections.items():
            if "pin_memory" in section and _bool(section["pin_memory"], f"{z}{name}.pin_memory") != pin:
                _fail(z + "cpu_offload_use_pin_memory", f"{str(pin).lower()} (deprecated) disagrees with "
                      f"{z}{name}.pin_memory {str(section['pin_memory']).lower()}; remove "
                      f"{z}cpu_offload_use_pin_memory")
            section["pin_memory"] = pin
    return {"offload_optimizer": OffloadOptimizerConfig(**sections["offload_optimizer"]),
            "offload_param": OffloadParamConfig(**sections["offload_param"])}


def _section(mapping: Any, path: str, unsupported: list[str]) -> dict[str, Any]:
    """Returns the supported keys of one section (aliases resolved); records unsupported key paths."""
    supported, aliases, ignored, not_yet = _SCHEMA[path]
    prefix = path + "." if path else ""
    if not isinstance(mapping, Mapping):
        _fail(path or "config", f"expected a JSON object (a mapping), got {mapping!r}")
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            _fail(path or "config", f"keys must be strings, got {key!r}")
        name = aliases.get(key, key)
        if name in supported:
            if name in out:
                _fail(prefix + name, "given twice, under its name and under an alias DeepSpeed also accepts")
            out[name] = value
        elif key in not_yet:
            unsupported.append(prefix + key)
        elif key not in ignored:
            known = sorted(supported | set(aliases) | ignored | not_yet)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            hint = f" ({_HINTS[prefix + key]})" if prefix + key in _HINTS else hint
            _fail(prefix + key, f"unknown key{hint}; accepted keys here: {', '.join(sorted(supported | ignored))}")
    return out


# Where the Hugging Face Trainer takes each "auto" it fills from TrainingArguments (its trainer_config_process /
# trainer_config_finalize): the argument named in zerocore's error.
_TRAINING_ARGUMENTS = {
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1 and adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "gradient_clipping": "max_grad_norm",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps (or warmup_ratio times the number of training steps)",
    "scheduler.params.total_num_steps": "max_steps (the number of training steps the Trainer computes)",
}
# "auto" bucket sizes the Trainer derives from the model's hidden size h.
_FROM_HIDDEN = {"reduce_bucket_size": ("h^2", lambda h: h * h),
                "stage3_prefetch_bucket_size": ("0.9 h^2", lambda h: int(0.9 * h * h)),
                "stage3_param_persistence_threshold": ("10 h", lambda h: 10 * h)}


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _fill_auto(*, plain: dict[str, Any], optimizer: dict[str, Any], params: dict[str, Any], fp16: dict[str, Any],
               bf16: dict[str, Any], zero: dict[str, Any], scheduler: dict[str, Any] | None,
               hidden_size: Any) -> None:
    """Fills in the ``"auto"`` values zerocore can derive, in place in these (fresh) section dicts, and raises
    one ``ValueError`` naming every other (Note [Hugging Face "auto" values])."""
    problems: list[str] = []
    reported: set[str] = set()

    def needs_value(path: str) -> None:
        if path in reported:
            return
        source = _TRAINING_ARGUMENTS.get(path)
        if source is None:
            problems.append(f'{path}: "auto" is a Hugging Face Trainer placeholder that the Trainer fills in before '
                            "DeepSpeed sees the config; zerocore needs the actual value")
        else:
            problems.append(f'{path}: "auto" is a Hugging Face Trainer placeholder, filled from TrainingArguments.'
                            f"{source}; zerocore does not see the training arguments, so give the value")

    # From the model's hidden size, as the Trainer does.
    for name, (formula, derive) in _FROM_HIDDEN.items():
        if _is_auto(zero.get(name)):
            if hidden_size is None:
                problems.append(
                    f'zero_optimization.{name}: "auto" is a Hugging Face Trainer placeholder, derived from the '
                    f"model's hidden size h ({formula}), and no hidden size is known: the model has no "
                    "config.hidden_size (nor config.hidden_sizes) (ZeroConfig.from_deepspeed takes hidden_size=); "
                    "give an integer")
                reported.add(f"zero_optimization.{name}")
            else:
                zero[name] = derive(_int(hidden_size, "hidden_size (the model's config.hidden_size)", 1))

    # Batch sizes: DeepSpeed's rule, an "auto" counting as absent; what needs the world size waits for it.
    auto_batch = [name for name in _BATCH_KEYS if _is_auto(plain.get(name))]
    if auto_batch:
        for name in auto_batch:
            del plain[name]
        given = [name for name in ("train_batch_size", "train_micro_batch_size_per_gpu") if name in plain]
        if "gradient_accumulation_steps" in auto_batch:
            if len(given) == 2:
                auto_batch.remove("gradient_accumulation_steps")  # derived by derive_accumulation_steps
            elif len(given) == 1:
                plain["gradient_accumulation_steps"] = 1  # DeepSpeed's rule with one batch size given
            else:
                auto_batch.remove("gradient_accumulation_steps")
                problems.append(
                    'gradient_accumulation_steps: "auto" is a Hugging Face Trainer placeholder, filled from '
                    "TrainingArguments.gradient_accumulation_steps; zerocore derives it (DeepSpeed's rule) only "
                    "from a numeric train_batch_size or train_micro_batch_size_per_gpu, and neither is given: "
                    "give gradient_accumulation_steps, or the batch sizes")
        plain["auto_batch_sizes"] = tuple(auto_batch)

    # The scheduler's: warmup_min_lr is 0 and warmup_max_lr the optimizer's lr, as the Trainer sets them.
    if scheduler is not None:
        sched_params = scheduler["params"]
        if _is_auto(sched_params.get("warmup_min_lr")):
            sched_params["warmup_min_lr"] = 0.0
        lr = params.get("lr")
        if _is_auto(sched_params.get("warmup_max_lr")) and lr is not None and not _is_auto(lr):
            sched_params["warmup_max_lr"] = lr

    # Everything else: named, with the training argument it stands for.
    sections = [("", plain), ("optimizer.", optimizer), ("optimizer.params.", params), ("fp16.", fp16),
                ("bf16.", bf16), ("zero_optimization.", zero)]
    if scheduler is not None:
        sections += [("scheduler.", scheduler), ("scheduler.params.", scheduler["params"])]
    for prefix, section in sections:
        for key, value in section.items():
            if _is_auto(value):
                needs_value(prefix + key)
    if len(problems) > 1:
        problems.insert(0, f'{len(problems)} "auto" values that zerocore cannot fill in:')
    if problems:
        raise ValueError("\n".join(problems))


def _load_json(path: str | os.PathLike[str]) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{os.fspath(path)}: key {key!r} appears twice in one object")
            out[key] = value
        return out

    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f, object_pairs_hook=no_duplicates)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: not valid JSON: {e}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"{os.fspath(path)}: not a JSON text file (not valid UTF-8 at byte {e.start}); pass the "
                             "path of a DeepSpeed JSON config") from e
