"""The parity rule of tests/_parity.py must fail for real bugs: the engine is broken on purpose in ways a
refactor could break it, and each broken run must be caught while the unbroken run passes."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _models import batch, build, loss_fn
from _parity import ReferencePair, assert_within_reference_noise

pytestmark = pytest.mark.timeout(300)
STEPS, LR, WEIGHT_DECAY = 6, 3e-3, 0.01


def _config(stage: int, **adam) -> dict:
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.99], "eps": 1e-8,
                                                      "weight_decay": WEIGHT_DECAY, **adam}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000}}


def _train(rank: int, stage: int, bug: str) -> dict[str, torch.Tensor]:
    model = build("transformer")
    config = _config(stage, **{"none": {}, "weight decay twice": {"weight_decay": 2 * WEIGHT_DECAY},
                               "lr 1% high": {"lr": 1.01 * LR}}.get(bug, {}))
    engine = zerocore.initialize(model, config)
    if bug == "one rank's gradient of one parameter dropped" and rank == 1:
        # as if the bucket holding this parameter were never reduced from this rank
        model.blocks[1].linear1.weight.register_hook(torch.zeros_like)
    for step in range(STEPS):
        if bug == "a step lost" and step == 2:
            continue  # as if step() had silently done nothing
        x, y = batch("transformer", torch.Generator().manual_seed(10_000 * step + rank))
        engine.backward(loss_fn("transformer", engine(x), y))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    return state


def broken_worker(rank: int, world: int, stage: int) -> dict[str, str]:
    reference = ReferencePair(build("transformer"),
                              lambda m: torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8,
                                                          weight_decay=WEIGHT_DECAY, foreach=False), wrap=DDP)
    for step in range(STEPS):
        x, y = batch("transformer", torch.Generator().manual_seed(10_000 * step + rank))
        reference.train_step(lambda module, dtype: loss_fn("transformer", module(x), y))
    outcomes = {}
    for bug in ("none", "weight decay twice", "lr 1% high", "one rank's gradient of one parameter dropped",
                "a step lost"):
        try:
            reference.assert_matches(_train(rank, stage, bug), label=bug)
            outcomes[bug] = "passed"
        except AssertionError as error:
            outcomes[bug] = str(error)
    return outcomes


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_parity_rule_catches_deliberately_broken_engines(stage):
    for outcomes in run_ranks(broken_worker, 2, stage):
        assert outcomes.pop("none") == "passed"
        for bug, outcome in outcomes.items():
            assert outcome != "passed", f"stage {stage}: the parity rule missed the bug: {bug}"
            assert "outside the fp32 reference's rounding noise" in outcome


def test_the_rule_itself():
    exact = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), "n": torch.tensor(3)}
    reference = {"w": torch.tensor([1.0, 2.0, 3.0 + 1e-6]), "n": torch.tensor(3)}
    within = {"w": torch.tensor([1.0 + 1e-6, 2.0, 3.0]), "n": torch.tensor(3)}
    assert_within_reference_noise(within, reference, exact)
    for bad, what in (({"w": torch.tensor([1.0, 2.0, 3.01]), "n": torch.tensor(3)}, "w: relative distance"),
                      ({"w": torch.tensor([1.0, float("nan"), 3.0]), "n": torch.tensor(3)}, "w: relative distance"),
                      ({"w": torch.tensor([1.0, 2.0, 3.0]), "n": torch.tensor(4)}, "n: 4 != 3"),
                      ({"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}, "w: shape")):
        with pytest.raises(AssertionError, match=what):
            assert_within_reference_noise(bad, reference, exact)
