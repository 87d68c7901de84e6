"""A backward's gradients on their way from autograd to the reducer, and the exchange that tells every rank
whether any rank's backward raised.

Note [Backward outcome]
-----------------------
Every backward outside ``no_sync()`` (at stage 3 every backward: its gathers are collectives) ends with one
tiny all-reduce of which ranks raised in it. A rank whose backward raised still completes the reductions it
started (finalize launches the buckets it never filled, so the bucket sequences match; stage 3 also plays
out the gathers its peers' backward still issues: Note [A backward that raised on one rank] in _stage3.py)
and then sends its flag; so when one rank fails and skips
the batch while its peers succeed, every rank learns it at the same point, all drop the accumulation
window (micro-step counters stay equal), and the peers raise naming the rank, instead of the next
collectives mismatching (Gloo aborts the process on that) or the accumulation boundaries drifting apart.
A training forward that raises on some ranks only (caught there, the batch skipped) would leave the others'
backward paired with the failing ranks' next batch, a silent mix of two batches' gradients, and the ranks
one backward apart from then on. So a rank whose training forward raises plays out the backward its peers
run for that batch, before its error reaches the user (Engine._play_out_forward; at stage 3 also the rest
of the forward's gathers: Note [A forward that raised on one rank] in _stage3.py), with no gradient of its
own and its flag in the exchange: every rank drops the window at the same backward and the next batch starts
in lockstep. The same all-reduce carries each rank's count of training forwards since the last exchange and
whether one of them raised, for what no play-out covers (a forward inside no_sync() at stages 1-2, where
nothing is exchanged; a KeyboardInterrupt, which reaches the ranks at different points, so that a play-out
could pair with anything, unless there is one rank): a forward that raised on any rank since the last exchange
makes the window's backward raise on every rank, dropping the window (which holds a batch some ranks skipped,
or, with unequal counts, pairs different batches), and the counts start over. Unequal counts alone are no
error: a rank may run extra forwards that it never back-propagates (a loss term of its own, a forward logged
with grad enabled), as under DDP.
On CPU the exchange is a few microseconds; on an accelerator it is one host sync per backward.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ._lifecycle import EngineState, Lifecycle
from ._names import named_parameters
from ._policy import StagePolicy
from ._user_frames import user_stacklevel

if TYPE_CHECKING:
    from ._stage3 import Stage3Runtime
    from .engine import Engine


# Every engine's routing in this process, so that a gradient arriving outside its engine's backward can say
# whether another engine's backward sent it.
_LIVE_ROUTINGS: weakref.WeakSet[GradientRouting] = weakref.WeakSet()


def _stray_gradient_message(routing: GradientRouting, name: str) -> str:
    """Why parameter ``name`` of ``routing``'s engine got a gradient outside that engine's backward, and the fix.
    A loss that reaches a second engine's parameters (a GAN's generator loss computed through the
    discriminator) is the usual cause besides a plain ``loss.backward()``: torch would accumulate those
    gradients into ``.grad``; here they would belong to no reduction of their engine, so they are refused."""
    nothing_lost = "nothing was accumulated: the engine's gradients are as they were"
    if any(other is not routing and other.lifecycle.state is EngineState.BACKWARD for other in list(_LIVE_ROUTINGS)):
        return (f"parameter {name!r} of one zerocore engine got a gradient in another engine's backward(): the loss "
                "reaches this engine's parameters (for example a GAN generator's loss computed through the "
                "discriminator). Turn their gradients off for that backward (requires_grad_(False) on this "
                "engine's parameters before its forward, and back on after, as DeepSpeed's GAN tutorial does), "
                "or detach what flows into this engine; to train both from one loss, wrap both models in one "
                f"engine ({nothing_lost})")
    return (f"parameter {name!r}, managed by zerocore, got a gradient outside engine.backward(); call "
            "engine.backward(loss) instead of loss.backward(), so gradients are scaled, reduced and sharded "
            f"({nothing_lost})")


class GradientRouting:
    """Each managed parameter's way from autograd to the reducer: the hooks that reject a stray
    ``loss.backward()`` and hand every accumulated gradient on, and the state of the backward in progress
    (``reducing``: whether it reduces across ranks; ``finalized``: whether its reductions were all launched)."""

    def __init__(self, lifecycle: Lifecycle, policy: StagePolicy, stage3: Stage3Runtime | None, reducer: Any,
                 param_slots: list[tuple[Any, int]]) -> None:
        self.lifecycle = lifecycle
        self.policy = policy
        self.stage3 = stage3
        self.reducer = reducer
        self.param_slots = param_slots  # (buffer, index in buffer) by the reducer's global parameter index
        self._buffers = list({id(buffer): buffer for buffer, _ in param_slots}.values())
        self.reducing = False
        self.finalized = True
        # stages 1-2, until the first clean reducing backward: launch in the order rank 0 completed the buckets
        # then (Note [Bucket launch order]). Stage 3 keeps the reverse layout order: a unit is one bucket, and its
        # reductions interleave with the backward's gathers (Note [Parameters this backward will not reach]).
        self.learns_launch_order = not policy.params_sharded
        # which parameters got a gradient on this rank since the window began (Note [Parameters without gradients])
        self.got_grad = bytearray(len(param_slots))
        self._pinned_flags: torch.Tensor | None = None
        self._managed_ids: set[int] | None = None
        self._managed_names: set[str] = set()
        self._warned: set[str] = set()  # parameters warn_untrained named already
        self._grad_accumulators: list[Any] = []
        self._last_got_grad: bytearray | None = None  # got_grad as the last completed backward left it
        # stages 2-3 accumulating in fp32: gradients wait in fp32 sums since a backward inside no_sync() (Note
        # [fp32 gradient accumulation]); the same on every rank, since every rank runs the same backwards
        self._holds_apart = any(buffer.grads_held_apart and buffer.grad_shard is not None
                                for buffer, _ in param_slots)
        self._held_since_reduction = False
        self._behind: dict[int, Any] = {}  # stage 3: buffers of the units whose backward began, not settled yet
        self._outer_task: int | None = None  # the graph task of engine.backward's own loss.backward()
        self._indices_of_buffer: dict[int, list[int]] = {}
        for index, (buffer, _) in enumerate(param_slots):
            self._indices_of_buffer.setdefault(id(buffer), []).append(index)
        if stage3 is not None:
            stage3.before_backward_gather = self.settle_units_behind
        self._register_hooks()

    def _register_hooks(self) -> None:
        routing_ref = weakref.ref(self)
        self._hook_handles = []
        self._post_hooks: list[tuple[torch.Tensor, int]] = []  # (parameter, id of the engine's hook on it)

        def before_accumulation(grad_outputs: Any, name: str) -> None:
            routing = routing_ref()
            if routing is not None and routing.lifecycle.state is not EngineState.BACKWARD:
                raise RuntimeError(_stray_gradient_message(routing, name))

        _LIVE_ROUTINGS.add(self)
        for index, (owner, local) in enumerate(self.param_slots):
            param = owner.params[local]
            # The parameter's gradient accumulator runs only when a backward accumulates into .grad (not for
            # torch.autograd.grad); its pre-hook rejects a stray loss.backward() before anything accumulates.
            with torch.enable_grad(), torch._C.DisableTorchFunctionSubclass():  # reads no values of a sharded param
                accumulator = param.view_as(param).grad_fn.next_functions[0][0]
            self._hook_handles.append(accumulator.register_prehook(
                functools.partial(before_accumulation, name=owner.names[local])))
            self._grad_accumulators.append(accumulator)  # keeps the node (and so its hook) alive

            def hook(p: torch.Tensor, index: int = index) -> None:
                routing = routing_ref()
                if routing is not None:
                    routing.on_grad_ready(index, p)

            handle = param.register_post_accumulate_grad_hook(hook)
            self._hook_handles.append(handle)
            self._post_hooks.append((param, handle.id))

    def remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._post_hooks = []
        self._grad_accumulators = []

    def _run_engine_hooks_last(self) -> None:
        """A user's ``register_post_accumulate_grad_hook`` added after ``initialize`` runs before the engine's
        (which takes ``.grad`` away), so it sees and can change the gradient as under DDP, whose reducer reads
        it after every tensor hook. Torch calls a tensor's hooks in their dict's insertion order, read at call
        time (the underlying dict's: ``OrderedDict.move_to_end`` would not change it, a re-insertion does)."""
        for param, hook_id in self._post_hooks:
            hooks = param._post_accumulate_grad_hooks
            if hooks is not None and next(reversed(hooks)) != hook_id:
                hooks[hook_id] = hooks.pop(hook_id)

    def begin(self, reducing: bool) -> None:
        """A backward starts; ``reducing``: it reduces the gradients across ranks."""
        self._run_engine_hooks_last()
        self.reducing = reducing
        self.finalized = not reducing and self.stage3 is None
        self._behind.clear()
        self._outer_task = None
        if reducing:
            # fp32 sums are reduced in fp32, not rounded to a 16-bit wire (every rank decides alike)
            self.reducer.begin_backward(self._reductions_add(), full_width=self._held_since_reduction)
            self._held_since_reduction = False
        elif self._holds_apart:
            self._held_since_reduction = True

    def launch_order_proposal(self) -> list[int] | None:
        """What this rank sends with the backward outcome exchange for the launch order to learn (Note [Bucket
        launch order] in ready_tracker.hpp): the order its reducing backward completed the buckets in, once all
        are (rank 0's is the one taken); None when nothing is learned (the same on every rank)."""
        if not (self.learns_launch_order and self.reducing):
            return None
        order = list(self.reducer.completion_order())
        buckets = len(self.reducer.launch_order)
        return order if len(order) == buckets else [-1] * buckets

    def adopt_launch_order(self, order: list[int]) -> None:
        """Every rank, at the same exchange, with rank 0's completion order: the buckets launch in it from the
        next backward on."""
        if sorted(order) == list(range(len(order))):
            self.reducer.set_launch_order(order)
            self.learns_launch_order = False

    def _reductions_add(self) -> bool:
        """Whether this reducing backward adds to the gradient shards rather than overwriting them: one answer
        for the one reducer, so buffers that disagree (none do: zero_grad covers them all) are settled to zeros
        and added to."""
        adds = [buffer.begin_reducing_backward() for buffer in self._buffers]
        if all(adds) or not any(adds):
            return bool(adds) and adds[0]
        for buffer, buffer_adds in zip(self._buffers, adds):
            if not buffer_adds and buffer.grad_shard is not None:
                buffer.grad_shard.zero_()
        return True

    def warn_untrained(self, module: torch.nn.Module) -> None:
        """A parameter frozen when ``initialize`` ran is not the engine's: unfrozen since, it gets gradients
        that no step uses. Said once per parameter, at the step (torch's optimizer would skip it silently)."""
        if self._managed_ids is None:
            self._managed_ids = {id(buffer.params[local]) for buffer, local in self.param_slots}
            self._managed_names = {buffer.names[local] for buffer, local in self.param_slots}
        for name, param in named_parameters(module):
            if param.grad is not None and id(param) not in self._managed_ids and name not in self._warned:
                self._warned.add(name)
                why = ("is a new Parameter object, set after zerocore.initialize (module.weight = nn.Parameter(...), "
                       "load_state_dict(assign=True)): the engine trains the one it was built with. Write new values "
                       "into the existing parameter instead (load_state_dict without assign, or copy_ under "
                       "torch.no_grad())" if name in self._managed_names else
                       "did not require grad when zerocore.initialize ran, or was added to the model after it, so the "
                       "engine holds no optimizer state for it. Unfreeze (or add) it before initialize, or build a "
                       "new engine, to train it")
                warnings.warn(f"parameter {name!r} has a gradient but is not trained: it {why}", RuntimeWarning,
                              stacklevel=user_stacklevel())

    def start_window(self) -> None:
        """An accumulation window begins (zero_grad): no parameter has a gradient yet."""
        self.got_grad = bytearray(len(self.param_slots))
        self._held_since_reduction = False

    def got_grad_on(self, device: torch.device) -> torch.Tensor:
        """``got_grad`` as float64 on ``device``, without a host sync (through a pinned buffer to a GPU: a copy
        from pageable memory would wait for the device)."""
        flags = torch.frombuffer(self.got_grad, dtype=torch.uint8) if self.got_grad else torch.zeros(0, dtype=torch.uint8)
        if device.type == "cpu":
            return flags.double()
        if self._pinned_flags is None:
            self._pinned_flags = torch.empty(flags.numel(), dtype=torch.uint8, pin_memory=True)
        self._pinned_flags.copy_(flags)  # the previous step's copy from it was waited for by that step's verdicts
        return self._pinned_flags.to(device, non_blocking=True).double()

    def names_without_grad(self, got_grad_anywhere: list[float]) -> frozenset[str]:
        """The parameters whose entry of ``got_grad`` summed over the ranks is zero: no rank's backward in
        this window gave them a gradient."""
        return frozenset(buffer.names[local] for (buffer, local), count in zip(self.param_slots, got_grad_anywhere)
                         if count == 0)

    def mark_got_grad(self, buffer: Any, local: int) -> None:
        """Parameter ``local`` of ``buffer`` has a gradient in this window (one set by hand: ``safe_set_full_grad``)."""
        self.got_grad[next(i for i, (b, j) in enumerate(self.param_slots) if b is buffer and j == local)] = 1

    def on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        self.got_grad[index] = 1
        buffer, local = self.param_slots[index]
        grad = param.grad
        if buffer.grad_buffer is not None:
            # .grad accumulates in place in the gradient buffer across micro-steps; the first gradient after
            # zero_grad (or one the user set) arrives as a fresh tensor and moves into the buffer first. Held
            # apart (Note [fp32 gradient accumulation]), it is added into its fp32 slot and dropped.
            grad = buffer.take_grad(local, grad)
            param.grad = None if buffer.grads_held_apart else grad
        elif buffer.grads_held_apart:
            if self.reducing:
                grad = buffer.take_held(local, grad)
            else:
                buffer.hold_grad(local, grad)
                param.grad = None
        if self.reducing:
            self._reduce(index, grad)
            # Its values now live in the reduction bucket (Note [Sharded buffer]); in stage 1 the buffer stays,
            # but once reduce-scattered a rank holds the average of its own shard only: a .grad left pointing
            # there would mix reduced and local values (a clip_grad_norm_ over it would differ per rank).
            param.grad = None
        if self.stage3 is not None:
            self.stage3.grad_ready(buffer, index)

    # Note [Parameters this backward will not reach]
    # ----------------------------------------------
    # Stage 3 reduce-scatters a unit's gradients as soon as they are all in, between the backward's gathers of
    # the units before it, on the same ordered collectives. A parameter that this rank's backward never
    # reaches (an expert no token of this rank went to, inside a layer that is the unit; a parameter frozen
    # after initialize) would hold its unit's reduction back to the end of the backward on this rank only,
    # while a rank whose tokens reached every expert launches it at once: the two ranks' collectives would
    # then come in different orders (a shared-memory "different collectives" error, a hang or mixed buffers
    # on other transports). So before each unit's backward gathers, the units whose backward began before it
    # (the same ones on every rank: their outputs' gradients arrived) settle their parameters whose gradient
    # accumulator the running graph will not run, as the end of the backward would settle them (with what
    # no_sync() accumulated for them, else zeros). In a model whose units run one after another, a unit's
    # backward is over when the one before it begins (its gradients in, also those of a reentrant activation
    # checkpoint inside it, whose recomputation runs a backward of its own before the gradients flow on), so
    # every rank launches that unit's reduction before the same gather: on a rank that reached every
    # parameter, after its last gradient; elsewhere, here. What the running graph still runs is left to arrive.
    # Inside a reentrant checkpoint's own backward nothing is settled (that graph does not show what the outer
    # one will still run): a model checkpointed whole block by block with use_reentrant=True settles at the end
    # of the backward, as before, so its ranks must reach the same experts (use_reentrant=False does not).
    # A backward that does not reduce (inside no_sync()) settles the same parameters for the unit's release
    # only: without it a unit would stay gathered to the end of the backward on the ranks whose batch missed
    # one of its experts (memory: with experts in every layer, most of the model) and be released at once on
    # the others, and what the backward gathers next must not depend on that (Note [Stage 3 prefetch plan]).
    def backward_root(self, loss: torch.Tensor) -> Any:
        """Stage 3: ``loss``, about to be back-propagated, names its graph task as the outer one when the backward
        starts (a tensor hook on the root runs first); returns the hook's handle, for removal after."""
        def outer(grad: torch.Tensor) -> None:
            self._outer_task = torch._C._current_graph_task_id()

        return loss.register_hook(outer) if self.stage3 is not None and loss.requires_grad else None

    def settle_units_behind(self, unit: Any) -> None:
        """Stage 3, ``unit``'s backward begins and is about to gather (Note [Parameters this backward will not
        reach]). Only in the outer graph: a reentrant checkpoint's recomputation runs a backward of its own, which
        cannot tell what the outer one will still run (the model's root, say: its head's gradients came first,
        its embedding's come last)."""
        if (not self.finalized and self._behind and self._outer_task is not None
                and torch._C._current_graph_task_id() == self._outer_task
                and not torch._C._are_functorch_transforms_active()):
            for buffer in self._behind.values():
                self._settle_unreachable(buffer)
            self._behind.clear()
        if unit.buffer is not None and unit.buffer.params:
            self._behind[id(unit.buffer)] = unit.buffer

    def _settle_unreachable(self, buffer: Any) -> None:
        for index in self._indices_of_buffer.get(id(buffer), ()):
            if torch._C._will_engine_execute_node(self._grad_accumulators[index]):
                continue
            if self.reducing:
                if self.reducer.is_marked(index):
                    continue
                if not self._reduce_local_gradient(index):  # nothing accumulated: zeros, as finalize fills them
                    shape = buffer.params[self.param_slots[index][1]].shape
                    self.reducer.mark_ready(index, torch.zeros(shape, dtype=buffer.dtype, device=buffer.device))
            self.stage3.grad_ready(buffer, index)

    def _reduce(self, index: int, grad: torch.Tensor) -> None:
        """Hands parameter ``index``'s gradient to the reducer."""
        buffer, local = self.param_slots[index]
        if self.finalized:
            raise RuntimeError(f"parameter {buffer.names[local]!r} produced a gradient after the backward was "
                               "finalized")
        try:
            self.reducer.mark_ready(index, grad)
        except RuntimeError as error:
            if "marked ready twice" not in str(error):
                raise
            # DDP refuses this too ("mark a variable ready only once"); the index alone names nothing
            raise RuntimeError(
                f"parameter {buffer.names[local]!r} got its gradient twice in one backward: its gradient "
                "accumulator ran in two separate autograd passes. The usual cause is activation checkpointing "
                "with use_reentrant=True (what Hugging Face's gradient_checkpointing_enable() uses unless "
                "told otherwise) around a module that runs more than once per step (a shared layer, two "
                "forwards summed into one loss): use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
            ) from error

    def finalize(self) -> None:
        if self.finalized:
            return
        self._last_got_grad = bytearray(self.got_grad)
        if self.reducing:
            self._reduce_accumulated_gradients()
            self.reducer.finalize()
        if self.stage3 is not None:
            self.stage3.end_backward()
        self.finalized = True

    def play_out_backward(self) -> None:
        """Stage 3, this rank's backward raised part-way: the collectives its peers' backward still issues are
        issued here too (Note [A backward that raised on one rank] in _stage3.py), the missing gradients as zeros."""
        if self.stage3 is None:
            return
        pending = list(self.reducer.unmarked_params()) if self.reducing and not self.finalized else []
        unmarked = set(pending)
        due: dict[int, list[int]] = {}  # by unit, for the walk without a record of events
        for index in pending:
            if self._last_got_grad is None or self._last_got_grad[index]:
                buffer, _ = self.param_slots[index]
                due.setdefault(id(self.stage3.unit_of_buffer(buffer)), []).append(index)

        def settle_param(index: int) -> None:
            buffer, local = self.param_slots[index]
            if index in unmarked:
                unmarked.discard(index)
                param = buffer.params[local]
                self.reducer.mark_ready(index, torch.zeros(param.shape, dtype=buffer.dtype, device=buffer.device))
            self.stage3.grad_ready(buffer, index)

        def settle(unit: Any) -> None:
            for index in due.pop(id(unit), []):
                settle_param(index)

        self.stage3.play_out_backward(settle, settle_param)

    def land_started_reductions(self) -> None:
        """A backward raised part-way: the reductions it started complete (finalize launches the buckets it
        never filled, so every rank's bucket sequence matches; Note [Backward outcome])."""
        if self.reducing and not self.finalized:
            self.finalized = True
            self.reducer.finalize()

    def _reduce_accumulated_gradients(self) -> None:
        """A parameter that got no gradient in this reducing backward may still hold one accumulated
        locally (earlier accumulation micro-steps of stage 1, or no_sync() backwards): it is reduced too,
        as DDP does, instead of counting as zero."""
        for index in self.reducer.unmarked_params():
            self._reduce_local_gradient(index)

    def _reduce_local_gradient(self, index: int) -> bool:
        """Hands the reducer what parameter ``index`` accumulated on this rank in the window (stage 1's buffer,
        no_sync() backwards), if anything; returns whether there was something."""
        buffer, local = self.param_slots[index]
        param = buffer.params[local]
        grad = buffer.grad_or_zeros(local) if buffer.grad_buffer is not None else buffer.take_held(local, param.grad)
        if grad is None:
            return False
        self.reducer.mark_ready(index, grad)
        param.grad = None
        return True


def exchanges_outcome(policy: StagePolicy, no_sync: bool) -> bool:
    """Every backward outside no_sync(), and every stage-3 backward (its gathers are collectives even inside
    no_sync()): Note [Backward outcome]."""
    return not no_sync or policy.params_sharded


def exchange_backward_outcome(engine: Engine, failed_here: bool) -> tuple[list[int], list[int], list[int]]:
    """One tiny all-reduce of which ranks raised in this backward, how many training forwards each ran since
    the last exchange and which ranks had one of them raise (Note [Backward outcome]); returns the ranks
    that raised in the backward, the counts by rank, and the ranks whose forward raised."""
    world = engine.world_size
    life = engine.lifecycle
    proposal = engine.gradients.launch_order_proposal()  # (until the launch order is learned: rank 0's rides along)
    flags = torch.zeros(3 * world + (0 if proposal is None else len(proposal)), dtype=torch.float64,
                        device=engine.device)
    if failed_here:
        flags[engine.rank] = 1.0
    flags[world + engine.rank] = float(life.forwards)
    flags[2 * world + engine.rank] = float(life.forward_raised)
    if proposal and engine.rank == 0:
        flags[3 * world:] = torch.tensor(proposal, dtype=torch.float64)
    life.forwards, life.forward_raised = 0, False
    engine.comm.all_reduce(flags, False).wait()
    if engine.device.type != "cpu":
        engine.host_syncs += 1
    values = flags.tolist()
    failed = [rank for rank, flag in enumerate(values[:world]) if flag > 0]
    raised = [rank for rank, flag in enumerate(values[2 * world:3 * world]) if flag > 0]
    if proposal is not None and not failed and not raised:
        engine.gradients.adopt_launch_order([int(v) for v in values[3 * world:]])
    return failed, [int(v) for v in values[world:2 * world]], raised


def outcome_problem(failed: list[int], forwards: list[int], forward_raised: list[int]) -> str | None:
    """What a backward outcome exchange found wrong (Note [Backward outcome]), or None."""
    if failed:
        in_forward = [rank for rank in failed if rank in forward_raised]  # (Engine._play_out_forward)
        in_backward = [rank for rank in failed if rank not in forward_raised]
        what = " and ".join(
            [f"rank(s) {in_forward} raised an exception in this batch's forward"] * bool(in_forward)
            + [f"rank(s) {in_backward} raised an exception in this backward"] * bool(in_backward)
        ) + ", so their gradients are missing"
    elif forward_raised:
        counts = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(forwards))
        what = (f"a training forward raised on rank(s) {forward_raised} since the last backward exchange, where "
                "no collective answered it (inside no_sync(), which exchanges nothing at once, or by a "
                "KeyboardInterrupt, which reaches the ranks at different points), so this window holds a batch that "
                "some ranks "
                + (f"skipped and the ranks ran different numbers of training forwards ({counts}): this backward "
                   "paired different batches across ranks" if len(set(forwards)) > 1 else "skipped"))
    else:
        return None
    return (f"{what}: this accumulation window's gradients were dropped on every rank and the engine is ready for "
            "the window's first forward again. If a rank skips a batch after an error, every rank must skip it "
            "(catch the error on every rank).")
