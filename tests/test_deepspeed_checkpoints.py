"""DeepSpeed ZeRO checkpoints loaded by engine.load_checkpoint (Note [DeepSpeed checkpoints] in
_deepspeed_checkpoint.py): the fixtures in tests/fixtures/deepspeed were written by DeepSpeed 0.19.8 on 2 ranks
(make_fixtures.py there), each with what DeepSpeed's own safe_get_full_* said every parameter's fp32 master and
moments were; a zerocore engine of another world size or stage loads them and must hold exactly those."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zerocore
from _dist import run_ranks
from _ds_fixture import CASES, build_fixture_model, fixture_batch, fixture_loss, param_groups, states_differing

pytestmark = pytest.mark.timeout(300)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed")


def _config(case: str, stage: int, offload: str | None = None) -> dict:
    config = copy.deepcopy(CASES[case]["deepspeed"])
    config["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": offload}
    return config


def load_worker(rank: int, world: int, case: str, stage: int, directory: str, offload: str | None,
                tag: str | None = None) -> dict:
    model = build_fixture_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    groups = param_groups(model, CASES[case])
    engine = zerocore.initialize(model, _config(case, stage, offload),
                                 param_groups=groups if CASES[case]["groups"] else None)
    path, client_state = engine.load_checkpoint(directory, tag=tag)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    seen: dict = {"path": os.path.basename(path), "client_state": client_state,
                  "differ": states_differing(model, expected)}
    whole = engine.full_state_dict(rank0_only=False)
    dtype = whole["embed.weight"].dtype
    seen["frozen_kept"] = all(torch.equal(whole[n], initial[n].to(whole[n].dtype)) for n in ("frozen.weight", "frozen.bias"))
    seen["params_are_masters"] = all(torch.equal(whole[n], expected[f"master/{n}"].to(dtype))
                                     for n in ("embed.weight", "hidden.weight", "scale"))
    seen["buffer"] = model.seen.tolist()
    seen["global_steps"], seen["adam_steps"] = engine.global_steps, engine.optimizer_state.step_count
    seen["global_samples"] = engine.global_samples
    seen["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    seen["loss_scaler"] = engine.loss_scaler.state_dict()
    # the resumed run's first update against DeepSpeed's own fourth step from the same state and batch: the
    # step count (Adam's bias correction), lr and moments all enter it (an update from t=1 would be 1.7x this one)
    # DeepSpeed's two ranks' batches, spread over this run's ranks so the averaged gradient is the same
    mine = [k for k in range(2) if k % world == rank] or [0]
    loss = sum(fixture_loss(engine(fixture_batch(3, k)[0]), fixture_batch(3, k)[1]) for k in mine)
    loss = loss * (world / 2 if any(k % world == rank for k in range(2)) else 0.0)
    engine.backward(loss)
    engine.step()
    seen["trains_on"] = bool(torch.isfinite(loss))
    seen["loss_scaler_after_step"] = engine.loss_scaler.state_dict()
    after = load_file(os.path.join(directory, "expected_after_step.safetensors"))
    seen["update_distance"] = {}
    for name, param in model.named_parameters():
        if param.requires_grad and not name.startswith("unused."):  # (DeepSpeed decays a parameter with no
            before = expected[f"master/{name}"]                       # gradient, zerocore leaves it alone)
            ds_update = after[f"master/{name}"] - before
            ours = zerocore.safe_get_full_fp32_param(param) - before
            seen["update_distance"][name] = float((ours - ds_update).norm() / ds_update.norm())
    engine.close()
    return seen


_UNIVERSAL = "global_step3_universal"  # ds_to_universal's conversion of the case's checkpoint (make_fixtures.py)


@pytest.mark.parametrize("case,world,stage,offload,tag", [
    ("stage1-fp32", 2, 1, None, None), ("stage1-fp32", 3, 3, None, None),
    ("stage2-bf16-groups-warmup", 2, 2, None, None), ("stage2-bf16-groups-warmup", 3, 3, None, None),
    ("stage2-bf16-offload", 2, 2, "cpu", None), ("stage2-bf16-offload", 1, 1, None, None),
    ("stage3-bf16", 2, 3, None, None), ("stage3-bf16", 3, 2, None, None),
    ("stage3-fp32", 2, 3, None, None), ("stage3-fp32", 4, 1, None, None),
    ("stage3-bf16-no-frozen", 2, 3, None, None), ("stage3-bf16-no-frozen", 2, 2, None, None),
    ("stage2-fp16-overflow", 2, 2, None, None), ("stage2-fp16-overflow", 3, 3, None, None),
    ("stage3-fp16-overflow", 2, 3, None, None), ("stage3-fp16-overflow", 1, 1, "cpu", None),
    # DeepSpeed's BF16_Optimizer (bf16, fp32 gradient accumulation, stage 1), resumed accumulating in fp32 too
    ("stage1-bf16-fp32-accum", 2, 1, None, None), ("stage1-bf16-fp32-accum", 3, 2, None, None),
    # DeepSpeed's universal checkpoints: every parameter whole, its moments beside it
    ("stage2-bf16-groups-warmup", 3, 3, None, _UNIVERSAL), ("stage2-bf16-groups-warmup", 1, 2, "cpu", _UNIVERSAL),
    ("stage3-bf16", 2, 1, None, _UNIVERSAL), ("stage3-bf16", 3, 3, None, _UNIVERSAL),
])
def test_a_deepspeed_checkpoint_loads_exactly_at_any_world_size_and_stage(case, world, stage, offload, tag):
    directory = os.path.join(FIXTURES, case)
    with open(os.path.join(directory, "expected.json")) as f:
        facts = json.load(f)
    for seen in run_ranks(load_worker, world, case, stage, directory, offload, tag):
        assert seen["path"] == (tag or "global_step3")
        assert seen["differ"] == [], seen["differ"]
        assert seen["frozen_kept"] and seen["params_are_masters"], seen
        assert seen["buffer"] == [3.0, 3.0, 3.0]
        assert seen["client_state"] == {"epoch": 7, "note": "from deepspeed"}
        skipped = facts.get("skipped_steps", 0)  # fp16 overflows: counted steps that updated nothing
        assert (seen["global_steps"], seen["adam_steps"]) == (3, 3 - skipped)
        # DeepSpeed's saved count (3 steps x 4 samples x its 2 ranks), not the steps at this run's batch
        assert seen["global_samples"] == 24, seen["global_samples"]
        if "loss_scaler" in facts:  # the resumed scale, and the counters that decide its next change, DeepSpeed's
            assert seen["loss_scaler"] == facts["loss_scaler"]
            assert seen["loss_scaler_after_step"] == facts["loss_scaler_after_step"]
        assert seen["lr"] == pytest.approx(facts["lr"], rel=1e-12)
        assert seen["trains_on"]
        # fp32: summation order only; bf16: gradients rounded to bf16 along other paths
        sixteen_bits = any(CASES[case]["deepspeed"].get(k, {}).get("enabled") for k in ("bf16", "fp16"))
        tolerance = 5e-2 if sixteen_bits else 1e-4
        assert max(seen["update_distance"].values()) < tolerance, seen["update_distance"]


def fp16_from_bf16_worker(rank: int, world: int, directory: str) -> tuple[dict, dict]:
    config = _config("stage3-bf16", 3)
    del config["bf16"]
    config["fp16"] = {"enabled": True, "initial_scale_power": 10}
    model = build_fixture_model()
    engine = zerocore.initialize(model, config, param_groups=param_groups(model, CASES["stage3-bf16"]))
    before = engine.loss_scaler.state_dict()
    engine.load_checkpoint(directory)
    after = engine.loss_scaler.state_dict()
    engine.close()
    return before, after


def test_an_fp16_run_resumed_from_a_bf16_checkpoint_keeps_its_own_dynamic_scale():
    """A bf16 DeepSpeed run saves a static scaler of scale 1: as an fp16 run's dynamic scale it would make
    small gradients underflow until the scale grew back."""
    for before, after in run_ranks(fp16_from_bf16_worker, 2, os.path.join(FIXTURES, "stage3-bf16")):
        assert before["scale"] == 1024.0 and after == before, (before, after)


def mismatch_worker(rank: int, world: int, directory: str) -> str:
    model = build_fixture_model()
    model.hidden = torch.nn.Linear(8, 9)  # another shape than the checkpoint's
    model.head.weight = model.embed.weight
    engine = zerocore.initialize(model, _config("stage1-fp32", 2))
    before = zerocore.safe_get_full_fp32_param(model.embed.weight)
    try:
        engine.load_checkpoint(directory)
        return "no error"
    except ValueError as error:
        unchanged = torch.equal(before, zerocore.safe_get_full_fp32_param(model.embed.weight))
        return f"{error} | unchanged={unchanged}"


def test_another_model_is_refused_on_every_rank_with_nothing_changed():
    for message in run_ranks(mismatch_worker, 2, os.path.join(FIXTURES, "stage1-fp32")):
        assert "'hidden.weight'" in message and "nothing was changed" in message and "unchanged=True" in message, message


def test_a_checkpoint_missing_a_rank_file_is_refused(tmp_path):
    copy_dir = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "stage3-fp32"), copy_dir)
    os.remove(copy_dir / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    for message in run_ranks(mismatch_free_worker, 2, str(copy_dir)):
        assert "written by 2 ranks but holds 1 optimizer files" in message, message


def mismatch_free_worker(rank: int, world: int, directory: str) -> str:
    engine = zerocore.initialize(build_fixture_model(), _config("stage3-fp32", 3))
    try:
        engine.load_checkpoint(directory)
    except ValueError as error:
        return str(error)
    return "no error"


def test_an_unknown_layout_is_refused_by_name(tmp_path):
    copy_dir = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "stage3-fp32"), copy_dir)
    for rank in range(2):  # optimizer files without ZeRO's keys (another optimizer's layout)
        torch.save({"optimizer_state_dict": {"state": {}}},
                   copy_dir / "global_step3" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    for message in run_ranks(mismatch_free_worker, 2, str(copy_dir)):
        assert "is not a DeepSpeed ZeRO (stage 1-3) checkpoint this version reads" in message, message
        assert "'zero_stage'" in message and "nothing was changed" in message, message


def test_a_range_of_no_elements_reads_as_an_empty_tensor():
    """A parameter of no elements (numel 0) in a DeepSpeed checkpoint: its range is empty, at any offset."""
    from zerocore._deepspeed_checkpoint import _Flat

    flat = _Flat([torch.arange(3.0), torch.arange(2.0)])
    assert torch.equal(flat.read(1, 3), torch.tensor([1.0, 2.0, 0.0]))
    assert flat.read(2, 0).numel() == 0 and flat.read(5, 0).numel() == 0
    assert _Flat([]).read(0, 0).numel() == 0


def universal_folder_worker(rank: int, world: int, directory: str) -> tuple[str, int, int, bool]:
    model = build_fixture_model()
    engine = zerocore.initialize(model, _config("stage3-bf16", 2), param_groups=param_groups(model, CASES["stage3-bf16"]))
    path, _ = engine.load_checkpoint(directory)  # the conversion's folder itself, no tag
    expected = load_file(os.path.join(os.path.dirname(directory), "expected.safetensors"))
    same = states_differing(model, expected) == []
    return os.path.basename(path), engine.global_steps, engine.optimizer_state.step_count, same


def test_a_universal_checkpoint_loads_from_its_own_folder():
    for name, global_steps, adam_steps, same in run_ranks(universal_folder_worker, 2,
                                                          os.path.join(FIXTURES, "stage3-bf16", _UNIVERSAL)):
        assert (name, global_steps, adam_steps, same) == (_UNIVERSAL, 3, 3, True)


def test_a_universal_checkpoint_missing_a_parameter_file_is_refused(tmp_path):
    copy_dir = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "stage3-fp32"), copy_dir)
    shutil.copytree(os.path.join(FIXTURES, "stage3-bf16", _UNIVERSAL), copy_dir / _UNIVERSAL)
    os.remove(copy_dir / _UNIVERSAL / "zero" / "hidden.weight" / "fp32.pt")
    for message in run_ranks(mismatch_free_worker, 2, str(copy_dir / _UNIVERSAL)):
        assert "hidden.weight/fp32.pt is missing" in message and "incomplete" in message, message


def load_universal_worker(rank: int, world: int, directory: str) -> str:
    """DeepSpeed's config key: load_checkpoint without a tag follows latest_universal, as DeepSpeed does."""
    config = {**_config("stage3-fp32", 3), "checkpoint": {"load_universal": True}}
    engine = zerocore.initialize(build_fixture_model(), config)
    try:
        path, _ = engine.load_checkpoint(directory)
    except (ValueError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return os.path.basename(path)


def test_load_universal_follows_latest_universal_and_refuses_on_every_rank_without_it(tmp_path):
    assert run_ranks(load_universal_worker, 2, os.path.join(FIXTURES, "stage3-bf16")) == [_UNIVERSAL] * 2
    copy_dir = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "stage3-fp32"), copy_dir)  # a plain checkpoint: no latest_universal
    for message in run_ranks(load_universal_worker, 2, str(copy_dir)):
        assert "latest_universal does not exist" in message, message
