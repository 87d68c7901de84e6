"""What the engine does once when it takes over a model (its process group and collective algorithms, rank
0's state everywhere, dtypes, where the optimizer state and parameter shards live, stages 1-2's one buffer,
the reducer's geometry) and auto_cast's input cast."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .config import ZeroConfig

from ._info import cpu_cores
from ._model_checks import model_device
from ._names import named_parameters
from ._native import _C
from ._host_params import HostParamShards, offloads_to_host
from ._nvme_params import param_file_for
from ._optimizer_state import NvmePlacement, OptimizerState
from ._policy import StagePolicy
from ._topology import Topology, build_topology, check_zeropp_partitions
from ._user_frames import user_stacklevel

if TYPE_CHECKING:
    from ._sharded_buffer import ShardedBuffer
    from .engine import Engine


def check_launch_environment(environ: Mapping[str, str]) -> None:
    """Raises when the launcher's variables describe a multi-process job that cannot be joined: WORLD_SIZE
    without RANK (or the reverse), or a value that is not a whole number. Without this, such a job would run
    as single-process copies that each train alone."""
    values: dict[str, int] = {}
    for name in ("WORLD_SIZE", "RANK"):
        if name in environ:
            try:
                values[name] = int(environ[name])
            except ValueError:
                raise ValueError(f"environment variable {name}={environ[name]!r} is not a whole number") from None
    world, rank = values.get("WORLD_SIZE"), values.get("RANK")
    if world is not None and world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world} must be >= 1")
    if world is not None and world > 1 and rank is None:
        raise ValueError(
            f"WORLD_SIZE={world} is set but RANK is not, so this process cannot join the {world}-process job; "
            "set RANK (and MASTER_ADDR, MASTER_PORT) for every process, launch with torchrun, or call "
            "torch.distributed.init_process_group() yourself before zerocore.initialize()")
    if rank is not None and world is None and rank != 0:
        raise ValueError(
            f"RANK={rank} is set but WORLD_SIZE is not, so this process cannot join its job; set WORLD_SIZE "
            "(and MASTER_ADDR, MASTER_PORT), launch with torchrun, or call torch.distributed.init_process_group() "
            "yourself before zerocore.initialize()")
    if rank is not None and world is not None and not 0 <= rank < world:
        raise ValueError(f"environment variable RANK={rank} must be in [0, WORLD_SIZE={world})")


def training_device(model: nn.Module, policy: StagePolicy,
                    device: torch.device | str | None) -> tuple[torch.device, bool]:
    """Where the engine trains, and whether the model is on the meta device (stage 3 materializes it on
    ``device``, by default the current CUDA device if any, else the CPU)."""
    where = model_device(model)
    if where.type == "cpu" and torch.cuda.is_available():
        # DDP and the engine train where the model is; FSDP2 and DeepSpeed move it to the GPU themselves, so a
        # script ported from them runs on the CPU, silently slower by orders of magnitude
        warnings.warn("zerocore.initialize: the model is on the CPU, so the engine trains there (over Gloo) although "
                      "this machine has CUDA; to train on the GPU, move the model to this rank's GPU first "
                      "(torch.cuda.set_device(local_rank); model.cuda()), as zerocore.deepspeed.initialize does "
                      "for a DeepSpeed script", stacklevel=user_stacklevel())
    if where.type != "meta":
        return where, False
    if not policy.params_sharded:
        raise ValueError("a model on the meta device can only be materialized by ZeRO stage 3 "
                         f"(zero_optimization.stage=3), got stage {policy.stage}")
    if device is not None:
        return torch.device(device), True
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu")), True


def default_process_group(device: torch.device) -> dist.ProcessGroup:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        check_launch_environment(os.environ)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def comm_algorithms_for(explicit: Mapping[str, str] | None, config: ZeroConfig) -> tuple[str, str]:
    """(reduce_scatter, all_gather) algorithm names: the caller's, else the config's ``reduce_scatter``
    (False means all-reduce), at stages 1-2 ``allgather_partitions`` (False means broadcasts) and at stage 3
    ``use_all_reduce_for_fetch_params`` (True means all-reduce), else the per-backend choice ("auto")."""
    algorithms = dict(explicit or {})
    unknown = set(algorithms) - {"reduce_scatter", "all_gather"}
    if unknown:
        raise ValueError(f"comm_algorithms keys must be 'reduce_scatter' or 'all_gather', got {sorted(unknown)}")
    reduce_scatter = algorithms.get("reduce_scatter", "auto")
    if not config.zero_optimization.reduce_scatter:
        if reduce_scatter not in ("auto", "all_reduce"):
            raise ValueError(f"zero_optimization.reduce_scatter=false asks for all-reduce, but comm_algorithms "
                             f"asks for reduce_scatter={reduce_scatter!r}; drop one of them")
        reduce_scatter = "all_reduce"
    all_gather = algorithms.get("all_gather", "auto")
    zo = config.zero_optimization
    for asked, algorithm, key in ((not zo.allgather_partitions and zo.stage < 3, "broadcast",
                                   "allgather_partitions=false"),
                                  (zo.use_all_reduce_for_fetch_params and zo.stage == 3, "all_reduce",
                                   "use_all_reduce_for_fetch_params=true")):
        if asked:
            if all_gather not in ("auto", algorithm):
                raise ValueError(f"zero_optimization.{key} asks for the {algorithm!r} all-gather, but comm_algorithms "
                                 f"asks for all_gather={all_gather!r}; drop one of them")
            all_gather = algorithm
    return reduce_scatter, all_gather


def reduced_grad_dtype(config: ZeroConfig) -> torch.dtype:
    """The dtype of the gradients the reducer is handed: each backward's (the compute dtype) at stages 2-3, the
    window's sums from the gradient buffer at stage 1 (fp32 with fp32 accumulation, Note [fp32 gradient
    accumulation] in _sharded_buffer.py)."""
    grads_sharded = StagePolicy.for_stage(config.zero_optimization.stage).grads_sharded
    return config.compute_dtype if grads_sharded else config.accumulation_dtype


def wire_dtype(config: ZeroConfig, world: int, algorithm_widens: bool) -> torch.dtype:
    """The dtype gradient buckets travel in, by the GradReducer's own rule (Note [Widening reduce-scatter]):
    16-bit gradients reduced in fp32 stay 16-bit where the reduce-scatter algorithm sums at the receiver."""
    return _C.reduction_wire_dtype(config.reduce_dtype, reduced_grad_dtype(config), world, algorithm_widens)


def reduction_wire_dtype(config: ZeroConfig, device: torch.device, world: int) -> torch.dtype:
    """wire_dtype under the engine's default algorithms, ``device`` standing for its default backend (Gloo on
    the CPU, NCCL otherwise): what the estimate plans with."""
    if config.zero_optimization.zero_quantized_gradients:
        algorithm = "hierarchical"
    else:
        algorithm = comm_algorithms_for(None, config)[0]
    backend = "gloo" if device.type == "cpu" else "nccl"
    return wire_dtype(config, world, _C.reduce_scatter_widens(algorithm, backend))


@dataclass
class Comms:
    """The engine's collectives (Note [Collective algorithms]): ``main`` for everything but stage 3's
    parameter gathers (gradient reduce-scatters: qgZ's "hierarchical" with ``zero_quantized_gradients``),
    ``weights`` for those (qwZ's "quantized" all-gather with ``zero_quantized_weights`` or
    ``zero_quantized_nontrainable_weights``, else ``main``),
    and ``hpz``, the Comm of this rank's hpZ partition (``zero_hpz_partition_size`` > 1) with its topology."""

    main: Any
    weights: Any
    hpz: Any = None
    hpz_topology: Topology | None = None

    def all(self) -> dict[str, Any]:
        """Each distinct Comm by the name comm_report() gives it."""
        out = {"global": self.main}
        if self.weights is not self.main:
            out["weights"] = self.weights
        if self.hpz is not None:
            out["hpz_partition"] = self.hpz
        return out


def build_comms(process_group: Any, explicit: Mapping[str, str] | None, config: ZeroConfig) -> Comms:
    """The engine's Comms (collective: every rank builds the same ones, in the same order)."""
    zo = config.zero_optimization
    reduce_scatter, all_gather = comm_algorithms_for(explicit, config)
    world = dist.get_world_size(process_group)
    hierarchical = zo.zero_quantized_gradients or zo.zero_hpz_partition_size > 1
    if hierarchical and world != dist.get_world_size():
        raise ValueError("ZeRO++ hpZ and qgZ build process groups of nodes, which every rank of the job must take part "
                         f"in; the engine's process group has {world} of the job's {dist.get_world_size()} ranks")
    node_size = zo.zero_node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_zeropp_partitions(zo, world, node_size)  # every rank alike, before any group is built
    options: dict[str, Any] = {"quantization_group_size": zo.zero_quantization_group_size}
    if zo.zero_quantized_gradients:
        if (explicit or {}).get("reduce_scatter", "auto") not in ("auto", "hierarchical"):
            raise ValueError(f"zero_optimization.zero_quantized_gradients asks for the 'hierarchical' reduce-scatter, "
                             f"but comm_algorithms asks for {explicit['reduce_scatter']!r}; drop one of them")
        topology = build_topology(process_group, node_size)
        reduce_scatter = "hierarchical"
        options.update(node_size=node_size, node_group=topology.node_group, cross_group=topology.cross_group)
    main = _C.Comm(process_group, reduce_scatter, all_gather, **options)
    weights = main
    if zo.zero_quantized_weights or zo.zero_quantized_nontrainable_weights:
        weights = _C.Comm(process_group, "auto", "quantized",  # it only gathers
                          quantization_group_size=zo.zero_quantization_group_size)
    comms = Comms(main, weights)
    if zo.zero_hpz_partition_size > 1:
        comms.hpz_topology = build_topology(process_group, zo.zero_hpz_partition_size)
        if comms.hpz_topology.node_group is not None:
            comms.hpz = _C.Comm(comms.hpz_topology.node_group)
    return comms


def broadcast_module_state(comm: Any, module: nn.Module) -> None:
    """Every rank starts from rank 0's parameters and buffers, as DDP does."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_contiguous():
                comm.broadcast(tensor.data, 0).wait()
            else:  # the collective needs dense memory: broadcast a copy, then write it back
                dense = tensor.data.contiguous()
                comm.broadcast(dense, 0).wait()
                tensor.data.copy_(dense)


def cast_untracked_tensors(module: nn.Module, dtype: torch.dtype, sharded: set[int]) -> None:
    """Stage 3: frozen parameters and floating buffers follow the compute dtype (the ``sharded`` ids, the
    parameters the units hold, already do)."""
    if dtype == torch.float32:
        return
    for child in module.modules():
        for param in child.parameters(recurse=False):
            if not param.requires_grad and param.is_floating_point() and id(param) not in sharded:
                param.data = param.data.to(dtype)
        for name, buffer in child._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                child._buffers[name] = buffer.to(dtype)


def build_reducer(engine: Engine) -> tuple[Any, list[tuple[Any, int]]]:
    """One GradReducer over every buffer's buckets, and each parameter's (buffer, index in buffer) by the
    stable global index the reducer knows it by."""
    bucket_sizes: list[int] = []
    destinations: list[torch.Tensor] = []
    param_bucket: list[int] = []
    param_offset: list[int] = []
    param_numel: list[int] = []
    slots: list[tuple[Any, int]] = []
    in_place: list[torch.Tensor | None] = []
    wire = wire_dtype(engine.config, engine.world_size, engine.comm.reduce_scatter_widens)
    for buffer in engine.buffers:
        first_bucket = len(bucket_sizes)
        # Stage 1 holds every gradient in its buffer: reduce each bucket right there when its dtype is the one
        # gradients travel in.
        whole = buffer.grad_buffer if buffer.grad_buffer is not None and buffer.grad_buffer.dtype == wire else None
        for k, bucket in enumerate(buffer.buckets):
            bucket_sizes.append(bucket.padded_size)
            destinations.append(buffer.grad_slice(k))
            in_place.append(None if whole is None else whole[bucket.flat_start : bucket.flat_start + bucket.padded_size])
        bucket_of = buffer.layout.tensor_buckets().tolist()
        for index, param in enumerate(buffer.params):
            bucket = buffer.buckets[bucket_of[index]]
            param_bucket.append(first_bucket + bucket_of[index])
            param_offset.append(buffer.offsets[index] - bucket.flat_start)
            param_numel.append(param.numel())
            slots.append((buffer, index))
    # Validated and ordered by the torch-free core (cpp/include/zerocore/bucket_geometry.hpp): reverse layout
    # order, see Note [Bucket launch order].
    launch_order = _C.reducer_geometry(bucket_sizes, param_bucket, param_offset, param_numel, engine.world_size)
    reducer = _C.GradReducer(
        engine.comm, bucket_sizes, param_bucket, param_offset, param_numel, launch_order, destinations,
        engine.config.reduce_dtype, 1.0 / engine.world_size, engine.config.zero_optimization.overlap_comm, in_place,
        grad_dtype=reduced_grad_dtype(engine.config),
    )
    return reducer, slots


def whole_model_buffer(engine: Engine, params: list[nn.Parameter], group_of: dict[int, int]) -> ShardedBuffer:
    """Stages 1-2: the whole model is one unit, in buckets of the reduce bucket size."""
    names = {id(p): name for name, p in named_parameters(engine.module)}
    buffer = engine.new_buffer("model", params, [names[id(p)] for p in params],
                               [group_of[id(p)] for p in params], engine.buckets.reduce)
    buffer.build_from([p.detach() for p in params])
    if engine.compute_dtype != torch.float32:
        # the rest (frozen params, buffers; trainable ones are already cast), floating-point ones only, as
        # DeepSpeed's module.bfloat16()/.half(): module.to(dtype) would also cast complex tensors to real
        engine.module.bfloat16() if engine.compute_dtype == torch.bfloat16 else engine.module.half()
    return buffer


def optimizer_state_for(config: ZeroConfig, device: torch.device, rank: int) -> OptimizerState:
    """Where the optimizer state lives: with the parameters, on the host (``offload_optimizer: cpu``), or in
    a file per rank (``offload_optimizer: nvme``, Note [NVMe optimizer state])."""
    offload = config.zero_optimization.offload_optimizer
    if offload.device == "nvme":
        nvme = NvmePlacement(offload.nvme_path, rank, config.zero_optimization.sub_group_size, config.aio.settings())
        return OptimizerState(torch.device("cpu"), nvme)
    if offload.device == "cpu":
        return OptimizerState(torch.device("cpu"), pin_memory=offload.pin_memory)
    return OptimizerState(device)


def cpu_step_threads_line(config: ZeroConfig, environ: Mapping[str, str], rank: int) -> str | None:
    """The line an offloaded run prints once per machine (local rank 0) at ``initialize``: how many CPU threads
    each rank's optimizer step gets and why (USER_PAINS #9: a CPU Adam starved of cores is the usual cause of
    a slow offloaded step, and torchrun's default gives it one). None when nothing is offloaded or on other
    ranks."""
    offload = config.zero_optimization.offload_optimizer.device
    local_rank = environ.get("LOCAL_RANK", str(rank))
    if offload not in ("cpu", "nvme") or local_rank != "0":
        return None
    threads = _C.get_num_threads()
    cores = cpu_cores()
    ranks = environ.get("LOCAL_WORLD_SIZE", "1")
    unpinned = _C.default_kernel_threads(torch.get_num_threads(), environ.get("OMP_NUM_THREADS"),
                                         environ.get("LOCAL_WORLD_SIZE"), cores)
    if threads != unpinned:
        why = "pinned by zerocore.ops.set_num_threads"
    elif threads != torch.get_num_threads():
        why = f"this rank's share of {cores} cores for {ranks} local ranks, in place of torchrun's OMP_NUM_THREADS=1"
    else:
        why = f"torch.get_num_threads(); {cores} cores here for {ranks} local rank(s)"
    return (f"zerocore: offload_optimizer {offload}: each rank's optimizer step runs on {threads} CPU thread(s) "
            f"({why}); zerocore.ops.set_num_threads(n) sets it")


def param_file_for_config(config: ZeroConfig, device: torch.device, rank: int) -> Any:
    """``offload_param``: nvme gives this rank a parameter file (Note [NVMe parameter shards]), cpu on a GPU host
    memory for the shards (Note [Host parameter shards]); on a CPU-only machine cpu is where the parameters are
    already. None when the shards stay where the parameters are."""
    offload = config.zero_optimization.offload_param
    if offloads_to_host(offload, device):
        return HostParamShards(offload.pin_memory)
    if offload.device != "nvme":
        return None
    return param_file_for(offload, config.aio.settings(), rank)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """DeepSpeed's auto_cast rule: floating tensors, recursively through lists, tuples and dicts."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value
