"""Stage 3: parameters sharded at rest, each unit gathered just in time and released after use.

Note [Stage 3 gather and release]
---------------------------------
Every unit (Note [Stage 3 units]) has one flat buffer laid out by the layout engine as a single bucket.
At rest a rank holds only its shard (compute dtype) plus fp32 master and moments of that shard; the
full buffer's storage is resized to zero, while every parameter keeps its global shape as a view of it.
Gathering resizes the storage back and all-gathers into it, so the views, and the tensors autograd
saved from an earlier gather, see the data again (FSDP's storage-resize technique). A unit is gathered
before its forward and released after it (except the root unit and units under
``stage3_param_persistence_threshold``, which stay gathered until the step, and the forward's last unit:
Note [Last unit stays for the backward]), gathered again before its backward (a hook on its outputs'
gradients) and released once every parameter in it got its gradient; the gradients are reduce-scattered
by the GradReducer (one bucket per unit) into the unit's gradient shard and the full gradients are freed
at once.

Note [Sharded placeholders]
---------------------------
While a unit is sharded, each of its parameters' ``.data`` is a NaN scalar expanded to the parameter's
global shape (one element of memory), never a view of the freed storage: reading freed storage would crash
the process. So a parameter always reports its global shape, computing with it outside a gather raises
naming the way out (Note [Sharded parameters refuse compute]) instead of crashing or yielding NaN, and
``zerocore.gathered(...)`` gives the real values. Gathering
points ``.data`` back at views of the refilled storage; tensors that autograd saved from the parameter
refer to the parameter (restored by the pre-backward gather) or to views of that same storage.

Every gather is paired with a tiny all-gather of (unit, call count, step) from every rank, checked when
the gather is waited for (Note [Divergence tags]): if ranks run different units (a rank-dependent
branch), the first divergent gather raises on every rank with the rank, the step and both modules,
instead of hanging or mixing one unit's shards into another's silently.

Note [Last unit stays for the backward]
---------------------------------------
From step 2 on, the last unit of the recorded forward order is not released after its forward when a
backward may follow (grad enabled, its outputs require grad) and the forward went along the recorded
order: the backward needs that unit first, so releasing it and gathering it again would be a collective
with nothing to overlap, moving one unit more per step. It is released as soon as its gradients are in
(or when the backward or the step ends), so no peak grows: the backward would hold it at that point
anyway, together with the unit prefetched before it. torchtitan leaves its last block unsharded after
forward for the same reason. Every rank decides alike (same recorded order, same forward), so the
collectives stay in lockstep; the values are those the backward would gather (the shards change only at
the step; qwZ quantizes a shard the same way every time).

Note [Gathers started in the step]
----------------------------------
Once an order is recorded, the gathers the next forward would issue at its start (its first unit, the
root's embedding as a rule, and what it prefetches from there under the same budget and cap) start inside
the optimizer step, each as soon as its unit's shard is updated, like stages 1-2's all-gathers: they travel
while the other shards compute instead of being waited for, with nothing to overlap, by the forward's first
module. Such a unit is GATHERING after ``step()``; the forward waits for it as for any prefetch, a module
called on its own lands it first, and every other path (state dicts, ``gathered()``, checkpoints, close)
lands it before reading. A sharded-state error (``model.state_dict()``, ``load_state_dict()`` outside
``gathered()``) is raised for it as for a sharded unit, so nothing depends on which units were ahead.

Prefetch: step 1 records the sequence of units gathered in forward; later steps keep the units that follow
the computing one in that sequence gathered, up to ``stage3_prefetch_bucket_size`` elements of them (the
next unit by default; units gathered ahead already, by the step or an earlier prefetch, count), and the
previous one in backward, never holding more than ``stage3_max_live_parameters`` gathered elements through
prefetching (Note [Stage 3 prefetch plan]). A step that deviates from the
recorded sequence warns once, naming the expected and the seen module, and gathers on demand from there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ._buckets import stage3_prefetch_budget
from ._divergence import DivergenceCheck
from ._ds_param_attributes import attach as attach_ds_attributes
from ._ds_param_attributes import detach as detach_ds_attributes
from ._gather_spares import GatherSpares, spare_capacity
from ._module_hooks import EngineHook
from ._native import _C
from ._sharded_buffer import ShardedBuffer
from ._sharded_param import mark_whole
from ._stage3_access import install_access_checks, remove_external_access
from ._stage3_unit import Unit, UnitState
from ._transforms import outside_transforms, wrapped_values
from ._unit_outputs import output_leaves
from ._units import UnitSpec, frozen_storage_dtype
from ._user_frames import user_stacklevel

if TYPE_CHECKING:
    from .engine import Engine

NO_BUCKET_CAP = 2**62  # one bucket per unit: one all-gather gathers the whole unit
# the gathers that feed computation, which qwZ quantizes; state dicts, gathered(), close() get exact values
_QUANTIZED_LABELS = frozenset({"all_gather_forward", "all_gather_backward", "all_gather_external"})
_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)  # the quantize kernels' inputs


class Stage3Runtime:
    """Schedules gathers, releases, prefetch and divergence checks of the units of one engine."""

    def __init__(self, engine: Engine, specs: list[UnitSpec], group_of: dict[int, int], *, init_fn: Any = None,
                 meta: bool = False, strict_spmd: bool = False) -> None:
        self.engine = engine
        self.comm = engine.comm
        self.weight_comm = engine.comms.weights  # parameter gathers (qwZ quantizes them)
        zo = engine.config.zero_optimization
        self.quantizes_weights = zo.zero_quantized_weights
        self.quantizes_frozen = zo.zero_quantized_nontrainable_weights
        self.hpz_comm = engine.comms.hpz  # backward gathers inside the hpZ partition
        topology = engine.comms.hpz_topology
        self.hpz_slot = None if topology is None else (topology.node_size, topology.local_rank)
        self.max_live = zo.stage3_max_live_parameters
        self.prefetch_elements, self.prefetch_source = stage3_prefetch_budget(zo)
        self.units = [self._new_unit(s, group_of) for s in specs if s.params or s.frozen]
        self._parent_of = {s.index: s.parent for s in specs}  # (also through units without parameters)
        self._unit_of_buffer = {id(storage): u for u in self.units for storage in u.storages}
        self._slot_of = {u.index: slot for slot, u in enumerate(self.units)}  # unit index -> position in units
        self._numels = [u.numel for u in self.units]
        # each unit's state as the prefetch planner reads it in place (1: sharded), kept by the units' moves
        self._sharded = bytearray(b"\x01" * len(self.units))
        for slot, unit in enumerate(self.units):
            unit.flags, unit.slot = self._sharded, slot
        self._recorded_slots: list[int] = []
        self._planner: Any = None  # _C.PrefetchPlanner over the recorded order, once there is one
        self._by_index = {u.index: u for u in self.units}
        if meta:
            from ._meta_init import materialize_units

            materialize_units(engine.module, self.units, engine.device, init_fn, comm=engine.comm)
        else:
            for unit in self.units:
                unit.build_from({id(p): p.detach() for p in unit.all_params})
        for unit in self.units:
            unit.persistent = unit.spec.parent is None or unit.numel < zo.stage3_param_persistence_threshold
        self._persistent = [u.persistent for u in self.units]  # the prefetch planner's view
        # built and released: from here on, released units' memory serves the next gathers
        self.spares = GatherSpares(spare_capacity([u.nbytes for u in self.units], 1))
        for unit in self.units:
            for storage in unit.storages:
                storage.spares = self.spares
        self._unit_of_param = {id(p): unit for unit in self.units for p in unit.all_params}
        attach_ds_attributes(p for p in engine.module.parameters() if id(p) in self._unit_of_param)
        self.in_forward = False  # between the model's forward pre-hook and its forward hook
        self._any_pinned = False
        self._retain_graph = False  # the backward running keeps its graph for another (Stage3Runtime.end_backward)
        self._warned_unseen: set[int] = set()  # units named once for returning no tensor that requires grad
        self._forward_done = False
        self.step = 0
        self.recorded_order: list[int] | None = None
        self._recorded_position: dict[int, int] = {}  # a unit's first place in recorded_order
        self._recording_training = False  # the forward being recorded runs with grad
        self.before_backward_gather: Callable[[Unit], None] | None = None
        # shards off the device between uses (Note [NVMe parameter shards], Note [Host parameter shards])
        self._reads_ahead = engine.param_file is not None
        self._order: list[int] = []
        self._open: list[Unit] = []  # units whose forward began and has not ended, outermost first
        # Note [Backward events]: this backward's so far, and the last completed backward's
        self._events: list[tuple[str, int, str]] = []
        self._backward_visits: dict[int, int] = {}
        self._logging = False
        self._recorded_events: list[tuple[str, int, str]] | None = None
        self._recorded_events_forward: list[int] = []  # the units of the forward those events back-propagated
        self._grad_flowing = False
        self._whole_forward = False  # _order was collected since a forward of the whole model began
        self._position = 0
        self._prefetch_enabled = False
        self._warned = False
        self.live_elements = 0  # what the prefetch cap (stage3_max_live_parameters) counts
        self.live_bytes = 0
        self.peak_live_bytes = 0  # since the last optimizer step
        self.last_step_peak_bytes = 0  # the peak of the last completed step
        self.order_changes = 0
        self._started_in_step: set[int] = set()  # units whose gather started after this step's update
        self.reading_state = False  # inside the engine's full_state_dict(): state_dict() may see placeholders
        self.divergence = DivergenceCheck(engine, {u.index: u.name for u in self.units}, strict_spmd)
        self._register_module_hooks()

    def _new_unit(self, spec: UnitSpec, group_of: dict[int, int]) -> Unit:
        engine, label = self.engine, f"unit {spec.name or '<root>'}"
        buffer = None
        if spec.params:
            buffer = engine.new_buffer(label, spec.params, spec.param_names, [group_of[id(p)] for p in spec.params],
                                       NO_BUCKET_CAP)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, param in enumerate(spec.frozen):
            by_dtype.setdefault(frozen_storage_dtype(param, engine.compute_dtype), []).append(i)
        frozen = [engine.new_frozen_buffer(f"{label} frozen {str(dtype).removeprefix('torch.')}",
                                           [spec.frozen[i] for i in at], [spec.frozen_names[i] for i in at], dtype)
                  for dtype, at in by_dtype.items()]
        return Unit(spec, buffer, frozen)

    def _gather_comms(self, unit: Unit, label: str) -> tuple[list[Any], list[bool]]:
        """Each storage's all-gather for a gather labelled ``label``: the gathers that feed computation go
        through qwZ for trainable parameters with ``zero_quantized_weights`` and for frozen ones with
        ``zero_quantized_nontrainable_weights`` (16- and 32-bit floats only); exact otherwise."""
        feeds = label in _QUANTIZED_LABELS
        flags = [feeds and (self.quantizes_weights if storage is unit.buffer
                            else self.quantizes_frozen and storage.dtype in _QUANTIZABLE)
                 for storage in unit.storages]
        return [self.weight_comm if q else self.comm for q in flags], flags

    # ---- hooks ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Removes the hooks and makes every parameter a whole, ordinary tensor again."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
        remove_external_access(self.engine.module)
        for unit in self.units:
            unit.pinned = False
            unit.user_holds = 0  # closed inside a gathered() block: the parameters become plain tensors
            self.ensure_gathered(unit, "all_gather_close")
            whole = [param.detach().clone() for param in unit.all_params]
            self.release(unit)
            for param, value in zip(unit.all_params, whole):
                param.data = value
                mark_whole(param)
            detach_ds_attributes(unit.all_params)
        self.spares.clear()

    def _register_module_hooks(self) -> None:
        self.hook_handles: list[Any] = []
        # A forward of the whole model starts here, whether or not the root module owns parameters.
        self.hook_handles.append(self.engine.module.register_forward_pre_hook(
            EngineHook(lambda m, args: None if self._in_backward() else self._begin_forward(), eager=True),
            prepend=True))
        self.hook_handles.append(self.engine.module.register_forward_hook(
            EngineHook(lambda m, args, out: self._end_forward(), eager=True)))
        for unit in self.units:
            module = unit.spec.module
            self.hook_handles.append(module.register_forward_pre_hook(
                EngineHook(lambda m, args, kwargs, unit=unit: self.pre_forward(unit, args, kwargs), eager=True),
                with_kwargs=True))
            self.hook_handles.append(module.register_forward_hook(
                EngineHook(lambda m, args, out, unit=unit: self.post_forward(unit, out), eager=True)))
        # Note [External parameters]; running or saving a module whose parameters are sharded raises
        self.hook_handles += install_access_checks(self.engine.module, self.units, self._unit_of_param, self)

    def _in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def pre_forward(self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Gathers the unit; with frozen parameters, hooks its inputs' gradients (Note [Units with frozen
        parameters in backward])."""
        if self._in_backward():  # activation-checkpoint recomputation: the unit is needed, nothing else
            self._log("gather", unit.index, "all_gather_backward")
            self.ensure_gathered(unit, "all_gather_backward")
            # a reentrant recomputation's graph is back-propagated (a non-reentrant one's is not: its forward
            # already hooked the inputs)
            if unit.frozen and not unit.input_grads_left:
                self._await_input_grads(unit, args, kwargs)
            return
        self._follow_order(unit)
        self._open.append(unit)
        self.ensure_gathered(unit, "all_gather_forward")
        self._prefetch_next()
        if unit.frozen:
            self._await_input_grads(unit, args, kwargs)

    # Note [Units with frozen parameters in backward]
    # -----------------------------------------------
    # A unit without frozen parameters is released in backward once each of its parameters got its gradient:
    # an autograd node that reads a trainable weight also computes that weight's gradient, so no later node
    # reads it. A frozen weight has no gradient to wait for, and it is read after the unit's trainable
    # gradients may all be in (``y = W_frozen @ h + b``: b's gradient comes first, then the node computing the
    # input's gradient reads W). So such a unit's forward hooks the gradients of its inputs that require grad
    # (one multi-grad hook, mode "all"): an input's gradient is complete only once every node that used it
    # ran, the unit's backward included. FSDP2 passes the inputs through an identity autograd function
    # instead, whose outputs a module cannot then write in place (``relu_(x)``, ``x += ...``: autograd forbids
    # it); a hook leaves the inputs as they are. The unit is released when both are in
    # (Stage3Runtime._release_after_backward). A forward with no input that requires grad (the first block
    # after a frozen embedding), or one under a torch.func transform, leaves nothing to wait for: its unit
    # stays gathered until the backward ends. Activation checkpointing: a non-reentrant recomputation's graph
    # is never back-propagated, so only the original forward's inputs are hooked; a reentrant one's original
    # forward ran without grad, so its recomputation's are.
    def _await_input_grads(self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        if torch._C._are_functorch_transforms_active():
            unit.held_to_backward_end = True
            return
        inputs = [value for value in tree_flatten((args, kwargs))[0]
                  if isinstance(value, torch.Tensor) and value.requires_grad]
        if not inputs:
            unit.held_to_backward_end = True
            return
        unit.input_grads_left += 1
        torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads: self._input_grads_done(unit), mode="all")

    def _input_grads_done(self, unit: Unit) -> None:
        self._log("inputs", unit.index)
        unit.input_grads_left = max(0, unit.input_grads_left - 1)
        self._release_after_backward(unit)

    def _release_after_backward(self, unit: Unit) -> None:
        """The unit's backward is over once its gradients and its inputs' gradients are in."""
        if unit.grads_left or unit.input_grads_left or unit.held_to_backward_end:
            return
        unit.secondary = None  # its backward is done; the next forward gathers the updated values
        if not unit.persistent and not unit.pinned:
            self.release(unit)

    def post_forward(self, unit: Unit, output: Any) -> Any:
        outputs = output_leaves(output)
        if any(id(t) in self._unit_of_param for t in outputs if isinstance(t, nn.Parameter)):
            for t in outputs:  # a parameter handed out: its parent uses it later (Note [External parameters])
                if isinstance(t, nn.Parameter) and id(t) in self._unit_of_param:
                    self._pin(self._unit_of_param[id(t)])
        backward_follows = False
        if torch.is_grad_enabled():
            tensors = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
            tensors += wrapped_values(outputs)  # under torch.func transforms (Note [torch.func transforms])
            if not self._in_backward():
                unit.hooks_backward = bool(tensors)
                self._grad_flowing |= bool(tensors)
            if tensors:
                self._hook_output_grads(unit, tensors)
                backward_follows = unit.backward_hooked = True
            elif not self._in_backward() and not unit.pinned and (unit.params or unit.input_grads_left):
                self._pin_unseen_output(unit, output)
        if not self._in_backward():
            self._close(unit)
            self._release_after_forward(unit, backward_follows)
        return None

    def _close(self, unit: Unit) -> None:
        for at in range(len(self._open) - 1, -1, -1):
            if self._open[at] is unit:
                del self._open[at]
                return

    def _release_after_forward(self, unit: Unit, backward_follows: bool) -> None:
        if not unit.persistent and not unit.pinned and not (backward_follows and self._ends_recorded_forward(unit)):
            self.release(unit)

    def _hook_output_grads(self, unit: Unit, tensors: list[torch.Tensor]) -> None:
        """``pre_backward(unit)`` once the first of its outputs' gradients arrives (once per backward). As
        pre-hooks of the outputs' autograd nodes where every output has one: autograd runs them after the
        tensor hooks on the same gradients, so the next unit, when it waits for its input gradients (these
        outputs; Note [Units with frozen parameters in backward]), is released before this unit's backward
        gathers it and prefetches the one before: a tensor hook registered here, before the next unit's,
        would run first and hold three units at that moment instead of two."""
        nodes = [t.grad_fn for t in tensors]
        if any(node is None for node in nodes) or torch._C._are_functorch_transforms_active():
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads, unit=unit: self.pre_backward(unit), mode="any")
            return
        ran: set[int] = set()  # graph tasks: a retain_graph backward runs it again

        def hook(grad_outputs: Any) -> None:
            task = torch._C._current_graph_task_id()
            if task not in ran:
                ran.add(task)
                self.pre_backward(unit)

        for node in dict.fromkeys(nodes):
            node.register_prehook(hook)

    def _ends_recorded_forward(self, unit: Unit) -> bool:
        """``unit`` is the last of the recorded forward order, reached along it: the backward needs it first
        (Note [Last unit stays for the backward])."""
        order = self.recorded_order
        return (self._prefetch_enabled and order is not None and self._position == len(order)
                and order[-1] == unit.index)

    def access_external(self, unit: Unit) -> None:
        """A parameter of ``unit`` is read outside its unit's forward (Note [External parameters])."""
        if self.in_forward or self._in_backward():
            if self._in_backward():
                self._log("external", unit.index)
            self.ensure_gathered(unit, "all_gather_external")
            self._pin(unit)

    def gather_persistent_for_module(self, unit: Unit) -> None:
        """A module owning parameters of persistent ``unit`` runs while the unit is sharded (Note [Modules of
        persistent units run on their own] in _stage3_access.py)."""
        if not self._in_backward():  # a backward finds every persistent unit its forward used gathered
            self.ensure_gathered(unit, "all_gather_external")

    def _pin(self, unit: Unit) -> None:
        unit.pinned = True
        if torch.is_grad_enabled():
            unit.pinned_for_backward = True
        self._any_pinned = True

    def _pin_unseen_output(self, unit: Unit, output: Any) -> None:
        """The unit's forward ran with grad, but no output tensor requires grad: its result reached autograd
        some way the walk cannot see (an attribute the module set, a container of its own), so no hook can
        gather the unit again for its backward, which would read freed storage. It stays gathered until the
        backward ends, as a unit whose parameters are read outside its forward."""
        self._pin(unit)
        if unit.index not in self._warned_unseen:
            self._warned_unseen.add(unit.index)
            warnings.warn(
                f"zerocore stage 3: module {unit.name!r} ran with grad enabled but returned no tensor that "
                f"requires grad (it returned {type(output).__name__}); it stays gathered until the backward "
                "ends, using its whole parameters' memory meanwhile. Return the tensors its backward needs (in "
                "a tuple, dict, dataclass or pytree), or run it under torch.no_grad() if none is needed",
                RuntimeWarning, stacklevel=user_stacklevel())

    def _unpin_no_grad_forward(self) -> None:
        """A forward without grad ended: the units it pinned are released; those a grad-enabled forward
        pinned stay for the backward still to come (an evaluation between a forward and its backward)."""
        if self._any_pinned:
            self._any_pinned = False
            for unit in self.units:
                if unit.pinned and not unit.pinned_for_backward:
                    unit.pinned = False
                    if not unit.persistent and not unit.in_backward:
                        self.release(unit)
                self._any_pinned |= unit.pinned

    def _end_forward(self) -> None:
        if not self._in_backward():
            self.in_forward = False
            self._forward_done = True
            if not torch.is_grad_enabled():  # no backward will need what this forward pinned
                self._unpin_no_grad_forward()

    def pre_backward(self, unit: Unit) -> None:
        if self.before_backward_gather is not None:  # (GradientRouting.settle_units_behind: logged before "pre")
            self.before_backward_gather(unit)
        self._log("pre", unit.index)
        self.ensure_gathered(unit, "all_gather_backward")
        unit.in_backward = True
        visit = self._backward_visits.get(unit.index, 0)
        self._backward_visits[unit.index] = visit + 1
        self._prefetch_for_backward(unit, visit)

    def _begin_forward(self) -> None:
        """A forward of the whole model starts: several per step with gradient accumulation or inference."""
        self._end_order_record()
        self._whole_forward = True
        self._recording_training = torch.is_grad_enabled()
        self._forward_done = False  # a forward that raises part-way never becomes the recorded order
        self._open = []
        self._grad_flowing = False  # a unit's output in this forward required grad
        self.in_forward = True
        self._prefetch_enabled = self.recorded_order is not None and not self._warned

    def _end_order_record(self) -> None:
        """A whole forward (one that began at the model, not a unit called on its own) that completed becomes the
        schedule that later forwards prefetch by, and a forward that raised plays out (Note [A forward that
        raised on one rank]): the first one, and later every training forward that ran another order (a first
        step that skipped a layer must not leave every later step without prefetching, or a one-rank failure
        playing out the wrong order). An evaluation on another path (generate) leaves the training order. Every
        rank runs the same forwards, so every rank records the same order."""
        if self._order and self._whole_forward and self._forward_done and (
                self.recorded_order is None or (self._recording_training and self._order != self.recorded_order)):
            self.recorded_order = list(self._order)
            self._recorded_slots = [self._slot_of[index] for index in self.recorded_order]
            self._planner = _C.PrefetchPlanner(self._recorded_slots, self._numels, self._persistent)
            self._recorded_position = {}
            for position, index in enumerate(self.recorded_order):
                self._recorded_position.setdefault(index, position)
        self._order = []
        self._position = 0

    def _prefetch_for_backward(self, unit: Unit, visit: int) -> None:
        """Backward runs the recorded forward order in reverse: gather the unit before this one, before the
        ``visit``-th call's backward of a unit called more than once (the plan is pure C++:
        cpp/include/zerocore/prefetch_plan.hpp)."""
        if not self._prefetch_enabled or self.recorded_order is None:
            return
        slot = self._planner.backward(unit=self._slot_of[unit.index], visit=visit, unit_sharded=self._sharded,
                                      live_elements=self.live_elements, max_live=self.max_live)
        if slot is not None:
            self._gather(self.units[slot], "all_gather_backward")

    def grad_ready(self, buffer: ShardedBuffer, index: int) -> None:
        """Parameter ``index`` (the reducer's) of the unit that owns ``buffer`` got its gradient; the last one
        releases the unit."""
        self._log("grad", index)
        unit = self.unit_of_buffer(buffer)
        unit.grads_left -= 1
        self._release_after_backward(unit)

    # ---- gather / release -----------------------------------------------------------------------------
    @outside_transforms  # gathers and releases are the engine's, never a transform's (Note [torch.func transforms])
    def ensure_gathered(self, unit: Unit, label: str) -> None:
        # A reader of the values themselves (state dict, gathered()) gets them exact, and computation gets what
        # qwZ gathers, whatever gathered the unit before (the persistent root stays gathered after a state read:
        # a forward computing with its exact values would train otherwise than one that had not read the state)
        if unit.state is not UnitState.SHARDED and unit.quantized_storages != self._gather_comms(unit, label)[1]:
            self.release(unit)
        if unit.state is UnitState.SHARDED:
            self._gather(unit, label)
        unit.wait()

    @outside_transforms
    def _gather(self, unit: Unit, label: str, step: int | None = None) -> None:
        """``step``: the step the gather's divergence tag names, when it is not the current one."""
        unit.calls += 1
        partition = self.hpz_slot is not None and label == "all_gather_backward" and unit.secondary is not None
        # this rank's values first (from the parameter file, maybe): a failed read rides on the tag
        failure = None if partition else unit.stage_own()
        tag = self.divergence.before_gather(unit.index, unit.calls, self.step if step is None else step, label, failure)
        if partition:
            unit.start_partition_gather(self.hpz_comm, label, self.divergence, tag, self.hpz_slot)
            unit.quantized_storages = self._gather_comms(unit, label)[1]  # the forward's values, as they were gathered
        else:  # forward gathers refresh the hpZ slice the backward will gather from
            comms, unit.quantized_storages = self._gather_comms(unit, label)
            # (not in a forward without grad, which no backward follows: a teacher model would hold 1/K of itself)
            evaluating = not torch.is_grad_enabled() and (
                self.in_forward or (label == "all_gather_external" and not self._in_backward()))
            keep = self.hpz_slot if not unit.in_backward and not evaluating and label in _QUANTIZED_LABELS else None
            unit.start_gather(comms, label, self.divergence, tag, keep)
        self.live_elements += unit.numel
        self.live_bytes += unit.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
        backward = label == "all_gather_backward"
        if self._reads_ahead and self.recorded_order is not None and not (backward and self.hpz_slot is not None):
            self._read_ahead_after(unit, backward)  # (hpZ's backward gathers read no shard)

    def _read_ahead_after(self, unit: Unit, backward: bool) -> None:
        """Parameter shards on NVMe: the unit gathered after ``unit`` along the recorded order (before it in
        backward) starts reading its shard (Note [NVMe parameter shards])."""
        position = self._recorded_position.get(unit.index)
        if position is None:
            return
        position += -1 if backward else 1
        if 0 <= position < len(self.recorded_order):
            after = self._unit(self.recorded_order[position])
            if after.state is UnitState.SHARDED:
                after.storages[0].read_ahead()  # (the file reads one shard ahead: the unit's first)

    @outside_transforms
    def release(self, unit: Unit) -> None:
        """Frees the unit's gathered values, unless a ``zerocore.gathered()`` block holds it (Note [Units
        held by gathered()])."""
        if unit.state is not UnitState.SHARDED and not unit.user_holds:
            unit.release()
            self.live_elements -= unit.numel
            self.live_bytes -= unit.nbytes

    def gathered_in_turn(self, units: Iterable[Unit]) -> Iterator[Unit]:
        """Each of ``units`` whole with its exact values, one at a time (state dicts, checkpoints: a collective),
        released after unless it is persistent."""
        for unit in units:
            self.ensure_gathered(unit, "all_gather_state_dict")
            yield unit
            if not unit.persistent:
                self.release(unit)

    # Note [Units held by gathered()]
    # -------------------------------
    # Inside ``zerocore.gathered(params)`` the units of ``params`` stay whole whatever runs: the hooks of a
    # forward or backward inside the block find them gathered and do not release them. So a decoding loop
    # inside the block issues no collective (ranks may stop at different lengths, where DeepSpeed needs
    # ``synced_gpus``), and values written on ``modifier_rank`` inside it are still there when the block
    # ends. What would make a held copy stale is refused while any unit is held, before anything changes:
    # the update of ``step()`` and ``load_checkpoint()``.
    def hold(self, unit: Unit) -> None:
        self.ensure_gathered(unit, "all_gather_user")
        unit.user_holds += 1

    def unhold(self, unit: Unit) -> None:
        unit.user_holds = max(0, unit.user_holds - 1)  # 0 already when close() ran inside the block
        if not unit.persistent:
            self.release(unit)

    def refuse_while_held(self, what: str) -> None:
        held = [unit.name for unit in self.units if unit.user_holds]
        if held:
            raise RuntimeError(
                f"{what} inside a zerocore.gathered() block would leave the whole parameters it holds stale "
                f"(modules {held}); nothing was changed. Leave the block first.")

    # ---- prefetch -------------------------------------------------------------------------------------
    def _follow_order(self, unit: Unit) -> None:
        self._order.append(unit.index)
        if self.recorded_order is None or not self._prefetch_enabled:
            return
        expected = self.recorded_order[self._position] if self._position < len(self.recorded_order) else None
        if expected == unit.index:
            self._position += 1
            return
        self.order_changes += 1
        # An evaluation (no grad) may run other paths than training (generate: the encoder once, then the
        # decoder with a cache): it gathers on demand from here, silently, and the next forward tries the order again
        if not self._warned and torch.is_grad_enabled():
            names = {u.index: u.name for u in self.units}
            warnings.warn(
                f"zerocore stage 3: the forward order changed at step {self.step}: expected module "
                f"{names.get(expected, 'end of forward')!r} but {unit.name!r} ran; prefetching is off and units "
                "are gathered on demand for the rest of this step",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
            self._warned = True
        self._prefetch_enabled = False
        self._drain_prefetched()

    def _prefetch_next(self) -> None:
        """Gather ahead along the recorded order, within the prefetch budget and the live-parameter cap."""
        if not self._prefetch_enabled or self.recorded_order is None:
            return
        for slot in self._planner.forward(
                position=self._position, unit_sharded=self._sharded, live_elements=self.live_elements,
                max_live=self.max_live, prefetch_budget=self.prefetch_elements):
            self._gather(self.units[slot], "all_gather_forward")

    def land_gathers(self) -> None:
        """Every gather in flight lands (and its divergence tag is checked)."""
        self._drain_prefetched()

    @outside_transforms
    def _drain_prefetched(self) -> None:
        """Lands every gather in flight, so none is left behind when prefetching stops mid-step; the
        landed units are released by the usual post-forward and post-backward rules."""
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                unit.wait()

    def _unit(self, index: int) -> Unit:
        return self._by_index[index]

    # ---- step boundaries ------------------------------------------------------------------------------
    def begin_backward(self, retain_graph: bool = False) -> None:
        self._retain_graph = retain_graph
        self._events, self._logging = [], True
        self._backward_visits = {}  # unit index -> its pre-backwards so far in this backward
        for unit in self.units:
            unit.grads_left = len(unit.params)

    def end_backward(self, abandoned: bool = False) -> None:
        """Releases what the backward used. After a ``retain_graph`` backward the units pinned for it stay
        gathered: a second backward through the same graph reads their parameters again, and nothing else
        would gather them (no hook of theirs is in that graph)."""
        keep = self._retain_graph and not abandoned
        if self._logging and not abandoned:
            self._recorded_events, self._recorded_events_forward = self._events, list(self._order)
        self._logging = False
        self._any_pinned = False
        for unit in self.units:
            unit.in_backward = unit.backward_hooked = False
            unit.input_grads_left, unit.held_to_backward_end = 0, False
            if keep and unit.pinned_for_backward:
                self._any_pinned = True
                continue
            unit.pinned = unit.pinned_for_backward = False
            if not unit.persistent:
                self.release(unit)

    # Note [A backward that raised on one rank]
    # ----------------------------------------
    # Stage 3's backward issues collectives as it goes: each unit's gather (and the one it prefetches) when
    # its outputs' gradients arrive, and its gradients' reduce-scatter once they are in. When the backward
    # raises on one rank only (an error in a custom autograd function, an out-of-memory), its peers would
    # wait in their next gather for a rank that left, until the process group's timeout. So the rank that
    # raised plays the rest of its backward out, issuing what the peers' backward issues, in the same order:
    # it replays the events of the last completed backward (Note [Backward events]) from where its own
    # stopped, each unit's pre-backward (its gather and prefetch, as the peers do), each parameter's
    # gradient arriving as zeros (the reduce-scatters launch as on the peers), each gather of a
    # recomputation or an external parameter. Then the backward's outcome exchange (Note [Backward outcome])
    # makes every rank raise and drop the window. Without such a record (the first backward), or when this
    # backward left it, it walks the forward's units in reverse instead (the order the peers' backward meets
    # them in a model that runs its units one after another, not nested and each once): it settles the
    # units whose backward began (their parameters still due reduce as zeros), then runs each remaining
    # unit's pre-backward and settles it; parameters that got no gradient in the last backward are left to
    # the end-of-backward finalize, as on the peers. A model whose backward interleaves its units otherwise
    # may then pair different collectives (the divergence tags raise where they can tell).
    #
    # Note [Backward events]
    # ----------------------
    # Every backward logs, in order, what in it issues or releases collectives' data: each unit's
    # pre-backward, each parameter's gradient (the reducer launches the buckets in its fixed order as they
    # fill), each gather for a recomputation or an external parameter, and each unit whose inputs'
    # gradients arrived (its release). The sequence depends on the graph, not the values, so the last
    # completed backward's is the one the peers run now, when this step's forward ran the same units (a
    # model that skips layers at random, LayerDrop, runs another graph: then the walk). Logging is a list
    # append per event.
    def _log(self, kind: str, index: int, label: str = "") -> None:
        if self._logging:
            self._events.append((kind, index, label))

    def play_out_backward(self, settle: Callable[[Unit], None], settle_param: Callable[[int], None]) -> None:
        """``settle(unit)``: the unit's parameters still due reduce as zeros; ``settle_param(index)``: the
        reducer's parameter ``index`` got its gradient on the peers."""
        self._logging = False
        done, recorded = self._events, self._recorded_events
        if recorded is not None and self._recorded_events_forward == self._order and recorded[:len(done)] == done:
            for kind, index, label in recorded[len(done):]:
                if kind == "grad":
                    settle_param(index)
                    continue
                unit = self._unit(index)
                if kind == "pre":
                    self.pre_backward(unit)
                elif kind == "inputs":
                    self._input_grads_done(unit)
                else:
                    self.ensure_gathered(unit, "all_gather_external" if kind == "external" else label)
                    if kind == "external":
                        self._pin(unit)
            return
        order = [self._unit(index) for index in dict.fromkeys(reversed(self._order))]
        for unit in order:
            if unit.in_backward:
                self._settle_played_out(unit, settle)
        for unit in order:
            if unit.backward_hooked and not unit.in_backward:
                self.pre_backward(unit)
                self._settle_played_out(unit, settle)

    def _settle_played_out(self, unit: Unit, settle: Callable[[Unit], None]) -> None:
        """The unit's backward is over here, as on the peers; its inputs' gradients, which its release may wait
        for, never come: this rank's graph was dropped."""
        unit.input_grads_left = 0
        settle(unit)
        self._release_after_backward(unit)

    # Note [A forward that raised on one rank]
    # ---------------------------------------
    # Stage 3's forward issues collectives too: when it raises on one rank only (a bad batch, an out-of-memory
    # error in one layer), the peers' forward goes on gathering the units after the failing one and their
    # backward gathers and reduces, while the rank that raised, its error caught, starts the next batch's
    # forward: different collectives from there on (RanksDivergedError at best, a hang until the process
    # group's timeout at worst), and the engine is unusable. So the rank that raised plays the rest of its
    # forward out before its error reaches the user: the units whose forward began end as on the peers
    # (released, or kept when the recorded order says the backward needs them first: Note [Last unit stays
    # for the backward]), then every unit the peers still run is gathered, prefetched from and released
    # along the recorded order (before an order is recorded, or once this step left it, the units not run
    # yet in the order recorded or else the model's: what a model that runs its units one after another
    # does; the divergence tags raise where that guess is wrong). Then the engine plays out the peers'
    # backward (Note [A backward that raised on one rank]) and its outcome exchange, so every rank drops the
    # accumulation window at the same point and the next batch starts in lockstep (Engine.forward). Which
    # played-out units the peers' backward gathers follows each unit's last forward with grad (whether its
    # outputs required grad; never run with grad: whether it or a unit before it has trainable parameters).
    # The play-out runs while the error is being raised, so the failed forward's activations are still alive
    # (its traceback holds them; torch's hook wrapper keeps each hooked module's inputs even in cleared
    # frames); its gathers take the memory of the units it releases (the caching allocator's, or Note [Spare
    # gather storage]), so an out-of-memory error in an activation leaves room for them.
    def play_out_forward(self, backward_follows: bool) -> None:
        """This rank's forward raised part-way (Note [A forward that raised on one rank])."""
        if not self.in_forward:
            self._begin_forward()
        if backward_follows:  # the graph that would have run their input-gradient hooks was dropped
            for index in self._order:
                self._unit(index).input_grads_left = 0
        for index in self._forward_remaining():
            unit = self._unit(index)
            while self._open and not self._encloses(self._open[-1], unit):  # forwards that end before it runs
                self._end_played_out_forward(self._open.pop(), backward_follows)
            self._follow_order(unit)
            self.ensure_gathered(unit, "all_gather_forward")
            self._prefetch_next()
            self._end_played_out_forward(unit, backward_follows)
        while self._open:
            self._end_played_out_forward(self._open.pop(), backward_follows)
        self._end_forward()

    def _encloses(self, outer: Unit, unit: Unit) -> bool:
        parent = self._parent_of[unit.index]
        while parent is not None and parent != outer.index:
            parent = self._parent_of[parent]
        return parent is not None

    def _end_played_out_forward(self, unit: Unit, backward_follows: bool) -> None:
        """Ends ``unit``'s forward as the peers' ends: its outputs require grad as in its last forward with grad
        (never run with grad: when it has trainable parameters or a unit before it returned such outputs)."""
        known = unit.hooks_backward
        hooks = backward_follows and (known if known is not None else bool(unit.params) or self._grad_flowing)
        self._grad_flowing |= hooks
        if backward_follows:  # (without grad, a forward waits for no gradient: a pending backward's waits stay)
            unit.input_grads_left, unit.held_to_backward_end = 0, False
        unit.backward_hooked |= hooks
        self._release_after_forward(unit, hooks)

    def _forward_remaining(self) -> list[int]:
        """The units a forward that stopped here would still run, as the peers run them."""
        order = self.recorded_order
        if order is not None and self._prefetch_enabled:
            return order[self._position:]
        ran = set(self._order)
        return [index for index in dict.fromkeys(order or [u.index for u in self.units]) if index not in ran]

    def gathers_in_step(self) -> Callable[[int], None] | None:
        """The optimizer step's ``after_shard``: the gathers the next forward would issue at its start (its
        first unit and what it prefetches from there) start as soon as their units' shards are updated
        (Note [Gathers started in the step]); None before an order is recorded or with NVMe parameter shards."""
        self._started_in_step.clear()  # (a step that raised part-way left its own)
        if self.recorded_order is None or self._reads_ahead:
            return None
        first = self._recorded_slots[0]
        sharded = bytearray(b"\x01" * len(self.units))  # (as at the next forward's start: only `first` gathered)
        sharded[first] = 0
        ahead = [first, *self._planner.forward(
            position=1, unit_sharded=sharded, live_elements=self._numels[first], max_live=self.max_live,
            prefetch_budget=self.prefetch_elements)]
        for slot in ahead:  # frozen parameters only: the update changes nothing, they go now
            unit = self.units[slot]
            if unit.buffer is None:
                if unit.state is UnitState.SHARDED:
                    unit.calls = 0
                    self._gather(unit, "all_gather_forward", self.step + 1)
                self._started_in_step.add(unit.index)
        ahead = [slot for slot in ahead if self.units[slot].buffer is not None]
        shards_left = {slot: len(self.units[slot].buffer.optimizer_shards) for slot in ahead}
        slot_of_shard = {shard.index: slot for slot in ahead for shard in self.units[slot].buffer.optimizer_shards}

        def after_shard(index: int) -> None:
            slot = slot_of_shard.get(index)
            if slot is None:
                return
            shards_left[slot] -= 1
            if shards_left[slot] == 0:
                unit = self.units[slot]
                self.release(unit)  # its gathered copy, if it kept one, holds the values before the update
                unit.calls = 0
                self._gather(unit, "all_gather_forward", self.step + 1)
                self._started_in_step.add(unit.index)

        return after_shard

    def end_forward_backward_step(self) -> None:
        """After the optimizer step: shards changed, so every gathered copy is stale (except those gathered
        after the update, Note [Gathers started in the step])."""
        for unit in self.units:
            unit.pinned = unit.pinned_for_backward = False
            unit.input_grads_left, unit.held_to_backward_end = 0, False
            if unit.index not in self._started_in_step:
                self.release(unit)
                unit.calls = 0
                unit.secondary = None  # hpZ: the values before the update (a unit held to its backward's end)
        self._started_in_step.clear()
        self._any_pinned = False
        self._end_order_record()
        self._whole_forward = False
        self._warned = False
        self._prefetch_enabled = self.recorded_order is not None
        self.step += 1
        self.last_step_peak_bytes = self.peak_live_bytes
        self.peak_live_bytes = self.live_bytes

    def memory(self) -> dict[str, int]:
        return {"gathered_params_live": self.live_bytes,
                "gathered_params_peak_last_step": self.last_step_peak_bytes,
                # hpZ: each unit's slice of its forward values, held until its backward is done
                "hpz_secondary": sum(t.numel() * t.element_size() for u in self.units if u.secondary is not None
                                     for t in u.secondary),
                "gather_spares": self.spares.held_bytes}  # Note [Spare gather storage]

    def release_all(self) -> None:
        """Every unit not held by a ``gathered()`` block is released and the spare gather storage freed
        (``engine.empty_partition_cache()``): the persistent ones gather again when a forward next needs them."""
        self.land_gathers()
        for unit in self.units:
            self.release(unit)
        self.spares.clear()

    def forget_partition_slices(self) -> None:
        """The shards changed outside a step (a checkpoint load, a write in ``gathered()``): no backward may
        gather the hpZ slices of the old values."""
        for unit in self.units:
            unit.secondary = None

    # ---- outside forward ------------------------------------------------------------------------------
    def unit_of_buffer(self, buffer: ShardedBuffer) -> Unit:
        return self._unit_of_buffer[id(buffer)]

    def storage_quantized(self, storage: ShardedBuffer) -> bool:
        """Whether ``storage``'s gathered values are qwZ's dequantized ones."""
        unit = self.unit_of_buffer(storage)
        return unit.quantized_storages[next(i for i, s in enumerate(unit.storages) if s is storage)]
