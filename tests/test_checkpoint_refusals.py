"""Saves and loads that must fail on every rank alike or be refused before anything changes: a save that fails
on one rank, a load inside an accumulation window, a load into other param groups; and the save of stage 3's
fp32 parameter shards on NVMe (Note [Checkpoint format] in python/zerocore/checkpoint.py)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

import zerocore
import zerocore._safetensors_io as stio
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _config(stage: int, gas: int = 1, **zero) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, **zero}}


def _micro_step(engine: zerocore.Engine, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = nn.functional.mse_loss(engine(torch.randn(4, 8, generator=g)), torch.randn(4, 2, generator=g))
    engine.backward(loss)
    engine.step()
    return loss.item()


# ---- a save that fails on one rank --------------------------------------------------------------------------
def failing_save_worker(rank: int, world: int, directory: str, how: str) -> list[str]:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(2))
    _micro_step(engine, 0, rank)
    engine.save_checkpoint(directory, tag="good")
    _micro_step(engine, 1, rank)
    target = directory
    if how == "disk full on rank 1" and rank == 1:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        stio.write = full
    elif how == "save_dir is a file":
        target = os.path.join(directory, "good", "index.json")  # rank 0 cannot make a directory there
    elif how == "rank 0's index write raises a ValueError" and rank == 0:
        def refuse(*args, **kwargs):
            raise ValueError("simulated: not an OSError")
        zerocore.checkpoint._write_index = refuse  # the others would wait in the next collective until the timeout
    with pytest.raises((OSError, ValueError)) as raised:
        engine.save_checkpoint(target, tag="bad")
    _micro_step(engine, 2, rank)  # every rank left the save at the same point: the collectives still line up
    with open(os.path.join(directory, "latest")) as f:
        latest = f.read()
    return [str(raised.value), latest, str(sorted(os.listdir(directory)))]


@pytest.mark.parametrize("how", ["disk full on rank 1", "save_dir is a file",
                                 "rank 0's index write raises a ValueError"])
def test_a_save_that_fails_on_one_rank_raises_on_every_rank_and_training_goes_on(how, tmp_path):
    results = run_ranks(failing_save_worker, 2, os.fspath(tmp_path), how, timeout=120, pg_timeout=30)
    failing = 1 if how == "disk full on rank 1" else 0
    for rank, (message, latest, listing) in enumerate(results):
        if rank != failing:
            assert f"rank {failing} could not" in message and "previous" in message, message
        else:
            assert "simulated" in message or how == "save_dir is a file", message
        assert latest == "good"
        assert ".bad.tmp" not in listing, listing  # the partial save is removed


# ---- a load inside an accumulation window -------------------------------------------------------------------
def window_load_worker(rank: int, world: int, directory: str) -> list[str]:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(1, gas=2))
    _micro_step(engine, 0, rank)
    _micro_step(engine, 1, rank)
    engine.save_checkpoint(directory)
    messages = []
    _micro_step(engine, 2, rank)  # half a window: its gradients came from the weights before a load
    with pytest.raises(RuntimeError, match="inside an accumulation window") as raised:
        engine.load_checkpoint(directory)
    messages.append(str(raised.value))
    _micro_step(engine, 3, rank)
    with engine.no_sync():
        g = torch.Generator().manual_seed(7)
        engine.backward(engine(torch.randn(4, 8, generator=g)).square().mean())
    with pytest.raises(RuntimeError, match="no_sync"):
        engine.load_checkpoint(directory)
    with pytest.raises(RuntimeError, match="no_sync"):
        engine.save_checkpoint(directory)  # those gradients would not be in the checkpoint
    _micro_step(engine, 4, rank)
    _micro_step(engine, 5, rank)
    engine.load_checkpoint(directory)  # between windows: loads
    return messages


def test_a_load_inside_an_accumulation_window_is_refused(tmp_path):
    run_ranks(window_load_worker, 2, os.fspath(tmp_path))


# ---- ranks that disagree on which checkpoint ------------------------------------------------------------------
def disagreeing_ranks_worker(rank: int, world: int, directory: str, stage: int) -> list[str]:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(stage))
    _micro_step(engine, 0, rank)
    engine.save_checkpoint(directory, tag=1)  # DeepSpeed's str(tag): "1"
    _micro_step(engine, 1, rank)
    engine.save_checkpoint(directory, tag="2")
    before = engine.full_state_dict(rank0_only=False)
    messages = []
    for tag in (f"mine{rank}", "ok" if rank == 0 else "a/b"):  # different tags; one rank's tag invalid
        with pytest.raises(ValueError) as raised:
            engine.save_checkpoint(directory, tag=tag)
        messages.append(str(raised.value))
    with pytest.raises(ValueError) as raised:
        engine.save_checkpoint(directory, client_state={"x": object()} if rank == 1 else {})
    messages.append(str(raised.value))
    with pytest.raises(ValueError) as raised:  # shards of two trainings would be mixed
        engine.load_checkpoint(directory, tag=str(rank + 1))
    messages.append(str(raised.value))
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert sorted(os.listdir(directory)) == ["1", "2", "latest"]  # nothing was written
    path, _ = engine.load_checkpoint(directory, tag=1)  # the same on every rank: loads
    _micro_step(engine, 2, rank)  # the collectives still line up
    return messages + [os.path.basename(path)]


@pytest.mark.parametrize("stage", [1, 3])
def test_ranks_that_disagree_on_the_checkpoint_are_refused_on_every_rank(stage, tmp_path):
    results = run_ranks(disagreeing_ranks_worker, 2, os.fspath(tmp_path), stage, timeout=120, pg_timeout=30)
    for rank, (tags, invalid, client, load, loaded) in enumerate(results):
        assert "different tags (rank 0: mine0, rank 1: mine1)" in tags, tags
        assert ("must be a plain directory name" in invalid if rank == 1 else "rank 1 refused" in invalid), invalid
        assert ("a checkpoint cannot store" in client if rank == 1 else "rank 1 refused" in client), client
        assert "different checkpoints" in load and "rank 0: " in load and "rank 1: " in load, load
        assert loaded == "1"


# ---- param groups --------------------------------------------------------------------------------------------
def _groups(model: Net, layout: str) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if layout == "one":
        return [{"params": weights + biases}]
    decay, no_decay = {"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 3e-3}
    return [decay, no_decay] if layout == "saved" else [no_decay, decay]


def groups_worker(rank: int, world: int, directory: str, stage: int) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage), param_groups=_groups(model, "saved"))
    _micro_step(engine, 0, rank)
    engine.save_checkpoint(directory)
    messages = []
    for layout in ("swapped", "one"):
        torch.manual_seed(0)
        model = Net()
        other = zerocore.initialize(model, _config(stage), param_groups=_groups(model, layout))
        with pytest.raises(ValueError, match="param group") as raised:
            other.load_checkpoint(directory)
        messages.append(str(raised.value))
        other.load_checkpoint(directory, load_optimizer_states=False)  # the weights alone: any groups
        other.close()
    return messages


@pytest.mark.parametrize("stage", [2, 3])
def test_a_load_into_other_param_groups_is_refused(stage, tmp_path):
    for swapped, one in run_ranks(groups_worker, 2, os.fspath(tmp_path), stage):
        assert "holds other parameters" in swapped and "load_optimizer_states=False" in swapped
        assert "2 param groups" in one


# ---- stage 3's fp32 parameter shards on NVMe -----------------------------------------------------------------
def nvme_params_worker(rank: int, world: int, directory: str, nvme: str) -> list[list[float]]:
    config = _config(3, offload_param={"device": "nvme", "nvme_path": nvme, "max_in_cpu": 10},
                     stage3_param_persistence_threshold=0)
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), config)
    _micro_step(engine, 0, rank)
    engine.save_checkpoint(directory)  # the master is the parameter shard itself, read back from its file
    straight = [_micro_step(engine, step, rank) for step in (1, 2)]
    engine.close()
    torch.manual_seed(1)
    fresh = zerocore.initialize(Net(), config)
    fresh.load_checkpoint(directory)
    resumed = [_micro_step(fresh, step, rank) for step in (1, 2)]
    return [straight, resumed]


def test_stage3_fp32_parameters_on_nvme_save_and_resume_bit_exactly(tmp_path):
    for straight, resumed in run_ranks(nvme_params_worker, 2, os.fspath(tmp_path / "ckpt"),
                                       os.fspath(tmp_path)):
        assert straight == resumed


# ---- buffers a module registers in its first forward ------------------------------------------------------
class LazyBuffers(Net):
    """Registers a cache (``persistent=False``) in its first forward, as some rotary embeddings do, and with
    ``count`` a persistent buffer as well."""

    def __init__(self, count: bool) -> None:
        super().__init__()
        self.count = count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.full((8,), 0.5), persistent=False)
            if self.count:
                self.register_buffer("seen", torch.zeros(()))
        if self.count:
            self.seen += 1
        return super().forward(x + self.cache)


def lazy_buffers_worker(rank: int, world: int, stage: int, directory: str, count: bool) -> tuple[str, bool]:
    torch.manual_seed(0)
    engine = zerocore.initialize(LazyBuffers(count), _config(stage))
    _micro_step(engine, 0, rank)
    engine.save_checkpoint(directory, tag="t")
    saved = engine.full_state_dict(rank0_only=False)
    torch.manual_seed(1)
    fresh = zerocore.initialize(LazyBuffers(count), _config(stage))  # no forward yet: no cache, no count
    try:
        fresh.load_checkpoint(directory, tag="t")
    except ValueError as error:
        return str(error), False
    loaded = fresh.full_state_dict(rank0_only=False)
    _micro_step(fresh, 1, rank)  # the cache is made in its first forward
    return "", loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_cache_made_in_the_first_forward_is_no_state_but_a_count_is(stage, tmp_path):
    """A persistent=False buffer is no state (load_state_dict ignores it): one the checkpoint's model had made
    and a fresh model has not yet does not stop the load; a persistent one is refused, naming it (as
    load_state_dict refuses an unexpected key), with nothing changed."""
    for message, equal in run_ranks(lazy_buffers_worker, 2, stage, str(tmp_path / "cache"), False):
        assert not message and equal, message
    for message, _ in run_ranks(lazy_buffers_worker, 2, stage, str(tmp_path / "count"), True):
        assert "in the checkpoint only: ['seen']" in message and "first forward" in message, message
