"""DeepSpeed's ``set_train_batch_size`` / ``set_train_micro_batch_size`` (Megatron-DeepSpeed's batch-size
ramp-up calls the first): the accumulation steps change at a window's end and train as an engine configured
with them from the start; ``global_samples`` counts each step at the batch it was taken at, through
checkpoints; a change inside a window, or to a size the ranks cannot split, is refused before anything changes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _config(stage: int, accumulation_steps: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation_steps,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), nn.Linear(16, 2))


def _window(engine: zerocore.Engine, step: int, rank: int) -> None:
    for micro in range(engine.gradient_accumulation_steps()):
        g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def ramp_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    engine = zerocore.initialize(_model(), _config(stage, 1))
    for step in range(2):
        _window(engine, step, rank)
    assert engine.global_samples == 2 * 8
    engine.save_checkpoint(directory, tag="before")
    engine.set_train_batch_size(16)  # 4 per micro-batch x 2 ranks: two micro-batches a step
    sizes = (engine.train_batch_size(), engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu())
    for step in range(2, 4):
        _window(engine, step, rank)
    samples = engine.global_samples
    engine.save_checkpoint(directory, tag="after")
    ramped = {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.set_train_micro_batch_size(2)  # the steps stay: 2 x 2 x 2
    micro = (engine.train_batch_size(), engine.gradient_accumulation_steps(), engine.global_samples)
    engine.close()

    # the same two windows from the same state, by an engine configured with two micro-batches from the start
    fresh = zerocore.initialize(_model(), _config(stage, 2))
    fresh.load_checkpoint(directory, tag="before")
    loaded_samples = fresh.global_samples
    for step in range(2, 4):
        _window(fresh, step, rank)
    reference = {k: v.tolist() for k, v in fresh.full_state_dict(rank0_only=False).items()}
    fresh.load_checkpoint(directory, tag="after")
    resumed_samples = fresh.global_samples
    _window(fresh, 4, rank)
    return {"sizes": sizes, "samples": samples, "micro": micro, "loaded": loaded_samples,
            "resumed": resumed_samples, "after_resume": fresh.global_samples, "same": ramped == reference}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_batch_ramp_trains_as_the_engine_configured_with_it_and_counts_its_samples(stage, tmp_path):
    for result in run_ranks(ramp_worker, 2, stage, str(tmp_path), timeout=240):
        assert result["sizes"] == (16, 2, 4), result
        assert result["samples"] == 2 * 8 + 2 * 16, result  # DeepSpeed's count: each step at its own batch
        assert result["micro"] == (8, 2, 48), result
        assert result["same"], "the ramped engine's parameters differ from the engine configured with the steps"
        # a checkpoint carries the count; a step after the load adds the loading engine's batch
        assert result["loaded"] == 16 and result["resumed"] == 48 and result["after_resume"] == 48 + 16, result


def refusal_worker(rank: int, world: int) -> list[str]:
    engine = zerocore.initialize(_model(), _config(2, 2))
    errors = []
    for call in (lambda: engine.set_train_batch_size(12),  # 12 is not a multiple of 4 x 2
                 lambda: engine.set_train_batch_size(0), lambda: engine.set_train_micro_batch_size(True)):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    g = torch.Generator().manual_seed(rank)
    engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
    engine.step()  # the first of the window's two micro-steps
    try:
        engine.set_train_batch_size(8)
    except RuntimeError as error:
        errors.append(str(error))
    unchanged = (engine.train_batch_size(), engine.gradient_accumulation_steps())
    engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
    engine.step()
    for asked in ((8, 16), (8, 12)):  # ranks that disagree; a size one rank refuses
        try:
            engine.set_train_batch_size(asked[rank])
        except (ValueError, RuntimeError) as error:
            errors.append(str(error))
    unchanged += (engine.train_batch_size(), engine.gradient_accumulation_steps())
    engine.set_train_batch_size(8)  # at the window's end, the same on every rank: fine
    errors.append(str((unchanged, engine.gradient_accumulation_steps())))
    engine.close()
    bare = zerocore.initialize(_model(), {"zero_optimization": {"stage": 1}})
    try:
        bare.set_train_batch_size(8)
    except ValueError as error:
        errors.append(str(error))
    bare.close()
    return errors


def test_changes_the_ranks_cannot_take_are_refused_on_every_rank_before_anything_changes():
    for rank, errors in enumerate(run_ranks(refusal_worker, 2, timeout=120)):
        assert len(errors) == 8, errors
        assert "not divisible by train_micro_batch_size_per_gpu (4) * data-parallel ranks (2)" in errors[0], errors
        assert "train_batch_size" in errors[1] and "micro_batch_size" in errors[2], errors
        assert "inside an accumulation window" in errors[3], errors
        assert "the ranks asked for different batch sizes" in errors[4] and "call it on every rank" in errors[4], errors
        if rank == 0:
            assert "set_train_batch_size() was refused on rank(s) [1]" in errors[5], errors
        else:
            assert "set_train_batch_size(12): not divisible" in errors[5], errors
        assert errors[6] == "((16, 2, 16, 2), 1)", errors
        assert "no train_micro_batch_size_per_gpu" in errors[7], errors
