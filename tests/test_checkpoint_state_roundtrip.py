"""What a checkpoint holds besides tensors comes back as it was saved: an lr scheduler's state (MultiStepLR's
milestones are a Counter of int keys), the user's client_state (int keys, tuples), complex buffers (Llama's
rotary table), and the fp16 loss scale only where it means something; a re-save of one tag killed between its
renames leaves the previous copy loadable (python/zerocore/_json_state.py, Note [Checkpoint format])."""

from __future__ import annotations

import collections
import os
import shutil

import pytest
import torch
from torch import nn

import zerocore
from zerocore import _json_state as json_state
from zerocore._checkpoint_format import check_tag
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Rotary(nn.Module):
    """A block with a complex buffer, as Llama's reference implementation holds its rotary freqs_cis."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(4), torch.arange(4.0)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        turned = torch.view_as_real(torch.view_as_complex(x.float().reshape(-1, 4, 2)) * self.freqs_cis)
        return self.head(torch.tanh(self.inner(turned.reshape(x.shape).to(x.dtype))))


def _config(stage: int, dtype: str = "fp32", scheduler: dict | None = None) -> dict:
    config: dict = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 15}
    if scheduler is not None:
        config["scheduler"] = scheduler
    return config


def _step(engine: zerocore.Engine, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g).to(engine.compute_dtype)
    loss = nn.functional.mse_loss(engine(x).float(), torch.randn(4, 2, generator=g))
    engine.backward(loss)
    engine.step()
    return loss.item()


MULTISTEP = {"type": "MultiStepLR", "params": {"milestones": [5, 7], "gamma": 0.1}}
CLIENT = {"best_by_epoch": {3: 0.5, 7: 0.25}, "shape": (2, 3), "seen": collections.Counter({4: 2}),
          "nested": [{"k": (1, (2, 3))}], "best": float("inf"), "note": None, "tensor": torch.tensor([1.5, 2.0])}


def resume_worker(rank: int, world: int, directory: str, stage: int) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Rotary(), _config(stage, scheduler=MULTISTEP))
    for step in range(4):
        _step(engine, step, rank)
    engine.save_checkpoint(directory, tag="t", client_state=CLIENT)
    straight = [(_step(engine, step, rank), engine.get_lr()[0]) for step in range(4, 9)]
    engine.close()
    torch.manual_seed(1)  # other initial weights: the load must bring the saved ones
    resumed = zerocore.initialize(Rotary(), _config(stage, scheduler=MULTISTEP))
    _, client = resumed.load_checkpoint(directory)
    again = [(_step(resumed, step, rank), resumed.get_lr()[0]) for step in range(4, 9)]
    tensor = client.pop("tensor")  # checked here: a tensor returned through the rank queue is a shared fd
    assert torch.equal(tensor, CLIENT["tensor"]) and tensor.dtype == CLIENT["tensor"].dtype
    return {"straight": straight, "again": again, "client": client}


@pytest.mark.parametrize("stage", [1, 3])
def test_scheduler_state_and_client_state_come_back_as_saved(stage, tmp_path):
    for result in run_ranks(resume_worker, 2, os.fspath(tmp_path), stage):
        assert result["again"] == result["straight"]  # bitwise: losses and the lr, which decays at 5 and 7
        assert [lr for _, lr in result["straight"]] == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4, 1e-4])
        client = result["client"]
        expected = {k: v for k, v in CLIENT.items() if k != "tensor"}
        assert client == expected and isinstance(client["seen"], collections.Counter)
        assert isinstance(client["shape"], tuple) and isinstance(client["nested"][0]["k"][1], tuple)


def loss_scale_worker(rank: int, world: int, directory: str, saved: str, loaded: str) -> float:
    torch.manual_seed(0)
    engine = zerocore.initialize(Rotary(), _config(2, saved))
    _step(engine, 0, rank)
    engine.save_checkpoint(directory, tag="t")
    engine.close()
    resumed = zerocore.initialize(Rotary(), _config(2, loaded))
    resumed.load_checkpoint(directory, tag="t")
    _step(resumed, 1, rank)
    return resumed.loss_scale


@pytest.mark.parametrize("saved,loaded,scale", [("fp16", "bf16", 1.0), ("fp16", "fp32", 1.0),
                                                ("bf16", "fp16", 2.0 ** 15), ("fp16", "fp16", 2.0 ** 15)])
def test_the_fp16_loss_scale_resumes_only_into_fp16_training(saved, loaded, scale, tmp_path):
    # an fp16 checkpoint's 32768 in a bf16 engine would scale every gradient by it (norms, clipping, Adam's eps)
    assert run_ranks(loss_scale_worker, 2, os.fspath(tmp_path), saved, loaded) == [scale, scale]


def resave_worker(rank: int, world: int, directory: str) -> list:
    torch.manual_seed(0)
    engine = zerocore.initialize(Rotary(), _config(3))
    _step(engine, 0, rank)
    engine.save_checkpoint(directory, tag="last")
    first = engine.full_state_dict(rank0_only=False)
    _step(engine, 1, rank)
    torch.distributed.barrier()
    if rank == 0:  # a re-save of "last" killed between its renames: the old copy moved aside, the new not in place
        os.rename(os.path.join(directory, "last"), os.path.join(directory, ".last.old"))
        os.makedirs(os.path.join(directory, ".last.tmp"))
    torch.distributed.barrier()
    with pytest.warns(RuntimeWarning, match="interrupted"):
        engine.load_checkpoint(directory)
    after = engine.full_state_dict(rank0_only=False)
    return [all(torch.equal(first[k], after[k]) for k in first), torch.equal(engine.module.freqs_cis,
                                                                             Rotary().freqs_cis)]


def test_a_resave_killed_between_its_renames_leaves_the_previous_copy_loadable(tmp_path):
    assert run_ranks(resave_worker, 2, os.fspath(tmp_path)) == [[True, True], [True, True]]
    shutil.rmtree(tmp_path / ".last.tmp")


def test_latest_is_not_a_tag_and_unstorable_state_is_named():
    for tag in ("latest", "latest.tmp"):
        with pytest.raises(ValueError, match="names the newest checkpoint"):
            check_tag(tag)
    with pytest.raises(TypeError, match=r"client_state=...\)\['fn'\] holds function"):
        json_state.encode({"fn": lambda: 0}, "save_checkpoint(client_state=...)")
    assert json_state.decode(json_state.encode({"a": [1, 2.5, "x"]}, "x")) == {"a": [1, 2.5, "x"]}
