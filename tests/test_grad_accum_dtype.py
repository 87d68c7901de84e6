"""DeepSpeed's ``data_types.grad_accum_dtype: "fp32"`` with 16-bit compute (Note [fp32 gradient accumulation] in
_sharded_buffer.py): a window's gradient is the fp32 sum of its micro-steps' 16-bit gradients and ranks', at
every stage, with and without ``no_sync()``, where accumulating in bf16 rounds it at every micro-step."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]

MICRO_STEPS = 8
WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + micro)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).pow(2).mean()


def _reference_grads(model: nn.Module, dtype: torch.dtype, scale: float) -> dict[str, torch.Tensor]:
    """Every rank's micro-step gradients of the 16-bit model (losses divided by the micro-steps and times the
    loss scale, as the engine's backward scales them), summed in float64 and averaged over ranks, unscaled."""
    ref = copy.deepcopy(model).to(dtype)
    total = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in ref.named_parameters()}
    for rank in range(WORLD):
        for micro in range(MICRO_STEPS):
            x, y = _batch(rank, micro)
            ref.zero_grad()
            (_loss(ref(x.to(dtype)), y) * (scale / MICRO_STEPS)).backward()
            for name, p in ref.named_parameters():
                total[name] += p.grad.double() / (WORLD * scale)
    return total


def _window(rank: int, stage: int, precision: str, accum: str | None, no_sync: bool) -> dict:
    model = _model()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    config = {precision: {"enabled": True}, "gradient_clipping": 0.0,
              "gradient_accumulation_steps": 1 if no_sync else MICRO_STEPS,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}
    if precision == "fp16":
        config["fp16"].update(loss_scale=0, initial_scale_power=8)
    if accum is not None:
        config["data_types"] = {"grad_accum_dtype": accum}
    reference = _reference_grads(model, dtype, 2.0**8 if precision == "fp16" else 1.0)
    engine = zerocore.initialize(model, config)
    for micro in range(MICRO_STEPS):
        x, y = _batch(rank, micro)
        inside = no_sync and micro < MICRO_STEPS - 1
        with engine.no_sync() if inside else contextlib.nullcontext():
            engine.backward(_loss(engine(x.to(dtype)), y) / (MICRO_STEPS if no_sync else 1))
        grads_left = [name for name, p in engine.module.named_parameters() if p.grad is not None]
        if not inside and micro < MICRO_STEPS - 1:
            engine.step()
    errors = {}
    for name, p in engine.module.named_parameters():
        got = zerocore.safe_get_full_grad(p).double()
        errors[name] = ((got - reference[name]).norm() / reference[name].norm()).item()
    report = engine.comm_report()
    engine.step()
    engine.close()
    return {"error": max(errors.values()), "grads_left": grads_left, "wire": report["gradient_wire_dtype"]}


CASES = ([(stage, "bf16", "fp32", no_sync) for stage in (1, 2, 3) for no_sync in (False, True)]
         + [(2, "fp16", "fp32", False), (2, "bf16", None, False)])


def accumulation_worker(rank: int, world: int) -> list[dict]:
    return [_window(rank, *case) for case in CASES]


def test_fp32_accumulation_sums_the_micro_steps_in_fp32_at_every_stage():
    results = run_ranks(accumulation_worker, WORLD, timeout=240)
    for case, *outcomes in zip(CASES, *results):
        stage, precision, accum, no_sync = case
        error = max(o["error"] for o in outcomes)
        if accum == "fp32":
            # the only rounding left is fp32's (the 16-bit gradients themselves are the reference's, exactly)
            assert error < 1e-6, (case, error)
            # .grad is not where the window accumulates: None after every backward, also at stage 1
            assert all(not o["grads_left"] for o in outcomes), case
            # stage 1 reduces its fp32 sums in fp32; stages 2-3 send each backward's 16-bit gradients in 16
            # bits and sum them in fp32 at the receiver (Gloo), no_sync()'s fp32 sums in fp32
            assert all(o["wire"] == ("float32" if stage == 1 else "bfloat16" if precision == "bf16" else "float16")
                       for o in outcomes), (case, outcomes)
        else:
            # accumulating in bf16 (DeepSpeed's default) rounds at every micro-step: what the check above catches
            assert error > 1e-4, (case, error)


def report_worker(rank: int, world: int) -> tuple[int, int, str]:
    config = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 2}}
    engine = zerocore.initialize(_model(), config)
    report = engine.memory_report()
    engine.close()
    return report["bytes"]["grads"], report["psi_padded"], report["formula_text"]


def test_fp32_accumulation_is_in_the_memory_report_and_the_formula():
    for grads, psi_padded, formula in run_ranks(report_worker, WORLD, timeout=120):
        assert grads == 4 * psi_padded // WORLD
        assert formula == "2Psi + (4+12)Psi/N"
