"""DeepSpeed JSON configs read into a :class:`~zerocore.config.ZeroConfig` and written back from one.

:meth:`ZeroConfig.from_deepspeed` reads a DeepSpeed config (a JSON file or a dict) and sorts its keys into three
classes: keys zerocore supports (parsed), real DeepSpeed keys zerocore does not support yet (an error, or with
``strict=False`` one warning listing them all, and then ignored), and unknown keys (always an error, with a "did
you mean" suggestion). ``"auto"`` values are filled in or named by _hf_auto.py (Note [Hugging Face "auto"
values]); the deprecated ``cpu_offload*`` flags are read by _offload_config.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ._autocast_config import autocast_from_deepspeed
from ._config_values import as_bool, as_choice, fail
from ._hf_auto import FROM_HIDDEN, fill_auto
from ._monitor import MONITOR_SECTIONS, monitor_sections_for_deepspeed
from ._offload_config import LEGACY_OFFLOAD, AioConfig, OffloadOptimizerConfig, OffloadParamConfig, offload_configs
from ._scheduler_config import SchedulerConfig
from .config import OPTIMIZER_TYPES, FP16Config, OptimizerConfig, ZeroConfig, ZeroOptimizationConfig

# weight_decay when a DeepSpeed JSON leaves it out, per optimizer type.
_DEFAULT_WEIGHT_DECAY = {"Adam": 0.0, "AdamW": 0.0}  # DeepSpeed builds FusedAdam, whose default is 0.0
# Per section (key path, "" = top level): supported keys, aliases DeepSpeed also accepts, keys accepted and
# ignored, and real DeepSpeed keys that zerocore does not support yet.
_ZEROCORE_ONLY = frozenset({"zero_quantization_group_size", "zero_node_size"})  # zero_optimization keys
_Z3 = "max_reuse_distance model_persistence_threshold module_granularity_threshold allgather_sequential".split()
_SCHEMA: dict[str, tuple[frozenset[str], dict[str, str], frozenset[str], frozenset[str]]] = {
    # (grad_accum_dtype is read from the data_types section, check_grad_overflow from bf16, the torch_autocast
    # fields from their section)
    "": ((frozenset(f.name for f in dataclasses.fields(ZeroConfig))
          - {"auto_batch_sizes", "grad_accum_dtype", "check_grad_overflow",
             "torch_autocast_lower_precision_safe_modules"}) | {"data_types"},
         {"bfloat16": "bf16"},
         frozenset({"wall_clock_breakdown"}), frozenset((
             "activation_checkpointing flops_profiler comet comms_logger amp "
             "zero_allow_untested_optimizer zero_force_ds_cpu_optimizer elasticity autotuning prescale_gradients "
             "gradient_predivide_factor sparse_gradients sparse_attention pipeline data_efficiency "
             "curriculum_learning compression_training checkpoint nebula memory_breakdown "
             "dump_state disable_allgather compile hybrid_engine eigenvalue progressive_layer_drop "
             "quantize_training weight_quantization seq_parallel_communication_data_type dataloader_drop_last "
             "tensor_parallel timers sequence_parallel_size").split())),
    "optimizer": (frozenset({"type", "params"}), {}, frozenset(), frozenset({"legacy_fusion"})),
    "optimizer.params": (frozenset({"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction"}), {},
                         frozenset(), frozenset({"torch_adam", "amsgrad"})),
    "fp16": (frozenset(f.name for f in dataclasses.fields(FP16Config)), {}, frozenset(),
             frozenset({"fp16_master_weights_and_grads"})),
    "bf16": (frozenset({"enabled", "check_grad_overflow"}), {}, frozenset(), frozenset({
        "immediate_grad_update", "check_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"})),
    "scheduler": (frozenset({"type", "params"}), {}, frozenset(), frozenset()),
    "zero_optimization": (
        frozenset(f.name for f in dataclasses.fields(ZeroOptimizationConfig)) | frozenset(LEGACY_OFFLOAD),
        {**{name: "stage3_" + name for name in ("prefetch_bucket_size", "max_live_parameters",
                                                "param_persistence_threshold")},
         "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
         **{name: "stage3_gather_16bit_weights_on_model_save"
            for name in ("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")}},
        frozenset(),
        frozenset((
            "load_from_fp32_weights elastic_checkpoint use_multi_rank_bucket_allreduce "
            "ignore_unused_parameters legacy_stage1 round_robin_gradients zeropp_loco_param "
            "mics_shard_size mics_hierarchical_params_gather memory_efficient_linear pipeline_loading_checkpoint "
            "override_module_apply log_trace_cache_warnings zenflow leaf_module").split()
            + _Z3 + ["stage3_" + name for name in _Z3])),
    "zero_optimization.offload_optimizer": (
        frozenset(f.name for f in dataclasses.fields(OffloadOptimizerConfig)), {}, frozenset(),
        frozenset({"pipeline_read", "pipeline_write", "super_offload", "cpuadam_cores_perc"})),
    "zero_optimization.offload_param": (
        frozenset(f.name for f in dataclasses.fields(OffloadParamConfig)), {}, frozenset(), frozenset()),
    "data_types": (frozenset({"grad_accum_dtype"}), {}, frozenset(), frozenset()),
    "torch_autocast": (frozenset({"enabled", "dtype", "lower_precision_safe_modules"}), {}, frozenset(), frozenset()),
    **{name: (frozenset(f.name for f in dataclasses.fields(cls)), {}, frozenset(), frozenset())
       for name, cls in MONITOR_SECTIONS.items()},
    "aio": (frozenset(f.name for f in dataclasses.fields(AioConfig)) | {"use_gds"},
            {"intra_op_parallelism": "thread_count"}, frozenset(), frozenset()),
}
_HINTS = {"optimizer.params.max_grad_norm": "DeepSpeed clips with the top-level gradient_clipping"}


# Note [DeepSpeed keys at what zerocore does]
# A DeepSpeed key zerocore does not support is still accepted, silently, when its value asks for what zerocore
# does anyway: DeepSpeed's default (a disabled monitor, a switched-off feature, a factor of 1.0), a value naming
# zerocore's behaviour (every rank must name the same checkpoint tag, as tag_validation "Fail" asks, and zerocore
# refuses when they differ), or any value of a key that only changes how DeepSpeed schedules the same work. So
# configs written for DeepSpeed, which spell out such values, load as they are; any other value of these keys
# still raises as unsupported (or is warned about with strict=False). Defaults from DeepSpeed 0.19's models.
def _disabled(value: Any) -> bool:  # a section DeepSpeed switches on with "enabled": true (default false)
    return isinstance(value, Mapping) and value.get("enabled", False) is False


def _equals(*accepted: Any) -> Any:
    def same(value: Any, want: Any) -> bool:  # booleans and null only themselves; numbers by value (1e9 == 10**9)
        if want is None or type(want) is bool:
            return value is want
        return type(value) is not bool and value == want

    return lambda value: any(same(value, want) for want in accepted)


def _all_off(value: Any) -> bool:  # every switch false, no count given
    return isinstance(value, Mapping) and all(v is False or v is None for v in value.values())


_ACTIVATION_CHECKPOINTING = frozenset({"partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                                       "number_checkpoints", "synchronize_checkpoint_boundary", "profile"})


def _checkpointing_like_zerocore(value: Any) -> bool:
    """activation_checkpointing configures DeepSpeed's deepspeed.checkpointing, and only when a script passes the
    config to its configure() (zerocore's is torch's: zerocore.deepspeed.checkpointing, whose configure reads the
    section and refuses cpu_checkpointing there); DeepSpeed's engine never reads it, so any well-typed value loads.
    Its buffers, count, synchronizing and profiling tune DeepSpeed's implementation only."""
    flags = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
             "synchronize_checkpoint_boundary", "profile")
    return (isinstance(value, Mapping) and set(value) <= _ACTIVATION_CHECKPOINTING
            and all(type(value[k]) is bool for k in flags if k in value)
            and (value.get("number_checkpoints") is None or type(value["number_checkpoints"]) is int))


def _checkpoint_like_zerocore(value: Any) -> bool:  # tag_validation Warn/Fail: zerocore refuses differing tags
    # (load_universal is read into ZeroConfig.load_universal: zerocore reads universal checkpoints)
    return (isinstance(value, Mapping) and set(value) <= {"tag_validation", "load_universal", "use_node_local_storage"}
            and _equals("Warn", "WARN", "Fail", "FAIL")(value.get("tag_validation", "Warn"))
            and isinstance(value.get("load_universal", False), bool)
            and _all_off({k: v for k, v in value.items() if k not in ("tag_validation", "load_universal")}))


def _compile_like_zerocore(value: Any) -> bool:
    """DeepSpeed's compile section: off unless ``deepcompile`` is true; every other key tunes DeepCompile only
    (engine.compile() is torch.compile, as the stage allows)."""
    return isinstance(value, Mapping) and value.get("deepcompile", False) is False


def _timers_like_zerocore(value: Any) -> bool:
    """DeepSpeed's timers section: whether and how it times throughput for its logs (zerocore's reports time
    what they report); its switches only, either value."""
    throughput = value.get("throughput", {}) if isinstance(value, Mapping) else None
    return (isinstance(value, Mapping) and set(value) <= {"throughput"} and isinstance(throughput, Mapping)
            and set(throughput) <= {"enabled", "synchronized"} and all(type(v) is bool for v in throughput.values()))


# the stage-3 keys DeepSpeed reads with or without their "stage3_" prefix (_Z3), at their defaults
_Z3_LIKE_ZEROCORE = {"allgather_sequential": False}


def _count(value: Any) -> bool:
    """A whole number >= 0 (a JSON float such as 1e9 included), or "auto" (DeepSpeed's default, as below)."""
    return value == "auto" or (type(value) in (int, float) and value >= 0 and float(value).is_integer())


# Stage-3 tuning keys whose every value asks for what zerocore does:
# * module_granularity_threshold makes modules of few parameters per descendant leaves, fetched whole with
#   their children instead of by a hook each; zerocore fetches whole units (a model's repeated blocks: Note
#   [Stage 3 units]) and never a module inside one on its own;
# * max_reuse_distance keeps a fetched parameter that is used again within that many elements; zerocore's
#   release rule is its own (Note [Stage 3 gather and release]: a unit is released after its forward, the
#   forward's last one kept for the backward), and either only trades memory for gathers, never values.
_Z3_ANY_COUNT = ("module_granularity_threshold", "max_reuse_distance")


_LIKE_ZEROCORE: dict[str, Any] = {
    **{key: _disabled for key in (
        "flops_profiler comet comms_logger amp elasticity autotuning nebula "
        "hybrid_engine eigenvalue progressive_layer_drop quantize_training curriculum_learning data_efficiency"
        ).split()},
    "activation_checkpointing": _checkpointing_like_zerocore,
    "zero_allow_untested_optimizer": _equals(True, False),  # governs client optimizers, which zerocore never takes
    "zero_force_ds_cpu_optimizer": _equals(True, False),  # likewise: offload always steps with zerocore's CPU Adam
    # where DeepSpeed divides gradients by the world size, before the reduction (prescale_gradients) or split
    # around it (gradient_predivide_factor before, the rest after): the same average either way, up to rounding;
    # zerocore divides as it writes each gradient into its bucket, which is what prescale_gradients asks for
    "prescale_gradients": _equals(True, False),
    "gradient_predivide_factor": lambda value: type(value) in (int, float) and 0 < value < math.inf,
    # sparse allreduce for sparse gradients: zerocore refuses modules that make them (nn.Embedding(sparse=True))
    # by name at initialize, so either value changes nothing that trains
    "sparse_gradients": _equals(True, False),
    "memory_breakdown": _equals(False),
    "dump_state": _equals(False),
    "disable_allgather": _equals(False),
    "dataloader_drop_last": _equals(False),
    "seq_parallel_communication_data_type": _equals("fp32"),
    "checkpoint": _checkpoint_like_zerocore,
    "compile": _compile_like_zerocore,
    "timers": _timers_like_zerocore,
    "sequence_parallel_size": _equals(1),  # Ulysses sequence parallelism over more than one rank: not done here
    "optimizer.legacy_fusion": _equals(False),
    "optimizer.params.torch_adam": _equals(True, False),  # the same Adam, another implementation
    "optimizer.params.amsgrad": _equals(False),
    "fp16.fp16_master_weights_and_grads": _equals(False),
    "bf16.bf16_master_weights_and_grads": _equals(False),
    "bf16.bf16_optimizer_states": _equals(False),
    # when BF16_Optimizer adds a backward's gradients into its fp32 ones: either way the same sums (zerocore
    # adds them as they arrive, Note [fp32 gradient accumulation])
    "bf16.immediate_grad_update": _equals(True, False),
    # Either value asks for what zerocore does: every checkpoint reshards at load (elastic_checkpoint); the
    # offloaded copies are each rank's own shard already (round_robin_gradients spreads DeepSpeed's); the
    # reduction is zerocore's own, the sums the same (use_multi_rank_bucket_allreduce); stage 3 runs the model's
    # own linear layers, what DeepSpeed's memory_efficient_linear replaces (false asks for them, true only saves
    # DeepSpeed's activation memory).
    **{"zero_optimization." + key: _equals(True, False) for key in (
        "elastic_checkpoint", "round_robin_gradients", "use_multi_rank_bucket_allreduce", "memory_efficient_linear")},
    **{"zero_optimization." + key: _equals(value) for key, value in (
        ("load_from_fp32_weights", True), ("ignore_unused_parameters", True), ("legacy_stage1", False),
        ("zeropp_loco_param", None), ("mics_shard_size", -1), ("mics_hierarchical_params_gather", False),
        ("pipeline_loading_checkpoint", False), ("log_trace_cache_warnings", False), ("zenflow", None))},
    **{f"zero_optimization.{prefix}{key}": _equals(value) for key, value in _Z3_LIKE_ZEROCORE.items()
       for prefix in ("", "stage3_")},
    **{f"zero_optimization.{prefix}{key}": _count for key in _Z3_ANY_COUNT for prefix in ("", "stage3_")},
    # zerocore's NVMe-offloaded step always reads the next sub-group and writes the previous one while it updates
    # the current one (Note [NVMe optimizer state]): true asks for that, false only has DeepSpeed wait on each
    "zero_optimization.offload_optimizer.pipeline_read": _equals(True, False),
    "zero_optimization.offload_optimizer.pipeline_write": _equals(True, False),
    "zero_optimization.offload_optimizer.super_offload": _equals(False),
    # the CPU share of SuperOffload's Adam, read only with super_offload (refused above unless false)
    "zero_optimization.offload_optimizer.cpuadam_cores_perc":
        lambda value: type(value) in (int, float) and 0 <= value <= 1,
}


def _section(mapping: Any, path: str, unsupported: list[str]) -> dict[str, Any]:
    """Returns the supported keys of one section (aliases resolved); records unsupported key paths."""
    supported, aliases, ignored, not_yet = _SCHEMA[path]
    prefix = path + "." if path else ""
    if not isinstance(mapping, Mapping):
        fail(path or "config", f"expected a JSON object (a mapping), got {mapping!r}")
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            fail(path or "config", f"keys must be strings, got {key!r}")
        name = aliases.get(key, key)
        if not path and key.startswith("_"):
            continue  # a top-level "_comment" (JSON has no comments; DeepSpeed ignores keys it does not know there)
        if name in supported:
            if name in out:
                fail(prefix + name, "given twice, under its name and under an alias DeepSpeed also accepts")
            out[name] = value
        elif key in not_yet:
            like_zerocore = _LIKE_ZEROCORE.get(prefix + key)
            if like_zerocore is None or not like_zerocore(value):  # Note [DeepSpeed keys at what zerocore does]
                unsupported.append(prefix + key)
        elif key in ignored:  # wall_clock_breakdown, zerocore's reports cover it: its value still a bool
            if not isinstance(value, bool):
                fail(prefix + key, f"expected true or false, got {value!r}")
        else:
            known = sorted(supported | set(aliases) | ignored | not_yet)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            hint = f" ({_HINTS[prefix + key]})" if prefix + key in _HINTS else hint
            fail(prefix + key, f"unknown key{hint}; accepted keys here: {', '.join(sorted(supported | ignored))}")
    return out


def load_json(path: str | os.PathLike[str]) -> Any:
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


def _without_auto(section: dict[str, Any], keep: Sequence[str] = ()) -> dict[str, Any]:
    """The section without its "auto" values but those in ``keep``: DeepSpeed's config models (the
    zero_optimization section and its offload sections) read "auto" as their default, and the Hugging Face
    Trainer fills in only the bucket sizes there (Note [Hugging Face "auto" values]), so a config that leaves
    sub_group_size or stage3_max_live_parameters "auto" (OpenRLHF's) trains at DeepSpeed's defaults; here the
    key counts as absent. ``stage`` is kept, to be refused by name: no one fills it in, and a script that
    reads the config's stage back would find "auto"."""
    return {key: value for key, value in section.items() if value != "auto" or key in keep}


def from_deepspeed(cls: type[ZeroConfig], source: str | os.PathLike[str] | Mapping[str, Any], *, strict: bool,
                   hidden_size: int | None) -> tuple[ZeroConfig, list[str]]:
    """See :meth:`ZeroConfig.from_deepspeed`; also returns the unsupported keys that were ignored
    (``strict=False``), for the caller's warning."""
    if isinstance(source, (str, os.PathLike)):
        data = load_json(source)
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
    zero = _without_auto(_section(top.get("zero_optimization", {}), "zero_optimization", unsupported),
                         keep=("stage", *FROM_HIDDEN))
    offload = {name: _without_auto(_section(zero[name], f"zero_optimization.{name}", unsupported))
               for name in ("offload_optimizer", "offload_param")
               if zero.get(name) is not None and zero.get(name) is not False}  # null / false: no offload
    aio = {} if top.get("aio") is None else _section(top["aio"], "aio", unsupported)
    data_types = {} if top.get("data_types") is None else _section(top["data_types"], "data_types", unsupported)
    autocast = {} if top.get("torch_autocast") is None else _section(top["torch_autocast"], "torch_autocast",
                                                                     unsupported)
    monitors = {name: cls(**_section(top[name], name, unsupported)) for name, cls in MONITOR_SECTIONS.items()
                if top.get(name) is not None}
    scheduler = top.get("scheduler")
    if scheduler is not None:
        scheduler = _section(scheduler, "scheduler", unsupported)
        if "type" not in scheduler:
            fail("scheduler.type", "missing; a scheduler section needs a type (such as \"WarmupLR\")")
        scheduler_params = scheduler.get("params", {})
        if not isinstance(scheduler_params, Mapping):
            fail("scheduler.params", f"expected a JSON object (a mapping), got {scheduler_params!r}")
        scheduler["params"] = dict(scheduler_params)  # a copy: "auto" values are filled in below
    if unsupported and strict:
        raise ValueError(f"DeepSpeed keys not supported yet by zerocore: {', '.join(unsupported)}; remove them, "
                         "or pass strict=False to ignore them with a warning")
    plain = {k: v for k, v in top.items() if k not in (
        "optimizer", "fp16", "bf16", "zero_optimization", "scheduler", "aio", "data_types", "torch_autocast",
        *MONITOR_SECTIONS)}
    plain["torch_autocast"], plain["torch_autocast_lower_precision_safe_modules"] = autocast_from_deepspeed(autocast)
    if data_types.get("grad_accum_dtype") is not None:  # null: DeepSpeed's default, the compute dtype
        plain["grad_accum_dtype"] = data_types["grad_accum_dtype"]
    fill_auto(plain=plain, optimizer=optimizer, params=params, fp16=fp16, bf16=bf16, zero=zero,
              scheduler=scheduler, hidden_size=hidden_size)

    opt_type = as_choice(optimizer.get("type", "AdamW"), "optimizer.type", OPTIMIZER_TYPES)
    opt_kwargs = {("adamw_mode" if k == "adam_w_mode" else k): v for k, v in params.items()}
    opt_kwargs.setdefault("weight_decay", _DEFAULT_WEIGHT_DECAY[opt_type])
    if opt_type == "AdamW" and "adamw_mode" in opt_kwargs:  # DeepSpeed: type AdamW forces adam_w_mode on
        as_bool(opt_kwargs.pop("adamw_mode"), "optimizer.params.adam_w_mode")
    if ("gradient_accumulation_steps" not in plain and plain.get("train_batch_size") is not None
            and plain.get("train_micro_batch_size_per_gpu") is not None):
        plain["derive_accumulation_steps"] = True  # DeepSpeed derives it once the world size is known
    schedule = None if scheduler is None else SchedulerConfig(scheduler["type"], scheduler["params"])
    zero.update(offload_configs(zero, offload))
    if as_bool(aio.pop("use_gds", False), "aio.use_gds"):
        fail("aio.use_gds", "GPUDirect Storage is not supported: zerocore's NVMe I/O goes through (pinned) CPU "
             "memory; set it to false or remove it")
    checkpoint = data.get("checkpoint")
    load_universal = checkpoint.get("load_universal", False) if isinstance(checkpoint, Mapping) else False
    config = cls(optimizer=OptimizerConfig(type=opt_type, **opt_kwargs), bf16=bf16.get("enabled", False),
                 check_grad_overflow=bf16.get("check_grad_overflow", True),
                 fp16=FP16Config(**fp16), zero_optimization=ZeroOptimizationConfig(**zero), scheduler=schedule,
                 aio=AioConfig(**aio), load_universal=load_universal is True, **monitors, **plain)
    return config, unsupported


def to_deepspeed(config: ZeroConfig) -> dict[str, Any]:
    """See :meth:`ZeroConfig.to_deepspeed`."""
    o, a = config.optimizer, config.aio
    zero = {k: v for k, v in dataclasses.asdict(config.zero_optimization).items()
            if v is not None and k not in _ZEROCORE_ONLY}  # DeepSpeed refuses keys it does not know
    for name in ("offload_optimizer", "offload_param"):
        zero[name] = {k: v for k, v in zero[name].items() if v is not None}  # nvme_path unset: left out
    out: dict[str, Any] = {
        "optimizer": {"type": o.type, "params": {
            "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
            "adam_w_mode": o.adamw_mode, "bias_correction": o.bias_correction}},
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "gradient_clipping": config.gradient_clipping,
        "bf16": {"enabled": config.bf16, **({} if config.check_grad_overflow else {"check_grad_overflow": False})},
        "fp16": dataclasses.asdict(config.fp16),
        "zero_optimization": zero,
        "steps_per_print": config.steps_per_print,
        **({"checkpoint": {"load_universal": True}} if config.load_universal else {}),
        "aio": {"block_size": a.block_size, "queue_depth": a.queue_depth, "intra_op_parallelism": a.thread_count,
                "single_submit": a.single_submit, "overlap_events": a.overlap_events},
    }
    for name in ("communication_data_type", "train_batch_size", "train_micro_batch_size_per_gpu"):
        if getattr(config, name) is not None:
            out[name] = getattr(config, name)
    if config.grad_accum_dtype is not None:
        out["data_types"] = {"grad_accum_dtype": config.grad_accum_dtype}
    modules = config.torch_autocast_lower_precision_safe_modules
    if config.torch_autocast is not None or modules is not None:
        out["torch_autocast"] = {"enabled": config.torch_autocast is not None,
                                 **({} if config.torch_autocast is None else {"dtype": "bfloat16"}),
                                 **({} if modules is None else {"lower_precision_safe_modules": list(modules)})}
    out.update(monitor_sections_for_deepspeed(config))
    if config.derive_accumulation_steps:
        del out["gradient_accumulation_steps"]  # left for DeepSpeed's rule, as in the source config
    for name in config.auto_batch_sizes:
        out[name] = "auto"  # still to be derived (by for_world_size), as in the source config
    if config.scheduler is not None:
        out["scheduler"] = {"type": config.scheduler.type, "params": config.scheduler.params_dict}
    return out
