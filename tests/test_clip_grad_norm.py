"""engine.clip_grad_norm_: FSDP1's clip-by-hand over sharded gradients, against DDP with torch's
clip_grad_norm_ (Note [Clipping by hand] in _grad_clip.py)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _models import batch, build, loss_fn
from _parity import ReferencePair, as_dtype

pytestmark = pytest.mark.timeout(600)

# The config clips far below the hand clip: a step that clipped again at it would leave DDP's parity by far.
CONFIG_CLIP = 1e-3


@dataclass(frozen=True)
class Case:
    model: str
    stage: int
    max_norm: float
    norm_type: float = 2.0
    gas: int = 1
    offload: str | None = None
    steps: int = 8


def _config(case: Case, path: str | None) -> dict:
    zero: dict = {"stage": case.stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000,
                  "stage3_param_persistence_threshold": 0}
    if case.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif case.offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        zero["sub_group_size"] = 333
    return {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "gradient_accumulation_steps": case.gas, "gradient_clipping": CONFIG_CLIP, "zero_optimization": zero}


def parity_worker(rank: int, world: int, cases: list[Case], path: str | None) -> list[int]:
    clipped_steps = []
    for case in cases:
        model = build(case.model)
        reference = ReferencePair(
            model, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8,
                                               weight_decay=0.01, foreach=False), wrap=DDP)
        engine = zerocore.initialize(model, _config(case, path))
        first = next(model.parameters())
        clipped = 0
        for step in range(case.steps):
            micro = [batch(case.model, torch.Generator().manual_seed(10_000 * step + 100 * rank + m))
                     for m in range(case.gas)]
            for x, y in micro:
                engine.backward(loss_fn(case.model, engine(x), y))
                if engine.is_gradient_accumulation_boundary():
                    unclipped = zerocore.safe_get_full_grad(first)
                    norm = engine.clip_grad_norm_(case.max_norm, norm_type=case.norm_type)
                    # read as .grad is after torch's clip; written back, taken as given (not clipped twice)
                    grad = zerocore.safe_get_full_grad(first)
                    coefficient = min(1.0, case.max_norm / (norm.item() + 1e-6))
                    torch.testing.assert_close(grad, unclipped * coefficient, rtol=1e-6, atol=0)
                    if step % 2:  # (a write multiplies the clip into the shards: even steps leave it to the step)
                        zerocore.safe_set_full_grad(first, grad)
                engine.step()
            x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
            _, expected = reference.train_step(lambda module, dtype: loss_fn(case.model, module(as_dtype(x, dtype)), y),
                                               clip=case.max_norm, norm_type=case.norm_type)
            assert norm.dtype == torch.float32 and norm.shape == ()
            assert norm.item() == pytest.approx(expected.item(), rel=1e-5), (case, step)
            clipped += norm.item() > case.max_norm
            if case.norm_type == 2.0:  # the step's own norm: of the clipped gradients
                assert engine.get_global_grad_norm() == pytest.approx(min(norm.item(), case.max_norm), rel=1e-4)
        reference.assert_matches(engine.full_state_dict(rank0_only=False), label=str(case))
        engine.close()
        clipped_steps.append(clipped)
    return clipped_steps


CASES = [
    Case("mlp", 1, 0.05), Case("mlp", 2, 0.05, gas=3), Case("transformer", 3, 0.5),
    Case("transformer", 3, 0.05, norm_type=math.inf), Case("mlp", 2, 0.1, norm_type=1.0),
    Case("mlp", 3, 0.05, offload="cpu", gas=2), Case("transformer", 1, 0.5, offload="nvme"),
]


@pytest.mark.parametrize("world", [1, 2])
def test_hand_clipping_matches_ddp_with_torch_clip_grad_norm(world, tmp_path):
    """At every stage, with accumulation, the optimizer on the host and on NVMe, for the 2-, 1- and inf-norm:
    the norm returned is DDP's, the training stays within DDP's rounding noise, the step does not clip again
    at the config's gradient_clipping, and a gradient read after the clip is clipped (and written back,
    is not clipped twice)."""
    for clipped in run_ranks(parity_worker, world, CASES, str(tmp_path), timeout=500):
        assert all(count >= 2 for count in clipped), clipped  # every case clipped on some steps


def fp16_worker(rank: int, world: int, stage: int) -> list[float]:
    model = build("mlp")
    reference = copy.deepcopy(model)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 0.0,
              "fp16": {"enabled": True, "initial_scale_power": 12}, "zero_optimization": {"stage": stage}}
    engine = zerocore.initialize(model, config)
    x, y = batch("mlp", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("mlp", engine(x.half()), y))
    measured = engine.clip_grad_norm_(math.inf).item()  # measure only
    engine.step()
    after_step = engine.get_global_grad_norm()
    # the data-parallel gradient's norm in fp32: the mean of every rank's loss
    batches = [batch("mlp", torch.Generator().manual_seed(r)) for r in range(world)]
    (sum(loss_fn("mlp", reference(bx), by) for bx, by in batches) / world).backward()
    exact = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    x, y = batch("mlp", torch.Generator().manual_seed(100 + rank))
    engine.backward(loss_fn("mlp", engine(x.half()), y))
    before = engine.clip_grad_norm_(measured / 10).item()
    engine.step()
    return [measured, after_step, exact, before, engine.get_global_grad_norm(), measured / 10]


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_norm_is_unscaled(stage):
    """Under fp16's loss scale (2^12 here) the norm is the gradients' own, the step's agrees, and a clip leaves
    the step's norm at max_norm."""
    for measured, after_step, exact, before, clipped_norm, max_norm in run_ranks(fp16_worker, 2, stage):
        assert measured == pytest.approx(after_step, rel=1e-6)
        assert measured == pytest.approx(exact, rel=1e-2)
        assert before > max_norm and clipped_norm == pytest.approx(max_norm, rel=1e-2)


def refusals_worker(rank: int, world: int, stage: int) -> list[str]:
    model = build("mlp")
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": stage}}
    engine = zerocore.initialize(model, config)
    seen = []

    def refused(*args, **kwargs) -> str:
        with pytest.raises((RuntimeError, ValueError)) as raised:
            engine.clip_grad_norm_(*args, **kwargs)
        assert "nothing was changed on any rank" in str(raised.value)
        return f"{type(raised.value).__name__}: {raised.value}"

    seen.append(refused(1.0))  # before any backward
    x, y = batch("mlp", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("mlp", engine(x), y))
    seen.append(refused(1.0))  # mid-window: local sums
    engine.step()
    engine.backward(loss_fn("mlp", engine(x), y))
    norm = engine.clip_grad_norm_(math.inf).item()
    seen.append(refused(-1.0 if rank == 0 else 1.0))  # one rank's bad argument: every rank raises
    seen.append(refused(1.0, norm_type=0))
    seen.append(refused(1.0, norm_type="two"))
    seen.append(refused(1.0 + rank))  # different arguments: each rank would clip its shard differently
    seen.append(refused(model.parameters(), 1.0))  # torch's signature, parameters first
    assert engine.clip_grad_norm_(math.inf).item() == norm  # the refusals changed nothing
    engine.step()
    engine.backward(loss_fn("mlp", engine(x), y) * math.inf)
    engine.step()
    engine.backward(loss_fn("mlp", engine(x), y))
    seen.append(refused(1.0, error_if_nonfinite=True))
    return seen


@pytest.mark.parametrize("stage", [2, 3])
def test_refusals_raise_on_every_rank_with_nothing_changed(stage):
    """Outside the boundary's window, or a bad argument on one rank: every rank raises (no rank left waiting in
    the all-reduce), naming why, and the gradients are as they were."""
    first, second = run_ranks(refusals_worker, 2, stage)
    for messages in (first, second):
        assert "exist only between" in messages[0] and "'idle'" in messages[0]
        assert "mid-window" in messages[1]
        assert messages[3].startswith("ValueError") and "norm_type must be > 0" in messages[3]
        assert messages[4].startswith("ValueError") and "'two'" in messages[4]
        assert messages[5].startswith("ValueError") and "different arguments on different ranks" in messages[5]
        assert "rank 0: max_norm=1.0" in messages[5] and "rank 1: max_norm=2.0" in messages[5]
        assert messages[6].startswith("ValueError") and "torch's function takes the parameters first" in messages[6]
        assert messages[7].startswith("RuntimeError") and "so they cannot be clipped" in messages[7]
    assert first[2].startswith("ValueError") and "max_norm must be >= 0" in first[2]
    assert second[2].startswith("RuntimeError") and "refused on rank(s) [0]" in second[2]
