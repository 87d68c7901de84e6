"""Gradients accumulated locally are never dropped: a parameter that gets no gradient in the reducing
backward of a window still contributes what it accumulated earlier in the window (stage 1's accumulation
micro-steps, or backwards inside no_sync()), as DDP does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from zerocore.engine import EngineState
from _dist import run_ranks
from _parity import ReferencePair

pytestmark = pytest.mark.timeout(300)


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # stage 3: a unit each
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](x))
        if use_second:
            h = h + torch.tanh(self.blocks[1](x))
        return self.head(h)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)


def _loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor, use_second: bool) -> torch.Tensor:
    dtype = next(module.parameters()).dtype
    return nn.functional.mse_loss(module(x.to(dtype), use_second), y.to(dtype))


def worker(rank: int, world: int, stage: int, mode: str) -> bool:
    torch.manual_seed(0)
    model = TwoBlocks()
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0,
                                                                 foreach=False))
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "gradient_accumulation_steps": 1 if mode == "no_sync" else 2}
    engine = zerocore.initialize(model, config)
    for step in range(3):
        # micro-step 0 uses both blocks, micro-step 1 (the reducing one) only the first
        for micro, use_second in ((0, True), (1, False)):
            if mode.startswith("manual"):  # DeepSpeed's manual window, as Accelerate's DeepSpeed wrapper sets it
                engine.set_gradient_accumulation_boundary(micro == 1)
            x, y = _batch(step, micro, rank)
            loss = _loss(engine, x, y, use_second)
            if mode == "no_sync" and micro == 0:
                with engine.no_sync():
                    engine.backward(loss / 2)
            elif mode == "no_sync":
                engine.backward(loss / 2)
                engine.step()
            elif mode == "manual" and micro == 0:
                engine.backward(loss)  # no step(): the next forward ends this micro-step
                assert not engine.is_gradient_accumulation_boundary()
            else:
                engine.backward(loss)
                engine.step()
                assert engine.was_step_applied() == (micro == 1)
        reference.train_step(lambda module, dtype: sum(
            _loss(module, *_batch(step, micro, r), use_second) for r in range(world)
            for micro, use_second in ((0, True), (1, False))) / (2 * world))
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"stage {stage} {mode}")
    return True


@pytest.mark.parametrize("stage,mode", [(stage, mode) for mode in ("accumulation", "no_sync", "manual",
                                                                   "manual_stepped") for stage in (1, 2, 3)])
def test_a_parameter_without_a_gradient_in_the_last_micro_step_keeps_its_accumulated_one(stage, mode):
    assert all(run_ranks(worker, 2, stage, mode))


def stale_worker(rank: int, world: int, stage: int) -> dict:
    torch.manual_seed(0)
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    engine = zerocore.initialize(TwoBlocks(), config)
    norms, losses = [], []
    for step in range(3):
        x, y = _batch(step, 0, rank)
        loss = _loss(engine, x, y, use_second=step == 0)  # the second block has a gradient in step 0 only
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        losses.append(loss.item())
    params = {k: v.reshape(-1).tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return {"norms": norms, "losses": losses, "params": params}


def test_a_parameter_without_gradients_after_a_step_reduces_zeros_not_its_last_gradient():
    """Stage 1 leaves its gradient buffer unzeroed between steps (Note [Gradient slots start stale]): the
    second block's slot still holds step 0's gradient when steps 1-2 give it none. It must count as zero, as
    in stage 2 (whose gradient shard is zeroed): same layout, same sums, so the two train bitwise alike."""
    stage1 = run_ranks(stale_worker, 2, 1)
    stage2 = run_ranks(stale_worker, 2, 2)
    for a, b in zip(stage1, stage2):
        assert a["norms"] == b["norms"] and a["losses"] == b["losses"]
        assert a["params"] == b["params"]


def scale_wrt_gas_worker(rank: int, world: int, stage: int) -> list[list[float]]:
    """DeepSpeed's backward(loss, scale_wrt_gas=False) leaves the division by the accumulation steps to the
    caller: backward(loss / 2, scale_wrt_gas=False) at 2 accumulation steps trains as backward(loss)."""
    results = []
    for divide_here in (False, True):
        torch.manual_seed(0)
        engine = zerocore.initialize(TwoBlocks(), {"gradient_clipping": 0.0, "optimizer": {"params": {"lr": 1e-2}}, "gradient_accumulation_steps": 2,
                                                   "zero_optimization": {"stage": stage}})
        for step in range(2):
            for micro in range(2):
                loss = _loss(engine, *_batch(step, micro, rank), use_second=True)
                engine.backward(loss / 2, scale_wrt_gas=False) if divide_here else engine.backward(loss)
                engine.step()
        results.append([float(v.double().sum()) for v in engine.full_state_dict(rank0_only=False).values()])
        engine.close()
    return results


@pytest.mark.parametrize("stage", [1, 3])
def test_backward_without_scaling_by_the_accumulation_steps(stage):
    for default, divided_by_caller in run_ranks(scale_wrt_gas_worker, 2, stage):
        assert default == divided_by_caller


def manual_boundary_worker(rank: int, world: int, stage: int, directory: str) -> list[str]:
    """Note [Manual accumulation boundary]: what DeepSpeed's set_gradient_accumulation_boundary() allows, and a
    setting changed between a backward and its step() refused with nothing changed."""
    torch.manual_seed(0)
    model = TwoBlocks()
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0,
                                                                 foreach=False))
    engine = zerocore.initialize(model, {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2})
    errors = []

    def micro_step(step: int, micro: int) -> None:
        engine.backward(_loss(engine, *_batch(step, micro, rank), use_second=True))

    engine.set_gradient_accumulation_boundary(False)
    micro_step(0, 0)
    engine.set_gradient_accumulation_boundary(True)  # too late: that backward ran as no boundary
    with pytest.raises(RuntimeError, match=r"set_gradient_accumulation_boundary\(True\) was called after") as error:
        engine.step()
    errors.append(str(error.value))
    assert engine.state is EngineState.AWAITING_STEP and not engine.was_step_applied()
    engine.set_gradient_accumulation_boundary(False)
    engine.step()  # ends the micro-step, updates nothing
    engine.set_gradient_accumulation_boundary(True)
    micro_step(0, 1)
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1

    engine.set_gradient_accumulation_boundary(False)
    micro_step(1, 0)
    with pytest.raises(RuntimeError, match="inside an accumulation window") as error:
        engine.save_checkpoint(directory)  # the next forward would end the micro-step; the window stays open
    errors.append(str(error.value))
    engine.step()
    engine.set_gradient_accumulation_boundary(True)
    micro_step(1, 1)
    engine.step()

    engine.set_gradient_accumulation_boundary(None)  # counting gradient_accumulation_steps again
    for micro in range(2):
        assert engine.is_gradient_accumulation_boundary() == (micro == 1)
        micro_step(2, micro)
        engine.step()
    assert engine.global_steps == 3 and engine.was_step_applied()
    for step in range(3):
        reference.train_step(lambda module, dtype: sum(_loss(module, *_batch(step, micro, r), use_second=True)
                                                       for r in range(world) for micro in range(2)) / (2 * world))
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"stage {stage} manual boundary")
    return errors


@pytest.mark.parametrize("stage", [1, 3])
def test_a_manual_boundary_changed_after_its_backward_is_refused_and_the_window_trains_on(stage, tmp_path):
    for errors in run_ranks(manual_boundary_worker, 2, stage, str(tmp_path)):
        assert len(errors) == 2
