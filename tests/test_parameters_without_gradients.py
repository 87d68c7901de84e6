"""A parameter that gets no gradient in an accumulation window on any rank is left alone by that step, as
torch's AdamW leaves a parameter whose ``.grad`` is None under DDP (Note [Parameters without gradients] in
python/zerocore/_shard_geometry.py): never used, used on some steps only, frozen after ``initialize``.
Weight decay is on, so a step that decayed such a parameter, or counted a step it sat out in its bias
correction, would move it visibly."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from zerocore._shard_geometry import ShardPiece, ShardRun, shard_segments
from _parity import ReferencePair

pytestmark = pytest.mark.timeout(600)


class Switching(nn.Module):
    """``middle`` runs only when ``use_middle``; ``never`` and ``spare`` are never used; ``late`` is frozen
    part-way. ``spare`` lies between two parameters that are updated alike, in one shard."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.spare = nn.Parameter(torch.ones(3))
        self.scale = nn.Parameter(torch.full((8,), 0.9))
        self.middle = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.late = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.use_middle = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x)) * self.scale
        if self.use_middle:
            h = torch.tanh(self.middle(h))
        return self.head(torch.tanh(self.late(h)))


def _schedule(step: int) -> tuple[bool, bool]:
    """(middle runs, late is frozen) at ``step``: middle sits out steps 1, 2 and 4 and comes back, late is
    frozen from step 3 on."""
    return step not in (1, 2, 4), step >= 3


def _config(stage: int, gas: int, offload: dict | None = None) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 200}  # several buckets, shards of several parameters
    if offload is not None:
        zero["offload_optimizer"] = offload
        zero["sub_group_size"] = 16
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "gradient_accumulation_steps": gas, "zero_optimization": zero}


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def _apply(models: list[nn.Module], step: int) -> None:
    middle, frozen = _schedule(step)
    for model in models:
        model.use_middle = middle
        model.late.requires_grad_(not frozen)


def train_worker(rank: int, world: int, stage: int, gas: int, resume_dir: str | None,
                 offload: dict | None = None) -> list[str]:
    torch.manual_seed(0)
    model = Switching()
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                                                                   foreach=False),
                              wrap=lambda m: DDP(m, find_unused_parameters=True))
    engine = zerocore.initialize(model, _config(stage, gas, offload))
    for step in range(7):
        _apply([model, *reference.models], step)
        if resume_dir is not None and step == 5:  # idle counts survive a save and a load
            engine.save_checkpoint(resume_dir, tag="mid")
            engine.close()
            torch.manual_seed(1)
            model = Switching()  # other initial values: everything comes from the checkpoint
            engine = zerocore.initialize(model, _config(stage, gas, offload))
            engine.load_checkpoint(resume_dir, tag="mid")
            _apply([model], step)  # frozen after initialize, as in the run saved
        micro = [_batch(step, m, rank) for m in range(gas)]
        for x, y in micro:
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
        reference.train_step(lambda module, dtype: nn.functional.mse_loss(module(x.to(dtype)), y.to(dtype)))
    state = engine.full_state_dict(rank0_only=False)
    reference.assert_matches(state, label=f"stage {stage}, gas {gas}")
    # the parameters no rank ever used are exactly where they started, weight decay notwithstanding
    torch.manual_seed(0)
    start = Switching().state_dict()
    for name in ("never.weight", "never.bias", "spare"):
        assert torch.equal(state[name], start[name]), name
    engine.close()
    return sorted(engine.optimizer_state.idle_steps.items()) and ["ok"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_without_a_gradient_are_left_alone_like_ddp_and_torch_adamw(stage):
    run_ranks(train_worker, 2, stage, 1, None, timeout=300)


def test_parameters_without_a_gradient_under_gradient_accumulation():
    run_ranks(train_worker, 2, 2, 2, None, timeout=300)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_parameters_without_a_gradient_with_the_optimizer_state_offloaded(device, tmp_path):
    # nvme: the step walks sub-groups of 16 elements, so pieces are cut across sub-groups too
    offload = {"device": device, "nvme_path": os.fspath(tmp_path)}
    run_ranks(train_worker_offloaded, 2, offload, timeout=300)


def train_worker_offloaded(rank: int, world: int, offload: dict) -> list[str]:
    return train_worker(rank, world, 2, 1, None, offload)


@pytest.mark.parametrize("stage", [1, 3])
def test_idle_step_counts_survive_a_checkpoint(stage, tmp_path):
    run_ranks(train_worker, 2, stage, 1, os.fspath(tmp_path), timeout=300)


@st.composite
def shards_and_plans(draw):
    """A shard of pieces (some with padding between them) in runs of param groups, and a plan: names left
    out and each other name's lag."""
    count = draw(st.integers(1, 8))
    pieces, runs, offset = [], [], 0
    for i in range(count):
        offset += draw(st.integers(0, 3))  # padding
        length = draw(st.integers(0, 5))
        group = draw(st.integers(0, 1))
        pieces.append(ShardPiece(f"p{i}", (length,), 0, offset, length))
        if runs and runs[-1].group == group:
            runs[-1] = ShardRun(runs[-1].start, offset + length, group)
        else:
            runs.append(ShardRun(offset, offset + length, group))
        offset += length
    names = [p.name for p in pieces]
    idle = frozenset(draw(st.lists(st.sampled_from(names), unique=True)))
    lags = frozenset((n, draw(st.integers(1, 3))) for n in draw(st.lists(st.sampled_from(names), unique=True))
                     if n not in idle)
    return SimpleNamespace(runs=tuple(runs), pieces=tuple(pieces)), (idle, lags)


@given(shards_and_plans())
def test_segments_cover_exactly_the_updated_pieces_with_their_group_and_lag(case):
    shard, plan = case
    idle, lags = plan
    lag_of = dict(lags)
    segments = shard_segments(shard, plan)
    for piece in shard.pieces:
        run = next(r for r in shard.runs if r.start <= piece.shard_offset and piece.shard_offset + piece.length <= r.end)
        inside = [s for s in segments if s[0] <= piece.shard_offset and piece.shard_offset + piece.length <= s[1]]
        overlapping = [s for s in segments if s[0] < piece.shard_offset + piece.length and piece.shard_offset < s[1]]
        if piece.name in idle:
            assert not overlapping, (piece, segments)
        elif piece.length:
            assert inside == overlapping and len(inside) == 1, (piece, segments)
            assert inside[0][2:] == (run.group, lag_of.get(piece.name, 0)), (piece, segments)
    assert shard_segments(shard, None) == [(r.start, r.end, r.group, 0) for r in shard.runs]


def bf16_worker(rank: int, world: int, stage: int, zero: dict) -> list[bool]:
    torch.manual_seed(0)
    model = Switching()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **zero}}
    engine = zerocore.initialize(model, config)
    for step in range(5):
        _apply([model], step)
        if step == 3:
            late_when_frozen = engine.full_state_dict(rank0_only=False)["late.weight"]
        x, y = _batch(step, 0, rank)
        engine.backward(nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    kept = [torch.equal(state[n], start[n].bfloat16()) for n in ("never.weight", "never.bias", "spare")]
    return [*kept, torch.equal(state["late.weight"], late_when_frozen),
            not torch.equal(state["middle.weight"], start["middle.weight"].bfloat16())]


@pytest.mark.parametrize("stage,where", [(1, "memory"), (3, "memory"), (3, "nvme")])
def test_bf16_parameters_without_a_gradient_keep_their_values_wherever_they_live(stage, where, tmp_path):
    # on NVMe the step reads each parameter shard only when it writes not every element of it
    zero = {} if where == "memory" else {
        "offload_optimizer": {"device": "nvme", "nvme_path": os.fspath(tmp_path)}, "sub_group_size": 20,
        "offload_param": {"device": "nvme", "nvme_path": os.fspath(tmp_path), "max_in_cpu": 10}}
    for flags in run_ranks(bf16_worker, 2, stage, zero, timeout=300):
        assert all(flags), flags


def _runtime_warnings_of_two_steps(engine: zerocore.Engine, rank: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = _batch(step, 0, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
    untrained = [w for w in caught if "not trained" in str(w.message)]
    assert all(w.filename == __file__ for w in untrained), [(w.filename, w.lineno) for w in untrained]  # the step's line
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def unfrozen_worker(rank: int, world: int, stage: int) -> list[str]:
    torch.manual_seed(0)
    model = Switching()
    model.late.requires_grad_(False)  # frozen when the engine is built
    engine = zerocore.initialize(model, _config(stage, 1))
    model.late.requires_grad_(True)  # unfrozen afterwards: the engine has no optimizer state for it
    return _runtime_warnings_of_two_steps(engine, rank)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_unfrozen_after_initialize_is_named_once_as_untrained(stage):
    for messages in run_ranks(unfrozen_worker, 2, stage):
        named = [m for m in messages if "not trained" in m]
        assert sorted(m.split("'")[1] for m in named) == ["late.bias", "late.weight"], messages


def replaced_worker(rank: int, world: int, stage: int) -> list[str]:
    torch.manual_seed(0)
    model = Switching()
    engine = zerocore.initialize(model, _config(stage, 1))
    with pytest.raises(RuntimeError, match="parameter 'late.weight' would be added"):
        model.late.weight = nn.Parameter(torch.zeros(8, 8))  # Note [Parameters added after initialize]
    # torch's registration hooks do not see a write into the dict itself: the step's check still names it
    model.late._parameters["weight"] = nn.Parameter(torch.zeros(8, 8))
    return _runtime_warnings_of_two_steps(engine, rank)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_replaced_after_initialize_is_named_as_a_new_object(stage):
    """module.weight = nn.Parameter(...) (or load_state_dict(assign=True)) after initialize raises where it is
    assigned; written into the module's _parameters directly, the engine trains the object it was built with
    and the warning says so instead of blaming requires_grad."""
    for messages in run_ranks(replaced_worker, 2, stage):
        named = [m for m in messages if "not trained" in m]
        assert len(named) == 1 and "'late.weight'" in named[0] and "new Parameter object" in named[0], messages
