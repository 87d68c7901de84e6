"""``python -m zerocore.checkpoint to-deepspeed`` (Note [DeepSpeed export] in _deepspeed_export.py): a zerocore
checkpoint as a DeepSpeed universal checkpoint. zerocore's own DeepSpeed reader (checked against DeepSpeed's
ds_to_universal output in test_deepspeed_checkpoints.py) loads it back exactly, and its next step is the one
resumed from the zerocore checkpoint itself. Where DeepSpeed is installed (the .venv-ds of bench/train_step.py's
docstring: ``.venv-ds/bin/python -m pytest tests/test_deepspeed_export.py``), DeepSpeed itself resumes from it at
stages 1-3 and other world sizes, holding zerocore's masters and moments exactly, and takes zerocore's next step."""

from __future__ import annotations

import io
import os

import pytest
import torch

import zerocore
from _dist import run_ranks
from _ds_fixture import (build_fixture_model, deepspeed_full_moment, fixture_batch, fixture_loss, param_groups,
                         states_differing)
from zerocore._checkpoint_format import read_index, tag_path
from zerocore._saved_tensors import SavedTensors
from zerocore.checkpoint import main, to_deepspeed

pytestmark = pytest.mark.timeout(300)

_GROUPS = {"groups": True}  # decay / no decay, as _ds_fixture splits them
_SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "scheduler": _SCHEDULER,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _loss(engine, rank: int, world: int, step: int) -> torch.Tensor:
    """The 2 ranks' batches of ``step`` spread over this run's ranks, scaled so the averaged gradient is theirs."""
    mine = [k for k in range(2) if k % world == rank]
    loss = sum(fixture_loss(engine(fixture_batch(step, k)[0]), fixture_batch(step, k)[1]) for k in mine or [0])
    return loss * (world / 2 if mine else 0.0)


def _serialized(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def train_worker(rank: int, world: int, directory: str, freeze_after: int | None) -> None:
    model = build_fixture_model()
    engine = zerocore.initialize(model, _config(3), param_groups=param_groups(model, _GROUPS))
    for step in range(3):
        if step == freeze_after:  # frozen after initialize: it sits out the later steps, so its step lags
            model.hidden.bias.requires_grad_(False)
        engine.backward(_loss(engine, rank, world, step))
        engine.step()
        model.seen += 1  # a buffer the checkpoint carries
    engine.save_checkpoint(directory, client_state={"epoch": 7})
    engine.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A zerocore checkpoint of 3 stage-3 steps on 2 ranks: two param groups, WarmupLR, a frozen layer, an unused
    one (never a gradient: its step is 0), a tied head, a buffer, a client_state."""
    directory = str(tmp_path_factory.mktemp("zerocore"))
    run_ranks(train_worker, 2, directory, None)
    return directory


def _saved(directory: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Every trainable parameter's master and moments as the checkpoint holds them (states_differing's keys),
    and the groups' lr."""
    path = tag_path(directory, "global_step3")
    index = read_index(path)
    with SavedTensors(path, index) as saved:
        states = {f"{key}/{name}": saved.trainable(name, state) for name in index["params"]
                  for key, state in (("master", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))}
    return states, [g["lr"] for g in index["param_groups"]]


def resume_worker(rank: int, world: int, directory: str, stage: int, expected: dict, universal: bool) -> bytes:
    """zerocore loads ``directory`` (``universal``: through latest_universal, as DeepSpeed's config asks for it);
    what it holds, and every trainable master after the step from it."""
    model = build_fixture_model()
    config = {**_config(stage), "checkpoint": {"load_universal": universal}}
    engine = zerocore.initialize(model, config, param_groups=param_groups(model, _GROUPS))
    path, client_state = engine.load_checkpoint(directory)
    seen = {"path": os.path.basename(path), "client_state": client_state, "differ": states_differing(model, expected),
            "global_steps": engine.global_steps, "adam_steps": engine.optimizer_state.step_count,
            "buffer": model.seen.tolist(), "lr": [g["lr"] for g in engine.optimizer.param_groups]}
    engine.backward(_loss(engine, rank, world, 3))
    engine.step()
    seen["after"] = {n: zerocore.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()
                     if p.requires_grad}
    engine.close()
    return _serialized(seen)


@pytest.mark.parametrize("world,stage", [(3, 1), (2, 3), (1, 2)])
def test_the_export_loads_back_into_zerocore_exactly(source, tmp_path, world, stage):
    out = str(tmp_path / "ds")
    written = to_deepspeed(source, out)
    assert written[-2:] == ["latest", "latest_universal"]
    for pointer in ("latest", "latest_universal"):
        with open(os.path.join(out, pointer)) as f:
            assert f.read() == "global_step3"
    expected, lr = _saved(source)
    exported = [torch.load(io.BytesIO(b), weights_only=False) for b in run_ranks(resume_worker, world, out, stage, expected, True)]
    own = [torch.load(io.BytesIO(b), weights_only=False) for b in run_ranks(resume_worker, world, source, stage, expected, False)]
    for seen, reference in zip(exported, own):
        assert seen["path"] == "global_step3"
        assert seen["differ"] == [], seen["differ"]
        assert seen["client_state"] == {"epoch": 7}
        assert (seen["global_steps"], seen["adam_steps"]) == (3, 3)
        assert seen["buffer"] == [3.0, 3.0, 3.0]
        assert seen["lr"] == lr == reference["lr"]
        # the step from the export is the one from the checkpoint, bit for bit
        assert all(torch.equal(seen["after"][n], reference["after"][n]) for n in reference["after"])


def deepspeed_worker(rank: int, world: int, directory: str, stage: int, expected: dict, bf16: bool,
                     fp32_accum: bool = False) -> bytes:
    """DeepSpeed resumes from the export: what it holds (its own safe_get_full_* views), and every trainable master
    after its next step (with ``fp32_accum`` at stage 1 in bf16 that is DeepSpeed's BF16_Optimizer)."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    model = build_fixture_model()
    config = {**_config(stage), "checkpoint": {"load_universal": True}, "bf16": {"enabled": bf16}}
    if fp32_accum:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, _GROUPS), config=config)
    path, client_state = engine.load_checkpoint(directory)
    differ = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        got = {"master": safe_get_full_fp32_param(param).detach().float()}
        for key in ("exp_avg", "exp_avg_sq"):
            got[key] = deepspeed_full_moment(engine, param, key)
        differ += [f"{key}/{name}" for key, value in got.items()
                   if not torch.equal(value.reshape(expected[f"{key}/{name}"].shape), expected[f"{key}/{name}"])]
    seen = {"path": path, "epoch": client_state.get("epoch"), "differ": differ, "global_steps": engine.global_steps,
            "lr": [g["lr"] for g in engine.optimizer.param_groups],
            "weight_decay": [g["weight_decay"] for g in engine.optimizer.param_groups], "buffer": model.seen.tolist()}
    engine.backward(_loss(engine, rank, world, 3))
    engine.step()
    seen["after"] = {n: safe_get_full_fp32_param(p).detach().float().clone() for n, p in model.named_parameters()
                     if p.requires_grad}
    return _serialized(seen)


@pytest.mark.parametrize("world,stage,bf16,fp32_accum", [(2, 1, False, False), (1, 2, False, False),
                                                         (3, 3, False, False), (2, 2, True, False), (2, 3, True, False),
                                                         (2, 1, True, True)])
def test_deepspeed_resumes_from_the_export(source, tmp_path, world, stage, bf16, fp32_accum):
    pytest.importorskip("deepspeed")
    out = str(tmp_path / "ds")
    to_deepspeed(source, out)
    expected, lr = _saved(source)
    reference = torch.load(io.BytesIO(run_ranks(resume_worker, 2, source, 3, expected, False)[0]), weights_only=False)
    results = run_ranks(deepspeed_worker, world, out, stage, expected, bf16, fp32_accum, timeout=240.0)
    for seen in (torch.load(io.BytesIO(b), weights_only=False) for b in results):
        assert seen["differ"] == [], seen["differ"]
        assert seen["epoch"] == 7 and seen["global_steps"] == 3
        assert seen["lr"] == lr
        # the no-decay group keeps its 0 at stage 3 too (DeepSpeed's stage-3 universal load copies one saved group
        # into every group: Note [DeepSpeed export])
        assert seen["weight_decay"] == [0.01, 0.0]
        assert seen["buffer"] == [0.0, 0.0, 0.0]  # DeepSpeed's universal load reads no buffer: the model's own
        for name, after in reference["after"].items():
            if name.startswith("unused."):  # (DeepSpeed decays a parameter with no gradient; zerocore leaves it)
                continue
            before = expected[f"master/{name}"]
            ours, theirs = after - before, seen["after"][name].reshape(before.shape) - before
            # fp32: summation order only; bf16: DeepSpeed computes in bf16 from the rounded masters
            assert float((theirs - ours).norm() / ours.norm()) < (5e-2 if bf16 else 1e-4), name


def forgotten_universal_worker(rank: int, world: int, directory: str) -> str:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed

    model = build_fixture_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, _GROUPS), config=_config(2))
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.load_checkpoint(directory)
    return "raised"


def test_deepspeed_without_load_universal_fails_instead_of_starting_afresh(source, tmp_path):
    """Without ``latest`` DeepSpeed's load_checkpoint would return None and train from scratch."""
    pytest.importorskip("deepspeed")
    out = str(tmp_path / "ds")
    to_deepspeed(source, out)
    assert run_ranks(forgotten_universal_worker, 1, out) == ["raised"]


def test_a_parameter_whose_step_lags_its_group_is_refused_unless_accepted(tmp_path):
    source = str(tmp_path / "zerocore")
    run_ranks(train_worker, 2, source, 1)  # hidden.bias takes step 1 only
    out = str(tmp_path / "ds")
    with pytest.raises(ValueError, match=r"'hidden.bias' \(step 1\).*--group-steps.*nothing was written"):
        to_deepspeed(source, out)
    assert not os.path.exists(out)
    with pytest.warns(UserWarning, match="continue at step 3"):
        to_deepspeed(source, out, group_steps=True)
    step = torch.load(os.path.join(out, "global_step3", "zero", "hidden.bias", "step.pt"), weights_only=False)
    assert step == 3


def test_the_command_line_refuses_an_existing_tag_and_an_output_inside_the_checkpoint(source, tmp_path, capsys):
    out = str(tmp_path / "ds")
    assert main(["to-deepspeed", source, out]) == 0
    assert "load_universal" in capsys.readouterr().out
    marker = os.path.join(out, "global_step3", "zero", "scale", "fp32.pt")
    mtime = os.stat(marker).st_mtime_ns
    with pytest.raises(SystemExit):
        main(["to-deepspeed", source, out])
    assert "already exists" in capsys.readouterr().err and os.stat(marker).st_mtime_ns == mtime
    assert main(["to-deepspeed", source, out, "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["global_step3", "latest", "latest_universal"]  # no temporary directory left
    assert main(["info", out]) == 0
    assert "global_step3: a DeepSpeed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["to-deepspeed", source, os.path.join(source, "global_step3", "ds")])
    assert "overlaps the checkpoint" in capsys.readouterr().err
