"""The ZeRO engine: ``zerocore.initialize(model, config) -> Engine`` (stages 1-2 here; stage 3's gathering
lives in _stage3.py).

Note [Engine lifecycle]
-----------------------
A training iteration is DeepSpeed's: ``loss = engine(batch)``, ``engine.backward(loss)``,
``engine.step()``, repeated ``gradient_accumulation_steps`` times per optimizer update. ``step()`` counts
micro-steps and updates only at the accumulation boundary. Every backward outside ``no_sync()`` must be
followed by ``step()`` before the next one; backwards inside ``no_sync()`` only accumulate locally.

Which backwards communicate (see Note [Stage 1-2 storage] in _flat_group.py):
  stage 1: the boundary backward reduce-scatters every bucket (earlier micro-steps accumulate in place);
  stage 2: every backward outside ``no_sync()`` reduce-scatters and adds this rank's shard.
The boundary ``step()`` then, on every rank in the same order: agrees on fp16 overflow (one all-reduce),
computes the global gradient norm for clipping (one all-reduce), runs the fused Adam kernel on this
rank's shard of every bucket (writing the compute-dtype params in the same pass) and all-gathers each
bucket's params asynchronously; the next forward waits for them.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import ops
from ._flat_group import FlatParamGroup, sum_of_squares
from ._gathered import engine_for, unregister
from ._gathered import register as register_managed
from ._loss_scaler import LossScaler
from ._model_checks import check_same_model_on_all_ranks, collect_trainable, model_device
from ._stage3 import Stage3Runtime
from ._units import resolve_units
from ._native import _C
from .config import ZeroConfig
from .layout import FlatLayout
from .optimizer import ZeroOptimizer

__all__ = ["Engine", "initialize"]

# Alignment of every tensor and shard boundary, in elements: 128 bytes for fp16/bf16 (vector loads and
# cache lines on CPU, coalesced access on GPU).
_ALIGNMENT = 64


def initialize(
    model: nn.Module,
    config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str],
    process_group: dist.ProcessGroup | None = None,
    *,
    param_groups: Iterable[Mapping[str, Any]] | None = None,
    comm_algorithms: Mapping[str, str] | None = None,
    units: Sequence[nn.Module | type] | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    device: torch.device | str | None = None,
) -> Engine:
    """Wraps ``model`` for ZeRO data-parallel training.

    Args:
        model: an ordinary ``nn.Module``, identical on every rank (checked), on one device.
        config: a :class:`ZeroConfig`, or a DeepSpeed config as a dict or a JSON file path.
        process_group: the data-parallel group (a subgroup composes with tensor/pipeline parallelism);
            default: the default group, initialized here from the environment (``torchrun``) or as a
            single-process group when none exists.
        param_groups: torch-style groups (``{"params": [...], "weight_decay": 0.0, ...}``) over the model's
            parameters; default: one group of every trainable parameter.
        comm_algorithms: ``{"reduce_scatter": ..., "all_gather": ...}`` overrides of the per-backend choice
            (see Note [Collective algorithms] in bindings/comm.hpp).
        units: stage 3 units of gathering, module instances and/or classes (Note [Stage 3 units]);
            default: the model's repeated blocks.
        init_fn: stage 3 with a model on the meta device: initializes one module's own parameters
            (default: the module's ``reset_parameters()``).
        device: where a meta-device model is materialized (default: the current CUDA device if any, else
            the CPU); ignored for a model that already has real tensors.
    """
    if not isinstance(config, ZeroConfig):
        config = ZeroConfig.from_deepspeed(config)
    return Engine(model, config, process_group, param_groups=param_groups, comm_algorithms=comm_algorithms,
                  units=units, init_fn=init_fn, device=device)


def _default_process_group(device: torch.device) -> dist.ProcessGroup:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


class Engine:
    """ZeRO stage 1, 2 or 3 training engine. Build it with :func:`initialize`."""

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        process_group: dist.ProcessGroup | None,
        *,
        param_groups: Iterable[Mapping[str, Any]] | None = None,
        comm_algorithms: Mapping[str, str] | None = None,
        units: Sequence[nn.Module | type] | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        stage = config.zero_optimization.stage
        self.module = model
        self.stage = stage
        self.device = model_device(model)
        meta = self.device.type == "meta"
        if meta:
            if stage != 3:
                raise ValueError("a model on the meta device can only be materialized by ZeRO stage 3 "
                                 f"(zero_optimization.stage=3), got stage {stage}")
            self.device = torch.device(device) if device is not None else (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.process_group = process_group if process_group is not None else _default_process_group(self.device)
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.config = config = config.for_world_size(self.world_size)
        algorithms = dict(comm_algorithms or {})
        unknown = set(algorithms) - {"reduce_scatter", "all_gather"}
        if unknown:
            raise ValueError(f"comm_algorithms keys must be 'reduce_scatter' or 'all_gather', got {sorted(unknown)}")
        self.comm = _C.Comm(self.process_group, algorithms.get("reduce_scatter", "auto"),
                            algorithms.get("all_gather", "auto"))

        for name, param in model.named_parameters():
            if engine_for(param) is not None:
                raise ValueError(f"parameter {name!r} is already managed by another zerocore engine; call "
                                 "close() on that engine first (it hands the parameters back whole)")
        check_same_model_on_all_ranks(model, self.comm, self.rank, self.device)
        if not meta:
            self._broadcast_module_state()
        groups = collect_trainable(model, param_groups, config.optimizer)
        self.compute_dtype = config.compute_dtype
        self._stage3: Stage3Runtime | None = None
        self.groups: list[FlatParamGroup] = []
        if stage == 3:
            self._group_of = {id(p): index for index, group in enumerate(groups) for p in group["params"]}
            self._stage3 = Stage3Runtime(self, resolve_units(model, units), init_fn=init_fn, meta=meta)
            self._cast_untracked_tensors()
        else:
            self._build_flat_groups(groups)
        self.optimizer = ZeroOptimizer(self, groups)
        register_managed(self, [p for group in groups for p in group["params"]])
        self.loss_scaler = LossScaler(config.fp16)
        self._build_reducer()
        self._register_hooks()

        self.broadcast_buffers = True  # as DDP's default; set False to keep buffers rank-local
        self._in_backward_call = False
        self._comm_reset_at_step = 0
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._no_sync = False
        self._awaiting_step = False  # a synced backward ran and step() has not followed yet
        self._backward_ran = False  # any backward since the last step()
        self._reducing = False
        self._finalized = True
        self._pending_gathers: list[Any] = []
        self._last_grad_norm: float | None = None
        self.zero_grad()

    def _build_flat_groups(self, groups: list[dict[str, Any]]) -> None:
        config, model = self.config, self.module
        bucket_cap = min(config.zero_optimization.reduce_bucket_size, config.zero_optimization.allgather_bucket_size)
        for group in groups:
            params = group["params"]
            layout = FlatLayout([p.numel() for p in params], self.world_size, _ALIGNMENT, bucket_cap)
            self.groups.append(FlatParamGroup(params, layout, rank=self.rank, stage=self.stage,
                                              compute_dtype=self.compute_dtype, device=self.device))
        if self.compute_dtype != torch.float32:
            model.to(self.compute_dtype)  # the rest (frozen params, buffers); trainable ones are already cast

    def _cast_untracked_tensors(self) -> None:
        """Stage 3: frozen parameters and floating buffers follow the compute dtype (sharded ones already do)."""
        if self.compute_dtype == torch.float32:
            return
        for module in self.module.modules():
            for param in module.parameters(recurse=False):
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(self.compute_dtype)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point():
                    module._buffers[name] = buffer.to(self.compute_dtype)

    # ---- construction helpers -----------------------------------------------------------------------
    def _broadcast_module_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DDP does."""
        with torch.no_grad():
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                if tensor.is_contiguous():
                    self.comm.broadcast(tensor.data, 0).wait()
                else:  # the collective needs dense memory: broadcast a copy, then write it back
                    dense = tensor.data.contiguous()
                    self.comm.broadcast(dense, 0).wait()
                    tensor.data.copy_(dense)

    def _build_reducer(self) -> None:
        """One GradReducer over every group's buckets; parameters get stable global indices."""
        bucket_sizes: list[int] = []
        destinations: list[torch.Tensor] = []
        param_bucket: list[int] = []
        param_offset: list[int] = []
        param_numel: list[int] = []
        self._param_slots: list[tuple[Any, int]] = []
        if self._stage3 is not None:
            for unit in self._stage3.units:
                bucket_sizes.append(unit.numel)
                destinations.append(unit.grad_shard)
                for local, param in enumerate(unit.params):
                    param_bucket.append(len(bucket_sizes) - 1)
                    param_offset.append(unit.offsets[local])
                    param_numel.append(param.numel())
                    self._param_slots.append((unit, local))
        for group in self.groups:
            first_bucket = len(bucket_sizes)
            for k, bucket in enumerate(group.buckets):
                bucket_sizes.append(bucket.padded_size)
                destinations.append(group.grad_slice(k))
            bucket_of = group.layout.tensor_buckets().tolist()
            for index, param in enumerate(group.params):
                bucket = group.buckets[bucket_of[index]]
                param_bucket.append(first_bucket + bucket_of[index])
                param_offset.append(group.offsets[index] - bucket.flat_start)
                param_numel.append(param.numel())
                self._param_slots.append((group, index))
        launch_order = list(reversed(range(len(bucket_sizes))))  # see Note [Bucket launch order]
        self.reducer = _C.GradReducer(
            self.comm, bucket_sizes, param_bucket, param_offset, param_numel, launch_order, destinations,
            self.config.reduce_dtype, 1.0 / self.world_size,
        )
        self.num_buckets = len(bucket_sizes)

    def _register_hooks(self) -> None:
        engine_ref = weakref.ref(self)
        self._hook_handles = []
        for index, (owner, local) in enumerate(self._param_slots):
            param = owner.params[local]

            def hook(p: torch.Tensor, index: int = index) -> None:
                engine = engine_ref()
                if engine is not None:
                    engine._on_grad_ready(index, p)

            self._hook_handles.append(param.register_post_accumulate_grad_hook(hook))

    # ---- forward / backward -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module after the last step's all-gathers landed. In bf16/fp16 training, floating-point
        tensor arguments are cast to the compute dtype (integer inputs such as token ids are left alone)."""
        self.wait_for_params()
        if self.compute_dtype != torch.float32:
            args = tuple(self._cast_input(a) for a in args)
            kwargs = {k: self._cast_input(v) for k, v in kwargs.items()}
        if self.broadcast_buffers and torch.is_grad_enabled():
            self._sync_buffers()
        return self.module(*args, **kwargs)

    def _sync_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm running statistics, ...) before every training forward, as DDP's
        default ``broadcast_buffers=True`` does: one broadcast per buffer dtype."""
        buffers = [b for b in self.module.buffers() if b.numel()]
        if self.world_size == 1 or not buffers:
            return
        with torch.no_grad():
            for dtype in sorted({b.dtype for b in buffers}, key=str):
                same = [b for b in buffers if b.dtype == dtype]
                flat = torch.cat([b.reshape(-1) for b in same])
                self.comm.broadcast(flat, 0, -1).wait()
                offset = 0
                for b in same:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()

    def _cast_input(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def wait_for_params(self) -> None:
        """Blocks until the all-gather of the last step's updated parameters has landed."""
        for pending in self._pending_gathers:
            pending.wait()
        self._pending_gathers = []

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Back-propagates ``loss`` (scaled for fp16 and averaged over accumulation micro-steps)."""
        if self._awaiting_step:
            raise RuntimeError(
                "backward() was called twice without step() in between. Call engine.step() after every "
                "engine.backward() (it only updates at the accumulation boundary), or wrap accumulation "
                "backwards in engine.no_sync()."
            )
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ValueError("backward() needs a loss tensor that requires grad")
        self.wait_for_params()
        self._reducing = not self._no_sync and (self.stage >= 2 or self.is_gradient_accumulation_boundary())
        self._finalized = not self._reducing and self._stage3 is None
        if self._reducing:
            self.reducer.begin_backward(self.stage >= 2)
        if self._stage3 is not None:
            self._stage3.begin_backward()
        scale = self.loss_scaler.scale / self.config.gradient_accumulation_steps
        self._in_backward_call = True
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self._in_backward_call = False
        if not self._finalized:  # no parameter got a gradient in this backward
            self._finalize_backward()
        self._backward_ran = True
        self._awaiting_step = not self._no_sync

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._in_backward_call:
            raise RuntimeError(
                "a zerocore-managed parameter got a gradient outside engine.backward(); call "
                "engine.backward(loss) instead of loss.backward(), so gradients are scaled, reduced and "
                "sharded"
            )
        if self._stage3 is not None:
            unit, _ = self._param_slots[index]
            if self._reducing:
                self._reduce(index, param)
                param.grad = None  # reduced into the unit's gradient shard; see Note [Stage 3 gather and release]
            self._stage3.grad_ready(unit)
            return
        group, local = self._param_slots[index]
        if self.stage == 1:
            # .grad accumulates in place in the gradient buffer across micro-steps; when autograd made a fresh
            # tensor (the user set .grad to None), its values move into the buffer first.
            view = group.grad_view(local)
            if param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)
                param.grad = view
        if self._reducing:
            self._reduce(index, param)
            if self.stage == 2:
                param.grad = None  # its values now live in the bucket; see Note [Stage 1-2 storage]

    def _reduce(self, index: int, param: torch.Tensor) -> None:
        """Hands parameter ``index``'s gradient to the reducer; the first one of a backward also queues the
        end-of-backward finalize."""
        if self._finalized:
            raise RuntimeError(f"parameter {index} produced a gradient after the backward was finalized")
        if not self.reducer.in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        self.reducer.mark_ready(index, param.grad)

    def _finalize_backward(self) -> None:
        if self._finalized:
            return
        if self._reducing:
            self.reducer.finalize()
        if self._stage3 is not None:
            self._stage3.end_backward()
        self._finalized = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally without communicating (every stage).

        Stage 2 then holds full gradients until the next synced backward, like FSDP's ``no_sync``.
        """
        previous = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = previous

    # ---- step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """Ends a micro-step; at the accumulation boundary, updates the parameters on every rank."""
        if not self._backward_ran:
            raise RuntimeError("step() was called before backward(); call engine.backward(loss) first")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self._backward_ran = False
        self._awaiting_step = False
        if boundary:
            self.optimizer.step()
            self.zero_grad()

    def _apply_update(self) -> None:
        """The sharded optimizer step; called by ``optimizer.step()`` (so lr schedulers see it)."""
        overflow = False
        if self.config.fp16.enabled:
            local = 0.0 if self._grads_finite() else 1.0
            flag = torch.tensor([local], dtype=torch.float32, device=self.device)
            self.comm.all_reduce(flag, True).wait()
            overflow = bool(flag.item() > 0)
        # The gradients were produced with the scale in effect now: unscale with it before update() moves it.
        grad_scale = 1.0 / self.loss_scaler.scale if self.config.fp16.enabled else 1.0
        if self.config.fp16.enabled:
            self.loss_scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            self._last_grad_norm = float("inf")
            if self._stage3 is not None:
                self._stage3.end_forward_backward_step()
            return
        grad_scale *= self._clip_coefficient(grad_scale)
        if self._stage3 is not None:
            self.global_steps += 1
            self._stage3.apply_adam(self._group_of, self.optimizer.param_groups, self.global_steps, grad_scale)
            self._stage3.end_forward_backward_step()
            return
        for group, hyper in zip(self.groups, self.optimizer.param_groups):
            group.step_count += 1
            beta1, beta2 = hyper["betas"]
            for bucket in range(len(group.buckets)):
                exp_avg, exp_avg_sq = group.moment_slices(bucket)
                ops.adam_step(
                    group.master_slice(bucket), group.grad_slice(bucket), exp_avg, exp_avg_sq,
                    step=group.step_count, lr=hyper["lr"], beta1=beta1, beta2=beta2, eps=hyper["eps"],
                    weight_decay=hyper["weight_decay"], adamw=hyper["adamw_mode"], grad_scale=grad_scale,
                    bias_correction=hyper["bias_correction"],
                    param_out=None if self.compute_dtype == torch.float32 else group.param_shard_slice(bucket),
                )
        self.global_steps += 1
        for group in self.groups:
            for bucket in range(len(group.buckets)):
                self._pending_gathers.append(self.comm.all_gather(group.param_bucket(bucket), bucket))

    def _clip_coefficient(self, grad_scale: float) -> float:
        """Global L2 norm of the (unscaled) gradients across every shard; the clip coefficient."""
        clip = self.config.gradient_clipping
        sum_sq = sum_of_squares(self._grad_shards(), self.device).reshape(1)
        self.comm.all_reduce(sum_sq, False).wait()
        norm = math.sqrt(float(sum_sq.item())) * grad_scale
        self._last_grad_norm = norm
        if clip <= 0:
            return 1.0
        return min(1.0, clip / (norm + 1e-6))

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last update (inf when fp16 overflow skipped it)."""
        return self._last_grad_norm

    def _grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradient shards, whatever the stage."""
        shards = [shard for group in self.groups for shard in group.grad_shards()]
        return shards + (self._stage3.grad_shards() if self._stage3 is not None else [])

    def _grads_finite(self) -> bool:
        return all(ops.all_finite(shard) for shard in self._grad_shards())

    def zero_grad(self) -> None:
        for group in self.groups:
            group.zero_grad()
        if self._stage3 is not None:
            self._stage3.zero_grad()

    # ---- reports ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        from ._reports import memory_report

        return memory_report(self)

    def comm_report(self) -> dict[str, Any]:
        from ._reports import comm_report

        return comm_report(self)

    def reset_comm_stats(self) -> None:
        """Starts comm_report()'s counts afresh (its per-step figures divide by the steps since then)."""
        self.comm.reset_stats()
        self._comm_reset_at_step = self.global_steps + self.skipped_steps

    def close(self) -> None:
        """Detaches the engine from the model: hooks removed, pending gathers landed, and under stage 3
        every parameter gathered back into an ordinary full tensor. A collective (every rank calls it).
        The model can then be used plainly or given to a new engine."""
        self.wait_for_params()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        if self._stage3 is not None:
            self._stage3.close()
        for group in self.groups:  # stage 1's .grad are views of the engine's gradient buffer
            for param in group.params:
                param.grad = None
        unregister(self, [owner.params[local] for owner, local in self._param_slots])

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict on every rank (see :meth:`full_state_dict` to gather to rank 0 only)."""
        return self.full_state_dict(rank0_only=False)

    def full_state_dict(self, dtype: torch.dtype | None = None, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict, keyed by the original names and loadable into the plain model
        with ``load_state_dict(strict=True)``; CPU tensors, in ``dtype`` when given (floating ones).

        Stage 3 gathers one unit at a time, so the peak is the output plus one unit. A collective: call it
        on every rank. With ``rank0_only`` other ranks get an empty dict.
        """
        self.wait_for_params()
        keep = not rank0_only or self.rank == 0
        entries = self.module.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}

        def take(name: str, tensor: torch.Tensor) -> None:
            value = tensor.detach()
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            out[name] = value.to("cpu", copy=True)

        names_of: dict[int, list[str]] = {}
        for name, tensor in entries.items():
            names_of.setdefault(id(tensor), []).append(name)
        sharded: set[int] = set()
        if self._stage3 is not None:
            for unit in self._stage3.units:
                self._stage3.ensure_gathered(unit, "all_gather_state_dict")
                for param in unit.params:
                    sharded.add(id(param))
                    if keep:
                        for name in names_of.get(id(param), []):
                            take(name, param)
                if not unit.persistent:
                    self._stage3.release(unit)
        if keep:
            for name, tensor in entries.items():
                if id(tensor) not in sharded:
                    take(name, tensor)
        return {name: out[name] for name in entries if name in out}

    # ---- zerocore.gathered --------------------------------------------------------------------------
    def _gather_for_user(self, params: list[nn.Parameter]) -> None:
        self.wait_for_params()
        if self._stage3 is not None:
            for unit in self._stage3.units_of(params):
                self._stage3.ensure_gathered(unit, "all_gather_user")

    def _release_for_user(self, params: list[nn.Parameter], modifier_rank: int | None) -> None:
        if self._stage3 is not None:
            for unit in self._stage3.units_of(params):
                if modifier_rank is not None:
                    self.comm.broadcast(unit.full, modifier_rank).wait()
                    self._stage3.write_back(unit)
                if not unit.persistent:
                    self._stage3.release(unit)
            return
        if modifier_rank is not None:
            wanted = {id(p) for p in params}
            for group in self.groups:
                if any(id(p) in wanted for p in group.params):
                    self.comm.broadcast(group.param_buffer, modifier_rank).wait()
                    group.sync_master_from_params()
