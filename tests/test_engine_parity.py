"""Stages 1-2 against DDP + torch.optim.AdamW, elementwise, on 1, 2 and 4 Gloo ranks."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _models import batch, build, loss_fn
from _parity import ReferencePair, as_dtype

pytestmark = pytest.mark.timeout(600)


@dataclass(frozen=True)
class Case:
    model: str
    stage: int
    steps: int = 20
    gas: int = 1
    clip: float = 0.0
    weight_decay: float = 0.01
    bucket: int = 2000  # elements: several buckets even for these small models
    rtol: float = 1e-5  # for the losses; parameters follow tests/_parity.py's rule
    atol: float = 1e-6
    extra: dict = field(default_factory=dict)


def _config(case: Case, **overrides) -> dict:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8,
                                                  "weight_decay": case.weight_decay}},
        "gradient_accumulation_steps": case.gas,
        "gradient_clipping": case.clip,
        "zero_optimization": {"stage": case.stage, "reduce_bucket_size": case.bucket,
                              "allgather_bucket_size": case.bucket},
    }
    config.update(overrides)
    return config


def parity_worker(rank: int, world: int, cases: list[Case]) -> list[str]:
    done = []
    for case in cases:
        model = build(case.model)
        reference = ReferencePair(
            model,
            lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.99),
                                        eps=1e-8, weight_decay=case.weight_decay, foreach=False),
            wrap=lambda m: DDP(m, find_unused_parameters=case.model == "odd"))
        engine = zerocore.initialize(model, _config(case))
        for step in range(case.steps):
            micro = [batch(case.model, torch.Generator().manual_seed(10_000 * step + 100 * rank + m))
                     for m in range(case.gas)]
            losses = []
            for x, y in micro:
                loss = loss_fn(case.model, engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            x = torch.cat([m[0] for m in micro])
            y = torch.cat([m[1] for m in micro])
            ref_loss, norm = reference.train_step(lambda module, dtype: loss_fn(case.model, module(as_dtype(x, dtype)), y),
                                                  clip=case.clip)
            if case.clip:
                assert engine.get_global_grad_norm() == pytest.approx(norm.item(), rel=1e-4)
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=case.rtol, atol=case.atol,
                                       msg=lambda m: f"{case} step {step} loss: {m}")
        reference.assert_matches(engine.full_state_dict(rank0_only=False), label=str(case))
        done.append(f"{case.model}/stage{case.stage}")
    return done


PARITY = [Case(m, s) for m in ("mlp", "transformer") for s in (1, 2, 3)]
EXTRAS = [
    Case("mlp", 1, steps=8, gas=4), Case("mlp", 2, steps=8, gas=4), Case("transformer", 3, steps=6, gas=4),
    Case("mlp", 1, steps=10, clip=0.05), Case("transformer", 2, steps=10, clip=0.5),
    Case("transformer", 3, steps=10, clip=0.5),
    # "odd"'s unused layer gets no gradient: left alone, weight decay notwithstanding, as torch AdamW leaves it
    Case("odd", 1, steps=10, weight_decay=0.1), Case("odd", 2, steps=10, weight_decay=0.1),
    Case("odd", 3, steps=10, weight_decay=0.1),
]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_parity_with_ddp(world):
    cases = PARITY + (EXTRAS if world != 1 else EXTRAS[:3])
    results = run_ranks(parity_worker, world, cases, timeout=500)
    assert all(len(r) == len(cases) for r in results)


def bf16_worker(rank: int, world: int, stage: int) -> list[float]:
    model = build("transformer")
    reference = copy.deepcopy(model)
    ddp = DDP(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01,
                            foreach=False)
    case = Case("transformer", stage)
    engine = zerocore.initialize(model, _config(case, bf16={"enabled": True}))
    gaps = []
    for step in range(20):
        x, y = batch("transformer", torch.Generator().manual_seed(10_000 * step + rank))
        loss = loss_fn("transformer", engine(x), y)
        engine.backward(loss)
        engine.step()
        ref = loss_fn("transformer", ddp(x), y)
        ref.backward()
        opt.step()
        opt.zero_grad()
        gaps.append(abs(loss.item() - ref.item()) / ref.item())
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(v.dtype == torch.bfloat16 for v in engine.full_state_dict(rank0_only=False).values())
    return gaps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_tracks_fp32_reference(stage):
    """Documented tolerance: bf16 compute with fp32 master stays within 2% of the fp32 loss over 20 steps."""
    for gaps in run_ranks(bf16_worker, 2, stage):
        assert max(gaps) < 0.02, gaps


def fp16_overflow_worker(rank: int, world: int, stage: int) -> dict:
    model = build("mlp")
    config = _config(Case("mlp", stage), fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine = zerocore.initialize(model, config)
    before = None
    for step in range(3):
        x, y = batch("mlp", torch.Generator().manual_seed(step + 10 * rank))
        loss = loss_fn("mlp", engine(x.half()), y)
        if step == 1:
            before = list(engine.full_state_dict(rank0_only=False).values())
            if rank == world - 1:
                loss = loss * float("inf")  # only the last rank overflows
        scale_before = engine.loss_scale
        engine.backward(loss)
        engine.step()
        if step == 1:
            after = engine.full_state_dict(rank0_only=False).values()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
            return {"unchanged": unchanged, "skipped": engine.skipped_steps, "scale": (scale_before, engine.loss_scale)}
    return {}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_skips_step_on_every_rank_and_lowers_scale(stage):
    for result in run_ranks(fp16_overflow_worker, 2, stage):
        assert result["unchanged"] and result["skipped"] == 1
        assert result["scale"] == (256.0, 128.0)


def fp16_window_worker(rank: int, world: int, stage: int) -> list[float]:
    """A dynamic scale that doubles every step must unscale with the scale the gradients were made with."""
    results, scales = [], []
    for fp16 in ({"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1},
                 {"enabled": True, "loss_scale": 256.0}):
        model = build("mlp")
        engine = zerocore.initialize(model, _config(Case("mlp", stage), fp16=fp16))
        for step in range(3):
            x, y = batch("mlp", torch.Generator().manual_seed(step + 10 * rank))
            engine.backward(loss_fn("mlp", engine(x.half()), y))
            engine.step()
        scales.append(engine.loss_scale)
        results.append(torch.cat([v.float().reshape(-1) for v in engine.full_state_dict(rank0_only=False).values()]))
    assert scales == [1024.0, 256.0], scales  # DeepSpeed's rule: the first step after start does not grow it
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    return scales


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_dynamic_scale_growth_unscales_with_the_scale_in_effect(stage):
    run_ranks(fp16_window_worker, 2, stage)


def _train_with_groups(rank: int, stage: int, model: torch.nn.Module, groups: Any, schedule: Any, steps: int,
                       each_step: Any = None) -> tuple[zerocore.Engine, ReferencePair]:
    """The engine and a DDP + torch AdamW reference, both with ``groups(model)`` and a ``schedule(optimizer)``
    lr scheduler each, trained ``steps`` steps on the transformer's batches; ``each_step(optimizers, step)``
    runs after every step."""
    reference = ReferencePair(
        model, lambda m: torch.optim.AdamW(groups(m), lr=3e-3, betas=(0.9, 0.99), eps=1e-8, foreach=False), wrap=DDP)
    engine = zerocore.initialize(model, _config(Case("transformer", stage)), param_groups=groups(model))
    optimizers = (*reference.optimizers, engine.optimizer)
    schedulers = [s for s in map(schedule, optimizers) if s is not None]
    for step in range(steps):
        x, y = batch("transformer", torch.Generator().manual_seed(10_000 * step + rank))
        engine.backward(loss_fn("transformer", engine(x), y))
        engine.step()
        reference.train_step(lambda module, dtype: loss_fn("transformer", module(x), y))
        for s in schedulers:
            s.step()
        if each_step is not None:
            each_step(optimizers, step)
    return engine, reference


def param_groups_worker(rank: int, world: int, stage: int) -> bool:
    """Two param groups (no weight decay on biases and norms, another lr) and an lr scheduler."""
    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}]

    engine, reference = _train_with_groups(rank, stage, build("transformer"), groups,
                                           lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 8)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"param groups, stage {stage}")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_and_lr_scheduler_match_torch(stage):
    assert all(run_ranks(param_groups_worker, 2, stage))


def layer_decay_worker(rank: int, world: int, stage: int, save_dir: str) -> bool:
    """BEiT's and MAE's layer-wise lr decay: each group carries its own ``lr_scale`` and ``layer_id``, which the
    training loop reads to set the group's lr every step (``group["lr"] = lr * group["lr_scale"]``); torch and
    DeepSpeed keep a group's own keys. Also per-group betas and eps, a group given torch's flags at their
    defaults, and a tensor lr (torch takes one), which a checkpoint saves as its number and a load writes back
    into the same tensor."""
    model = build("transformer")

    def groups(m):
        named = list(m.named_parameters())
        depth = {name: (0 if name.startswith("embed") else 3 if name.startswith(("norm", "head")) else
                        1 + int(name.split(".")[1])) for name, _ in named}
        out = [{"params": [p for name, p in named if depth[name] == layer], "layer_id": layer,
                "lr_scale": 0.5 ** (3 - layer), "weight_decay": 0.05} for layer in range(4)]
        out[1].update(betas=(0.8, 0.95), eps=1e-6, amsgrad=False, maximize=False, foreach=None)
        out[2]["lr"] = torch.tensor(1e-3)
        return out

    def layer_decay(optimizers, step):
        for o in optimizers:
            for group in o.param_groups:
                lr = 3e-3 * (0.7 ** step) * group["lr_scale"]
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr

    engine, reference = _train_with_groups(rank, stage, model, groups, lambda o: None, 5, layer_decay)
    assert [g["layer_id"] for g in engine.optimizer.param_groups] == [0, 1, 2, 3]
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"layer decay, stage {stage}")
    lr_tensor = engine.optimizer.param_groups[2]["lr"]
    saved = lr_tensor.item()
    engine.save_checkpoint(save_dir, tag="t")
    lr_tensor.fill_(0.0)
    engine.optimizer.param_groups[1]["eps"] = 1.0
    engine.load_checkpoint(save_dir, tag="t")
    groups_now = engine.optimizer.param_groups
    assert groups_now[2]["lr"] is lr_tensor and lr_tensor.item() == saved
    assert groups_now[1]["eps"] == 1e-6 and groups_now[1]["betas"] == (0.8, 0.95)
    assert [g["lr_scale"] for g in groups_now] == [0.125, 0.25, 0.5, 1.0]
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_param_groups_keep_their_own_keys_for_layer_wise_lr_decay(stage, tmp_path):
    assert all(run_ranks(layer_decay_worker, 2, stage, str(tmp_path)))


def empty_group_worker(rank: int, world: int, stage: int, save_dir: str) -> bool:
    """HF's create_optimizer on a LoRA-like model: the no-decay group is empty (its biases and norms are
    frozen). torch keeps the empty group, so group 2 stays group 2 for per-group lambdas and index writes."""
    model = build("transformer")
    for p in model.parameters():
        if p.dim() < 2:
            p.requires_grad_(False)

    def groups(m):
        matrices = [p for p in m.parameters() if p.dim() >= 2]
        return [{"params": matrices[::2], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
                {"params": matrices[1::2], "weight_decay": 0.0, "lr": 1e-3}]

    def write_group_2(optimizers, step):  # a callback writing one group by index
        for o in optimizers:
            o.param_groups[2]["weight_decay"] = 0.05 * step

    lambdas = [lambda s: 1.0, lambda s: 0.0, lambda s: 0.5 ** s]
    engine, reference = _train_with_groups(rank, stage, model, groups,
                                           lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambdas), 4, write_group_2)
    assert [len(g["params"]) for g in engine.optimizer.param_groups][1] == 0
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"empty group, stage {stage}")
    engine.save_checkpoint(save_dir, tag="t")
    engine.load_checkpoint(save_dir, tag="t")  # the saved groups, the empty one included, match the engine's
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_an_empty_param_group_keeps_its_place_as_in_torch(stage, tmp_path):
    assert all(run_ranks(empty_group_worker, 2, stage, str(tmp_path)))
