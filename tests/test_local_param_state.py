"""DeepSpeed's local per-parameter accessors (``safe_get_local_grad``, ``safe_get_local_fp32_param``,
``safe_get_local_optimizer_state`` and their setters, Note [Local parameter state] in _local_param_state.py):
this rank's range of a parameter's sharded state, with no communication, checked against the full accessors
(themselves checked against a reference in test_full_param_state.py)."""

from __future__ import annotations

import pytest
import torch

import zerocore
from _dist import run_ranks
from test_full_param_state import _config, _model
from test_stage3 import data, loss_of

pytestmark = pytest.mark.timeout(300)

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _collectives(engine: zerocore.Engine) -> int:
    return sum(s.calls for comm in engine.comms.all().values() for s in comm.stats().values())


def _transformed(name: str, key: str, value: torch.Tensor) -> torch.Tensor:
    """A new value for a piece of state: another for every parameter and key, -0.0 and odd bits included."""
    salt = (sum(map(ord, name + key)) % 7) + 1
    out = value * (0.5 + 0.125 * salt) - 0.01 * salt
    if key == "exp_avg_sq":  # (Adam takes its square root)
        out = out.abs()
    return torch.where(value == 0, -0.0, out)  # elementwise: a range's new values are the whole's


def _set(mode: str, key: str, param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``zerocore.safe_set_{mode}_grad / _fp32_param / _optimizer_state``."""
    if key in _MOMENTS:
        getattr(zerocore, f"safe_set_{mode}_optimizer_state")(param, value, key)
    else:
        getattr(zerocore, f"safe_set_{mode}_{'grad' if key == 'grad' else 'fp32_param'}")(param, value)


def local_worker(rank: int, world: int, stage: int, dtype: str, mode: str, offload: str | None,
                 path: str | None) -> dict:
    """``mode`` "local": every rank reads its ranges and writes new values through the local setters;
    "full": the same new values through the full setters. Both then train two steps."""
    model = _model()
    engine = zerocore.initialize(model, _config(stage, dtype, offload, path))
    params = dict(model.named_parameters())
    seen: dict = {"ranges": {}, "differ": [], "steps": []}
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()  # moments exist
    engine.backward(loss_of(engine, *data(1, rank)))
    keys = ("grad", "master", *_MOMENTS) if stage == 3 else ("grad", *_MOMENTS)
    full = {name: {"grad": zerocore.safe_get_full_grad(p), "master": zerocore.safe_get_full_fp32_param(p),
                   **{k: zerocore.safe_get_full_optimizer_state(p, k) for k in _MOMENTS}} for name, p in params.items()}
    before = _collectives(engine)
    local = {}
    for name, p in params.items():
        start, stop = seen["ranges"][name] = zerocore.local_range(p)
        local[name] = {"grad": zerocore.safe_get_local_grad(p), "master": zerocore.safe_get_local_fp32_param(p),
                       **{k: zerocore.safe_get_local_optimizer_state(p, k) for k in _MOMENTS}}
        for key, value in local[name].items():
            if value.dtype != torch.float32 or not torch.equal(value, full[name][key].reshape(-1)[start:stop]):
                seen["differ"].append(f"{name}.{key}")
    seen["local_reads_communicate"] = _collectives(engine) != before
    seen["grad_sq_sum"] = sum(float(local[name]["grad"].double().square().sum()) for name in params)
    seen["full_grad_sq_sum"] = sum(float(full[name]["grad"].double().square().sum()) for name in params)
    read = local if mode == "local" else full
    for name, p in params.items():
        for key in keys:
            _set(mode, key, p, _transformed(name, key, read[name][key]))
    seen["local_writes_communicate"] = mode == "local" and _collectives(engine) != before
    # what every rank reads back whole, whichever setter wrote it: the fp32 state exactly the new values (the
    # gradient as stored in the gradients' dtype: compared across the two modes)
    seen["after_set"] = {}
    for name, p in params.items():
        for key in keys:
            got = (zerocore.safe_get_full_grad(p) if key == "grad" else zerocore.safe_get_full_fp32_param(p)
                   if key == "master" else zerocore.safe_get_full_optimizer_state(p, key))
            seen["after_set"][f"{name}.{key}"] = got.view(torch.int32).reshape(-1).tolist()
            if key != "grad" and not torch.equal(got, _transformed(name, key, full[name][key]).view(got.shape)):
                seen["differ"].append(f"{name}.{key} after set")
    engine.step()
    for step in (2, 3):
        loss = loss_of(engine, *data(step, rank))
        engine.backward(loss)
        engine.step()
        seen["steps"].append(loss.item())
    # (bit patterns: tensors do not travel back from a rank's process)
    seen["masters"] = {name: zerocore.safe_get_full_fp32_param(p).view(torch.int32).reshape(-1).tolist()
                       for name, p in params.items()}
    engine.close()
    return seen


@pytest.mark.parametrize("stage,dtype,world,offload", [
    (1, "fp32", 2, None), (2, "bf16", 2, None), (2, "fp16", 3, None), (3, "fp32", 2, None), (3, "bf16", 3, None),
    (3, "bf16", 2, "nvme+params"),
])
def test_local_state_is_this_ranks_range_and_writes_like_the_full_setters(stage, dtype, world, offload, tmp_path):
    paths = [tmp_path / "local", tmp_path / "full"]
    for path in paths:
        path.mkdir()
    by_local = run_ranks(local_worker, world, stage, dtype, "local", offload, str(paths[0]) if offload else None)
    by_full = run_ranks(local_worker, world, stage, dtype, "full", offload, str(paths[1]) if offload else None)
    for seen in by_local:
        assert seen["differ"] == [], seen["differ"]
        assert not seen["local_reads_communicate"] and not seen["local_writes_communicate"]
    # the ranks' ranges tile every parameter, and their squared gradient norms add up to the parameter's
    names = by_local[0]["ranges"]
    for name in names:
        ranges = sorted(seen["ranges"][name] for seen in by_local)
        numel = len(by_local[0]["masters"][name])
        assert sum(stop - start for start, stop in ranges) == numel, (name, ranges)
        covered = [start for start, stop in ranges if stop > start] + [numel]
        assert covered[0] == 0 and all(stop in covered for _, stop in ranges), (name, ranges)
    assert sum(seen["grad_sq_sum"] for seen in by_local) == pytest.approx(by_local[0]["full_grad_sq_sum"], rel=1e-9)
    # the local writes are the full writes of the same values: the training that follows is bitwise the same
    for local, full in zip(by_local, by_full):
        assert local["after_set"] == full["after_set"]
        assert local["steps"] == full["steps"]
        assert local["masters"] == full["masters"]


def refusals_worker(rank: int, world: int, stage: int) -> list[str]:
    model = _model()
    engine = zerocore.initialize(model, _config(stage, "bf16"))
    weight = next(model.blocks[0].parameters())
    start, stop = zerocore.local_range(weight)
    errors = []

    def attempt(fn) -> None:
        try:
            fn()
            errors.append("no error")
        except (RuntimeError, ValueError) as error:
            errors.append(str(error))

    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    moment = zerocore.safe_get_local_optimizer_state(weight, "exp_avg")
    master = zerocore.safe_get_local_fp32_param(weight)
    attempt(lambda: zerocore.safe_get_local_grad(weight))  # after the step: none
    attempt(lambda: zerocore.safe_set_local_optimizer_state(weight, torch.zeros(stop - start + 1), "exp_avg"))
    attempt(lambda: zerocore.safe_get_local_optimizer_state(weight, "momentum"))
    attempt(lambda: zerocore.safe_set_local_fp32_param(weight, master * 2))
    loss = loss_of(engine, *data(1, rank))
    attempt(lambda: zerocore.safe_set_local_optimizer_state(weight, moment * 2, "exp_avg"))  # mid forward
    errors.append("unchanged" if torch.equal(zerocore.safe_get_local_optimizer_state(weight, "exp_avg"), moment)
                  else "changed")
    engine.backward(loss)
    if rank == 0:  # a local call on one rank only issues nothing the other ranks would have to match
        zerocore.safe_set_local_optimizer_state(weight, moment * 2, "exp_avg")
        zerocore.safe_get_local_grad(weight)
    engine.step()
    engine.backward(loss_of(engine, *data(2, rank)))
    engine.step()
    errors.append("trained on")
    engine.close()
    return errors


@pytest.mark.parametrize("stage", [2, 3])
def test_misuse_raises_on_the_calling_rank_only_and_nothing_hangs(stage):
    for errors in run_ranks(refusals_worker, 2, stage):
        no_grad, wrong_size, wrong_key, master_write, mid_forward, unchanged, trained = errors
        assert "exists only between the accumulation boundary's engine.backward() and engine.step()" in no_grad
        assert "this rank holds" in wrong_size and "zerocore.local_range(param)" in wrong_size
        assert "optim_state_key must be one of" in wrong_key
        if stage == 3:
            assert master_write == "no error"
        else:
            assert "is for stage 3" in master_write and "safe_set_full_fp32_param()" in master_write
        assert "between a forward and its backward" in mid_forward
        assert unchanged == "unchanged"
        assert trained == "trained on"


def persistent_worker(rank: int, world: int) -> list[bool]:
    """Stage 3: a local master write reaches a unit gathered after it at once, and the root unit (whole since
    the backward) at the step, on every rank alike."""
    model = _model()
    config = _config(3, "bf16")
    config["optimizer"]["params"].update(lr=0.0, weight_decay=0.0)  # the step leaves every master where it is
    engine = zerocore.initialize(model, config)
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    engine.backward(loss_of(engine, *data(1, rank)))  # the root stays whole until the step
    targets = {"embed.weight": model.embed.weight, "blocks.1": next(model.blocks[1].parameters())}
    new = {}
    for name, p in targets.items():
        new[name] = torch.randn(p.shape, generator=torch.Generator().manual_seed(5))
        start, stop = zerocore.local_range(p)
        zerocore.safe_set_local_fp32_param(p, new[name].reshape(-1)[start:stop])
    rounded = {name: value.to(torch.bfloat16) for name, value in new.items()}
    results = []
    with zerocore.gathered([targets["blocks.1"]]):  # gathers the unit: the new values
        results.append(torch.equal(targets["blocks.1"].detach(), rounded["blocks.1"]))
    results.append(not torch.equal(targets["embed.weight"].detach(), rounded["embed.weight"]))  # the old values
    engine.step()
    with zerocore.gathered(list(targets.values())):
        results += [torch.equal(p.detach(), rounded[name]) for name, p in targets.items()]
    engine.close()
    return results


def test_a_stage3_master_write_reaches_units_gathered_later_and_held_units_at_the_step():
    for results in run_ranks(persistent_worker, 2):
        assert results == [True, True, True, True], results
