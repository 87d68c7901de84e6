"""``deepspeed.initialize`` for zerocore: a training script written for DeepSpeed switches with one line,
``import zerocore.deepspeed as deepspeed``.

Note [DeepSpeed's initialize]
-----------------------------
``initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
lr_scheduler=None, ..., config=None, config_params=None)`` returns DeepSpeed's four values, ``(engine, optimizer,
training_dataloader, lr_scheduler)``, built by :func:`zerocore.initialize`:

* the config comes from ``config`` (a dict or a JSON path), ``config_params``, or ``args.deepspeed_config``, as
  DeepSpeed takes it; two different ones are refused, as DeepSpeed refuses them;
* ``model_parameters``: the parameters or torch-style param groups to train, as DeepSpeed takes them;
* ``optimizer``: a torch ``Adam``/``AdamW`` (or DeepSpeed's ``FusedAdam``/``DeepSpeedCPUAdam``, from DeepSpeed or
  from ``ops.adam`` here, or zerocore.optim's) that has not
  stepped, or a callable building one from the parameters, becomes the engine's own sharded Adam with the same param groups and hyperparameters (decoupled
  weight decay or L2 as the optimizer has it; a group's own keys, such as BEiT's ``lr_scale``, kept, torch's
  flags not), as the Hugging Face Trainer hands its optimizer to DeepSpeed. Any
  other optimizer (SGD, amsgrad, maximize) is refused by name: the engine's update is its fused Adam. A config
  with its own ``optimizer`` section and an optimizer argument is refused, as DeepSpeed refuses it;
* ``lr_scheduler``: a callable taking the engine's optimizer and returning a torch scheduler (what the Hugging
  Face Trainer passes), or a scheduler built on the optimizer passed as ``optimizer=`` (what scripts written for
  DeepSpeed pass), which then moves the engine's lr instead; ``engine.step()`` steps it after every applied step
  (``engine.step(lr_kwargs={"metrics": val_loss})`` passes DeepSpeed's lr_kwargs on, as a ReduceLROnPlateau needs).
  A scheduler built on any other optimizer is refused: it would move that optimizer's lr, not the engine's. One
  in both the config and the argument is refused;
* ``training_data``: a ``torch.utils.data.Dataset`` becomes a ``DataLoader`` of ``train_micro_batch_size_per_gpu``
  samples per batch over this rank's part of it (a ``DistributedSampler`` at its defaults, shuffled, as
  DeepSpeed's loader has it; ``dataloader_drop_last`` drops the last incomplete batch), with ``collate_fn``; else
  None.

* the device: where CUDA is, as DeepSpeed places it: the process's GPU is its local rank's
  (``args.device_rank`` if the script's arguments have one, else torchrun's ``LOCAL_RANK``;
  ``torch.cuda.set_device``), and a model with tensors elsewhere (built on the CPU, as ``from_pretrained`` builds
  it) is moved there before the engine is built, which trains on its model's device (a Hugging Face script that
  left the move to DeepSpeed would otherwise train on the CPU over Gloo). A model under ``torch.device("meta")``
  is materialized there, unit by unit (stage 3). DeepSpeed casts the model to 16 bits before moving it; here it
  moves as built, so the fp32 master starts from the built values (the GPU holds it whole until ``initialize``
  shards it: build large models under ``torch.device("meta")``). Without CUDA the model stays where it is.

``mpu``, ``mesh_param`` (model parallelism) and ``dist_init_required=False`` without a process group are
refused; ``distributed_port`` is torchrun's business (``MASTER_PORT``).

Also DeepSpeed's ``init_distributed`` (the default process group from torchrun's environment, unless one exists),
``add_config_arguments`` (``--deepspeed``, ``--deepspeed_config``), ``zero`` (``zero.GatheredParameters``,
``zero.Init``, ``ZeroParamStatus``: runtime/zero/partition_parameters.py), and the modules DeepSpeed's scripts
import beside it: ``accelerator.get_accelerator``, ``checkpointing``, ``comm``, ``ops.adam``,
``runtime.lr_schedules`` and ``utils`` (each its file's docstring).
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._config_values import as_bool
from .._deepspeed_json import load_json
from .._model_checks import as_param_groups
from ..engine import Engine
from ..engine import initialize as _initialize
from ..optim import _ZerocoreAdam
from ..optimizer import ADAM_HYPERPARAMETERS, as_json_value, own_group_keys, set_group_value
from . import accelerator, checkpointing, comm, ops, runtime, utils, zero
from .accelerator import get_accelerator

__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpointing", "comm", "get_accelerator",
           "init_distributed", "initialize", "log_dist", "logger", "ops", "runtime", "utils", "zero"]

DeepSpeedEngine = Engine  # what initialize returns (isinstance checks in DeepSpeed scripts)
log_dist, logger = utils.log_dist, utils.logger



def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's: ``--deepspeed`` and ``--deepspeed_config`` (``initialize(args=...)`` reads the latter), and
    their old names ``--deepscale`` / ``--deepscale_config``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="train with DeepSpeed's settings")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed's: the default process group (NCCL where CUDA is, else Gloo) from torchrun's environment, or
    ``rank``/``world_size``/``init_method``; one process alone when none of them is set. Does nothing when a group
    exists."""
    del auto_mpi_discovery, verbose, config
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError("deepspeed.init_distributed: dist_init_required=False, but no process group is initialized")
    if rank < 0 and "RANK" not in os.environ and init_method is None:  # a single process, not under torchrun
        rank, world_size = 0, 1
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(dist_backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                            init_method=init_method, **kwargs)


def _place_on_local_gpu(model: nn.Module, args: Any) -> None:
    """DeepSpeed's device placement where CUDA is (Note [DeepSpeed's initialize]): this process's GPU is its local
    rank's, and the model moves to it; a meta-device model stays for the engine to materialize there."""
    if not torch.cuda.is_available():
        return
    device_rank = getattr(args, "device_rank", None) if args is not None else None
    source = "args.device_rank"
    if device_rank is None:
        device_rank, source = os.environ.get("LOCAL_RANK", "0"), "LOCAL_RANK"
    try:
        index = int(device_rank)
    except (TypeError, ValueError):
        raise ValueError(f"deepspeed.initialize: {source}={device_rank!r} is not a GPU index") from None
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"deepspeed.initialize: {source}={index} names GPU {index}, but this process sees {count} "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); launch one "
                         "process per visible GPU (torchrun --nproc-per-node)")
    torch.cuda.set_device(index)
    device = torch.device("cuda", index)
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        return  # materialized by the engine on the current device; a mix is refused there, naming the tensors
    if any(t.device != device for t in tensors):
        model.to(device)


def _config_of(args: Any, config: Any, config_params: Any) -> Any:
    given = [c for c in (config, config_params) if c is not None]
    if len(given) == 2 and given[0] is not given[1]:
        raise ValueError("deepspeed.initialize: config and config_params are both given; pass one")
    from_args = None
    if args is not None:  # (--deepscale_config: the old name DeepSpeed still reads)
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    chosen = given[0] if given else None
    if from_args is not None and chosen is not None:
        raise ValueError("deepspeed.initialize: a config is given both in args.deepspeed_config and as an argument "
                         "(DeepSpeed refuses this too); pass one")
    chosen = chosen if chosen is not None else from_args
    if chosen is None:
        raise ValueError("deepspeed.initialize: no DeepSpeed config: pass config= (a dict or a JSON path), "
                         "config_params=, or args with a deepspeed_config attribute")
    return chosen


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        return dict(load_json(config))  # (a key given twice, or not JSON, is named as zerocore.initialize names it)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(f"deepspeed.initialize: config must be a dict or a JSON file path, got {type(config).__name__}")


def _adam_groups(optimizer: Any) -> tuple[str, list[dict[str, Any]]]:
    """The optimizer type and param groups of a client Adam/AdamW (Note [DeepSpeed's initialize])."""
    name = type(optimizer).__name__
    zerocore_adam = isinstance(optimizer, _ZerocoreAdam)  # zerocore.optim's, and this package's ops.adam
    deepspeed_adam = name in ("FusedAdam", "DeepSpeedCPUAdam") and hasattr(optimizer, "adam_w_mode")
    if not (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or zerocore_adam or deepspeed_adam):
        raise TypeError(f"deepspeed.initialize: optimizer is a {name}; the engine's update is its sharded fused "
                        "Adam/AdamW, so only a torch Adam or AdamW (or DeepSpeed's FusedAdam / DeepSpeedCPUAdam) is "
                        "taken over. Give Adam's settings in the config's optimizer section instead")
    if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(f"deepspeed.initialize: the {name} passed has already stepped (it holds moments); the engine "
                         "starts its own state, so pass an optimizer that has not stepped")
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"deepspeed.initialize: optimizer.param_groups[{index}] has {flag}=True, which the "
                                 "engine's Adam does not do")
        if zerocore_adam:
            decoupled = bool(group["adamw_mode"])
        elif deepspeed_adam:
            decoupled = bool(optimizer.adam_w_mode)
        else:
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        entry = own_group_keys(group)  # (BEiT's lr_scale, which its schedule reads; not torch's flags)
        entry.update({key: (tuple(group[key]) if key == "betas" else group[key]) for key in ADAM_HYPERPARAMETERS})
        entry.update(params=list(group["params"]), adamw_mode=decoupled)
        if "bias_correction" in group:
            entry["bias_correction"] = bool(group["bias_correction"])
        groups.append(entry)
    return ("AdamW" if all(g["adamw_mode"] for g in groups) else "Adam"), groups


def _data_loader(engine: Engine, training_data: Any, collate_fn: Callable[..., Any] | None,
                 drop_last: bool) -> torch.utils.data.DataLoader:
    batch = engine.config.train_micro_batch_size_per_gpu
    if batch is None:
        raise ValueError("deepspeed.initialize: training_data needs train_micro_batch_size_per_gpu (or the batch sizes "
                         "it is derived from) in the config")
    # DeepSpeed's DeepSpeedDataLoader: a DistributedSampler at its defaults (shuffled with seed 0, the same order every
    # epoch, and padded to a multiple of the ranks even with dataloader_drop_last, which only the loader reads)
    sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=engine.world_size, rank=engine.rank)
    return torch.utils.data.DataLoader(training_data, batch_size=batch, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=drop_last)


def _rebind(scheduler: torch.optim.lr_scheduler.LRScheduler, engine: Engine) -> torch.optim.lr_scheduler.LRScheduler:
    """A scheduler built on the client optimizer moves the engine's lr instead: the engine's groups are that
    optimizer's, lr included, as its construction left them. torch marks an optimizer's ``step`` when a scheduler
    is built on it (to warn about a scheduler stepped first); a scheduler of factor 1 built on the engine's
    optimizer marks it the same way; the lrs it sets (each group's ``initial_lr``, which the groups carry over
    from the client's, times 1) are put back."""
    # (a ReduceLROnPlateau has no base_lrs: it schedules its optimizer's groups)
    scheduled = len(scheduler.base_lrs) if hasattr(scheduler, "base_lrs") else len(scheduler.optimizer.param_groups)
    if scheduled != len(engine.optimizer.param_groups):
        raise ValueError(f"deepspeed.initialize: lr_scheduler schedules {scheduled} param groups, the "
                         f"engine has {len(engine.optimizer.param_groups)}")
    scheduler.optimizer = engine.optimizer
    if not hasattr(engine.optimizer.step, "_wrapped_by_lr_sched"):
        lrs = [as_json_value(group["lr"]) for group in engine.optimizer.param_groups]  # (a tensor lr's number)
        torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda _: 1.0)
        for group, lr in zip(engine.optimizer.param_groups, lrs):
            set_group_value(group, "lr", lr)
    return scheduler


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None,
               lr_scheduler: Any = None, distributed_port: int | None = None, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Callable[..., Any] | None = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None
               ) -> tuple[Engine, Any, torch.utils.data.DataLoader | None, Any]:
    """DeepSpeed's ``initialize``, returning ``(engine, optimizer, training_dataloader, lr_scheduler)`` (Note
    [DeepSpeed's initialize])."""
    del distributed_port  # (torchrun's MASTER_PORT)
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError("deepspeed.initialize: model parallelism (mpu, mesh_param) is not supported by zerocore: it "
                         "shards data-parallel state only")
    if dist_init_required is False and not dist.is_initialized():
        raise ValueError("deepspeed.initialize: dist_init_required=False, but no process group is initialized")
    ds_config = _as_dict(_config_of(args, config, config_params))
    groups = (None if model_parameters is None
              else as_param_groups(model_parameters, "deepspeed.initialize: model_parameters"))
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        # DeepSpeed's other form: a callable building the optimizer from the parameters
        optimizer = optimizer(groups if groups is not None else [p for p in model.parameters() if p.requires_grad])
    if optimizer is not None:
        if "optimizer" in ds_config:
            raise ValueError("deepspeed.initialize: an optimizer is given both in the config and as an argument "
                             "(DeepSpeed refuses this too); pass one")
        kind, groups = _adam_groups(optimizer)
        first = groups[0] if groups else {}
        ds_config["optimizer"] = {"type": kind, "params": {key: (list(first[key]) if key == "betas" else first[key])
                                                           for key in ADAM_HYPERPARAMETERS if key in first}}
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            if optimizer is None or lr_scheduler.optimizer is not optimizer:
                raise TypeError("deepspeed.initialize: lr_scheduler is a scheduler built on an optimizer that is not "
                                "the one passed as optimizer=, whose lr it would move; pass a callable that builds it "
                                "on the engine's optimizer (lambda optimizer: get_linear_schedule_with_warmup("
                                "optimizer, ...)), as the Hugging Face Trainer does, or a scheduler section in the "
                                "config")
        elif not callable(lr_scheduler):
            raise TypeError(f"deepspeed.initialize: lr_scheduler must be a callable (optimizer -> scheduler), got "
                            f"{type(lr_scheduler).__name__}")
        if "scheduler" in ds_config:
            raise ValueError("deepspeed.initialize: a scheduler is given both in the config and as lr_scheduler; "
                             "pass one")
    # the data loader's, which only this function builds (the engine itself reads no data)
    drop_last = as_bool(ds_config.pop("dataloader_drop_last", False), "dataloader_drop_last")
    _place_on_local_gpu(model, args)
    engine = _initialize(model, ds_config, param_groups=groups)
    if optimizer is not None:
        engine._client_optimizer_name = type(optimizer).__name__  # (DeepSpeed's optimizer_name() gives it)
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        engine.lr_scheduler = _rebind(lr_scheduler, engine)
    elif lr_scheduler is not None:
        engine.lr_scheduler = lr_scheduler(engine.optimizer)
    loader = None if training_data is None else _data_loader(engine, training_data, collate_fn, drop_last)
    return engine, engine.optimizer, loader, engine.lr_scheduler
