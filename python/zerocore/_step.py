"""The accumulation boundary's update: one collective for every verdict of the step (the global gradient
norm for clipping, the fp16 overflow, parameters written on some ranks only, an unreadable NVMe state file,
an unusable hyperparameter on some rank, stage 3's deferred divergence checks), the fused Adam update with
stages 1-2's all-gathers behind it, and the NVMe I/O verdicts that every rank learns alike (Note [Engine
lifecycle] in engine.py).

Note [Writes to parameters]
---------------------------
A user may write to parameters in place between steps (``model.load_state_dict``, ``nn.init.*``,
``fill_``) wherever the parameters hold their full values (stages 1-2 always; stage 3 units kept
gathered). Such a write moves the parameter's autograd version counter, which the engine's own writes
(through the flat buffer and its views) never touch; at the next step every buffer whose parameters moved
takes the written values into its shard and fp32 master (``ShardedBuffer.absorb_param_writes``) before the
update, so the write is trained from instead of reverted. Whether any rank absorbed a write travels with the
norm all-reduce: a write made on some ranks only (``if rank == 0: model.load_state_dict(...)``) would leave
the ranks' shards inconsistent, so it raises on every rank, naming ``zerocore.gathered(..., modifier_rank=)``.
A write every rank makes must also be the same write: each rank keeps only its own shard of it, so ranks
writing different values (``nn.Embedding(max_norm=)`` renormalizing the rows each rank's batch looked up)
would leave a mix whose makeup depends on the sharding. Each write's values are fingerprinted (CRC-32C per
parameter, ``ParamWrites._fingerprint_written``: at the step for stages 1-2, when a stage-3 unit is released
for its forward's writes), and when every rank wrote, a second exchange (on such steps only) compares them:
a difference raises on every rank, naming the parameters, after the parameters are gathered again from the
shards so that every rank holds the same values. A sharded stage-3 parameter cannot be written (Note
[Sharded placeholders]).

Note [Writes through .data]
---------------------------
``p.data.copy_(ema)`` or ``p.data.clamp_()`` writes without moving ``p``'s version counter (``.data`` is a
new tensor with its own), and ``p.data = t`` gives the parameter other storage. The second is noticed by
storage (``ShardedBuffer.reattach_rebound``). The first needs the values: where the parameters are the
master (fp32 at stages 1-2) nothing is lost; where 16-bit parameters sit beside an fp32 master (stages 1-2),
every element of this rank's shard that no longer equals its master's rounding was written, and each step
the master takes those (``OptimizerState.absorb_untracked_writes``), as it takes version-tracked writes; with
the master on NVMe or in host memory beside a GPU's parameters, the step does the same as each piece of
state comes to hand (inside the NVMe pipeline, after a sub-group's read; on the host copy of a GPU shard), so
no extra pass over the state. A stage-3 unit kept gathered is compared with its shard, bit for bit. Every rank
checks its own shard, so such writes do not enter the some-ranks-only verdict above. Not seen: writes through
``.data`` to a stage-3 unit gathered through qwZ (its values are quantized) or whose shard is on NVMe
(``offload_param``); write those under ``torch.no_grad()`` without ``.data``, or inside
``zerocore.gathered(..., modifier_rank=0)``. ``p.data = t`` on a stage-3 parameter at rest is refused when its
unit is next gathered (``ShardedBuffer.attach_views``): kept, the release would make a swap meant to be undone
permanent; replaced, the values would be lost without a word.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._model_checks import all_gather_json, check_group_hyperparameters
from ._user_frames import user_stacklevel

if TYPE_CHECKING:
    from .engine import Engine

_log = logging.getLogger("zerocore")


def boundary_update(engine: Engine, record_norm: Callable[[float], None]) -> None:
    """Engine.apply_update's body: one all-reduce of the gradients' sum of squares, the written-parameter
    flag, the NVMe state's readability, stage 3's divergence verdict and which parameters got a gradient, then
    the update (or the fp16 overflow skip). ``record_norm`` takes the step's global gradient norm (inf when the
    update was skipped)."""
    fp16 = engine.config.fp16.enabled
    # The gradients were produced with the scale in effect now: unscale with it before update() moves it.
    grad_scale = 1.0 / engine.loss_scaler.scale if fp16 else 1.0
    engine.gradients.warn_untrained(engine.module)
    engine.absorb_param_writes()
    written = engine.take_write_fingerprints()  # stage 3 units released mid-forward absorbed theirs already
    for buffer in engine.buffers:
        buffer.settle_grads()  # a step with no backward since zero_grad reads zeros (Note [Gradient slots start stale])
    sum_of_squares = engine.optimizer_state.grad_sum_of_squares()
    store = engine.optimizer_state.store
    unusable = store.check_whole() if store is not None else None  # NVMe: checked before anything changes
    bad_group = hyperparameter_problem(engine)
    # filled in place (torch.tensor(list, device=...) would copy from pageable memory: a second host sync)
    verdicts = torch.zeros(4, dtype=torch.float64, device=sum_of_squares.device)
    verdicts[0] = sum_of_squares
    verdicts[1] = float(bool(written))
    verdicts[2] = float(unusable is not None)
    verdicts[3] = float(bad_group is not None)
    if engine.stage3 is not None:  # deferred divergence checks travel with the norm (Note [Divergence tags])
        verdicts = torch.cat([verdicts, engine.stage3.divergence.verdict().reshape(1).double()])
    # which parameters got a gradient on any rank (Note [Parameters without gradients]), last
    flags_at = verdicts.numel()
    verdicts = torch.cat([verdicts, engine.gradients.got_grad_on(verdicts.device)])
    engine.comm.all_reduce(verdicts, False).wait()
    values = verdicts.tolist()
    engine.host_syncs += 1
    without_grad = engine.gradients.names_without_grad(values[flags_at:])
    if engine.stage3 is not None:
        engine.stage3.divergence.end_step(values[4] > 0, engine.stage3.step)
    if values[3] > 0:  # before anything moves (the loss scale included); engine.step() drops the gradients
        _end_window(engine)
        raise ValueError(f"the step was refused on every rank, nothing changed: "
                         f"{bad_group or f'{int(values[3])} other rank(s) hold an unusable hyperparameter'}")
    if values[2] > 0:
        raise OSError(f"offload_optimizer: the step was refused on every rank, nothing changed: "
                      f"{unusable or f'{int(values[2])} other rank(s) cannot read their optimizer state file'}")
    if 0 < values[1] < engine.world_size:
        raise RuntimeError(
            f"parameters were written in place (load_state_dict, nn.init, fill_, ...) on {int(values[1])} of "
            f"{engine.world_size} ranks only (this rank: {'yes' if written else 'no'}): their shards now disagree. "
            "Write on every rank, or write on one inside `with zerocore.gathered(params, modifier_rank=r):`, "
            "which sends rank r's values to every rank; then reload the model's state on every rank.")
    if values[1] > 1:  # every rank wrote: the same values? (only then: a second collective on write steps alone)
        differ = _differently_written(engine, written)
        if differ:
            _end_window(engine)
            engine.reload_params_from_shards()  # every rank holds the same values again: each shard's owner's
            raise RuntimeError(
                f"parameters were written in place with different values on different ranks ({differ}): each "
                "rank keeps only its own shard of a write, so the model now holds a mix of the ranks' values "
                "(the same on every rank; the update was not applied). nn.Embedding(max_norm=...) does this: it "
                "renormalizes the rows each rank's batch looked up. Renormalize on every rank alike instead (e.g. "
                "the whole weight after the step), or write on one rank inside `with zerocore.gathered(params, "
                "modifier_rank=r):`; load a checkpoint to undo the writes.")
    total = values[0]
    fp16_wire = engine.config.reduce_dtype == torch.float16
    overflow = (fp16 or fp16_wire or engine.config.check_grad_overflow) and not math.isfinite(total)
    if fp16:
        engine.loss_scaler.update(overflow)
    if overflow:
        engine.skipped_steps += 1
        record_norm(float("inf"))
        if not fp16:  # no loss scale to lower: say why the update was skipped (the norm is on the host already)
            why = ("gradients overflowed in the fp16 reduction (communication_data_type: fp16, max 65504); with "
                   "bf16 or fp32 compute set communication_data_type to bf16 or fp32" if fp16_wire else
                   f"the global gradient norm is {math.sqrt(total)} (a NaN or inf loss or gradient on some rank); "
                   "DeepSpeed skips such a step too (bf16.check_grad_overflow: false applies it, as torch's AdamW "
                   "does, and the parameters become non-finite)")
            warnings.warn(f"step {engine.global_steps}: the update was skipped: {why}", RuntimeWarning,
                          stacklevel=user_stacklevel())
    else:
        norm = math.sqrt(total) * grad_scale
        record_norm(norm)
        if not math.isfinite(norm):  # the norm is on the host already: saying so costs nothing
            warnings.warn(
                f"step {engine.global_steps + 1}: the global gradient norm is {norm} (a "
                "NaN or inf loss or gradient on some rank); the update is applied (bf16.check_grad_overflow: "
                "false), as torch's AdamW applies it, so the parameters become non-finite. Skip such batches "
                "before backward(), or lower the learning rate", RuntimeWarning, stacklevel=user_stacklevel())
        hand_clipped = engine.optimizer_state.hand_clip is not None  # Note [Clipping by hand]
        clip = 0.0 if hand_clipped else engine.config.gradient_clipping
        if clip > 0:
            grad_scale *= min(1.0, clip / (norm + 1e-6))
        update_and_gather(engine, grad_scale, without_grad)
        if store is not None or engine.param_file is not None:
            check_offload_io(engine, store)
    _end_window(engine)
    log_progress(engine)


def _end_window(engine: Engine) -> None:
    """The accumulation window's forward/backward is over, updated or refused: stage 3's gathered copies go
    (the shards may have changed)."""
    if engine.stage3 is not None:
        engine.stage3.end_forward_backward_step()


def hyperparameter_problem(engine: Engine) -> str | None:
    """What is wrong with this rank's ``optimizer.param_groups`` (an lr set to NaN by hand or driven to inf by a
    scheduler, a group's params edited), or None. Groups are per rank, so the verdict travels with the step's
    all-reduce: raising here on one rank alone would leave the others waiting in that collective."""
    changed = engine.optimizer.layout_problem()
    if changed is not None:
        return changed
    try:
        check_group_hyperparameters(engine.optimizer.param_groups, where="optimizer.param_groups")
    except ValueError as error:
        return str(error)
    return None


def agree_on_state_files(engine: Engine) -> None:
    """Every rank learns whether every rank made its NVMe files (optimizer state, parameter shards); all
    raise alike if one could not (a path missing on one node, one full disk), instead of the others going
    on into a collective."""
    error = engine.optimizer_state.init_failure or (engine.param_file.failure if engine.param_file else None)
    failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=engine.device)
    engine.comm.all_reduce(failed, False).wait()
    if failed.item() > 0:
        engine.optimizer_state.close()
        if engine.param_file is not None:
            engine.param_file.close()
        if error is not None:
            raise error
        raise OSError(f"zero_optimization: {int(failed.item())} of {engine.world_size} ranks could not create "
                      "their NVMe files under nvme_path (their error names the key and the path); this "
                      "rank's files are removed")


def check_offload_io(engine: Engine, store: Any) -> None:
    """After an NVMe step, every rank learns whether any rank's I/O failed (optimizer state or parameter
    shards; each still issued every collective of the step, Note [NVMe optimizer state]); then all raise
    alike."""
    here = (store.failure if store is not None else None) or (
        engine.param_file.step_failure if engine.param_file is not None else None)
    failed = torch.tensor([float(here is not None)], dtype=torch.float64, device=engine.device)
    engine.comm.all_reduce(failed, False).wait()
    engine.host_syncs += 1
    if failed.item() > 0:
        raise OSError(f"offload: the NVMe I/O of the step failed on {int(failed.item())} of "
                      f"{engine.world_size} ranks during step {engine.global_steps}, so the parameters are now "
                      "partly updated; load the last checkpoint to go on. This rank: "
                      f"{here or 'its I/O succeeded'}")


def _differently_written(engine: Engine, written: dict[str, int]) -> str:
    """The parameters whose written values differ between ranks, as text ('' when none)."""
    everyone = all_gather_json(engine.comm, written, engine.device)
    names = sorted({name for prints in everyone for name in prints
                    if len({str(p.get(name)) for p in everyone}) > 1})
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def update_and_gather(engine: Engine, grad_scale: float, without_grad: frozenset[str] = frozenset()) -> None:
    """The Adam update of every shard; in stages 1-2 each bucket's all-gather starts as soon as its shard
    is updated (so it travels while the next shard computes) and is still in flight on return: the next
    forward overlaps it, each parameter waiting for its bucket's gather on its first read (Note [Gathers land
    on first read]), with at most ``allgather_bucket_size`` elements in flight when it is set. Stage 3
    starts the gathers the next forward begins with (Note [Gathers started in the step]) and gathers every
    other unit when it is next used."""
    if engine.policy.params_sharded:
        engine.optimizer_state.step(engine.optimizer.param_groups, grad_scale,
                                    after_shard=engine.stage3.gathers_in_step(), without_grad=without_grad)
    else:
        (buffer,) = engine.buffers  # stages 1-2: the whole model is one buffer, its shard i is bucket i
        cap = engine.buckets.allgather_in_flight

        def gather(bucket: int) -> None:
            buffer.gather_in_background(engine.comm, bucket, "all_gather", cap)

        engine.optimizer_state.step(engine.optimizer.param_groups, grad_scale, after_shard=gather,
                                    without_grad=without_grad)
    for updated in engine.buffers:  # as torch's optimizers do: a graph recorded before the update is stale
        updated.mark_rewritten()


def log_progress(engine: Engine) -> None:
    every = engine.config.steps_per_print
    done = engine.global_steps
    if engine.rank == 0 and done % every == 0 and _log.isEnabledFor(logging.INFO):
        lrs = [group["lr"] for group in engine.optimizer.param_groups]
        _log.info("step %d: skipped %d, lr %s, loss scale %g, grad norm %s", done, engine.skipped_steps, lrs,
                  engine.loss_scaler.scale, engine.get_global_grad_norm())
