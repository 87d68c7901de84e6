"""DeepSpeed ZeRO checkpoints loaded by engine.load_checkpoint (Note [DeepSpeed checkpoints] in
_deepspeed_checkpoint.py): the fixtures in tests/fixtures/deepspeed were written by DeepSpeed 0.19.8 on 2 ranks
(make_fixtures.py there), each with what DeepSpeed's own safe_get_full_* said every parameter's fp32 master and
moments were; a zerocore engine of another world size or stage loads them and must hold exactly those."""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, client_state = engine.load_checkpoint(directory, tag=tag)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    seen: dict = {"path": os.path.basename(path), "client_state": client_state,
                  "differ": states_differing(model, expected),
                  "warned_of_8393": any("deepspeedai/DeepSpeed#8393" in str(w.message) for w in caught)}
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
    # DeepSpeed's ranks' batches, spread over this run's ranks so the averaged gradient is the same (in one
    # forward on every rank: a rank given two batches must not run a forward the others do not)
    ds_world = CASES[case].get("world", 2)
    mine = [k for k in range(ds_world) if k % world == rank] or [0]
    output = engine(torch.cat([fixture_batch(3, k)[0] for k in mine]))
    loss = sum(fixture_loss(out, fixture_batch(3, k)[1]) for k, out in zip(mine, output.split(4)))
    loss = loss * (world / ds_world if any(k % world == rank for k in range(ds_world)) else 0.0)
    engine.backward(loss)
    engine.step()
    seen["trains_on"] = bool(torch.isfinite(loss))
    seen["loss_scaler_after_step"] = engine.loss_scaler.state_dict()
    after = load_file(os.path.join(directory, "expected_after_step.safetensors"))
    if CASES[case].get("gradients_over_scale"):  # DeepSpeed's next update is its bug's: torch's from the state
        after = _torch_adamw_step(expected, seen["adam_steps"])
    seen["update_distance"] = {}
    for name, param in model.named_parameters():
        if param.requires_grad and not name.startswith("unused."):  # (DeepSpeed decays a parameter with no
            before = expected[f"master/{name}"]                       # gradient, zerocore leaves it alone)
            ds_update = after[f"master/{name}"] - before
            ours = zerocore.safe_get_full_fp32_param(param) - before
            seen["update_distance"][name] = float((ours - ds_update).norm() / ds_update.norm())
    engine.close()
    return seen


def _torch_adamw_step(state: dict[str, torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
    """The masters after torch's AdamW (the fixtures' hyperparameters) takes the fourth step from ``state``
    (masters and moments by name, ``steps`` taken) on DeepSpeed's two ranks' batches, in fp32."""
    model = build_fixture_model()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[f"master/{name}"])
            optimizer.state[param] = {"step": torch.tensor(float(steps)), "exp_avg": state[f"exp_avg/{name}"].clone(),
                                      "exp_avg_sq": state[f"exp_avg_sq/{name}"].clone()}
    (sum(fixture_loss(model(fixture_batch(3, k)[0]), fixture_batch(3, k)[1]) for k in range(2)) / 2).backward()
    optimizer.step()
    return {f"master/{n}": p.detach().clone() for n, p in params.items()}


_UNIVERSAL = "global_step3_universal"  # ds_to_universal's conversion of the case's checkpoint (make_fixtures.py)


@pytest.mark.parametrize("case,world,stage,offload,tag", [
    ("stage1-fp32", 2, 1, None, None), ("stage1-fp32", 3, 3, None, None),
    ("stage2-bf16-groups-warmup", 2, 2, None, None), ("stage2-bf16-groups-warmup", 3, 3, None, None),
    ("stage2-bf16-offload", 2, 2, "cpu", None), ("stage2-bf16-offload", 1, 1, None, None),
    ("stage3-bf16", 2, 3, None, None), ("stage3-bf16", 3, 2, None, None),
    ("stage3-fp32", 2, 3, None, None), ("stage3-fp32", 4, 1, None, None),
    ("stage3-bf16-no-frozen", 2, 3, None, None), ("stage3-bf16-no-frozen", 2, 2, None, None),
    ("stage2-bf16-no-frozen", 2, 2, None, None), ("stage2-bf16-no-frozen", 3, 3, None, None),
    ("stage2-bf16-round-robin", 2, 2, None, None), ("stage2-bf16-round-robin", 3, 1, None, None),
    ("stage2-fp16-overflow", 2, 2, None, None), ("stage2-fp16-overflow", 3, 3, None, None),
    ("stage3-fp16-overflow", 2, 3, None, None), ("stage3-fp16-overflow", 1, 1, "cpu", None),
    # DeepSpeed's BF16_Optimizer (bf16, fp32 gradient accumulation, stage 1), resumed accumulating in fp32 too
    ("stage1-bf16-fp32-accum", 2, 1, None, None), ("stage1-bf16-fp32-accum", 3, 2, None, None),
    # stage 0: the optimizer's whole state by position in the model state file (Note [DeepSpeed stage-0 checkpoints])
    ("stage0-fp32", 2, 1, None, None), ("stage0-fp32", 3, 3, None, None),
    ("stage0-bf16", 2, 2, None, None), ("stage0-bf16", 1, 3, "cpu", None),
    ("stage0-fp16-overflow", 2, 2, None, None), ("stage0-fp16-overflow", 3, 1, None, None),
    ("stage0-fp32-every-param", 2, 3, None, None),
    # DeepSpeed's universal checkpoints: every parameter whole, its moments beside it
    ("stage2-bf16-groups-warmup", 3, 3, None, _UNIVERSAL), ("stage2-bf16-groups-warmup", 1, 2, "cpu", _UNIVERSAL),
    ("stage3-bf16", 2, 1, None, _UNIVERSAL), ("stage3-bf16", 3, 3, None, _UNIVERSAL),
    # written by 3 DeepSpeed ranks
    ("stage2-bf16-world3", 2, 2, None, None), ("stage2-bf16-world3", 4, 3, None, None),
    ("stage2-bf16-world3", 2, 1, None, _UNIVERSAL),
    ("stage3-fp32-world3", 3, 3, None, None), ("stage3-fp32-world3", 2, 1, "cpu", None),
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
        assert seen["warned_of_8393"] == bool(CASES[case].get("gradients_over_scale"))
        assert seen["client_state"] == {"epoch": 7, "note": "from deepspeed"}
        skipped = facts.get("skipped_steps", 0)  # fp16 overflows: counted steps that updated nothing
        # (stage 0's FP16_Optimizer counts one more: its first step initializes the state)
        assert (seen["global_steps"], seen["adam_steps"]) == (3, facts.get("adam_steps", 3 - skipped))
        # DeepSpeed's saved count (3 steps x 4 samples x its ranks), not the steps at this run's batch
        assert seen["global_samples"] == 12 * CASES[case].get("world", 2), seen["global_samples"]
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
        assert "is not a DeepSpeed ZeRO (stage 0-3) checkpoint this version reads" in message, message
        assert "'zero_stage'" in message and "nothing was changed" in message, message


def stage0_order_worker(rank: int, world: int, case: str, order: str) -> str:
    """A stage-0 checkpoint loaded by an engine whose param groups are not the DeepSpeed run's."""
    model = build_fixture_model()
    groups = param_groups(model, CASES[case])
    if order == "one group":
        groups = [p for g in groups for p in g["params"]]
    else:  # the same groups, the first one's parameters in another order
        groups[0]["params"] = groups[0]["params"][::-1]
    engine = zerocore.initialize(model, _config(case, 2), param_groups=groups)
    before = zerocore.safe_get_full_fp32_param(model.embed.weight)
    try:
        engine.load_checkpoint(os.path.join(FIXTURES, case))
        return "no error"
    except ValueError as error:
        unchanged = torch.equal(before, zerocore.safe_get_full_fp32_param(model.embed.weight))
        x, y = fixture_batch(0, rank)
        engine.backward(fixture_loss(engine(x), y))
        engine.step()  # (every rank raised: they train on together)
        return f"{error} | unchanged={unchanged}"


@pytest.mark.parametrize("case,order,names", [
    ("stage0-fp32", "one group", "param groups of [3, 3] parameters; the engine's groups hold [6]"),
    ("stage0-fp32", "reversed", "an Adam moment of shape [20, 8] at the position of 'unused.weight'"),
    ("stage0-bf16", "one group", "param groups of [248, 12] elements; the engine's groups hold [260]"),
    ("stage0-bf16", "reversed", "fp32 master of 'unused.weight' is not the one its torch.bfloat16 weight"),
])
def test_a_stage_0_checkpoint_in_other_param_groups_is_refused_with_nothing_changed(case, order, names):
    """Note [DeepSpeed stage-0 checkpoints]: the optimizer state is kept by position, as DeepSpeed (and torch)
    load it; groups of other sizes, moments of other shapes or masters whose 16-bit copies differ name it."""
    for message in run_ranks(stage0_order_worker, 2, case, order):
        assert names in message and "model_parameters" in message and "unchanged=True" in message, message


def stage0_without_frozen_worker(rank: int, world: int, directory: str) -> dict:
    model = build_fixture_model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = zerocore.initialize(model, _config("stage0-fp32-every-param", 2))
    engine.load_checkpoint(directory)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    whole = engine.full_state_dict(rank0_only=False)
    return {"differ": states_differing(model, expected),
            "frozen_kept": all(torch.equal(whole[n], value) for n, value in frozen.items())}


def test_a_stage_0_checkpoint_saved_without_its_frozen_parameters_keeps_the_models_own(tmp_path):
    """DeepSpeed's exclude_frozen_parameters=True at stage 0 (the module's frozen weights left out, their
    positions still in the optimizer's group of every parameter): the trainable ones load exactly, the frozen
    ones stay the model's."""
    copy_dir = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "stage0-fp32-every-param"), copy_dir)
    file = copy_dir / "global_step3" / "mp_rank_00_model_states.pt"
    state = torch.load(file, weights_only=False)
    state["module"] = {k: v for k, v in state["module"].items() if not k.startswith("frozen.")}
    torch.save(state, file)
    for seen in run_ranks(stage0_without_frozen_worker, 2, str(copy_dir)):
        assert seen == {"differ": [], "frozen_kept": True}, seen


def test_a_stage_1_checkpoint_without_its_optimizer_files_is_not_read_as_stage_0(tmp_path):
    copy_dir = tmp_path / "ds"
    shutil.copytree(os.path.join(FIXTURES, "stage1-fp32"), copy_dir)
    for rank in range(2):
        os.remove(copy_dir / "global_step3" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    for message in run_ranks(mismatch_free_worker, 2, str(copy_dir)):
        assert "no ZeRO optimizer files (zero_pp_rank_*_optim_states.pt) for its stage 1" in message, message


def test_info_describes_deepspeed_checkpoints_of_stage_0_and_1():
    """``python -m zerocore.checkpoint info`` on DeepSpeed checkpoints: stage 0's parameters are named by the
    module's weights, its optimizer state's groups by their sizes (a load names them)."""
    from zerocore._deepspeed_checkpoint import describe

    lines = describe(os.path.join(FIXTURES, "stage0-bf16", "global_step3"))
    assert "ZeRO stage 0 checkpoint of 2 ranks" in lines[0] and "optimizer 4" in lines[1], lines
    assert lines[2].startswith("param groups of [248, 12] trainable elements, kept by position"), lines
    assert "  hidden.weight [8, 8]" in lines and "  seen [3]" not in lines, lines  # (a buffer, not a parameter)
    lines = describe(os.path.join(FIXTURES, "stage1-fp32", "global_step3"))
    assert "ZeRO stage 1 checkpoint" in lines[0] and lines[2].startswith("6 trainable parameters"), lines


def misplaced_universal_worker(rank: int, world: int) -> str:
    model = build_fixture_model()
    engine = zerocore.initialize(model, _config("stage2-bf16-round-robin", 2),
                                 param_groups=param_groups(model, CASES["stage2-bf16-round-robin"]))
    before = zerocore.safe_get_full_fp32_param(model.hidden.weight)
    try:
        engine.load_checkpoint(os.path.join(FIXTURES, "stage2-bf16-round-robin"), tag=_UNIVERSAL)
        return "no error"
    except ValueError as error:
        return f"{error} | unchanged={torch.equal(before, zerocore.safe_get_full_fp32_param(model.hidden.weight))}"


def test_a_universal_conversion_that_misplaced_parameters_is_refused_naming_why():
    """DeepSpeed 0.19.8's ds_to_universal of a round_robin_gradients run (LLaMA-Factory's ZeRO-2 config) writes
    hidden.weight and unused.weight from each other's elements (its fragment addresses ignore the round-robin
    order): each master is checked against the weight the model state holds, so the load is refused, naming
    the parameter and the checkpoint to load instead, where it would have trained on the wrong values."""
    for message in run_ranks(misplaced_universal_worker, 2):
        assert "fp32 master of 'unused.weight' is not the one its torch.bfloat16 weight" in message, message
        assert "round_robin_gradients" in message and "unchanged=True" in message, message


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
