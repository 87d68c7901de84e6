"""DeepSpeed's monitor sections (Note [Monitors] in _monitor.py): each accumulation boundary's lr and fp16 loss
scale from rank 0, keyed by global_samples, and a script's own events through engine.monitor; a monitor that
cannot start fails initialize on every rank."""

from __future__ import annotations

import csv
import os
import sys
import types

import pytest
import torch
from torch import nn

import zerocore
from zerocore import ZeroConfig
from _dist import run_ranks

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]


def _config(**sections: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}},
            **sections}


def _train(engine: zerocore.Engine, rank: int, steps: int) -> list[float]:
    lrs = []
    for step in range(steps * 2):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank)).half()
        engine.backward(engine(x).float().square().mean())
        engine.step()
        if step % 2 == 1:  # a boundary: the lr its monitor row should hold
            lrs.append(engine.get_lr()[0])
    return lrs


def csv_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    config = _config(csv_monitor={"enabled": True, "output_path": directory, "job_name": "run"})
    engine = zerocore.initialize(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), config)
    lrs = _train(engine, rank, 3)
    engine.monitor.write_events([("Train/my loss", torch.tensor(1.5), 7)])  # a script's own, a tensor value
    result = {"lrs": lrs, "samples": engine.global_samples, "scale": engine.loss_scaler.scale,
              "enabled": engine.monitor.enabled}
    engine.close()
    return result


def _read(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_monitor_logs_lr_and_loss_scale_per_boundary_from_rank_0(tmp_path):
    rank0, rank1 = run_ranks(csv_worker, 2, os.fspath(tmp_path))
    log_dir = tmp_path / "run"
    assert sorted(os.listdir(log_dir)) == ["Train_Samples_loss_scale.csv", "Train_Samples_lr.csv",
                                           "Train_my_loss.csv"]
    samples = [8, 16, 24]  # train_batch_size 2 x 2 x 2 per step, counted after it
    lr = _read(log_dir / "Train_Samples_lr.csv")
    assert lr[0] == ["step", "lr"] and [int(row[0]) for row in lr[1:]] == samples
    assert [float(row[1]) for row in lr[1:]] == pytest.approx(rank0["lrs"]) and rank0["lrs"] == rank1["lrs"]
    assert rank0["lrs"][0] < rank0["lrs"][-1]  # the warmup moves it: the rows follow the scheduler
    scale = _read(log_dir / "Train_Samples_loss_scale.csv")
    assert scale[0] == ["step", "loss_scale"] and float(scale[-1][1]) == rank0["scale"]
    assert _read(log_dir / "Train_my_loss.csv") == [["step", "my loss"], ["7", "1.5"]]  # once: rank 1 wrote none
    assert rank0["enabled"] and rank1["enabled"] and rank0["samples"] == 24


def broken_log_worker(rank: int, world: int, directory: str) -> dict:
    import shutil
    import warnings

    torch.manual_seed(0)
    config = _config(csv_monitor={"enabled": True, "output_path": directory, "job_name": "run"})
    engine = zerocore.initialize(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), config)
    if rank == 0:  # the log directory becomes a file: every write there fails (root ignores permission bits)
        shutil.rmtree(os.path.join(directory, "run"))
        open(os.path.join(directory, "run"), "w").close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(engine, rank, 2)
    state = {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return {"warned": [str(w.message) for w in caught if "monitor could not log" in str(w.message)],
            "state": state, "steps": engine.global_steps}


def test_a_failing_monitor_write_warns_on_rank_0_and_training_goes_on_in_lockstep(tmp_path):
    rank0, rank1 = run_ranks(broken_log_worker, 2, os.fspath(tmp_path))
    assert len(rank0["warned"]) == 2 and "NotADirectoryError" in rank0["warned"][0] and rank1["warned"] == []
    assert rank0["steps"] == rank1["steps"] == 2 and rank0["state"] == rank1["state"]


def tensorboard_worker(rank: int, world: int, directory: str) -> None:
    torch.manual_seed(0)
    config = _config(tensorboard={"enabled": True, "output_path": directory, "job_name": "tb"})
    engine = zerocore.initialize(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), config)
    _train(engine, rank, 2)
    engine.close()


def test_tensorboard_monitor_writes_the_scalars_where_deepspeed_does(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_ranks(tensorboard_worker, 2, os.fspath(tmp_path))
    events = EventAccumulator(os.fspath(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("Train/Samples/lr")] == [8, 16]
    assert [e.step for e in events.Scalars("Train/Samples/loss_scale")] == [8, 16]


def fake_wandb_worker(rank: int, world: int) -> dict:
    calls: list = []
    sys.modules["wandb"] = types.SimpleNamespace(  # a stand-in with the two functions DeepSpeed's monitor calls
        init=lambda **kwargs: calls.append(("init", kwargs)),
        log=lambda data, step=None: calls.append(("log", data, step)),
        __spec__=types.SimpleNamespace(name="wandb"))
    torch.manual_seed(0)
    config = _config(wandb={"enabled": True, "project": "p", "group": "g", "team": "t"})
    engine = zerocore.initialize(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), config)
    _train(engine, rank, 2)
    engine.close()
    return {"calls": calls}


def test_wandb_monitor_starts_a_run_and_logs_each_boundary_on_rank_0():
    rank0, rank1 = run_ranks(fake_wandb_worker, 2)
    assert rank1["calls"] == []
    init, *logs = rank0["calls"]
    assert init == ("init", {"project": "p", "group": "g", "entity": "t"})
    assert [(list(data), step) for _, data, step in logs] == [
        (["Train/Samples/lr"], 8), (["Train/Samples/loss_scale"], 8),
        (["Train/Samples/lr"], 16), (["Train/Samples/loss_scale"], 16)]


def failing_worker(rank: int, world: int, sections: dict) -> str:
    try:
        zerocore.initialize(nn.Linear(4, 4), _config(**sections))
    except RuntimeError as error:
        return str(error)
    return "built"


@pytest.mark.parametrize("how", ["not writable", "package missing"])
def test_a_monitor_that_cannot_start_fails_initialize_on_every_rank(tmp_path, how):
    if how == "not writable":
        blocker = tmp_path / "file"
        blocker.write_text("")  # a file where the log directory's parent should be
        sections = {"csv_monitor": {"enabled": True, "output_path": os.fspath(blocker), "job_name": "run"}}
        expected = "FileExistsError|NotADirectoryError|not writable"
    else:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is not None:
            pytest.skip("tensorboard is installed here")
        sections = {"tensorboard": {"enabled": True, "output_path": os.fspath(tmp_path)}}
        expected = "tensorboard.enabled is true but the tensorboard package is not installed"
    messages = run_ranks(failing_worker, 2, sections)
    for message in messages:  # every rank raised (none went on into a collective), naming rank 0's reason
        assert "a monitor could not start on rank 0" in message, message
        assert any(part in message for part in expected.split("|")), message


def test_monitor_sections_read_and_write_as_deepspeed_spells_them():
    source = {"tensorboard": {"enabled": False, "output_path": "tb", "job_name": "j"},
              "csv_monitor": {"enabled": True, "output_path": "/tmp/x"},
              "wandb": {"enabled": False, "project": "p"}, "comet": {"enabled": False}}
    config = ZeroConfig.from_deepspeed(source)
    assert config.csv_monitor.enabled and config.csv_monitor.job_name == "DeepSpeedJobName"
    written = config.to_deepspeed()
    assert {k: written[k] for k in ("tensorboard", "csv_monitor", "wandb")} == {
        "tensorboard": {"enabled": False, "output_path": "tb", "job_name": "j"},
        "csv_monitor": {"enabled": True, "output_path": "/tmp/x", "job_name": "DeepSpeedJobName"},
        "wandb": {"enabled": False, "group": None, "team": None, "project": "p"}}
    assert ZeroConfig.from_deepspeed(written) == config
    assert "tensorboard" not in ZeroConfig.from_deepspeed({}).to_deepspeed()
    for bad, match in [({"csv_monitor": {"enabled": "yes"}}, r"csv_monitor\.enabled: expected true or false"),
                       ({"tensorboard": {"output_path": 3}}, r"tensorboard\.output_path: expected a string"),
                       ({"wandb": {"project": None}}, r"wandb\.project: expected a string"),
                       ({"wandb": {"entity": "t"}}, r"wandb\.entity: unknown key"),
                       ({"comet": {"enabled": True}}, "not supported yet by zerocore: comet")]:
        with pytest.raises(ValueError, match=match):
            ZeroConfig.from_deepspeed(bad)
