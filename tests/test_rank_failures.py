"""One rank's failure reaches every rank as a Python exception (issue 9, item 19; Note [Backward outcome] in
_backward.py): a rank that raised in backward and skips the batch no longer makes its peers' next collectives
mismatch (Gloo aborts the process on that); and frozen parameters pass through zerocore.gathered (item 14)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import zerocore
from zerocore._model_checks import all_gather_json
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class RaiseOnRank(torch.autograd.Function):
    rank_to_fail: int | None = None

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int) -> torch.Tensor:
        ctx.rank = rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.rank == RaiseOnRank.rank_to_fail:
            raise RuntimeError("simulated out-of-memory on this rank")
        return grad, None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 64)
        self.rest = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3)))
        self.rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(RaiseOnRank.apply(torch.tanh(self.first(x)), self.rank))


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))


def _assert_in_lockstep(engine: zerocore.Engine) -> None:
    """Every rank holds the same parameters."""
    state = engine.full_state_dict(rank0_only=False)
    gathered = all_gather_json(engine.comm, {k: v.double().sum().item() for k, v in state.items()},
                               torch.device("cpu"))
    assert all(g == gathered[0] for g in gathered)


def _step_or_note(engine: zerocore.Engine, x: torch.Tensor, seen: list[str]) -> None:
    """One training step, as a user runs it: an error is caught (its first line kept), the batch skipped."""
    try:
        engine.backward(engine(x).square().mean())
        engine.step()
    except RuntimeError as error:
        seen.append(str(error).splitlines()[0])


def one_rank_fails_worker(rank: int, world: int, stage: int, accumulation: int) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    model.rank = rank
    engine = zerocore.initialize(model, {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}})
    seen = []
    for step in range(4 * accumulation):
        RaiseOnRank.rank_to_fail = 0 if step == accumulation else None  # only rank 0, once
        _step_or_note(engine, _x(step, rank), seen)
    _assert_in_lockstep(engine)  # training went on in lockstep afterwards
    return seen


@pytest.mark.parametrize("stage,accumulation", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (3, 2)])
def test_a_backward_error_on_one_rank_raises_on_every_rank(stage, accumulation):
    seen = run_ranks(one_rank_fails_worker, 2, stage, accumulation, timeout=120)
    assert seen[0] == ["simulated out-of-memory on this rank"], seen
    assert len(seen[1]) == 1 and "rank(s) [0] raised an exception in this backward" in seen[1][0], seen


def forward_fails_worker(rank: int, world: int, stage: int, skip_everywhere: bool) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}})
    seen = []
    for step in range(4):  # what a user does: catch the error, skip the batch, go on (every rank loops alike)
        if skip_everywhere and step == 1:
            continue  # the reference: no rank ran batch 1
        try:
            x = torch.randn(4, 7) if rank == 1 and step == 1 else _x(step, rank)  # a bad batch on rank 1 only
            engine.backward(engine(x).square().mean())
            engine.step()
        except RuntimeError as error:
            seen.append(str(error).splitlines()[0] + " | " + " ".join(getattr(error, "__notes__", [])))
    _assert_in_lockstep(engine)
    return {"seen": seen, "state": {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_forward_error_on_one_rank_drops_that_batch_on_every_rank(stage):
    """Rank 1's skipped batch would pair rank 0's backward with rank 1's next batch (and at stage 3 its next
    forward's gathers with rank 0's backward): the rank whose forward raised plays out the backward (Note
    [Backward outcome]), so rank 0's backward of that batch raises naming rank 1 and training goes on as if
    no rank had run the batch."""
    seen = run_ranks(forward_fails_worker, 2, stage, False, timeout=120)
    assert len(seen[0]["seen"]) == 1, seen
    assert "rank(s) [1] raised an exception in this batch's forward" in seen[0]["seen"][0], seen
    assert len(seen[1]["seen"]) == 1 and "mat1 and mat2" in seen[1]["seen"][0], seen
    assert "every rank dropped this accumulation window" in seen[1]["seen"][0], seen
    reference = run_ranks(forward_fails_worker, 2, stage, True, timeout=120)
    assert seen[0]["state"] == seen[1]["state"] == reference[0]["state"]


class SometimesSkips(nn.Module):
    """Blocks every rank runs, except at step 0, where every rank skips block 1 (a LayerDrop draw shared by
    the ranks, a first batch that needs fewer layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = torch.tanh(block(x))
        return x


def order_then_failure_worker(rank: int, world: int, skip_everywhere: bool) -> dict:
    import warnings

    torch.manual_seed(0)
    model = SometimesSkips()
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            model.skip = 1 if step == 0 else None
            if step == 3 and skip_everywhere:
                continue
            x = torch.randn(4, 7) if rank == 1 and step == 3 else _x(step, rank)  # a bad batch on rank 1 only
            _step_or_note(engine, x, seen)
    changed = [str(w.message).split(":")[0] for w in caught if "forward order changed" in str(w.message)]
    _assert_in_lockstep(engine)
    return {"seen": seen, "changed": changed, "state": {k: v.tolist() for k, v in engine.full_state_dict(
        rank0_only=False).items()}}


def test_the_prefetch_order_follows_the_latest_forward_so_a_one_rank_failure_plays_out_the_right_one():
    """The first forward's order used to be the schedule for good: after a first step that skipped a block,
    every later step warned and gathered on demand, and a forward failing on one rank played out the first
    step's order while its peers ran the whole model (mismatched collectives; a hang on some transports)."""
    results = run_ranks(order_then_failure_worker, 2, False, timeout=120)
    for result in results:  # step 1 returns to the whole order, once; then the schedule is the whole order
        assert result["changed"] == ["zerocore stage 3"], result["changed"]
    assert len(results[0]["seen"]) == 1 and "rank(s) [1] raised" in results[0]["seen"][0], results[0]["seen"]
    assert len(results[1]["seen"]) == 1 and "mat1 and mat2" in results[1]["seen"][0], results[1]["seen"]
    reference = run_ranks(order_then_failure_worker, 2, True, timeout=120)
    assert results[0]["state"] == results[1]["state"] == reference[0]["state"]


def no_sync_forward_fails_worker(rank: int, world: int, stage: int, skip_everywhere: bool) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage}})
    seen = []
    for window in range(3):
        if skip_everywhere and window == 1:
            continue
        for micro in range(2):  # the first micro-step accumulates locally, the second reduces and steps
            try:
                with engine.no_sync() if micro == 0 else contextlib.nullcontext():
                    bad = rank == 1 and window == 1 and micro == 0
                    engine.backward(engine(torch.randn(4, 7) if bad else _x(2 * window + micro, rank)).square().mean())
                if micro == 1:
                    engine.step()
            except RuntimeError as error:
                seen.append(str(error).splitlines()[0])
    _assert_in_lockstep(engine)
    return {"seen": seen, "state": {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_forward_error_inside_no_sync_drops_the_window_on_every_rank(stage):
    """Nothing is exchanged inside no_sync() at stages 1-2: the window's synced backward tells every rank that a
    forward raised in it, instead of stepping with rank 0's two batches and rank 1's one."""
    seen = run_ranks(no_sync_forward_fails_worker, 2, stage, False, timeout=120)
    assert len(seen[0]["seen"]) == 1 and "a training forward raised on rank(s) [1]" in seen[0]["seen"][0], seen
    assert len(seen[1]["seen"]) == 2 and "mat1 and mat2" in seen[1]["seen"][0], seen
    assert "a training forward raised on rank(s) [1]" in seen[1]["seen"][1], seen
    reference = run_ranks(no_sync_forward_fails_worker, 2, stage, True, timeout=120)
    assert seen[0]["state"] == seen[1]["state"] == reference[0]["state"]


def extra_forward_worker(rank: int, world: int, stage: int, extra: bool) -> dict[str, list[float]]:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}})
    for step in range(3):
        loss = engine(_x(step, rank)).square().mean()
        if extra and rank == 0:  # a forward this rank alone runs with grad enabled and never back-propagates (logging)
            engine(_x(step + 10, rank)).sum().item()
        engine.backward(loss)
        engine.step()
    return {k: v.flatten().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_an_extra_forward_on_one_rank_that_raised_nothing_trains_on(stage):
    """Unequal forward counts alone are no error (Note [Backward outcome]): the backwards still pair the same
    batches, and training equals the run without the extra forward."""
    extra = run_ranks(extra_forward_worker, 2, stage, True, timeout=120)
    assert extra == run_ranks(extra_forward_worker, 2, stage, False, timeout=120)
    assert extra[0] == extra[1]


@pytest.mark.parametrize("stage", [1, 2])
def test_failures_in_no_sync_raise_only_where_they_happen(stage):
    """Inside no_sync() nothing is exchanged (no communication, as documented): the failing rank raises."""
    seen = run_ranks(no_sync_failure_worker, 2, stage)
    assert seen == [["simulated out-of-memory on this rank"], []], seen


def no_sync_failure_worker(rank: int, world: int, stage: int) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    model.rank = rank
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage}})
    seen = []
    RaiseOnRank.rank_to_fail = 0
    with engine.no_sync():
        try:
            engine.backward(engine(_x(0, rank)).square().mean())
        except RuntimeError as error:
            seen.append(str(error).splitlines()[0])
    RaiseOnRank.rank_to_fail = None
    engine.backward(engine(_x(1, rank)).square().mean())
    engine.step()
    return seen


def frozen_worker(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage}})
    with zerocore.gathered(model.parameters(), modifier_rank=0):  # DeepSpeed's idiom passes every parameter
        weights = [p.detach().clone() for p in model.parameters()]
    assert all(torch.isfinite(w).all() for w in weights)
    with pytest.raises(ValueError, match="no zerocore engine manages"):
        with zerocore.gathered([nn.Parameter(torch.zeros(3))]):
            pass
    engine.close()
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_passes_frozen_parameters_over(stage):
    assert all(run_ranks(frozen_worker, 2, stage))


class SkipsLastBlockOnRank1(nn.Module):
    """A rank-dependent branch past the first step: rank 1 skips the last block, whose gather was prefetched on
    both ranks, so the ranks' backward collectives differ."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (i == 2 and torch.distributed.get_rank() == 1 and self.calls >= 1):
                x = torch.tanh(block(x))
        self.calls += 1
        return x


def failed_collective_worker(rank: int, world: int) -> list[str]:
    import os
    os.environ["ZEROCORE_SHARED_MEMORY"] = "1"  # the transport that sees the mismatch
    torch.manual_seed(0)
    engine = zerocore.initialize(SkipsLastBlockOnRank1(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    states = []
    for step in range(3):
        try:
            engine.backward(engine(_x(step, rank)).square().mean())
            engine.step()
        except RuntimeError:
            states.append(str(engine.state))
    return states


def test_a_backward_whose_collective_failed_leaves_the_engine_idle_not_in_backward():
    """Its cleanup waited for the failed collectives again and raised before the state machine moved on, so
    every later call said 'backward in progress' instead of the failure."""
    for states in run_ranks(failed_collective_worker, 2, timeout=120, pg_timeout=20):
        assert states and all(s == "EngineState.IDLE" for s in states), states


def failed_gather_worker(rank: int, world: int) -> list[str]:
    from zerocore._stage3_unit import UnitState

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)))
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.backward(engine(_x(0, rank)).square().mean())
    engine.step()
    unit = next(u for u in engine.stage3.units if u.state is UnitState.SHARDED)
    engine.stage3._gather(unit, "all_gather_user")  # in flight, as a prefetch is
    for pending in unit.pending:
        pending.wait()  # landed; now the transport "fails" instead

    class Broken:
        def wait(self) -> None:
            raise RuntimeError("simulated transport failure")

    unit.pending = [Broken()]
    messages = []
    for _ in range(2):  # the second wait is the cleanup's (a release while the first error unwinds)
        try:
            unit.wait()
        except Exception as error:  # noqa: BLE001 - the type is the point
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_a_gather_that_failed_says_so_again_when_the_cleanup_waits_for_it():
    """The backward's cleanup waits for the gathers in flight once more; a gather whose transport had failed
    raised TypeError ('cannot unpack non-iterable NoneType') there instead of naming the failure."""
    first, second = run_ranks(failed_gather_worker, 2)[0]
    assert first == "RuntimeError: simulated transport failure", first
    assert second.startswith("RuntimeError: the gather of unit") and "simulated transport failure" in second, second


def config_worker(rank: int, world: int, case: str) -> str:
    zero = {"stage": 3}
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3}}
    extra = {}
    if rank == 1 and case == "lr":  # each rank would update its own shard with its own lr: a mixed model
        optimizer["params"]["lr"] = 2e-3
    if rank == 1 and case == "stage":  # different collectives from here on
        zero["stage"] = 2
    if rank == 1 and case == "local":  # where a rank logs and keeps its host buffers is its own affair
        extra["steps_per_print"] = 7
        zero["offload_optimizer"] = {"device": "none", "pin_memory": False}
    try:
        engine = zerocore.initialize(Net(), {"optimizer": optimizer, "zero_optimization": zero, **extra})
    except ValueError as error:
        return str(error)
    engine.close()
    return "ok"


@pytest.mark.parametrize("case, key", [("lr", "optimizer.lr"), ("stage", "zero_optimization.stage"), ("local", None)])
def test_ranks_given_different_configs_are_told_which_key_differs(case, key):
    for message in run_ranks(config_worker, 2, case, timeout=120):
        if key is None:
            assert message == "ok", message
        else:
            assert f"config differs between ranks: {key} is" in message and "rank 1" in message, message


class FailingBlock(nn.Module):
    """A stage-3 unit whose backward raises on rank ``RaiseOnRank.rank_to_fail`` when ``fails``, and whose
    forward raises on rank ``forward_fails_on`` when ``fails``."""

    forward_fails_on: int | None = None

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.out = nn.Linear(32, 32)
        self.linear.requires_grad_(not frozen)
        self.fails = False
        self.rank = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(h))
        if self.fails and self.rank == FailingBlock.forward_fails_on:
            raise RuntimeError("simulated bad batch on this rank")
        if self.fails:
            h = RaiseOnRank.apply(h, self.rank)
        return h + self.out(h)


class FailingChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(FailingBlock(frozen=i == 2) for i in range(6))
        self.last = nn.Linear(32, 1)
        self.skipped: set[int] = set()  # blocks this forward leaves out (LayerDrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for i, block in enumerate(self.blocks):
            if i not in self.skipped:
                h = block(h)
        return self.last(h)


def _failing_chain_engine(rank: int, failing_block: int, zero: dict, accumulation: int = 1) -> zerocore.Engine:
    torch.manual_seed(0)
    model = FailingChain()
    for block in model.blocks:
        block.rank = rank
    model.blocks[failing_block].fails = True
    return zerocore.initialize(model, {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}})


def stage3_fails_worker(rank: int, world: int, failing_block: int, zero: dict) -> dict:
    engine = _failing_chain_engine(rank, failing_block, zero)
    seen = []
    for step in range(5):
        RaiseOnRank.rank_to_fail = 0 if step in (0, 3) else None  # rank 0 only: before and after an order is recorded
        _step_or_note(engine, _x(step, rank), seen)
    _assert_in_lockstep(engine)
    return {"seen": seen, "steps": engine.global_steps}


@pytest.mark.parametrize("failing_block", [0, 2, 5])  # 2: a unit of frozen weights
@pytest.mark.parametrize("zero", [{}, {"zero_quantized_weights": True, "zero_hpz_partition_size": 2}],
                         ids=["plain", "zeropp"])
def test_at_stage_3_a_backward_error_on_one_rank_raises_on_every_rank_instead_of_a_hang(failing_block, zero):
    """Note [A backward that raised on one rank]: the failing rank plays out the gathers and reductions its
    peers' backward still issues, then the outcome exchange makes both drop the window and go on in lockstep."""
    results = run_ranks(stage3_fails_worker, 2, failing_block, zero, timeout=60)
    assert results[0]["seen"] == ["simulated out-of-memory on this rank"] * 2, results
    assert len(results[1]["seen"]) == 2 and all("rank(s) [0] raised an exception in this backward" in message
                                                for message in results[1]["seen"]), results
    assert results[0]["steps"] == results[1]["steps"] == 3


def stage3_forward_fails_worker(rank: int, world: int, failing_block: int, zero: dict, accumulation: int,
                                skip_everywhere: bool, manual: bool = False) -> dict:
    engine = _failing_chain_engine(rank, failing_block, zero, accumulation)
    seen = []
    # a window's last micro-step (a window dropped part-way starts over at the next micro-step), the first
    # before an order is recorded
    failing = (accumulation - 1, 4 * accumulation - 1)
    for step in range(5 * accumulation):
        if skip_everywhere and any(f // accumulation * accumulation <= step <= f for f in failing):
            continue  # the reference: no rank ran what the dropped windows held
        FailingBlock.forward_fails_on = 0 if step in failing and not skip_everywhere else None
        boundary = step % accumulation == accumulation - 1
        if manual:  # Accelerate's way: no step() inside the window, so the failing forward follows a backward
            engine.set_gradient_accumulation_boundary(boundary)
        try:
            loss = engine(_x(step, rank)).square().mean()
            if step == 2:  # an evaluation forward raising on rank 1 alone: its peers' gathers are played out
                with torch.no_grad():
                    FailingBlock.forward_fails_on = rank if rank == 1 else None
                    try:
                        engine(_x(step, rank))
                    except RuntimeError as error:
                        seen.append(f"eval: {error}")
                    FailingBlock.forward_fails_on = None
            engine.backward(loss)
            if boundary or not manual:
                engine.step()
        except RuntimeError as error:
            seen.append(str(error).splitlines()[0])
    _assert_in_lockstep(engine)
    return {"seen": seen, "steps": engine.global_steps,
            "state": {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


@pytest.mark.parametrize("failing_block", [0, 2, 5])  # 2: a unit of frozen weights
@pytest.mark.parametrize("zero,accumulation,manual", [
    ({}, 1, False), ({}, 2, False), ({}, 2, True), ({"stage3_prefetch_bucket_size": 10**6}, 1, False),
    ({"zero_quantized_weights": True, "zero_hpz_partition_size": 2}, 1, False)],
    ids=["plain", "accumulation", "manual_boundary", "prefetch_all", "zeropp"])
def test_at_stage_3_a_forward_error_on_one_rank_drops_the_batch_on_every_rank_instead_of_a_hang(
        failing_block, zero, accumulation, manual):
    """Note [A forward that raised on one rank]: the failing rank plays out the rest of its peers' forward
    (gathers, prefetches, releases) and their backward; every rank drops the window, and training goes on as if
    no rank had run it. ``manual``: windows set by set_gradient_accumulation_boundary() without step() inside
    them (Note [Manual accumulation boundary])."""
    results = run_ranks(stage3_forward_fails_worker, 2, failing_block, zero, accumulation, False, manual, timeout=90)
    assert results[0]["seen"] == ["simulated bad batch on this rank"] * 2, results
    first, evaluation, last = results[1]["seen"]
    assert evaluation == "eval: simulated bad batch on this rank", results
    assert all("rank(s) [0] raised an exception in this batch's forward" in m for m in (first, last)), results
    reference = run_ranks(stage3_forward_fails_worker, 2, failing_block, zero, accumulation, True, manual, timeout=90)
    assert results[0]["steps"] == results[1]["steps"] == reference[0]["steps"] == 3
    assert results[0]["state"] == reference[0]["state"]


def buffers_worker(rank: int, world: int, stage: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage}})
    engine.backward(engine(_x(0, rank)).square().mean())
    engine.step()
    engine.eval()
    with torch.no_grad():
        try:  # an evaluation batch that fails on rank 1 alone, skipped there
            engine(torch.randn(4, 7) if rank == 1 else _x(1, rank))
        except RuntimeError:
            assert rank == 1
        engine(_x(2, rank))  # rank 1 broadcast the buffers here on its own: its failed forward had not ended
    engine.train()
    engine.backward(engine(_x(3, rank)).square().mean())
    engine.step()
    engine.eval()
    with torch.no_grad():
        engine(_x(4, rank))  # starts from rank 0's buffers
    return model[1].running_mean.tolist()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_evaluation_forward_that_raised_on_one_rank_ends_as_on_its_peers(stage):
    """Buffers are broadcast at a forward after a training forward (Note [Buffers follow rank 0]); a forward
    that raised counts as ended, as on the ranks where it did not raise, so the next forward agrees."""
    means = run_ranks(buffers_worker, 2, stage, timeout=60, pg_timeout=20)
    assert means[0] == means[1]



class NestedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(h)))


class NestedBlock(nn.Module):
    """A unit holding a unit (``units=[NestedBlock, NestedAttention]``) whose forward raises on rank
    ``FailingBlock.forward_fails_on`` (or its backward on ``RaiseOnRank.rank_to_fail``) when ``fails``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(16), NestedAttention(), nn.Linear(16, 16)
        self.fails, self.rank = False, 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm(h))
        if self.fails and self.rank == FailingBlock.forward_fails_on:
            raise RuntimeError("simulated bad batch on this rank")
        if self.fails:
            h = RaiseOnRank.apply(h, self.rank)
        return h + torch.tanh(self.mlp(h))


class NestedAndShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(NestedBlock() for _ in range(4))
        self.last = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for i in (0, 1, 0, 2, 3):  # blocks.0 twice: a shared layer
            h = self.blocks[i](h)
        return self.last(h)


def nested_fails_worker(rank: int, world: int, failing_block: int, in_backward: bool, skip_everywhere: bool) -> dict:
    torch.manual_seed(0)
    model = NestedAndShared()
    for block in model.blocks:
        block.rank = rank
    model.blocks[failing_block].fails = True
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
                                 units=[NestedBlock, NestedAttention])
    seen = []
    for step in range(5):
        if skip_everywhere and step == 2:
            continue
        fails = 1 if step == 2 and not skip_everywhere else None  # after a backward was recorded
        FailingBlock.forward_fails_on, RaiseOnRank.rank_to_fail = (None, fails) if in_backward else (fails, None)
        _step_or_note(engine, _x(step, rank), seen)
    _assert_in_lockstep(engine)
    return {"seen": seen, "state": {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


@pytest.mark.parametrize("failing_block", [0, 2])  # 0: the shared one
@pytest.mark.parametrize("in_backward", [False, True], ids=["forward", "backward"])
def test_at_stage_3_nested_and_shared_units_play_out_the_peers_backward_in_its_order(failing_block, in_backward):
    """Note [Backward events]: the peers' backward enters an enclosing unit before the unit inside it and
    meets a shared unit twice; the walk along the forward's units in reverse had issued a reduce-scatter
    where the peers gathered, and every later collective mismatched."""
    results = run_ranks(nested_fails_worker, 2, failing_block, in_backward, False, timeout=90)
    assert results[1]["seen"] == ["simulated bad batch on this rank" if not in_backward
                                  else "simulated out-of-memory on this rank"], results
    assert len(results[0]["seen"]) == 1 and "rank(s) [1] raised an exception" in results[0]["seen"][0], results
    reference = run_ranks(nested_fails_worker, 2, failing_block, in_backward, True, timeout=90)
    assert results[0]["state"] == reference[0]["state"]


def layer_drop_worker(rank: int, world: int, skip_everywhere: bool) -> dict:
    engine = _failing_chain_engine(rank, 5, {})  # its backward raises before that of the block dropped
    seen: list[str] = []
    for step in range(4):
        if skip_everywhere and step == 2:
            continue
        engine.module.skipped = {3} if step == 2 else set()  # every rank drops block 3 at step 2
        RaiseOnRank.rank_to_fail = 1 if step == 2 else None
        _step_or_note(engine, _x(step, rank), seen)
    _assert_in_lockstep(engine)
    return {"seen": seen, "state": {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


def test_a_backward_error_in_a_step_that_runs_other_units_plays_out_that_steps_backward():
    """Note [Backward events]: the last backward's events are another graph's when this step's forward ran
    other units (LayerDrop); replaying them had issued the dropped block's collectives."""
    results = run_ranks(layer_drop_worker, 2, False, timeout=90)
    assert results[1]["seen"] == ["simulated out-of-memory on this rank"], results
    assert len(results[0]["seen"]) == 1 and "rank(s) [1] raised an exception in this backward" in results[0]["seen"][0]
    assert results[0]["state"] == run_ranks(layer_drop_worker, 2, True, timeout=90)[0]["state"]
