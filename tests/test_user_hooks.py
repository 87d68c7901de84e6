"""A user's ``register_post_accumulate_grad_hook`` works the same whether it was registered before or after
``zerocore.initialize``: it sees ``.grad`` and what it changes is what gets reduced, as under DDP (the
engine's own hook is kept last: GradientRouting._run_engine_hooks_last)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _hook(param: torch.Tensor) -> None:
    assert param.grad is not None, "the user's hook must see the gradient"
    param.grad.mul_(0.5).add_(0.01)  # Adam ignores a constant scale: the shift shows whether it took effect


def hooks_worker(rank: int, world: int, stage: int) -> list[list[float]]:
    results = []
    for when in ("none", "before", "after"):
        torch.manual_seed(0)
        model = Net()
        if when == "before":
            model.blocks[0].weight.register_post_accumulate_grad_hook(_hook)
        engine = zerocore.initialize(model, {"optimizer": {"params": {"lr": 1e-2}}, "gradient_accumulation_steps": 2,
                                             "zero_optimization": {"stage": stage,
                                                                   "stage3_param_persistence_threshold": 0}})
        if when == "after":
            model.blocks[0].weight.register_post_accumulate_grad_hook(_hook)
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            engine.backward(nn.functional.mse_loss(engine(torch.randn(4, 8, generator=g)),
                                                   torch.randn(4, 3, generator=g)))
            engine.step()
        results.append([float(v.double().sum()) for v in engine.full_state_dict(rank0_only=False).values()])
        engine.close()
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_post_accumulate_grad_hook_registered_after_initialize_acts_as_before(stage):
    for without, before, after in run_ranks(hooks_worker, 2, stage):
        assert before != without  # the hook changes training
        assert after == before
