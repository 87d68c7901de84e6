"""What the engine checks about a model before it touches it, and how it groups the parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._user_frames import user_stacklevel
from .config import OptimizerConfig
from .optimizer import ADAM_GROUP_KEYS, TORCH_ADAM_FLAGS

_GROUP_KEYS = {*ADAM_GROUP_KEYS, "name"}
_READ_KEYS = sorted(set(ADAM_GROUP_KEYS) - {"params"})  # the hyperparameters a misspelt key would leave at default


def _check_group_keys(group: Mapping[str, Any], index: int) -> None:
    """A group's own keys (BEiT's and MAE's ``lr_scale`` for layer-wise lr decay, ``layer_id``) are kept, as
    torch's optimizers and DeepSpeed keep them, for the script's schedule to read; a key that is a misspelling
    of one zerocore's Adam reads would leave that hyperparameter at its default, so it is refused."""
    for key in sorted(set(group) - _GROUP_KEYS - set(TORCH_ADAM_FLAGS), key=str):
        if not isinstance(key, str):
            raise ValueError(f"param_groups[{index}] has a key {key!r} that is not a string")
        close = difflib.get_close_matches(key.lower(), _READ_KEYS + list(TORCH_ADAM_FLAGS), n=1, cutoff=0.8)
        if close:
            raise ValueError(f"param_groups[{index}] has key {key!r}: did you mean {close[0]!r}? (zerocore's Adam "
                             f"reads {_READ_KEYS}; a group's other keys are kept unread, for the script's own "
                             "schedule)")


def model_device(model: nn.Module) -> torch.device:
    """The one device every parameter and buffer of ``model`` lives on; ValueError otherwise."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    if not tensors:
        raise ValueError("the model has no parameters or buffers")
    first_name, first = tensors[0]
    for name, tensor in tensors[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"the model's tensors are on several devices: {first_name!r} on {first.device} and {name!r} on "
                f"{tensor.device}; move the model to one device (model.to(device)) before initialize()"
            )
    return first.device


def _fingerprint(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool]]:
    return [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]


def all_gather_json(comm: Any, value: Any, device: torch.device) -> list[Any]:
    """Every rank's JSON-serialisable ``value``, exchanged through zerocore's Comm (no numpy or pickle,
    unlike ``all_gather_object``). Tensors live on ``device`` so NCCL can carry them."""
    world, rank = comm.world_size, comm.rank
    payload = json.dumps(value).encode()
    lengths = torch.zeros(world, dtype=torch.int64, device=device)
    lengths[rank] = len(payload)
    comm.all_reduce(lengths).wait()  # every other slot is zero, so the sum is the gather
    longest = int(lengths.max().item())
    slots = torch.zeros(world * longest, dtype=torch.uint8, device=device)
    slots[rank * longest : rank * longest + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    comm.all_gather(slots, -1, "model_check").wait()
    rows = slots.view(world, longest).cpu()
    return [json.loads(bytes(rows[r, : int(lengths[r])].tolist()).decode()) for r in range(world)]


def raise_together(comm: Any, failure: BaseException | None, device: torch.device,
                   others: Callable[[int, str], BaseException]) -> None:
    """Every rank learns whether any rank failed, and all raise alike: this rank its own ``failure``, the others
    ``others(rank, message)`` for the first rank that failed; nothing when none did. A collective, issued by every
    rank, so none is left waiting in the next collective for a rank that raised alone."""
    failed = first_failure(comm, None if failure is None else f"{type(failure).__name__}: {failure}", device)
    if failure is not None:
        raise failure
    if failed is not None:
        raise others(*failed)


def first_failure(comm: Any, problem: str | None, device: torch.device) -> tuple[int, str] | None:
    """Every rank's ``problem`` (None: it succeeded) exchanged; the first rank with one and its message, or None.
    A collective."""
    verdicts = all_gather_json(comm, problem, device)
    return next(((rank, message) for rank, message in enumerate(verdicts) if message is not None), None)


@contextlib.contextmanager
def failing_together(comm: Any, device: torch.device, others: Callable[[int, str], BaseException]) -> Iterator[None]:
    """Runs the block on every rank, then :func:`raise_together` with what it raised (any ``Exception``)."""
    failure: Exception | None = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised by raise_together, here and (named) on the other ranks
        failure = error
    raise_together(comm, failure, device, others)


def check_same_model_on_all_ranks(model: nn.Module, comm: Any, rank: int, device: torch.device) -> None:
    """Raises on every rank, naming the first differing parameter and rank, when the models differ."""
    mine = [list(entry[:1]) + [list(entry[1])] + list(entry[2:]) for entry in _fingerprint(model)]
    everyone = [[(e[0], tuple(e[1]), e[2], e[3]) for e in theirs] for theirs in all_gather_json(comm, mine, device)]
    reference = everyone[0]
    for other_rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for index in range(max(len(reference), len(theirs))):
            ours = reference[index] if index < len(reference) else None
            other = theirs[index] if index < len(theirs) else None
            if ours != other:
                raise ValueError(
                    f"the model differs between ranks: parameter #{index} is {_describe(ours)} on rank 0 but "
                    f"{_describe(other)} on rank {other_rank} (this is rank {rank}). Every rank must build the "
                    "same model (names, shapes, dtypes, requires_grad)."
                )


# What may differ between ranks: where each rank's NVMe files go and how its host buffers are kept (one node's
# disk may be mounted elsewhere than another's), and how often it logs.
_RANK_LOCAL = frozenset({"nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init",
                         "steps_per_print"})


def _config_entries(value: Any, path: str = "") -> dict[str, str]:
    entries: dict[str, str] = {}
    for field in dataclasses.fields(value):
        key, item = f"{path}{field.name}", getattr(value, field.name)
        if field.name in _RANK_LOCAL or key.startswith("aio"):
            continue
        if dataclasses.is_dataclass(item):
            entries.update(_config_entries(item, key + "."))
        else:
            entries[key] = repr(item)
    return entries


def check_same_config_on_all_ranks(config: Any, comm: Any, rank: int, device: torch.device) -> None:
    """Raises on every rank, naming the first differing key, when the ranks were given different configs: a
    different stage, bucket size or ZeRO++ setting would issue different collectives (a hang, or the
    transport's error), a different lr or clipping would update each rank's shard differently (a model mixed
    of several trainings, silently). ``nvme_path``, ``pin_memory``, buffer counts and sizes, ``aio`` and
    ``steps_per_print`` may differ."""
    everyone = all_gather_json(comm, _config_entries(config), device)
    reference = everyone[0]
    for other_rank, theirs in enumerate(everyone[1:], start=1):
        for key in sorted(set(reference) | set(theirs)):
            if reference.get(key) != theirs.get(key):
                raise ValueError(
                    f"the config differs between ranks: {key} is {reference.get(key, 'missing')} on rank 0 but "
                    f"{theirs.get(key, 'missing')} on rank {other_rank} (this is rank {rank}). Every rank must "
                    "pass the same config (only nvme_path, pin_memory, buffer_count, buffer_size, max_in_cpu, "
                    "fast_init, the aio section and steps_per_print may differ)")


def _describe(entry: tuple[str, tuple[int, ...], str, bool] | None) -> str:
    if entry is None:
        return "missing"
    name, shape, dtype, requires_grad = entry
    return f"{name!r} shape={list(shape)} dtype={dtype} requires_grad={requires_grad}"


def _group_number(value: Any, path: str, wanted: str, ok: Any) -> None:
    number = value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        number = value.item()  # torch's optimizers accept a 1-element tensor lr
    if isinstance(number, bool) or not isinstance(number, numbers.Real) or not math.isfinite(number) \
            or not ok(float(number)):
        raise ValueError(f"{path}: expected {wanted}, got {value!r}")


def check_group_hyperparameters(groups: Sequence[Mapping[str, Any]], where: str = "param_groups") -> None:
    """Raises ValueError, naming the group and key (``param_groups[1].lr``), when a group's Adam
    hyper-parameters cannot be used: lr, eps or weight_decay negative, NaN or infinite, betas not two
    numbers in [0, 1), adamw_mode or bias_correction not a bool, or a torch Adam flag zerocore's Adam would
    ignore (amsgrad or maximize set, decoupled_weight_decay other than adamw_mode). Changes nothing.

    ``initialize`` checks the user's groups with it; the engine can call it on ``optimizer.param_groups``
    before a step mutates anything, so a value set later (by an lr scheduler, or by hand) is caught too.
    Keys a group does not hold are not checked.
    """
    for index, group in enumerate(groups):
        prefix = f"{where}[{index}]."
        for key in ("lr", "eps", "weight_decay"):
            if key in group:
                _group_number(group[key], prefix + key, "a finite number >= 0", lambda v: v >= 0.0)
        if "betas" in group:
            betas = group["betas"]
            if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
                raise ValueError(f"{prefix}betas: expected two numbers (beta1, beta2), each in [0, 1), got {betas!r}")
            for i, beta in enumerate(betas):
                _group_number(beta, f"{prefix}betas[{i}]", "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)
        for key in ("adamw_mode", "bias_correction"):
            if key in group and not isinstance(group[key], bool):
                raise ValueError(f"{prefix}{key}: expected True or False, got {group[key]!r}")
        # torch's Adam reads these from its groups; a step that ignored one set by hand would train otherwise
        # than asked (a scheduler's own keys, initial_lr and the like, change no update and pass)
        for key, instead in (("amsgrad", "use torch.optim.AdamW for AMSGrad"), ("maximize", "negate the loss")):
            if group.get(key, False):
                raise ValueError(f"{prefix}{key}: zerocore's Adam has no {key} ({group[key]!r} set); {instead}")
        if "decoupled_weight_decay" in group and "adamw_mode" in group \
                and group["decoupled_weight_decay"] != group["adamw_mode"]:
            raise ValueError(f"{prefix}decoupled_weight_decay: {group['decoupled_weight_decay']!r} is not this "
                             f"group's adamw_mode ({group['adamw_mode']!r}); zerocore's Adam reads "
                             "adamw_mode: set that instead (True: AdamW's decoupled decay, False: L2 as in Adam)")


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                               and isinstance(item[1], torch.Tensor) for item in items)


def _unnamed(group: dict[str, Any]) -> dict[str, Any]:
    """A group whose params are ``(name, parameter)`` pairs (torch's optimizers take ``named_parameters()``
    since 2.6) as torch keeps it: the parameters in ``params``, their names in ``param_names``."""
    params = group.get("params")
    params = list(params) if isinstance(params, Iterable) and not isinstance(params, torch.Tensor) else params
    if isinstance(params, list) and _named(params):
        return {**group, "params": [p for _, p in params], "param_names": [n for n, _ in params]}
    return {**group, "params": params} if "params" in group else group


def as_param_groups(items: Iterable[Any], what: str) -> list[dict[str, Any]]:
    """Parameters, named parameters or param-group dicts as param groups: an iterable of parameters (or of
    ``model.named_parameters()``'s pairs) is one group, as torch's optimizers and DeepSpeed's model_parameters
    take it. ``what`` names the argument in the error for a mix."""
    items = list(items)
    if items and (all(isinstance(item, torch.Tensor) for item in items) or _named(items)):
        return [_unnamed({"params": items})]
    if all(isinstance(item, Mapping) for item in items):
        return [_unnamed(dict(item)) for item in items]
    raise TypeError(f"{what} must be parameters (one group, as torch's optimizers take them), named parameters or "
                    "param-group dicts, not a mix")


def collect_trainable(
    model: nn.Module, param_groups: Iterable[Mapping[str, Any]] | None, defaults: OptimizerConfig
) -> list[dict[str, Any]]:
    """Optimizer groups of unique trainable parameters, each completed with the config's defaults.

    Tied parameters appear once. Frozen parameters are left out (they stay replicated and untouched); a group
    of frozen parameters only stays, empty, so the groups' indices are the caller's.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    base = {
        "lr": defaults.lr, "betas": tuple(defaults.betas), "eps": defaults.eps,
        "weight_decay": defaults.weight_decay, "adamw_mode": defaults.adamw_mode,
        "bias_correction": defaults.bias_correction,
    }
    if param_groups is None:
        raw = [{"params": list(model.parameters())}]
    else:
        raw = as_param_groups(param_groups, "param_groups")
    check_group_hyperparameters(raw)  # at initialize, not at the first step; the config's defaults are valid
    group_of: dict[int, int] = {}  # parameter id -> the group that lists it
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(raw):
        _check_group_keys(group, index)
        if "params" not in group:
            raise ValueError(f"param_groups[{index}] has no 'params'")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        given_names = group.get("param_names")
        named = isinstance(given_names, (list, tuple)) and len(given_names) == len(params)
        unique: list[nn.Parameter] = []
        kept_names: list[Any] = []  # torch's param_names, for the parameters kept
        taken: set[int] = set()  # ids, not `in unique`: that would compare tensors elementwise
        for position, param in enumerate(params):
            if id(param) not in names:
                raise ValueError(f"param_groups[{index}] holds a tensor that is not a parameter of the model")
            if group_of.setdefault(id(param), index) != index:
                raise ValueError(f"parameter {names[id(param)]!r} appears in more than one param group")
            if param.requires_grad and id(param) not in taken:
                taken.add(id(param))
                unique.append(param)
                if named:
                    kept_names.append(given_names[position])
        # A group left with no trainable parameter (HF's no-decay group of a LoRA model whose biases and
        # norms are frozen) is kept, as torch's optimizers keep it: dropped, every later group's index would
        # shift, and a scheduler's per-group lambdas or a param_groups[i]["lr"] callback would act on another.
        own = {k: v for k, v in group.items() if k != "params"}
        if "decoupled_weight_decay" in own and "adamw_mode" not in own:  # torch's Adam(decoupled_weight_decay=True)
            own["adamw_mode"] = bool(own["decoupled_weight_decay"])
        if named:
            own["param_names"] = kept_names
        groups.append({**base, **own, "params": unique})
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(
            f"parameter {missing[0]!r} requires grad but is in no param group; add it to one or set "
            "requires_grad=False"
        )
    return groups


def check_plain_model(model: nn.Module) -> None:
    """Another system's data parallelism around or inside the model is refused, naming what to pass instead: a
    DistributedDataParallel wrapper would all-reduce every gradient a second time and hold a whole gradient copy
    per rank (what stages 2-3 exist to avoid), and parameters another system already shards (FSDP, FSDP2's
    DTensors, DeepSpeed's ``zero.Init`` partitions) hold only a piece of their values on this rank: trained as
    whole tensors they fail deep in the first forward ("'weight' must be 2-D") or in a collective."""
    # a model holding FSDP or DTensor objects has imported their modules; importing them here would cost every
    # process half a second of CPU
    fsdp, tensor = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    fsdp_wrapper = getattr(fsdp, "FullyShardedDataParallel", ())
    dtensor = getattr(tensor, "DTensor", ())
    for name, module in model.named_modules():
        where = f"module {name!r}" if name else "the model"
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"{where} is wrapped in torch's DistributedDataParallel: zerocore does the data parallelism itself "
                "(DDP would all-reduce every gradient a second time and keep a whole gradient copy on every rank); "
                f"pass the module it wraps ({'model' if not name else name}.module) to zerocore.initialize")
        if isinstance(module, fsdp_wrapper):
            raise ValueError(
                f"{where} is wrapped in torch's FullyShardedDataParallel, which shards its parameters itself: build the "
                "model without FSDP and give it to zerocore.initialize, whose stage 3 shards it")
        if any(cls.__name__ == "DeepSpeedEngine" for cls in type(module).__mro__):
            raise ValueError(
                f"{where} is DeepSpeed's engine, which owns its parameters and optimizer: pass the model you gave to "
                "deepspeed.initialize (without calling it), or switch the script to zerocore with `import "
                "zerocore.deepspeed as deepspeed`")
    for name, param in model.named_parameters():
        if isinstance(param, dtensor):
            raise ValueError(
                f"parameter {name!r} is a DTensor (sharded by FSDP2's fully_shard or by tensor parallelism): zerocore "
                "shards plain tensors itself; build the model without fully_shard / parallelize_module and give it "
                "to zerocore.initialize, whose stage 3 shards it")
        if hasattr(param, "ds_tensor"):
            whole = math.prod(getattr(param, "ds_shape", param.shape))
            raise ValueError(
                f"parameter {name!r} was partitioned by DeepSpeed's zero.Init (this rank holds {param.numel()} of its "
                f"{whole} elements): zerocore cannot train DeepSpeed's partitions. Build the model without "
                "deepspeed.zero.Init, and without transformers' HfDeepSpeedConfig (which makes from_pretrained build "
                "under zero.Init): zerocore's stage 3 shards it at initialize; a model too large to build whole is "
                "built under torch.device('meta') and given init_fn=, its weights loaded with engine.load_hf_weights")


def check_trainable_dtypes(model: nn.Module) -> None:
    """The optimizer keeps fp32 master weights and the compute dtype comes from the config: a float64
    trainable parameter would be silently cast to fp32, and a complex one has no real master, so both are refused
    before anything changes; so is a module producing sparse gradients (nn.Embedding(sparse=True)), which would
    fail inside the first backward."""
    for name, param in model.named_parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter {name!r} is not materialized yet (a lazy module such as nn.LazyLinear): its shape is "
                "unknown until a forward runs; run one forward with a sample batch before zerocore.initialize()")
    trainable_dtypes: dict[torch.dtype, list[str]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            trainable_dtypes.setdefault(param.dtype, []).append(name)
        if param.requires_grad and param.is_complex():
            # model.float() leaves a complex tensor as it is, so the float64 advice would send the user in a circle
            raise ValueError(
                f"parameter {name!r} is {param.dtype}: zerocore's fp32 master weights hold real numbers. Keep it "
                "as its real view, nn.Parameter(torch.view_as_real(w)) (a trailing dimension of 2), and use "
                "torch.view_as_complex(self.<name>) in forward: torch's Adam updates a complex parameter as "
                "exactly that real view, so the training is the same; or freeze it (requires_grad=False)")
        if param.requires_grad and param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"parameter {name!r} is {param.dtype}: zerocore trains fp32 master weights (bf16/fp16 compute when "
                "the config enables it) and would silently cast it to fp32; call model.float() before "
                "zerocore.initialize(), or freeze it (requires_grad=False)")
    if len(trainable_dtypes) > 1:  # e.g. a router or LayerNorm kept in fp32 in a bf16 model (_keep_in_fp32_modules)
        found = "; ".join(f"{str(dtype).removeprefix('torch.')}: {len(names)} ({', '.join(names[:3])}"
                          f"{', ...' if len(names) > 3 else ''})" for dtype, names in trainable_dtypes.items())
        warnings.warn(
            f"the model's trainable parameters have several dtypes ({found}): zerocore trains every one in the "
            "same compute dtype (fp32, or bf16/fp16 when the config enables it) over fp32 master weights, so the "
            "others are cast to it; cast the model to one dtype before zerocore.initialize() to silence this",
            UserWarning, stacklevel=user_stacklevel())
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and any(p.requires_grad for p in module.parameters(recurse=False)):
            raise ValueError(
                f"module {name!r} ({type(module).__name__}) has sparse=True: its gradients are sparse tensors, which "
                "zerocore's flat gradient buffers do not take (DeepSpeed's sparse_gradients is not supported); build "
                "it with sparse=False, or freeze it")
