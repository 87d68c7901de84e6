"""torch.distributed.checkpoint (DCP) checkpoints loaded by engine.load_checkpoint (Note [DCP checkpoints] in
_dcp_checkpoint.py): the fixtures in tests/fixtures/dcp were written by FSDP2 runs on 2 ranks in torch's,
torchtitan's and Accelerate's layouts (make_fixtures.py there), each with what FSDP2 held for every parameter
(its fp32 value and AdamW moments) and its parameters after one more step; a zerocore engine of another world
size or stage loads them and must hold exactly those, and its next step must be FSDP2's."""

from __future__ import annotations

import io
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zerocore
from _dcp_fixture import ADAMW, CASES, STEPS
from _dist import run_ranks
from _ds_fixture import build_fixture_model, fixture_batch, fixture_loss, param_groups, states_differing

pytestmark = pytest.mark.timeout(300)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "dcp")


def _config(case: str, stage: int, offload: str | None = None, scheduler: bool = False) -> dict:
    config: dict = {"optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "lr": 0.5}},
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                    "gradient_clipping": 0.0}  # (FSDP2's run did not clip)
    if CASES[case]["bf16"]:
        config["bf16"] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": offload}
    if scheduler:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                              "warmup_num_steps": 10, "warmup_type": "linear"}}
    return config


def load_worker(rank: int, world: int, case: str, stage: int, offload: str | None) -> dict:
    directory = os.path.join(FIXTURES, case)
    model = build_fixture_model()
    groups = param_groups(model, CASES[case])
    engine = zerocore.initialize(model, _config(case, stage, offload),
                                 param_groups=groups if CASES[case]["groups"] else None)
    path, client_state = engine.load_checkpoint(directory)
    expected = load_file(os.path.join(directory, "expected.safetensors"))
    seen: dict = {"path": os.path.basename(path), "client_state": client_state,
                  "differ": states_differing(model, expected)}
    seen["buffer"] = model.seen.tolist()
    seen["global_steps"], seen["adam_steps"] = engine.global_steps, engine.optimizer_state.step_count
    seen["idle"] = dict(engine.optimizer_state.idle_steps)
    seen["lr"] = [g["lr"] for g in engine.optimizer.param_groups]
    # the resumed run's first update against FSDP2's own next step from the same state and batches: the step
    # counts (Adam's bias correction), lr and moments all enter it; FSDP2's two ranks' batches are spread over
    # this run's ranks so the averaged gradient is the same
    mine = [k for k in range(2) if k % world == rank]
    loss = sum(fixture_loss(engine(fixture_batch(STEPS, k)[0]), fixture_batch(STEPS, k)[1]) for k in mine or [0])
    engine.backward(loss * (world / 2 if mine else 0.0))  # (a third rank runs a batch that counts for nothing)
    engine.step()
    after = load_file(os.path.join(directory, "expected_after_step.safetensors"))
    seen["update_distance"] = {}
    for name, param in model.named_parameters():
        if param.requires_grad and not name.startswith("unused."):
            before = expected[f"master/{name}"]
            fsdp_update = after[f"master/{name}"] - before
            ours = zerocore.safe_get_full_fp32_param(param) - before
            seen["update_distance"][name] = float((ours - fsdp_update).norm() / fsdp_update.norm())
    seen["unused_unchanged"] = all(torch.equal(zerocore.safe_get_full_fp32_param(p), expected[f"master/{n}"])
                                   for n, p in model.named_parameters() if n.startswith("unused."))
    engine.close()
    return seen


@pytest.mark.parametrize("case,world,stage,offload", [
    ("tutorial-fp32-groups", 2, 1, None), ("tutorial-fp32-groups", 3, 3, None),
    ("torchtitan-bf16", 2, 3, None), ("torchtitan-bf16", 1, 2, "cpu"),
    ("accelerate-fp32", 2, 2, None), ("accelerate-fp32", 3, 3, None),
])
def test_an_fsdp2_dcp_checkpoint_loads_exactly_at_any_world_size_and_stage(case, world, stage, offload):
    with open(os.path.join(FIXTURES, case, "expected.json")) as f:
        facts = json.load(f)
    for seen in run_ranks(load_worker, world, case, stage, offload):
        assert seen["path"] == case
        assert seen["differ"] == [], seen["differ"]
        assert seen["buffer"] == facts["buffer_seen"]
        assert (seen["global_steps"], seen["adam_steps"]) == (STEPS, STEPS)
        # the unused layer never got a gradient: no AdamW state in FSDP2, idle for every step here
        assert seen["idle"] == {"unused.weight": STEPS, "unused.bias": STEPS}, seen["idle"]
        assert seen["lr"] == pytest.approx(facts["lr"], rel=1e-12)  # the checkpoint's, not the config's 0.5
        if CASES[case]["layout"] == "torchtitan":  # the objects beside the model and the optimizer
            assert seen["client_state"]["train_state"] == {"step": STEPS, "ntokens_seen": STEPS * 24}
            assert seen["client_state"]["lr_scheduler"]["last_epoch"] == STEPS
        else:
            assert seen["client_state"] == {}
        # fp32: summation order only; bf16: FSDP2 and zerocore round the gradients to bf16 along other paths
        tolerance = 1e-4 if not CASES[case]["bf16"] else 5e-2
        assert max(seen["update_distance"].values()) < tolerance, seen["update_distance"]
        assert seen["unused_unchanged"]


def scheduler_worker(rank: int, world: int) -> tuple[list[float], list[float]]:
    engine = zerocore.initialize(build_fixture_model(), _config("accelerate-fp32", 2, scheduler=True))
    engine.load_checkpoint(os.path.join(FIXTURES, "accelerate-fp32"))
    loaded = engine.get_lr()
    engine.close()
    engine = zerocore.initialize(build_fixture_model(), _config("accelerate-fp32", 2, scheduler=True))
    for step in range(STEPS):
        engine.backward(fixture_loss(engine(fixture_batch(step, rank)[0]), fixture_batch(step, rank)[1]))
        engine.step()
    trained = engine.get_lr()
    engine.close()
    return loaded, trained


def test_the_configured_schedule_resumes_at_the_loaded_step():
    """FSDP's scheduler is the script's object: the engine's, from the config, is where a run that took the
    checkpoint's steps has it (a WarmupLR part-way up)."""
    for loaded, trained in run_ranks(scheduler_worker, 2):
        assert loaded == trained and 0 < loaded[0] < 1e-2, (loaded, trained)


def refusal_worker(rank: int, world: int, directory: str, change: str) -> tuple[str, bool]:
    model = build_fixture_model()
    config = _config("accelerate-fp32", 3)
    if change == "l2_weight_decay":  # torch.optim.Adam's weight decay, not the checkpoint's AdamW's
        config["optimizer"] = {"type": "Adam", "params": {**config["optimizer"]["params"], "adam_w_mode": False}}
    if change == "shape":
        model.hidden = torch.nn.Linear(8, 9)
    elif change == "extra_layer":  # the checkpoint's model is missing one of this model's trainable layers
        model.extra = torch.nn.Linear(8, 8)
    elif change == "smaller_model":  # this model lacks a layer the checkpoint holds
        del model.unused
    engine = zerocore.initialize(model, config)
    before = {name: zerocore.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()
              if p.requires_grad}
    kwargs = {"load_optimizer_states": False} if change == "model_only_ok" else {}
    try:
        engine.load_checkpoint(directory, **kwargs)
        message = ""
    except ValueError as error:
        message = str(error)
    unchanged = all(torch.equal(zerocore.safe_get_full_fp32_param(p), before[n])
                    for n, p in model.named_parameters() if p.requires_grad)
    if change != "shape":  # the engine goes on training after a refused load
        engine.backward(fixture_loss(engine(fixture_batch(0, rank)[0]), fixture_batch(0, rank)[1]))
        engine.step()
    engine.close()
    return message, unchanged


def _copy_fixture(tmp_path, case: str) -> str:
    directory = str(tmp_path / case)
    shutil.copytree(os.path.join(FIXTURES, case), directory)
    return directory


@pytest.mark.parametrize("change,needle", [
    ("shape", "'hidden.weight' is [9, 8] in the model but [8, 8]"),
    ("extra_layer", "does not hold the model's trainable parameters (missing: ['extra.bias', 'extra.weight']"),
    ("smaller_model", "holds tensors the model does not have (['unused.bias', 'unused.weight'])"),
    ("l2_weight_decay", "with decoupled (AdamW) weight decay, this engine's optimizer applies it as L2"),
])
def test_a_dcp_checkpoint_of_another_model_is_refused_on_every_rank_with_nothing_changed(change, needle):
    for message, unchanged in run_ranks(refusal_worker, 2, os.path.join(FIXTURES, "accelerate-fp32"), change):
        assert needle in message, message
        assert "nothing was changed" in message and unchanged


def test_a_truncated_dcp_file_is_refused_before_anything_changes(tmp_path):
    directory = _copy_fixture(tmp_path, "tutorial-fp32-groups")
    file = os.path.join(directory, "__1_0.distcp")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    for message, unchanged in run_ranks(refusal_worker, 2, directory, "none"):
        assert f"the DCP file {file} is" in message and "entries end at byte" in message, message
        assert unchanged


def test_a_model_only_dcp_checkpoint_needs_load_optimizer_states_false(tmp_path):
    directory = _copy_fixture(tmp_path, "accelerate-fp32")
    shutil.rmtree(os.path.join(directory, "optimizer_0"))  # Accelerate's model directory alone
    for message, unchanged in run_ranks(refusal_worker, 2, directory, "none"):
        assert "holds no optimizer state" in message and "load_optimizer_states=False" in message, message
        assert unchanged
    for message, unchanged in run_ranks(refusal_worker, 2, directory, "model_only_ok"):
        assert message == "" and not unchanged  # the weights loaded (the fixture trained them)


def single_process_fixture_worker(rank: int, world: int, directory: str, kind: str) -> None:
    """A DCP checkpoint saved by DCP from whole tensors in a single process (the format FSDP2 writes, one chunk
    per tensor): ``sgd``: a model trained with SGD with momentum (its state: momentum_buffer), by name;
    ``indexed``: a DDP script's ``ddp.state_dict()`` and AdamW's ``optimizer.state_dict()`` as they are (state
    by parameter index)."""
    import torch.distributed.checkpoint as dcp

    if rank != 0:
        return
    model = build_fixture_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = (torch.optim.SGD(trainable, lr=0.1, momentum=0.9) if kind == "sgd" else
                 torch.optim.AdamW(trainable, **ADAMW))
    fixture_loss(model(fixture_batch(0, 0)[0]), fixture_batch(0, 0)[1]).backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = optimizer.state_dict() if kind == "indexed" else {
        "state": {names[id(p)]: dict(s) for p, s in optimizer.state.items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                          "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]}
    # "indexed": as a DDP script saves it, ddp.state_dict() naming every tensor under DDP's "module."
    weights = {f"module.{k}": v for k, v in model.state_dict().items()} if kind == "indexed" else model.state_dict()
    dcp.save({"model": weights, "optim": state}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)


def test_optimizer_state_that_is_not_adams_is_refused_by_name(tmp_path):
    directory = str(tmp_path / "sgd")
    run_ranks(single_process_fixture_worker, 1, directory, "sgd")
    for message, unchanged in run_ranks(refusal_worker, 2, directory, "none"):
        assert "optimizer state ['momentum_buffer']" in message and "not Adam/AdamW's" in message, message
        assert unchanged


def test_optimizer_state_by_parameter_index_is_refused_naming_get_state_dict(tmp_path):
    """``optimizer.state_dict()`` saved as it is numbers the parameters: which is which is the script's
    guess, so the optimizer state is refused (the weights, under DDP's "module." names, load alone with
    load_optimizer_states=False)."""
    directory = str(tmp_path / "indexed")
    run_ranks(single_process_fixture_worker, 1, directory, "indexed")
    for message, unchanged in run_ranks(refusal_worker, 2, directory, "none"):
        assert "optimizer state by parameter index" in message and "get_state_dict(model, optimizer)" in message
        assert unchanged
    for message, unchanged in run_ranks(refusal_worker, 2, directory, "model_only_ok"):
        assert message == "" and not unchanged


# ---- the other way: python -m zerocore.checkpoint to-dcp (Note [DCP export]) ------------------------------

def _groups_with_lr_scale(model: torch.nn.Module) -> list[dict]:
    """The fixture's groups, each with a key of the script's own (BEiT's layer-wise lr decay)."""
    return [{**group, "lr_scale": 0.5 * (i + 1)}
            for i, group in enumerate(param_groups(model, CASES["tutorial-fp32-groups"]))]


def train_and_save_worker(rank: int, world: int, directory: str, stage: int, exclude_frozen: bool = False,
                          lr_scale: bool = False) -> bytes:
    """zerocore trains the fixture model (two param groups, tied, frozen and unused parameters, a buffer) two
    steps and saves; returns its state and, after one more step on both fixture batches, its masters."""
    model = build_fixture_model()
    groups = _groups_with_lr_scale(model) if lr_scale else param_groups(model, CASES["tutorial-fp32-groups"])
    engine = zerocore.initialize(model, _config("tutorial-fp32-groups", stage), param_groups=groups)
    for step in range(2):
        engine.backward(fixture_loss(engine(fixture_batch(step, rank)[0]), fixture_batch(step, rank)[1]))
        engine.step()
        with torch.no_grad():
            model.seen += 1
    engine.save_checkpoint(directory, exclude_frozen_parameters=exclude_frozen)
    saved = {f"{key}/{name}": value for name, param in model.named_parameters() if param.requires_grad
             for key, value in (("master", zerocore.safe_get_full_fp32_param(param)),
                                ("exp_avg", zerocore.safe_get_full_optimizer_state(param, "exp_avg")),
                                ("exp_avg_sq", zerocore.safe_get_full_optimizer_state(param, "exp_avg_sq")))}
    engine.backward(fixture_loss(engine(fixture_batch(2, rank)[0]), fixture_batch(2, rank)[1]))
    engine.step()
    after = {name: zerocore.safe_get_full_fp32_param(p) for name, p in model.named_parameters() if p.requires_grad}
    engine.close()
    buffer = io.BytesIO()  # (tensors through the result queue would be shared-memory handles of a dead process)
    torch.save({"saved": saved, "after": after}, buffer)
    return buffer.getvalue()


def test_to_dcp_writes_what_torch_resumes_adamw_training_from(tmp_path):
    """torch's DCP recipe (get_state_dict, dcp.load, set_state_dict) on the plain model and torch's AdamW: the
    same values, moments, per-parameter steps and hyperparameters, and its next step is zerocore's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zerocore.checkpoint import to_dcp

    checkpoint, out = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    ours = torch.load(io.BytesIO(run_ranks(train_and_save_worker, 2, checkpoint, 3)[0]))
    written = to_dcp(checkpoint, out)
    assert written[0] == ".metadata" and all(name.endswith(".distcp") for name in written[1:])
    model = build_fixture_model()
    optimizer = torch.optim.AdamW(param_groups(model, CASES["tutorial-fp32-groups"]), **ADAMW)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=out, no_dist=True)  # (strict: every key the recipe asks for is there)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert model.head.weight is model.embed.weight and model.seen.tolist() == [2.0, 2.0, 2.0]
    names = {id(p): n for n, p in model.named_parameters()}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        name = names[id(param)]
        assert torch.equal(param.detach(), ours["saved"][f"master/{name}"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], ours["saved"][f"{key}/{name}"]), (key, name)
        # the unused layer never got a gradient: step 0 (zero moments), as torch's "no state yet" continues
        assert float(optimizer.state[param]["step"]) == (0 if name.startswith("unused.") else 2), name
    assert [(g["lr"], g["betas"], g["weight_decay"], g["decoupled_weight_decay"]) for g in optimizer.param_groups] \
        == [(0.5, (0.9, 0.999), 0.01, True), (0.5, (0.9, 0.999), 0.0, True)]  # (the config's lr)
    loss = sum(fixture_loss(model(fixture_batch(2, k)[0]), fixture_batch(2, k)[1]) for k in range(2)) / 2
    loss.backward()
    optimizer.step()
    for param in model.parameters():
        if param.requires_grad:
            name = names[id(param)]
            before = ours["saved"][f"master/{name}"]
            if name.startswith("unused."):
                assert torch.equal(param.detach(), before) and torch.equal(ours["after"][name], before)
                continue
            update, torch_update = ours["after"][name] - before, param.detach() - before
            assert float((update - torch_update).norm() / torch_update.norm()) < 1e-4, name


def test_to_dcp_carries_a_groups_own_keys_which_torchs_load_would_otherwise_drop(tmp_path):
    """torch's load replaces each param group with the saved one: a key of the script's own (lr_scale, which a
    layer-wise lr decay loop reads every step) must be in the export or the resumed script loses it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zerocore.checkpoint import to_dcp

    checkpoint, out = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    run_ranks(train_and_save_worker, 2, checkpoint, 1, False, True)
    to_dcp(checkpoint, out)
    model = build_fixture_model()
    optimizer = torch.optim.AdamW(_groups_with_lr_scale(model), **ADAMW)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert [g["lr_scale"] for g in optimizer.param_groups] == [0.5, 1.0]
    assert not any("adamw_mode" in g or "bias_correction" in g for g in optimizer.param_groups)


def test_to_dcp_resumes_under_a_scheduler_built_before_the_load(tmp_path):
    """torchtitan builds the lr scheduler before it loads, so torch's recipe asks the checkpoint for each group's
    initial_lr, which a zerocore run without a torch scheduler never had: the export gives it the run's lr (the
    load failed: 'Missing key in checkpoint state_dict: optim.param_groups.0.initial_lr')."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zerocore.checkpoint import to_dcp

    checkpoint, out = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    run_ranks(train_and_save_worker, 2, checkpoint, 2)
    to_dcp(checkpoint, out)
    model = build_fixture_model()
    optimizer = torch.optim.AdamW(param_groups(model, CASES["tutorial-fp32-groups"]), **ADAMW)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=out, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert [(g["lr"], g["initial_lr"]) for g in optimizer.param_groups] == [(0.5, 0.5), (0.5, 0.5)]
    assert scheduler.base_lrs == [ADAMW["lr"]] * 2  # (the scheduler's own state is the script's to load)


def roundtrip_worker(rank: int, world: int, directory: str, stage: int, expected_file: str) -> list[str]:
    model = build_fixture_model()
    engine = zerocore.initialize(model, _config("tutorial-fp32-groups", stage),
                                 param_groups=param_groups(model, CASES["tutorial-fp32-groups"]))
    engine.load_checkpoint(directory)
    differ = states_differing(model, torch.load(expected_file))
    differ += [] if model.seen.tolist() == [2.0, 2.0, 2.0] else ["seen"]
    differ += [] if (engine.global_steps, dict(engine.optimizer_state.idle_steps)) == (
        2, {"unused.weight": 2, "unused.bias": 2}) else ["counters"]
    engine.close()
    return differ


def test_to_dcp_output_loads_back_into_zerocore_at_another_world_size_and_stage(tmp_path):
    from zerocore.checkpoint import to_dcp

    checkpoint, out, expected = str(tmp_path / "ckpt"), str(tmp_path / "dcp"), str(tmp_path / "expected.pt")
    ours = torch.load(io.BytesIO(run_ranks(train_and_save_worker, 2, checkpoint, 2)[0]))
    to_dcp(checkpoint, out)
    torch.save(ours["saved"], expected)
    for differ in run_ranks(roundtrip_worker, 3, out, 3, expected):
        assert differ == [], differ


def test_to_dcp_refuses_to_overwrite_or_to_write_into_the_checkpoint(tmp_path):
    from zerocore.checkpoint import main, to_dcp

    checkpoint, out = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    run_ranks(train_and_save_worker, 2, checkpoint, 1)
    with pytest.raises(ValueError, match="overlaps the checkpoint"):
        to_dcp(checkpoint, os.path.join(checkpoint, "dcp"))
    assert main(["to-dcp", checkpoint, out]) == 0
    with open(os.path.join(out, "__7_0.distcp"), "wb") as f:  # a file of an earlier, larger run's save
        f.write(b"old")
    with pytest.raises(FileExistsError, match="already holds a DCP checkpoint"):
        to_dcp(checkpoint, out)
    written = to_dcp(checkpoint, out, overwrite=True)
    assert written[0] == ".metadata" and sorted(written) == sorted(os.listdir(out))  # the old run's file is gone


def test_to_dcp_of_a_checkpoint_without_frozen_parameters_loads_over_the_base_model(tmp_path):
    """A LoRA run's checkpoint (exclude_frozen_parameters): the output holds no frozen parameters, and torch's
    recipe with allow_partial_load keeps the base model's own, as the docstring says."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from zerocore.checkpoint import to_dcp

    checkpoint, out = str(tmp_path / "ckpt"), str(tmp_path / "dcp")
    ours = torch.load(io.BytesIO(run_ranks(train_and_save_worker, 2, checkpoint, 3, True)[0]))
    to_dcp(checkpoint, out)
    model = build_fixture_model()
    base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW(param_groups(model, CASES["tutorial-fp32-groups"]), **ADAMW)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with pytest.raises(dcp.api.CheckpointException) as refused:  # strict: the frozen parameters are not in it
        dcp.load(state, checkpoint_id=out, no_dist=True)
    assert "Missing key in checkpoint state_dict: model.frozen" in str(refused.value.failures)
    dcp.load(state, checkpoint_id=out, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.detach(), ours["saved"][f"master/{name}"]), name
        else:
            assert torch.equal(param.detach(), base[name]), name


def test_info_describes_a_dcp_checkpoint_and_a_deepspeed_one(capsys):
    """``python -m zerocore.checkpoint info`` on the formats load_checkpoint reads, instead of "index.json is
    missing"."""
    from zerocore.checkpoint import main

    assert main(["info", os.path.join(FIXTURES, "torchtitan-bf16")]) == 0
    out = capsys.readouterr().out
    assert "a torch.distributed.checkpoint (DCP) checkpoint; engine.load_checkpoint reads it" in out, out
    assert "tensors under <top>: 10" in out and "tensors under optimizer (optimizer state): 12" in out, out
    assert "train_state.step" in out, out
    deepspeed = os.path.join(os.path.dirname(FIXTURES), "deepspeed", "stage3-bf16")
    assert main(["info", deepspeed, "--tag", "global_step3_universal"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 3 universal checkpoint of 2 ranks" in out and "steps: global 3, optimizer 3" in out, out


def test_a_folder_of_dcp_checkpoints_needs_a_tag(tmp_path):
    """torchtitan keeps step-N folders side by side: without a tag, which one is meant is not a guess to make;
    with tag= the one named loads."""
    for step in ("step-2", "step-3"):
        shutil.copytree(os.path.join(FIXTURES, "tutorial-fp32-groups"), tmp_path / step)
    for message, unchanged in run_ranks(refusal_worker, 2, str(tmp_path), "none"):
        assert "holds several DCP checkpoints with optimizer state (step-2, step-3): pass tag=" in message, message
        assert unchanged
    for path in run_ranks(tagged_load_worker, 2, str(tmp_path), "step-3"):
        assert path == str(tmp_path / "step-3")


def tagged_load_worker(rank: int, world: int, directory: str, tag: str) -> str:
    model = build_fixture_model()
    engine = zerocore.initialize(model, _config("tutorial-fp32-groups", 2),
                                 param_groups=param_groups(model, CASES["tutorial-fp32-groups"]))
    path, _ = engine.load_checkpoint(directory, tag=tag)
    engine.close()
    return path
