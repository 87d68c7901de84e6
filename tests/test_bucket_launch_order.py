"""Stages 1-2 launch the gradient buckets, from the second reducing backward on, in the order rank 0's first
completed them (Note [Bucket launch order] in cpp/include/zerocore/ready_tracker.hpp): a layer that runs a
module registered after the ones it runs before (Llama's norms) no longer keeps its other buckets waiting
for that module's bucket, so fewer pool buffers are live; the values are the same, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class NormLast(nn.Module):
    """As a Hugging Face Llama layer: the norm it runs first is registered after the projections, so its
    gradient, which arrives last, sits in the bucket the reverse layout order launches first."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), *(NormLast(16) for _ in range(3)), nn.Linear(16, 4))


def worker(rank: int, world: int, stage: int, learns: bool) -> tuple[dict, list[int], list[int], int]:
    engine = zerocore.initialize(build(), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}})
    engine.gradients.learns_launch_order = learns
    default = list(engine.reducer.launch_order)
    pools = []
    for step in range(4):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x).square().mean())
        engine.step()
        pools.append(engine.reducer.buffer_bytes)
    state = {name: value.tolist() for name, value in engine.full_state_dict(rank0_only=False).items()}
    return state, default, list(engine.reducer.launch_order), max(pools[1:])


@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_launch_in_the_order_the_first_backward_completed_them(stage):
    learned = run_ranks(worker, 2, stage, True)
    fixed = run_ranks(worker, 2, stage, False)
    (state, default, order, pool), (_, _, other_rank_order, _) = learned
    assert order == other_rank_order and sorted(order) == sorted(default) and order != default
    assert fixed[0][2] == default  # not learned: the reverse layout order stays
    assert state == fixed[0][0]  # the same values, bit for bit
    if stage == 2:  # (stage 1 reduces its fp32 gradient buffer in place: no pool)
        assert pool < fixed[0][3], (pool, fixed[0][3])
