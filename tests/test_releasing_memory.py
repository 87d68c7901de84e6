"""DeepSpeed's calls for giving memory back: ``engine.empty_partition_cache()`` (stage 3's units that stay whole
between steps are released, and training goes on as if it had not been called) and ``engine.destroy()``."""

from __future__ import annotations

import copy

import pytest
import torch

import zerocore
from _dist import run_ranks
from _parity import ReferencePair
from test_stage3 import Zoo, config, data, loss_of

pytestmark = pytest.mark.timeout(300)


def forward_gathers(engine: zerocore.Engine) -> int:
    return engine.comm_report()["collectives"].get("all_gather_forward", {}).get("calls", 0)


def empty_cache_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Zoo()
    reference = ReferencePair(copy.deepcopy(model), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                                                weight_decay=0.01, foreach=False))
    # the blocks persist (under the threshold) as the root does: four units whole between steps
    engine = zerocore.initialize(model, config(stage3_param_persistence_threshold=10**6))
    seen: dict = {"live_after": [], "live_before": [], "gathers_after": []}
    for step in range(4):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
        reference.train_step(lambda module, dtype: sum(loss_of(module, *data(step, r)) for r in range(world)) / world)
        with torch.no_grad():  # an evaluation between steps, as a Trainer's
            engine.eval()
            torch.testing.assert_close(engine(data(50 + step, rank)[0]), reference.fp32(data(50 + step, rank)[0]),
                                       rtol=1e-4, atol=1e-5)
            engine.train()
        seen["live_before"].append(engine.stage3.live_elements)
        if step % 2 == 0:
            engine.empty_partition_cache()
            live_bytes = engine.memory_report()["bytes"]["gathered_params_live"]
            seen["live_after"].append((engine.stage3.live_elements, live_bytes, engine.stage3.spares.held_bytes))
            before = forward_gathers(engine)
            with torch.no_grad():
                engine(data(0, rank)[0])
            seen["gathers_after"].append(forward_gathers(engine) - before)  # gathered again on use
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label="empty_partition_cache")

    # a unit a gathered() block holds stays, and its values with it
    with zerocore.gathered(list(model.blocks[0].parameters())):
        engine.empty_partition_cache()
        held = model.blocks[0].linear.weight.detach().clone()
    seen["held_exact"] = torch.equal(held, engine.full_state_dict(rank0_only=False)["blocks.0.linear.weight"])

    # between a forward and its backward the forward's units are needed: refused, nothing released
    loss = loss_of(engine, *data(9, rank))
    live = engine.stage3.live_elements
    try:
        engine.empty_partition_cache()
        seen["refused"] = "no error"
    except RuntimeError as error:
        seen["refused"] = str(error)
    seen["live_kept"] = engine.stage3.live_elements == live
    engine.backward(loss)
    engine.step()
    engine.destroy()
    engine.destroy()  # twice does nothing
    seen["whole_after_destroy"] = float(model.blocks[0].linear.weight.detach().sum())  # an ordinary tensor again
    loss_of(model, *data(1, rank)).backward()  # no hooks left
    return seen


def test_empty_partition_cache_releases_every_unit_held_between_steps_and_training_goes_on():
    for seen in run_ranks(empty_cache_worker, 2):
        assert all(live > 0 for live in seen["live_before"]), seen  # persistent units stayed whole
        assert seen["live_after"] == [(0, 0, 0)] * 2, seen
        # the next forward gathers every unit again: the root, blocks.0, blocks.1, blocks.2 (all persistent)
        assert seen["gathers_after"] == [4, 4], seen
        assert seen["held_exact"], seen
        assert "empty_partition_cache()" in seen["refused"] and "after the backward and step()" in seen["refused"]
        assert seen["live_kept"], seen


def stages_1_2_worker(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, {**config(), "zero_optimization": {"stage": stage}})
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    expected = engine.full_state_dict(rank0_only=False)
    engine.empty_partition_cache()  # nothing gathered to release
    engine.destroy()
    return all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize("stage", [1, 2])
def test_at_stages_1_and_2_empty_partition_cache_does_nothing_and_destroy_hands_the_model_back(stage):
    assert all(run_ranks(stages_1_2_worker, 2, stage))
