"""The ZeRO engine's lifecycle: ``zerocore.initialize(model, config) -> Engine``.

Note [Engine lifecycle]
-----------------------
A training iteration is DeepSpeed's: ``loss = engine(batch)``, ``engine.backward(loss)``,
``engine.step()``, repeated ``gradient_accumulation_steps`` times per optimizer update. ``step()`` counts
micro-steps and updates only at the accumulation boundary. Every backward outside ``no_sync()`` must be
followed by ``step()`` before the next one (except one set as no boundary by DeepSpeed's
``set_gradient_accumulation_boundary(False)``: Note [Manual accumulation boundary]); backwards inside
``no_sync()`` only accumulate locally. The states and their legal transitions: Note [Engine states] in
_lifecycle.py.

What the stage changes is a policy (Note [Stage policy]); the storage is one ShardedBuffer per unit
(Note [Sharded buffer]; stages 1-2: one for the whole model; stage 3: one per unit, scheduled by
_stage3.py), each registering its shards with the one optimizer state (Note [Optimizer state
ownership]). Which backwards reduce gradients: the policy's ``reduce_every_sync`` (stages 2-3), else only
the accumulation boundary's (stage 1). The boundary ``step()`` then, on every rank in the same order:
all-reduces the gradients' sum of squares (the global norm for clipping, and the fp16 overflow verdict: one
collective, one host sync), runs the fused Adam kernel on every shard (writing the compute-dtype params in
the same pass) and starts the gathers the next forward overlaps: in stages 1-2 every bucket's, and any read
after ``step()`` first waits for its parameter's gather (Note [Gathers land on first read] in
_sharded_param.py); in stage 3 those the next forward begins with (Note [Gathers started in the step]).
Every other method of the engine lands them all before it does anything.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ._allocator import AllocatorWatch
from ._backward import GradientRouting, exchange_backward_outcome, exchanges_outcome, outcome_problem
from ._buckets import BucketSizes
from ._batch_sizes import set_batch_sizes, sizes_for_batch, sizes_for_micro_batch
from ._buffer_sync import BufferSync
from ._compile import compile_engine, is_compiled_module, land_gathers_before_compiled_forwards
from ._construction import (broadcast_module_state, build_comms, build_reducer, cast_floating,
                            cast_untracked_tensors, cpu_step_threads_line, default_process_group, optimizer_state_for,
                            param_file_for_config, training_device, whole_model_buffer)
from ._deepspeed_api import DeepSpeedAccessors
from ._deferred_signals import deferred_interrupts
from ._divergence import RanksDivergedError, ShardReadError
from ._full_state import full_state_dict, gather_for_user, release_for_user, save_16bit_model
from ._gathered import refuse_managed, unregister
from ._gathered import register as register_managed
from ._grad_clip import clip_grad_norm
from ._lifecycle import USABLE, EngineState, Lifecycle
from ._loss_scaler import LossScaler
from ._model_checks import (check_plain_model, check_same_config_on_all_ranks, check_same_model_on_all_ranks,
                            check_trainable_dtypes, collect_trainable)
from ._model_edits import track_model, untrack_model
from ._monitor import Monitor, start_monitor
from ._native import _C
from ._policy import StagePolicy
from ._reports import comm_report, memory_report
from ._sharded_buffer import ShardedBuffer
from ._sharded_param import CompileRefused
from ._stage3 import NO_BUCKET_CAP, Stage3Runtime
from ._step import agree_on_state_files, boundary_update
from ._units import resolve_units
from .config import ZeroConfig, hidden_size_of
from .lr_schedules import build_lr_scheduler, check_step_kwargs
from .optimizer import ZeroOptimizer

__all__ = ["Engine", "EngineState", "initialize"]
# States in which the model's parameters may be read or written from outside training.
# errors every rank raises at the same point, or after which no collective may follow: nothing to play out
_RAISED_IN_LOCKSTEP = (RanksDivergedError, ShardReadError, CompileRefused, dist.DistError)


def _raised_in_lockstep(error: BaseException | None) -> bool:
    """``error`` or one it was raised from (torch.compile wraps what its tracing raised) is one of those."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _RAISED_IN_LOCKSTEP):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


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
    strict_spmd: bool = False,
    strict: bool = True,
) -> Engine:
    """Wraps ``model`` for ZeRO data-parallel training.

    Args:
        model: an ordinary ``nn.Module``, identical on every rank (checked), on one device.
        config: a :class:`ZeroConfig`, or a DeepSpeed config as a dict or a JSON file path.
        process_group: the data-parallel group (a subgroup composes with tensor/pipeline parallelism);
            default: the default group, initialized here from the environment (``torchrun``) or as a
            single-process group when none exists.
        param_groups: torch-style groups (``{"params": [...], "weight_decay": 0.0, ...}``) over the model's
            parameters, or parameters (one group, as torch's optimizers take ``model.parameters()``, or
            ``model.named_parameters()``: the names go to ``param_names``, as torch keeps them); default:
            one group of every trainable parameter. A group's own keys (``lr_scale`` for layer-wise lr decay)
            stay in ``engine.optimizer.param_groups`` for the script to read, as torch keeps them; one that
            misspells a hyperparameter (``weight_deacy``) is refused.
        comm_algorithms: ``{"reduce_scatter": ..., "all_gather": ...}`` overrides of the per-backend choice
            (see Note [Collective algorithms] in bindings/comm.hpp).
        units: stage 3 units of gathering, module instances and/or classes (Note [Stage 3 units]);
            default: the model's repeated blocks.
        init_fn: stage 3 with a model on the meta device: initializes one module's own parameters, run as
            ``model.apply(init_fn)`` would (default: a Hugging Face model's own ``_init_weights``, else each
            module's ``reset_parameters()``).
        device: where a meta-device model is materialized (default: the current CUDA device if any, else
            the CPU); ignored for a model that already has real tensors.
        strict_spmd: stage 3: before every gather, wait for a check that every rank gathers the same unit
            (one blocking exchange per gather) instead of checking when the gather lands (Note [Divergence
            tags]); stages 1-2 issue no per-module collectives, so there is nothing to check.
        strict: a DeepSpeed config's keys that zerocore does not support yet raise if True; if False they are
            ignored with one warning (``ZeroConfig.from_deepspeed``). ``"auto"`` bucket sizes are derived from
            ``model.config.hidden_size`` (Note [Hugging Face "auto" values] in _hf_auto.py).
    """
    if not isinstance(config, ZeroConfig):
        config = ZeroConfig.from_deepspeed(config, strict=strict, hidden_size=hidden_size_of(model))
    return Engine(model, config, process_group, param_groups=param_groups, comm_algorithms=comm_algorithms,
                  units=units, init_fn=init_fn, device=device, strict_spmd=strict_spmd)


class Engine(DeepSpeedAccessors):
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
        strict_spmd: bool = False,
    ) -> None:
        self.policy = policy = StagePolicy.for_stage(config.zero_optimization.stage)
        self.stage = policy.stage
        self.module = model
        check_plain_model(model)  # before anything touches the model
        check_trainable_dtypes(model)
        self.device, meta = training_device(model, policy, device)
        self.process_group = process_group if process_group is not None else default_process_group(self.device)
        self.rank = dist.get_rank(self.process_group)
        if self.rank < 0:  # torch answers -1 for a group this process is not in
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the process_group "
                             "passed to zerocore.initialize: call it only on the group's ranks, each with the group "
                             "it belongs to (dist.new_group returns a group on every rank)")
        self.world_size = dist.get_world_size(self.process_group)
        # before anything the config decides issues a collective (build_comms makes node groups for ZeRO++)
        check_same_config_on_all_ranks(config, _C.Comm(self.process_group, "all_reduce", "all_reduce"), self.rank,
                                       self.device)
        self.config = config = config.for_world_size(self.world_size)
        self.comms = build_comms(self.process_group, comm_algorithms, config)
        self.comm = self.comms.main
        self.buckets = BucketSizes.resolve(config.zero_optimization, config.reduce_dtype)

        refuse_managed(model)
        check_same_model_on_all_ranks(model, self.comm, self.rank, self.device)
        self.monitor = Monitor(config, self.rank)  # Note [Monitors]: started once the checks have passed
        if self.monitor.enabled:
            start_monitor(self.monitor, self.comm, self.rank, self.device)
        if not meta:
            broadcast_module_state(self.comm, model)
        groups = collect_trainable(model, param_groups, config.optimizer)
        self.compute_dtype = config.compute_dtype
        self.optimizer_state = optimizer_state_for(config, self.device, self.rank)
        threads_line = cpu_step_threads_line(config, os.environ, self.rank)
        if threads_line is not None:
            print(threads_line, file=sys.stderr, flush=True)
        self.param_file = param_file_for_config(config, self.device, self.rank)  # offload_param, else None
        self.stage3: Stage3Runtime | None = None
        group_of = {id(p): index for index, group in enumerate(groups) for p in group["params"]}
        if policy.params_sharded:
            self.stage3 = Stage3Runtime(self, resolve_units(model, units), group_of, init_fn=init_fn, meta=meta,
                                        strict_spmd=strict_spmd)
            self.buffers = [unit.buffer for unit in self.stage3.units if unit.buffer is not None]
            self.frozen_buffers = [storage for unit in self.stage3.units for storage in unit.frozen]
            cast_untracked_tensors(model, self.compute_dtype, {id(p) for p in self._frozen_params()})
        else:
            self.buffers = [whole_model_buffer(self, [p for g in groups for p in g["params"]], group_of)]
            self.frozen_buffers = []  # stages 1-2 hold frozen parameters whole
        self.optimizer_state.build()
        if self.optimizer_state.nvme is not None or self.param_file is not None:
            agree_on_state_files(self)
        self.optimizer = ZeroOptimizer(self, groups)
        self.lr_scheduler = build_lr_scheduler(config.scheduler, self.optimizer)  # None without a scheduler
        held = {id(p) for storage in self.param_storages for p in storage.params}
        # frozen parameters every rank holds whole (stages 1-2): gathered() broadcasts a modifier rank's writes
        self.whole_frozen_params = [p for p in dict.fromkeys(model.parameters()) if id(p) not in held
                                    and not p.requires_grad]
        self.whole_frozen_ids = {id(p) for p in self.whole_frozen_params}
        register_managed(self, [p for group in groups for p in group["params"]] + self._frozen_params()
                         + self.whole_frozen_params)
        self.loss_scaler = LossScaler(config.fp16)
        self.reducer, param_slots = build_reducer(self)
        self.lifecycle = Lifecycle()
        self.gradients = GradientRouting(self.lifecycle, policy, self.stage3, self.reducer, param_slots)

        self._update_due = False  # engine.step() is calling optimizer.step()
        self.buffer_sync = BufferSync(self.comm, model, self.world_size)
        # compiled code cannot land a gather on first read (Note [Gathers land on first read]): the forward lands
        # them all before it runs
        self._has_compiled_code = any(is_compiled_module(m) for m in model.modules())
        self._compiled_root_lands = None if self.stage3 is not None else land_gathers_before_compiled_forwards(self)
        self._comm_reset_at_step = 0
        self._samples_mark = (0, 0)  # (global_samples, global_steps) when the batch size last changed
        self._compiled_modules: list[str] = []  # by compile() ("" for the root)
        self.micro_steps = 0
        self._micro_steps_in_window = 0  # micro-steps ended since the last boundary (the open window's)
        # Note [Manual accumulation boundary]
        self._boundary_override: bool | None = None
        self._backward_boundary = False  # whether the synced backward awaiting step() ends its window
        self.user_gathers = 0  # zerocore.gathered() blocks open on this engine
        self.allocator = AllocatorWatch(self.device)  # Note [Allocator pressure]
        self._backward_set_manually = False  # ... as set_gradient_accumulation_boundary() decided
        self._micro_step_ended_unstepped = False  # a manual non-boundary micro-step ended without its step()
        self.skipped_steps = 0
        # global_steps counts on from a checkpoint loaded with a fresh optimizer, whose Adam step starts over
        self._steps_before_optimizer = 0
        self.step_applied = False  # whether the last step() updated the parameters (was_step_applied())
        self.host_syncs = 0  # blocking device-to-host reads on the step path (see comm_report)
        self._last_grad_norm: float | None = None
        self.zero_grad()
        track_model(self, model)  # last: an initialize that raised leaves the model free to change

    @property
    def state(self) -> EngineState:
        """Where the engine is in its training cycle (Note [Engine states])."""
        return self.lifecycle.state

    @property
    def broadcast_buffers(self) -> bool:
        """Rank 0's buffers before each forward, as DDP's default (Note [Buffers follow rank 0]); set False
        to keep buffers rank-local."""
        return self.buffer_sync.enabled

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.buffer_sync.enabled = bool(value)

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, as DeepSpeed's engine counts them: applied updates and fp16 steps skipped for
        overflow (``skipped_steps``) alike, and those before a checkpoint loaded with
        ``load_optimizer_states=False`` (whose Adam step starts over)."""
        return self._steps_before_optimizer + self.optimizer_state.step_count + self.skipped_steps

    @property
    def param_storages(self) -> list[ShardedBuffer]:
        """Every buffer holding parameters: the trainable ones' and stage 3's frozen ones' (Note [Frozen shards])."""
        return self.buffers + self.frozen_buffers

    def _frozen_params(self) -> list[nn.Parameter]:
        return [p for storage in self.frozen_buffers for p in storage.params]

    def new_frozen_buffer(self, label: str, params: list[nn.Parameter], names: list[str],
                          dtype: torch.dtype) -> ShardedBuffer:
        """Stage 3: a unit's frozen parameters of one dtype, sharded without optimizer state (Note [Frozen shards])."""
        return ShardedBuffer(label, params, names, [0] * len(params), bucket_cap=NO_BUCKET_CAP, world=self.world_size,
                             rank=self.rank, policy=self.policy, dtype=dtype, device=self.device,
                             optimizer_state=None, param_file=self.param_file)

    def new_buffer(self, label: str, params: list[nn.Parameter], names: list[str], groups: list[int],
                   bucket_cap: int) -> ShardedBuffer:
        """The storage of one unit (Note [Sharded buffer]); stage 3 builds one per unit."""
        return ShardedBuffer(label, params, names, groups, bucket_cap=bucket_cap, world=self.world_size,
                             rank=self.rank, policy=self.policy, dtype=self.compute_dtype, device=self.device,
                             optimizer_state=self.optimizer_state, param_file=self.param_file,
                             grad_dtype=self.config.accumulation_dtype)

    # ---- forward / backward -------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the module. Inputs are passed as they are, as DeepSpeed does; with ``fp16.auto_cast`` the
        floating-point positional inputs (also inside lists, tuples and dicts) are cast to fp16 first, as
        DeepSpeed's auto_cast does (keyword arguments never are). With the config's ``torch_autocast`` the
        module runs under ``torch.autocast`` (Note [torch_autocast] in _autocast_config.py)."""
        life = self.lifecycle
        life.require("forward()", *USABLE)
        self._end_unstepped_micro_step()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args = cast_floating(args, torch.float16)
        self._refuse_changed_params()
        if self._has_compiled_code:
            self.land_param_gathers()
        training = torch.is_grad_enabled()
        life.forwards += training  # counted before the module runs: a forward that raises counts (Note [Backward outcome])
        self.buffer_sync.before_forward()
        try:
            with self._autocast():
                out = self.module(*args, **kwargs)
        except BaseException as error:
            life.forward_raised |= training
            self.buffer_sync.after_forward(training and life.state is not EngineState.NO_SYNC)  # as the peers' ends
            # A KeyboardInterrupt reaches the ranks at different points, so its play-out could pair with
            # anything; with no peer (a notebook's Ctrl-C, one process) there is nothing to pair with
            if (isinstance(error, Exception) or self.world_size == 1) and not _raised_in_lockstep(error):
                self._play_out_forward(error, training)
            raise
        self.buffer_sync.after_forward(training and life.state is not EngineState.NO_SYNC)
        if training:
            life.forward_pending = True
            if life.state is EngineState.IDLE:
                life.to(EngineState.FORWARD)
        return out

    def _play_out_forward(self, error: BaseException, training: bool) -> None:
        """This rank's forward raised; its peers' may not have: the collectives their forward and the backward
        after it still issue are issued here too (stage 3's gathers: Note [A forward that raised on one rank]
        in _stage3.py; the backward's reductions and outcome exchange: Note [Backward outcome]), so every rank
        drops this batch at the same point and the next one starts in lockstep."""
        life = self.lifecycle
        no_sync = life.state is EngineState.NO_SYNC
        backward_follows = (training and exchanges_outcome(self.policy, no_sync)
                            and life.state in (EngineState.IDLE, EngineState.FORWARD, EngineState.NO_SYNC))
        if self.stage3 is None and not backward_follows:
            return  # stages 1-2 without grad or inside no_sync(): the forward issues no collective
        try:
            if self.stage3 is not None:
                self.stage3.play_out_forward(backward_follows)
            if backward_follows:
                self._begin_backward(no_sync, retain_graph=False)
                self._abandon_backward(no_sync, failed_here=True)
        except BaseException as failure:
            error.add_note(f"zerocore: issuing the collectives of the other ranks' forward and backward after this "
                           f"error failed too ({type(failure).__name__}: {failure}); the ranks may be out of lockstep")
            return
        if backward_follows and self.world_size == 1:
            error.add_note("zerocore: this accumulation window's gradients were dropped; the engine is ready for "
                           "the next batch")
        elif backward_follows:
            error.add_note("zerocore: this rank played out the collectives of the other ranks' forward and backward "
                           "of this batch (with no gradient from this rank), and every rank dropped this accumulation "
                           "window (where the forward did not raise, the backward raises naming this rank). Go on "
                           "with the next batch on every rank; the engine is ready for it.")

    # Note [Manual accumulation boundary]
    # -----------------------------------
    # DeepSpeed's engine.set_gradient_accumulation_boundary(is_boundary), which Accelerate's DeepSpeed wrapper
    # calls before every backward, replaces the count of gradient_accumulation_steps: the next backward ends
    # the window when True (its step() updates) and accumulates when False, and then step() may be left out
    # (Accelerate calls it only at the boundary): the next forward, backward or no_sync() ends that micro-step
    # as its step() would, and a step() called for it afterwards does nothing, as on DeepSpeed. step() applies
    # what the backward was run as (stage 1 reduces only in the boundary's backward), so a setting changed
    # between a backward and its step() is refused rather than updating from unreduced gradients or leaving
    # reduced ones. Losses are still divided by gradient_accumulation_steps (scale_wrt_gas), as DeepSpeed does.
    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's manual accumulation boundary (Note [Manual accumulation boundary]): set before each
        micro-step's forward and backward, True for the window's last one; None counts
        ``gradient_accumulation_steps`` again."""
        self._boundary_override = None if is_boundary is None else bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next backward ends the accumulation window (its step() updates the parameters)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return self._micro_steps_in_window + 1 >= self.config.gradient_accumulation_steps

    def _end_micro_step(self, boundary: bool) -> None:
        self.micro_steps += 1
        self._micro_steps_in_window = 0 if boundary else self._micro_steps_in_window + 1
        self.step_applied = False

    def _end_unstepped_micro_step(self) -> None:
        """A backward set as no boundary awaits a step() that the caller leaves out (Note [Manual accumulation
        boundary]): ends its micro-step as step() would."""
        life = self.lifecycle
        if life.state is EngineState.AWAITING_STEP and self._backward_set_manually and not self._backward_boundary:
            self._end_micro_step(boundary=False)
            life.to(EngineState.FORWARD if life.forward_pending else EngineState.IDLE)
            self._micro_step_ended_unstepped = True

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """Back-propagates ``loss``, scaled for fp16 and (``scale_wrt_gas``, DeepSpeed's) divided by the
        accumulation steps, so that a window's gradient is the mean of its micro-steps'."""
        life = self.lifecycle
        self._end_unstepped_micro_step()
        if life.state is EngineState.AWAITING_STEP:
            raise RuntimeError(
                "backward() was called twice without step() in between. Call engine.step() after every "
                "engine.backward() (it only updates at the accumulation boundary), or wrap accumulation "
                "backwards in engine.no_sync()."
            )
        life.require("backward()", EngineState.IDLE, EngineState.FORWARD, EngineState.NO_SYNC)
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise ValueError("backward() needs a loss tensor that requires grad")
        no_sync = life.state is EngineState.NO_SYNC
        gradients = self.gradients
        scale = self.loss_scaler.scale / (self.config.gradient_accumulation_steps if scale_wrt_gas else 1)
        self._begin_backward(no_sync, retain_graph)
        root = loss * scale if scale != 1.0 else loss
        outer = gradients.backward_root(root)
        try:
            root.backward(retain_graph=retain_graph)
        except RanksDivergedError:
            life.to(EngineState.NO_SYNC if no_sync else EngineState.AWAITING_STEP)  # no collective may follow
            raise
        except BaseException as error:
            self._abandon_backward(no_sync, failed_here=True)
            if "modified by an inplace operation" in str(error):
                error.add_note("zerocore: step(), load_checkpoint() and gathered(modifier_rank=...) give the "
                               "parameters new values in place, as torch's optimizers do; run the forward again "
                               "after them, then its backward")
            error.add_note("zerocore: this accumulation window's gradients were dropped and the engine is ready "
                           "for the window's first forward again")
            raise
        finally:
            if outer is not None:
                outer.remove()
        life.to(EngineState.NO_SYNC if no_sync else EngineState.AWAITING_STEP)
        if not gradients.finalized:  # no parameter got a gradient in this backward
            gradients.finalize()
        if exchanges_outcome(self.policy, no_sync):
            problem = outcome_problem(*exchange_backward_outcome(self, failed_here=False))
            if problem is not None:
                self._abandon_backward(no_sync, failed_here=False)
                raise RuntimeError(problem)
        life.forward_pending = False
        life.local_grads = no_sync or (life.local_grads and not gradients.reducing)

    def _begin_backward(self, no_sync: bool, retain_graph: bool) -> None:
        """A backward starts (``backward()``, or one played out for a forward that raised): whether it reduces,
        stage 3's per-backward state, the state machine."""
        self.land_param_gathers()  # parameters the forward did not read
        boundary = self.is_gradient_accumulation_boundary()
        reduces = not no_sync and (self.policy.reduce_every_sync or boundary)
        if not no_sync:
            self._backward_boundary, self._backward_set_manually = boundary, self._boundary_override is not None
            self._micro_step_ended_unstepped = False
        self.gradients.begin(reduces)
        if self.stage3 is not None:
            self.stage3.begin_backward(retain_graph)
        self.lifecycle.to(EngineState.BACKWARD)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The config's ``torch_autocast`` for the forward, replacing one the script entered; else nothing."""
        dtype = self.config.autocast_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def _refuse_changed_params(self) -> None:
        """``model.half()`` / ``.to(dtype)`` after initialize gives the parameters new tensors of another dtype:
        stage 1's backward then failed inside torch, stage 2 trained one step in the new dtype and silently cast
        back. The dtype is the config's (bf16 / fp16) and fixed at initialize. So is the device: ``.cpu()`` moves
        stages 1-2's parameters off the engine's storage (stage 3's sharded parameters refuse ``.to()``
        themselves); moved back, they are taken as written (Note [Writes through .data] in _step.py). So is each
        parameter's shape: one resized through ``p.data = ...`` failed inside torch's backward."""
        for buffer in self.param_storages:
            for name, param, shape in zip(buffer.names, buffer.params, buffer.shapes):
                if param.shape != shape:  # (stage 3 refuses another tensor at its gather, naming it)
                    raise RuntimeError(
                        f"parameter {name!r} has shape {list(param.shape)} but zerocore laid it out as {list(shape)} "
                        "at initialize (was it given a tensor of another shape, p.data = ...?): its shards, "
                        "gradient buckets and optimizer state have that size. Resize it before zerocore.initialize "
                        "(resize_token_embeddings too), or engine.close() and initialize again; give it back a tensor "
                        "of its shape before the engine's next forward")
                if param.dtype != buffer.dtype:
                    raise RuntimeError(
                        f"parameter {name!r} is {param.dtype} but zerocore holds it in {buffer.dtype}, the compute "
                        "dtype fixed at initialize (was the model cast with .half(), .bfloat16(), .float() or "
                        ".to(dtype)?): set bf16.enabled or fp16.enabled in the config instead, and cast the model "
                        "back (or build it anew) before the next forward")
                if not buffer.policy.params_sharded and param.device != buffer.device:
                    raise RuntimeError(
                        f"parameter {name!r} is on {param.device} but zerocore holds it on {buffer.device}, the "
                        "device fixed at initialize (was the model moved with .to(device), .cpu() or .cuda()?): "
                        f"move it back to {buffer.device} before the engine's next forward (to evaluate it where it "
                        "is now, call the module itself: model(x))")

    def _abandon_backward(self, no_sync: bool, failed_here: bool) -> None:
        """A backward raised part-way (here, or on another rank: Note [Backward outcome]): the reductions it
        started complete (every rank that raised at the same point issued the same ones, in the same order),
        and the accumulation window starts over."""
        gradients = self.gradients
        try:  # a collective that failed (a peer gone, a transport error) raises again here: the state resets anyway
            if failed_here and exchanges_outcome(self.policy, no_sync):
                gradients.play_out_backward()  # stage 3: the peers' backward still gathers
            gradients.land_started_reductions()
            if failed_here and exchanges_outcome(self.policy, no_sync):
                exchange_backward_outcome(self, failed_here=True)  # the peers' backward waits for this
        finally:
            try:
                if self.stage3 is not None:
                    self.stage3.end_backward(abandoned=True)  # waits for gathers in flight: may raise the same
            finally:
                gradients.finalized = True
                self.zero_grad()
                self.micro_steps -= self._micro_steps_in_window
                self._micro_steps_in_window = 0
                self._micro_step_ended_unstepped = False
                life = self.lifecycle
                life.forward_pending = False
                life.local_grads = False
                life.to(EngineState.NO_SYNC if no_sync else EngineState.IDLE)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients locally without communicating (every stage).

        Stage 2 then holds full gradients until the next synced backward, like FSDP's ``no_sync``.
        """
        self._end_unstepped_micro_step()
        entered = self.lifecycle.enter_no_sync()
        try:
            yield
        finally:
            if entered:
                self.lifecycle.exit_no_sync()

    # ---- step ---------------------------------------------------------------------------------------
    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """Ends a micro-step; at the accumulation boundary, updates the parameters on every rank and steps the lr
        scheduler, with ``lr_kwargs`` as DeepSpeed passes them (``{"metrics": val_loss}`` for a
        ``ReduceLROnPlateau``; Megatron-DeepSpeed's ``{"increment": n}``)."""
        life = self.lifecycle
        if life.state in (EngineState.IDLE, EngineState.FORWARD) and self._micro_step_ended_unstepped:
            self._micro_step_ended_unstepped = False  # its micro-step has ended already
            return
        if life.state in (EngineState.IDLE, EngineState.FORWARD):
            if life.local_grads:
                raise RuntimeError(
                    "step() after backwards that all ran inside engine.no_sync(): their gradients were never "
                    "reduced across ranks, so this update would use one rank's gradients (DeepSpeed raises "
                    "too). Run the last backward of the accumulation window outside no_sync(), then step().")
            raise RuntimeError("step() was called before backward(); call engine.backward(loss) first")
        life.require("step()", EngineState.AWAITING_STEP)
        boundary = self._backward_boundary
        if self._boundary_override is not None and self._boundary_override != boundary:
            raise RuntimeError(
                f"set_gradient_accumulation_boundary({self._boundary_override}) was called after this micro-step's "
                f"backward, which ran {'as' if boundary else 'as not'} the accumulation boundary: set it before the "
                "forward and backward it is meant for (Accelerate and DeepSpeed's examples do). Nothing was "
                f"changed: call set_gradient_accumulation_boundary({boundary}) and step() to end this micro-step")
        if boundary and self.stage3 is not None:
            self.stage3.refuse_while_held("step()")
        if boundary:
            check_step_kwargs(self.lr_scheduler, lr_kwargs)  # before anything changes
        self._end_micro_step(boundary)
        life.to(EngineState.IDLE)
        if boundary:
            with deferred_interrupts("the optimizer step"):  # Note [Interrupts deferred in an update]
                self._boundary_step(lr_kwargs)

    def _boundary_step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        skipped = self.skipped_steps
        self._update_due = True
        try:
            self.optimizer.step()
        except BaseException as error:  # never added to the next window's gradients
            self.zero_grad()
            error.add_note("zerocore: this accumulation window's gradients were dropped and the engine is ready "
                           "for the next batch")
            raise
        finally:
            self._update_due = False
        self.step_applied = self.skipped_steps == skipped
        self.optimizer.overflow = not self.step_applied
        self.allocator.after_step(self.global_steps)
        if self.lr_scheduler is not None and self.step_applied:
            self.lr_scheduler.step(**(lr_kwargs or {}))  # as DeepSpeed: after an applied step, not an fp16 skip
        self.zero_grad()
        self.lifecycle.local_grads = False
        if self.monitor.enabled and self.rank == 0:  # Note [Monitors]
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.config.fp16.enabled:
                events.append(("Train/Samples/loss_scale", self.loss_scaler.scale, self.global_samples))
            self.monitor.write_step_events(events)

    def apply_update(self) -> None:
        """The sharded optimizer step; called by ``optimizer.step()`` (so lr schedulers see it).

        One all-reduce of the gradients' sum of squares gives the global norm and, being inf or NaN when
        any gradient is, the fp16 overflow verdict (with stage 3's deferred divergence verdict beside it):
        one collective and one host sync per step. Only ``engine.step()`` calls it (elsewhere the gradients
        may be unreduced, or applied already)."""
        if not self._update_due:
            raise RuntimeError("engine.optimizer.step() was called directly (nothing was updated): the update runs "
                               "inside engine.step(); call engine.backward(loss), then engine.step()")
        boundary_update(self, self._record_grad_norm)

    def _record_grad_norm(self, norm: float) -> None:
        self._last_grad_norm = norm

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last update (inf when fp16 overflow skipped it)."""
        return self._last_grad_norm

    def clip_grad_norm_(self, max_norm: float, norm_type: float | str = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the reduced gradients in place to a global ``norm_type``-norm of ``max_norm`` and returns the
        norm before clipping, as FSDP1's ``model.clip_grad_norm_`` (``torch.nn.utils.clip_grad_norm_`` sees no
        ``.grad`` after a reducing backward). A collective: every rank calls it, between the accumulation
        boundary's ``backward()`` and ``step()``; that step then does not clip again at the config's
        ``gradient_clipping`` (Note [Clipping by hand] in _grad_clip.py)."""
        self.lifecycle.require("clip_grad_norm_()", *USABLE)
        return clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite)

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.zero_grad()
        self.gradients.start_window()
        self.optimizer_state.hand_clip = None

    # ---- reports ------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        return memory_report(self)

    def comm_report(self) -> dict[str, Any]:
        return comm_report(self)

    def reset_comm_stats(self) -> None:
        """Starts comm_report()'s counts afresh (its per-step figures divide by the steps since then)."""
        for comm in self.comms.all().values():
            comm.reset_stats()
        self.host_syncs = 0
        self._comm_reset_at_step = self.global_steps
        if self.optimizer_state.store is not None:
            self.optimizer_state.store.bytes_read = self.optimizer_state.store.bytes_written = 0

    @property
    def steps_since_comm_reset(self) -> int:
        """Optimizer steps (skipped ones included) since the last ``reset_comm_stats()``."""
        return self.global_steps - self._comm_reset_at_step

    def compile(self, backend: str | Callable[..., Any] = "inductor", compile_kwargs: Mapping[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile()`` (Accelerate calls it when its dynamo plugin is on): ``torch.compile``
        with ``backend`` and ``compile_kwargs`` applied in place, the whole module at stages 1-2, each innermost
        unit's ``forward`` at stage 3 (Note [Compiling through the engine]). Local: no collective, but every rank
        should call it so that the ranks run the same code. Calling it again does nothing."""
        self.lifecycle.require("compile()", *USABLE)
        compiled = compile_engine(self, backend, compile_kwargs, schedule, compiled_autograd_enabled)
        self._has_compiled_code |= bool(compiled)
        self._compiled_modules += compiled

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` compiled anything (DeepSpeed's ``engine.is_compiled``)."""
        return bool(self._compiled_modules)

    def close(self) -> None:
        """Detaches the engine from the model: hooks removed, pending gathers landed, and under stage 3
        every parameter gathered back into an ordinary full tensor. A collective (every rank calls it).
        The model can then be used plainly or given to a new engine. Closing twice does nothing."""
        if self.lifecycle.state is EngineState.CLOSED:
            return
        self.lifecycle.require("close()", *USABLE)
        self.land_param_gathers()
        self.gradients.remove_hooks()
        if self._compiled_root_lands is not None:
            self._compiled_root_lands.remove()
        if self.stage3 is not None:
            self.stage3.close()
        for buffer in self.buffers:  # stage 1's .grad are views of the engine's gradient buffer
            for param in buffer.params:
                param.grad = None
        untrack_model(self, self.module)
        unregister(self, [owner.params[local] for owner, local in self.gradients.param_slots] + self._frozen_params()
                   + self.whole_frozen_params)
        self.optimizer_state.close()  # an NVMe state file is removed
        self.monitor.close()
        if self.param_file is not None:
            self.param_file.close()  # every unit is whole in memory again
        self.lifecycle.to(EngineState.CLOSED)

    def destroy(self) -> None:
        """DeepSpeed's name for letting go of an engine (Accelerate's ``free_memory()`` calls it): what
        :meth:`close` does. The engine's optimizer state, gradients and files are released with it; under stage 3
        the parameters come back whole, one unit at a time, where DeepSpeed's leaves them partitioned, so the
        trained values stay with the model (save a model that only fits sharded with ``save_checkpoint`` first,
        then drop the engine and the model instead). A collective."""
        self.close()

    def empty_partition_cache(self) -> None:
        """Stage 3: releases the units that stay whole between steps (the model's root, units under
        ``stage3_param_persistence_threshold``, those a step gathered ahead for the next forward) and the spare
        gather storage, as DeepSpeed's ``empty_partition_cache()``: after an evaluation or generation their
        memory is free until a forward gathers them again. Units a ``zerocore.gathered()`` block holds stay.
        Between steps only (not between a forward and its backward); every rank calls it, as a forward's
        gathers pair with the peers' only then. Stages 1-2 hold no gathered copies: nothing to release."""
        self._end_unstepped_micro_step()
        self.lifecycle.require("empty_partition_cache()", EngineState.IDLE, fix=(
            "call it after the backward and step() (the units a forward gathered stay for its backward)"
            if self.lifecycle.state is EngineState.FORWARD else None))
        if self.stage3 is not None:
            self.stage3.release_all()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict on every rank (see :meth:`full_state_dict` to gather to rank 0 only)."""
        return self.full_state_dict(rank0_only=False)

    def full_state_dict(self, dtype: torch.dtype | None = None, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict, keyed by the original names and loadable into the plain model with
        ``load_state_dict(strict=True)``; CPU tensors, in ``dtype`` when given (floating ones). Stage 3
        gathers one unit at a time (peak: the output plus one unit). A collective: call it on every rank;
        with ``rank0_only`` other ranks get an empty dict."""
        self.lifecycle.require("full_state_dict()", *USABLE)
        self.land_param_gathers()
        return full_state_dict(self, dtype, rank0_only)

    # ---- checkpoints (Note [Checkpoint format] in checkpoint.py) ----------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Writes this rank's optimizer state (fp32 master, moments), the model's buffers and frozen
        parameters (unless ``exclude_frozen_parameters``: a load keeps the model's own), counters, loss scaler,
        lr scheduler, RNG states and ``client_state`` (JSON) to ``save_dir/tag`` (default ``global_step<N>``)
        atomically, then (``save_latest``) points ``save_dir/latest`` at it. DeepSpeed's signature. A
        collective: every rank calls it, at an accumulation boundary. Returns the checkpoint's path."""
        from .checkpoint import save_checkpoint

        self._end_unstepped_micro_step()  # (then refused below as inside its window)
        self.lifecycle.require("save_checkpoint()", EngineState.IDLE, EngineState.FORWARD)
        self._refuse_inside_window("save_checkpoint()", "would lose its gradients")
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: the global batch becomes ``train_batch_size`` by changing the micro-batches per step
        (``gradient_accumulation_steps``); the micro-batch size stays (Megatron-DeepSpeed's batch-size ramp-up
        calls it). A collective, at a window's end: Note [Batch size changes].

        Raises:
            ValueError: for a size that micro-batch x ranks does not divide, a config without batch sizes, or
                ranks that asked for different sizes.
            RuntimeError: inside an accumulation window (on any rank).
        """
        set_batch_sizes(self, "set_train_batch_size()", lambda: sizes_for_batch(self, train_batch_size))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: the per-rank micro-batch becomes ``micro_batch_size`` and ``gradient_accumulation_steps``
        stays, so the global batch is ``micro_batch_size * gradient_accumulation_steps * ranks``. A collective,
        at a window's end: Note [Batch size changes]."""
        set_batch_sizes(self, "set_train_micro_batch_size()", lambda: sizes_for_micro_batch(self, micro_batch_size))

    def _refuse_inside_window(self, action: str, why: str) -> None:
        if self._micro_steps_in_window or self.lifecycle.local_grads:
            raise RuntimeError(f"{action} inside an accumulation window (or with no_sync() gradients pending) {why}; "
                               "call it after the step() that ends the window")

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable[..., Any] | None = None,
                        ) -> tuple[str | None, dict[str, Any]]:
        """Loads a checkpoint written by :meth:`save_checkpoint` at any world size and stage (each rank reads
        the parameter ranges its shards hold); ``tag`` defaults to the one ``latest`` names. DeepSpeed's
        signature: ``load_module_only`` replaces the weights and buffers only (moments, counters, scheduler
        and loss scale stay); ``load_optimizer_states=False`` starts the optimizer afresh from the loaded
        weights. Returns ``(path, client_state)``. Everything is validated before the engine changes. A
        collective. ``load_dir`` may also be a DeepSpeed ZeRO checkpoint (Note [DeepSpeed checkpoints]) or a
        torch.distributed.checkpoint directory saved by FSDP2, torchtitan or Accelerate (Note [DCP
        checkpoints]; its objects outside the model and the optimizer come back as the client state)."""
        from .checkpoint import load_checkpoint

        if load_module_strict is not True or custom_load_fn is not None:
            raise ValueError("load_checkpoint(load_module_strict=False / custom_load_fn=...) is not supported: a "
                             "zerocore checkpoint loads into the model it was saved from, every parameter checked; "
                             "load weights of another model into the plain model before zerocore.initialize")
        self._prepare_load("load_checkpoint()")
        return load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only)

    def load_hf_weights(self, path: str | os.PathLike[str], strict: bool = True) -> Any:
        """Loads pretrained weights in Hugging Face's safetensors layout (a file, or a directory with
        ``model.safetensors`` or a sharded ``model.safetensors.index.json``; older ``pytorch_model.bin``
        memory-mapped) into the model, each rank reading
        only its shards' share of the trainable weights (Note [Loading Hugging Face weights]); the optimizer's
        moments and counters stay. Names, shapes and files are checked on every rank before anything changes;
        with ``strict=False`` tensors missing from the files or absent from the model are left out. Returns
        ``load_state_dict``'s ``(missing_keys, unexpected_keys)``. A collective."""
        from ._hf_weights import load_hf_weights

        self._prepare_load("load_hf_weights()")
        return load_hf_weights(self, os.fspath(path), strict)

    def _prepare_load(self, what: str) -> None:
        """Refuses a load where it would mix with training in progress; lands the gathers in flight."""
        self._end_unstepped_micro_step()  # (then refused below as inside its window)
        self.lifecycle.require(what, EngineState.IDLE, EngineState.FORWARD)
        self._refuse_inside_window(what, "would apply the window's gradients, computed from the weights before "
                                   "the load, to the loaded ones")
        if self.stage3 is not None:
            self.stage3.refuse_while_held(what)
        self.land_param_gathers()

    def save_16bit_model(self, save_dir: str | os.PathLike[str], save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> str | Literal[False]:
        """Writes the model's whole weights in the compute dtype as one safetensors file on rank 0 (a
        ``torch.save`` file when ``save_filename`` does not end in ``.safetensors``, as DeepSpeed's default
        ``pytorch_model.bin``), Hugging Face's layout: tied parameters once, under their first name, persistent
        buffers included; without the frozen parameters with ``exclude_frozen_parameters`` (a LoRA adapter's
        run). A collective: stage 3 gathers unit by unit. Returns the file's path; at stage 3 with the config's
        ``stage3_gather_16bit_weights_on_model_save`` false it writes nothing, warns and returns False, as
        DeepSpeed does (the Hugging Face Trainer then saves a checkpoint instead)."""
        self.lifecycle.require("save_16bit_model()", *USABLE)
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str | os.PathLike[str],
                        save_filename: str = "model.safetensors") -> str | Literal[False]:
        """DeepSpeed's older name of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ``save_16bit_model()`` writes the whole weights: always at stages 1-2; at stage 3 unless the
        config's ``stage3_gather_16bit_weights_on_model_save`` is false (DeepSpeed's key, which Accelerate asks
        before saving)."""
        return self.stage3 is None or self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """DeepSpeed's (Accelerate's and Trainer's way to the whole weights): :meth:`full_state_dict` in the
        compute dtype on rank 0, an empty dict on the others; a collective."""
        state = self.full_state_dict(self.compute_dtype)
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        return state

    def land_param_gathers(self) -> None:
        """Waits for every parameter gather in flight (Note [Gathers land on first read]; stage 3's prefetches)."""
        if self.stage3 is not None:
            self.stage3.land_gathers()
        for buffer in self.buffers:  # (stages 1-2's gathers in flight; stage 3 has none of its own)
            buffer.land_gathers()

    def absorb_param_writes(self) -> list[ShardedBuffer]:
        """In-place writes since the last step reach the fp32 master (Note [Writes to parameters]): at every
        step and before the optimizer state is saved. Returns the buffers that absorbed a write."""
        self.land_param_gathers()
        written = [buffer for buffer in self.param_storages if buffer.params_written()]
        for buffer in self.param_storages:
            if buffer in written:
                buffer.absorb_param_writes()
            else:
                buffer.absorb_untracked_writes(self.stage3 is None or not self.stage3.storage_quantized(buffer))
        return written

    def take_write_fingerprints(self) -> dict[str, int]:
        """The parameters the user wrote since the last step, with their values' CRC-32C (Note [Writes to
        parameters]); the buffers start over."""
        prints: dict[str, int] = {}
        for buffer in self.param_storages:
            prints.update(buffer.write_fingerprints)
            buffer.write_fingerprints = {}
        return prints

    def restore_counters(self, global_steps: int, optimizer_steps: int, skipped_steps: int, micro_steps: int,
                         idle_steps: dict[str, int], global_samples: int | None = None) -> None:
        """``optimizer_steps``: the optimizer's own update count (Adam's bias correction); ``global_steps`` as
        the property counts them (skipped steps included); ``global_samples`` as saved (None: the checkpoint
        did not say, so ``global_steps`` at this engine's batch size)."""
        if global_samples is None:
            global_samples = global_steps * (self.train_batch_size() or 0)
        self._samples_mark = (global_samples, global_steps)
        self.optimizer_state.step_count = optimizer_steps
        self._steps_before_optimizer = global_steps - optimizer_steps - skipped_steps
        self.optimizer_state.idle_steps = dict(idle_steps)
        self.skipped_steps = skipped_steps
        self.micro_steps = micro_steps
        self._micro_steps_in_window = 0  # (saved and loaded at a window's end only)

    def reload_params_from_shards(self) -> None:
        """The optimizer shards were overwritten (a checkpoint load): the parameters follow them, every rank
        issuing the same all-gathers, left in flight as after ``step()`` (stages 1-2: Note [Gathers land on
        first read]), or releasing every unit (stage 3, gathered again on use)."""
        if self.stage3 is not None:
            self.stage3.land_gathers()
            self.stage3.forget_partition_slices()
            for unit in self.stage3.units:
                unit.pinned = False
                self.stage3.release(unit)
        else:
            for buffer in self.buffers:
                buffer.regather_in_background(self.comm, "all_gather_load", self.buckets.allgather_in_flight)
        for buffer in self.param_storages:  # a forward's graph from before the load cannot be back-propagated
            buffer.mark_rewritten()

    # ---- zerocore.gathered --------------------------------------------------------------------------
    def gather_for_user(self, params: list[nn.Parameter]) -> None:
        """Entering ``zerocore.gathered(params)``: the parameters hold their full values."""
        self.lifecycle.require("gathered()", *USABLE)
        self.land_param_gathers()
        # in-place writes made before the block (load_state_dict on every rank) are the model's, which the step
        # would take: taken now, so that leaving the block without a modifier rank undoes only what was
        # written inside it. A parameter given another tensor (p.data = t: an EMA swap, to be swapped back) is
        # not taken before the step, as at any time.
        for buffer in self.param_storages:
            if buffer.params_written() and not buffer.rebound_params():
                buffer.absorb_param_writes()
        gather_for_user(self, params)
        self.user_gathers += 1

    def release_for_user(self, params: list[nn.Parameter], modifier_rank: int | None) -> None:
        """Leaving ``zerocore.gathered(params)``: ``modifier_rank``'s values reach every rank's shard and
        the fp32 master."""
        self.user_gathers = max(0, self.user_gathers - 1)
        release_for_user(self, params, modifier_rank)
        if self.stage3 is not None:
            self.stage3.forget_partition_slices()

