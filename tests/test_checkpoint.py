"""Sharded checkpoints (issue 10; Note [Checkpoint format] in checkpoint.py): bit-exact resume at the same
world size and stage, resharding to another world size and stage at load, atomic saves, and bad input that
is refused before the engine changes."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
from torch import nn

import zerocore
from _deferred_comm import GatherAtWait
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3))
        self.norm = nn.BatchNorm1d(16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 30)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.frozen(self.norm(h)))


def _config(stage: int, dtype: str = "fp32", accumulation: int = 1) -> dict:
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4}},
              "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                    "stage3_param_persistence_threshold": 0}}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
        if dtype == "fp16":
            config["fp16"].update(initial_scale_power=8, loss_scale_window=2)
    return config


def _train(engine: zerocore.Engine, rank: int, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        for micro in range(engine.config.gradient_accumulation_steps):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            tokens, target = torch.randint(0, 30, (6, 5), generator=g), torch.randint(0, 30, (6,), generator=g)
            loss = nn.functional.cross_entropy(engine(tokens).float(), target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _optimizer_state(engine: zerocore.Engine) -> list[torch.Tensor]:
    return [t.clone() for s in engine.optimizer_state.shards for t in (s.master, s.exp_avg, s.exp_avg_sq)]


def _flat_state(engine: zerocore.Engine) -> list[torch.Tensor]:
    """The whole flat state tensors, padding between pieces included."""
    return [engine.optimizer_state.flat(key).clone() for key in ("master", "exp_avg", "exp_avg_sq")]


def resume_worker(rank: int, world: int, stage: int, dtype: str, accumulation: int, directory: str) -> bool:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(stage, dtype, accumulation))
    _train(engine, rank, 0, 3)
    engine.save_checkpoint(directory, client_state={"epoch": 1, "batch": 3})
    saved_flat = _flat_state(engine)
    expected_losses = _train(engine, rank, 3, 3)
    expected_state = engine.full_state_dict(rank0_only=False)
    expected_optimizer = _optimizer_state(engine)
    expected = (engine.global_steps, engine.skipped_steps, engine.loss_scale, engine.lr_scheduler.get_last_lr())

    torch.manual_seed(123)  # a different init and RNG stream: the checkpoint must restore all of it
    fresh = zerocore.initialize(Net(), _config(stage, dtype, accumulation))
    for key in ("master", "exp_avg", "exp_avg_sq"):  # poisoned: every element, padding too, comes from the file
        fresh.optimizer_state.flat(key).fill_(float("nan"))
    path, client = fresh.load_checkpoint(directory)
    assert client == {"epoch": 1, "batch": 3} and path.endswith("global_step3")
    assert all(torch.equal(a, b) for a, b in zip(_flat_state(fresh), saved_flat)), "flat state (or padding) differs"
    assert _train(fresh, rank, 3, 3) == expected_losses
    state = fresh.full_state_dict(rank0_only=False)
    assert all(torch.equal(state[k], expected_state[k]) for k in expected_state), "parameters or buffers differ"
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(fresh), expected_optimizer)), "Adam state differs"
    assert (fresh.global_steps, fresh.skipped_steps, fresh.loss_scale, fresh.lr_scheduler.get_last_lr()) == expected
    return True


@pytest.mark.parametrize("stage,dtype,accumulation", [(1, "fp32", 2), (2, "bf16", 1), (3, "fp32", 1), (3, "bf16", 2),
                                                      (2, "fp16", 1), (1, "bf16", 1)])
def test_resume_is_bit_exact_at_the_same_world_size_and_stage(stage, dtype, accumulation, tmp_path):
    assert all(run_ranks(resume_worker, 2, stage, dtype, accumulation, str(tmp_path)))


def save_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(stage))
    _train(engine, rank, 0, 3)
    engine.save_checkpoint(directory)
    state = engine.full_state_dict(rank0_only=False)
    _train(engine, rank, 3, 2)
    return {"saved": _plain(state)}


def load_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.manual_seed(5)
    engine = zerocore.initialize(Net(), _config(stage))
    engine.load_checkpoint(directory)
    return {"loaded": _plain(engine.full_state_dict(rank0_only=False)), "steps": engine.global_steps}


def _plain(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list]]:
    """Tensors as plain values: results travel back from the rank processes by pickling."""
    return {k: (str(v.dtype), v.flatten().tolist()) for k, v in state.items()}


@pytest.mark.parametrize("saved,loaded", [((2, 2), (1, 1)), ((2, 3), (3, 2)), ((1, 1), (2, 3)), ((3, 1), (2, 2))])
def test_a_checkpoint_loads_at_another_world_size_and_stage(saved, loaded, tmp_path):
    (save_world, save_stage), (load_world, load_stage) = saved, loaded
    before = run_ranks(save_worker, save_world, save_stage, str(tmp_path))[0]
    after = run_ranks(load_worker, load_world, load_stage, str(tmp_path))
    for result in after:
        assert result["steps"] == 3
        for name, value in before["saved"].items():
            assert result["loaded"][name] == value, name


def first_read_after_load_worker(rank: int, world: int, stage: int, directory: str) -> bool:
    from zerocore._sharded_param import _AwaitsGather

    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage))
    _train(engine, rank, 0, 3)
    engine.save_checkpoint(directory)
    saved = {k: v.detach().clone() for k, v in model.named_parameters()}
    _train(engine, rank, 3, 2)
    engine.comm = GatherAtWait(engine.comm)  # the load's all-gathers happen only when a read waits for them
    engine.load_checkpoint(directory)
    (buffer,) = engine.buffers
    assert buffer.gathers_in_flight == len(buffer.buckets) > 1  # load_checkpoint returned before any landed
    assert all(isinstance(p, _AwaitsGather) for p in model.parameters() if p.requires_grad)
    loaded = model.state_dict()  # the user's next read: it waits for every gather it touches
    assert buffer.gathers_in_flight == 0
    for name, value in saved.items():  # every rank's shard, not only this rank's, is the saved one
        assert torch.equal(loaded[name], value), name
    # a save right after a load, before any read, writes the loaded state (it lands the gathers first)
    engine.load_checkpoint(directory)
    assert buffer.gathers_in_flight == len(buffer.buckets)
    engine.save_checkpoint(os.path.join(directory, "again"))
    _train(engine, rank, 3, 1)
    engine.load_checkpoint(os.path.join(directory, "again"))
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    engine.close()
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_read_right_after_a_load_sees_the_loaded_values(stage, tmp_path):
    """load_checkpoint leaves stages 1-2's parameter all-gathers in flight, as step() does; the first read of
    a parameter waits for its gather (Note [Gathers land on first read])."""
    assert all(run_ranks(first_read_after_load_worker, 2, stage, str(tmp_path)))


def bad_input_worker(rank: int, world: int, directory: str) -> list[str]:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(2))
    _train(engine, rank, 0, 1)
    engine.save_checkpoint(directory, tag="good")
    before = engine.full_state_dict(rank0_only=False)
    messages = []
    with pytest.raises(RuntimeError, match="save_checkpoint"):
        engine.optimizer.state_dict()
    # another model: a parameter's shape differs
    other = nn.Module()
    other_engine = zerocore.initialize(_Wider(), _config(2))
    with pytest.raises(ValueError, match=r"'head.(weight|bias)' has shape") as caught:
        other_engine.load_checkpoint(directory, tag="good")
    messages.append(str(caught.value))
    torch.distributed.barrier()
    if rank == 0:  # a damaged file
        path = os.path.join(directory, "good", "rank1.safetensors")
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    torch.distributed.barrier()
    with pytest.raises(ValueError, match="rank1.safetensors") as caught:
        engine.load_checkpoint(directory, tag="good")
    messages.append(str(caught.value))
    with pytest.raises(FileNotFoundError, match="nope does not exist"):
        engine.load_checkpoint(directory, tag="nope")
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the engine"
    _train(engine, rank, 1, 1)  # and it trains on
    del other
    return messages


class _Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 31)


def test_bad_checkpoints_are_refused_before_anything_changes(tmp_path):
    for messages in run_ranks(bad_input_worker, 2, str(tmp_path)):
        assert len(messages) == 2, messages


def interrupted_worker(rank: int, world: int, directory: str) -> bool:
    """A save that dies part-way (here: an exception after this rank's file is written) leaves the previous
    checkpoint complete and named by ``latest``."""
    import zerocore.checkpoint as ckpt

    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(1))
    _train(engine, rank, 0, 1)
    engine.save_checkpoint(directory)
    real = ckpt.untracked_state

    def dies(engine, **kwargs):
        raise KeyboardInterrupt("killed during the save")

    ckpt.untracked_state = dies  # called once this rank's file is written
    try:
        _train(engine, rank, 1, 1)
        with pytest.raises(KeyboardInterrupt):
            engine.save_checkpoint(directory)
    finally:
        ckpt.untracked_state = real
    assert open(os.path.join(directory, "latest")).read() == "global_step1"
    assert not os.path.exists(os.path.join(directory, "global_step2"))
    torch.manual_seed(9)
    fresh = zerocore.initialize(Net(), _config(1))
    path, _ = fresh.load_checkpoint(directory)
    assert path.endswith("global_step1") and fresh.global_steps == 1
    return True


def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    assert all(run_ranks(interrupted_worker, 2, str(tmp_path)))


def test_info_prints_what_a_checkpoint_holds(tmp_path, capsys):
    run_ranks(save_worker, 1, 1, str(tmp_path))
    from zerocore.checkpoint import main

    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "stage 1, world size 1" in out and "head.weight [30, 16]" in out
    index = json.loads(open(os.path.join(tmp_path, "global_step3", "index.json")).read())
    assert index["format"] == "zerocore-checkpoint/2"


def test_to_hf_writes_safetensors_that_load_strictly_into_the_plain_model(tmp_path):
    before = run_ranks(save_worker, 2, 3, str(tmp_path / "ckpt"))[0]["saved"]
    from safetensors.torch import load_file

    from zerocore.checkpoint import main

    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    plain = Net()
    plain.load_state_dict(state, strict=True)
    assert _plain(plain.state_dict()) == before
    # sharded output with an index, in bf16
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf16"), "--dtype", "bf16",
                 "--max-shard-size", "3KB"]) == 0
    index = json.loads((tmp_path / "hf16" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1
    merged = {}
    for name in files:
        merged.update(load_file(str(tmp_path / "hf16" / name)))
    assert merged.keys() == state.keys() and merged["head.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(merged["head.weight"].float(), state["head.weight"], rtol=2**-8, atol=0)


def no_optimizer_worker(rank: int, world: int, directory: str) -> bool:
    torch.manual_seed(4)
    engine = zerocore.initialize(Net(), _config(1))
    engine.load_checkpoint(directory, load_optimizer_states=False)
    # DeepSpeed's counting: the steps and the schedule go on, the optimizer (Adam's step, its moments) starts over
    assert engine.global_steps == 3 and engine.optimizer_state.step_count == 0
    assert all(not s.exp_avg.any() and not s.exp_avg_sq.any() for s in engine.optimizer_state.shards)
    weights = engine.full_state_dict(rank0_only=False)
    lr = engine.get_lr()
    assert lr == [engine.lr_scheduler.get_last_lr()[0]] != [0.0]  # the schedule's lr at step 3, not its first
    rng = torch.get_rng_state()  # the checkpoint's (dropout)
    _train(engine, rank, 3, 1)  # trains on from the loaded weights with a fresh optimizer
    # ... whose first update is a fresh engine's first update from those weights at that lr
    torch.manual_seed(6)
    fresh = zerocore.initialize(Net(), _config(1))
    with zerocore.gathered(list(fresh.module.parameters()), modifier_rank=0):
        fresh.module.load_state_dict(weights)
    for group, value in zip(fresh.optimizer.param_groups, lr):
        group["lr"] = value
    fresh.lr_scheduler = None
    torch.set_rng_state(rng)
    _train(fresh, rank, 3, 1)
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(v, after[k]) for k, v in fresh.full_state_dict(rank0_only=False).items())
    fresh.close()
    # a save of the resumed run records both counts: a load continues Adam's step from 1, not from 4
    assert engine.global_steps == 4
    engine.save_checkpoint(directory, tag="resumed")
    _train(engine, rank, 4, 1)
    again = zerocore.initialize(Net(), _config(1))
    again.load_checkpoint(directory, "resumed")
    assert again.global_steps == 4 and again.optimizer_state.step_count == 1
    _train(again, rank, 4, 1)
    assert again.global_steps == 5
    assert all(torch.equal(v, again.full_state_dict(rank0_only=False)[k])
               for k, v in engine.full_state_dict(rank0_only=False).items())
    return True


def test_load_without_optimizer_states_starts_a_fresh_optimizer(tmp_path):
    run_ranks(save_worker, 2, 2, str(tmp_path))
    assert all(run_ranks(no_optimizer_worker, 2, str(tmp_path)))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 30, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def save_16bit_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = Tied()
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}})
    tokens = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens).float().square().mean())
    engine.step()
    path = engine.save_16bit_model(directory)
    return _plain(engine.full_state_dict(rank0_only=False)) if rank == 0 else {"path": path}


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_writes_the_tied_weight_once(stage, tmp_path):
    from safetensors.torch import load_file

    expected = run_ranks(save_16bit_worker, 2, stage, str(tmp_path))[0]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == ["embed.weight", "hidden.bias", "hidden.weight"]  # head.weight is embed.weight
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    plain = Tied()
    missing, unexpected = plain.load_state_dict(saved, strict=False)
    assert missing == ["head.weight"] and not unexpected and plain.head.weight is plain.embed.weight
    assert _plain(saved) == {k: v for k, v in expected.items() if k != "head.weight"}


def save_16bit_bin_worker(rank: int, world: int, directory: str) -> bool:
    torch.manual_seed(0)
    engine = zerocore.initialize(Tied(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                          "zero_optimization": {"stage": 3}})
    engine.save_16bit_model(directory, "pytorch_model.bin")
    engine.save_16bit_model(directory, "model.safetensors")
    return True


def test_save_16bit_model_under_deepspeeds_default_name_writes_a_torch_save_file(tmp_path):
    """DeepSpeed's save_16bit_model writes pytorch_model.bin with torch.save, which Hugging Face's loader (and
    torch.load) read there; safetensors bytes under that name read as neither."""
    from safetensors.torch import load_file

    run_ranks(save_16bit_bin_worker, 2, str(tmp_path))
    binary = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert {k: v.tolist() for k, v in binary.items()} == {
        k: v.tolist() for k, v in load_file(str(tmp_path / "model.safetensors")).items()}


def saving_forever_worker(rank: int, world: int, directory: str, started: Any) -> None:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(2))
    step = 0
    while True:  # until killed
        _train(engine, rank, step, 1)
        step += 1
        engine.save_checkpoint(directory)
        if rank == 0:
            started.set()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_killed_at_a_random_moment_of_saving_leaves_latest_loadable(seed, tmp_path):
    """SIGKILL one rank at a random moment while both ranks save checkpoint after checkpoint: ``latest``
    always names a complete checkpoint, which loads (here at world size 1, stage 1: all files are read
    and checked against their checksums)."""
    import random as stdlib_random
    import signal
    import time

    from _dist import _worker, free_port, rank_context

    ctx = rank_context()
    started, queue, port = ctx.Event(), ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(saving_forever_worker, r, 2, port, (str(tmp_path), started), queue,
                                               30.0), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert started.wait(120), "no checkpoint was completed"
        time.sleep(stdlib_random.Random(seed).uniform(0.0, 0.5))  # a save takes a few tens of milliseconds
        os.kill(procs[seed % 2].pid, signal.SIGKILL)
    finally:
        for p in procs:
            p.kill()
            p.join()
    latest = open(os.path.join(tmp_path, "latest")).read()
    assert os.path.exists(os.path.join(tmp_path, latest, "index.json"))
    result = run_ranks(load_worker, 1, 1, str(tmp_path))[0]
    assert result["steps"] == int(latest.removeprefix("global_step"))


@pytest.mark.parametrize("where", ["header", "data", "index", "piece_offset"])
def test_a_flipped_byte_is_refused_naming_the_file_and_bytes(where, tmp_path):
    """A file of the right size whose content changed after saving (one flipped bit in its header, its
    data, or a checksum in the index) is refused before the engine changes, naming the file and range."""
    run_ranks(save_worker, 1, 2, str(tmp_path))
    directory = tmp_path / "global_step3"
    path = directory / "rank0.safetensors"
    data = bytearray(path.read_bytes())
    index = json.loads((directory / "index.json").read_text())
    checksums = index["ranks"][0]["checksums"]
    if where == "header":
        data[20] ^= 0x01
        path.write_bytes(bytes(data))
        message = r"rank0.safetensors does not match its checksum in index.json in its header"
    elif where == "data":
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
        message = r"rank0.safetensors does not match its checksum in index.json in bytes \[\d+, \d+\)"
    elif where == "index":  # a checksum in the index: the index's own checksum no longer matches
        first = checksums["crc32c"][0]
        checksums["crc32c"] = ("1" if first != "1" else "2") + checksums["crc32c"][1:]
        (directory / "index.json").write_text(json.dumps(index))
        message = r"index.json does not match its checksum"
    else:  # where a piece lies in its shard: the files' checksums cannot see it, the index's does
        index["ranks"][0]["shards"][0]["pieces"][0][2] += 1
        (directory / "index.json").write_text(json.dumps(index))
        message = r"index.json does not match its checksum"
    for result in run_ranks(refused_worker, 1, str(tmp_path), message):
        assert result


def refused_worker(rank: int, world: int, directory: str, message: str) -> bool:
    torch.manual_seed(5)
    engine = zerocore.initialize(Net(), _config(2))
    before = engine.full_state_dict(rank0_only=False)
    with pytest.raises(ValueError, match=message):
        engine.load_checkpoint(directory)
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed the engine"
    return True


def test_checkpoint_files_are_plain_safetensors(tmp_path):
    """Every file of a checkpoint opens with the safetensors library and holds what the index says."""
    from safetensors import safe_open

    run_ranks(save_worker, 2, 3, str(tmp_path))
    directory = tmp_path / "global_step3"
    index = json.loads((directory / "index.json").read_text())
    for entry in index["ranks"]:
        with safe_open(str(directory / entry["file"]), framework="pt", device="cpu") as f:
            for shard, saved in enumerate(entry["shards"]):
                for state in ("master", "exp_avg", "exp_avg_sq"):
                    assert f.get_tensor(f"{shard}.{state}").shape == (saved["numel"],)
            assert f.get_tensor("rng.cpu").dtype == torch.uint8
    with safe_open(str(directory / "model.safetensors"), framework="pt", device="cpu") as f:
        assert set(f.keys()) == set(index["untracked"])


# ---- measured memory: a load reads this rank's share, to-hf one tensor at a time --------------------------
class Wide(nn.Module):
    """32 square 1024x1024 layers (33.6M parameters, 134 MB in fp32; 403 MB of checkpoint with both
    moments): big enough that reading more than a rank's share shows in its peak memory."""

    def __init__(self, layers: int = 32, dim: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x) * 1e-3
        return x


def _peak_reset() -> int:
    """Resets this process's peak RSS (VmHWM) and returns its current RSS, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _wide_config(stage: int) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}


def wide_save_worker(rank: int, world: int, directory: str) -> int:
    torch.manual_seed(0)
    engine = zerocore.initialize(Wide(), _wide_config(1))
    engine.backward(engine(torch.randn(4, 1024)).square().mean())
    engine.step()
    engine.save_checkpoint(directory)
    return sum(p.numel() for p in engine.module.parameters())


def wide_load_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(1)
    engine = zerocore.initialize(Wide(), _wide_config(3))
    own = sum(3 * 4 * shard.numel for shard in engine.optimizer_state.shards)
    base = _peak_reset()
    engine.load_checkpoint(directory)
    return {"extra": _status("VmHWM") - base, "own": own}


def test_a_resharding_load_reads_only_this_ranks_share(tmp_path):
    """Saved at world 2 (stage 1), loaded at world 4 (stage 3): each rank's peak extra host memory during the
    load is its own share of the state plus the checksum blocks around the byte ranges it reads and one
    tensor, far below the checkpoint's size (403 MB)."""
    import zerocore._safetensors_io as stio

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    numel = run_ranks(wide_save_worker, 2, str(tmp_path))[0]
    total = 3 * 4 * numel
    for result in run_ranks(wide_load_worker, 4, str(tmp_path), timeout=240):
        # at most two saved files overlap one rank's share: a block at each end of each run read from them
        bound = result["own"] + 2 * 2 * stio.BLOCK + 4 * 1024 * 1024 + 24 * 2**20
        assert result["extra"] <= bound, (result, bound, total)
        assert result["extra"] < total / 2, (result, total)


def test_to_hf_holds_one_tensor_at_a_time(tmp_path):
    """``to-hf`` of the same 134 MB model runs with a peak extra memory of a few times its largest tensor
    (4 MiB) plus the checksum blocks around it, measured in a fresh process."""
    import subprocess
    import sys
    import textwrap

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    numel = run_ranks(wide_save_worker, 2, str(tmp_path / "ckpt"))[0]
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import _peak_reset, _status
        from zerocore.checkpoint import to_hf
        base = _peak_reset()
        to_hf({str(tmp_path / "ckpt")!r}, {str(tmp_path / "hf")!r})
        print(json.dumps({{"extra": _status("VmHWM") - base}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=True)
    extra = json.loads(out.stdout.strip().splitlines()[-1])["extra"]
    import zerocore._safetensors_io as stio

    largest = 4 * 1024 * 1024
    assert extra <= 3 * largest + 2 * 2 * stio.BLOCK + 24 * 2**20, extra
    assert extra < 4 * numel / 2, (extra, 4 * numel)
    assert os.path.getsize(tmp_path / "hf" / "model.safetensors") >= 4 * numel


def _frozen_wide() -> Wide:
    """Wide with every layer but the last frozen: 31 frozen units of 4 MiB (130 MB), as a LoRA base is."""
    model = Wide()
    model.layers[:-1].requires_grad_(False)
    return model


def frozen_save_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(_frozen_wide(), _wide_config(3))
    engine.backward(engine(torch.randn(4, 1024)).square().mean())
    engine.step()
    base = _peak_reset()
    engine.save_checkpoint(directory)
    extra = _status("VmHWM") - base
    return {"extra": extra, "state": {k: v.sum().item() for k, v in engine.full_state_dict(rank0_only=False).items()}}


def frozen_load_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(1)
    engine = zerocore.initialize(_frozen_wide(), _wide_config(3))
    own = engine.memory_report()["bytes"]["frozen_params"]
    base = _peak_reset()
    engine.load_checkpoint(directory)
    extra = _status("VmHWM") - base
    return {"extra": extra, "own": own,
            "state": {k: v.sum().item() for k, v in engine.full_state_dict(rank0_only=False).items()}}


def test_sharded_frozen_parameters_are_never_whole_on_a_rank_in_a_save_or_a_load(tmp_path):
    """Stage 3's frozen parameters (Note [Sharded frozen parameters in checkpoints]): saved at world 2, rank 0
    streams each unit into the model file while it is gathered, so no rank's peak extra memory comes near
    the frozen base (130 MB: rank 0 used to hold it whole); loaded at world 4, each rank reads its shard's byte
    ranges of the model file, not every frozen tensor whole. The values round-trip exactly."""
    import zerocore._safetensors_io as stio

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    frozen = 31 * 4 * 1024 * 1024
    saved = run_ranks(frozen_save_worker, 2, str(tmp_path), timeout=240)
    for result in saved:  # a few units (4 MiB each) at most
        assert result["extra"] < 3 * 4 * 1024 * 1024 + 24 * 2**20 < frozen / 2, result["extra"]
    loaded = run_ranks(frozen_load_worker, 4, str(tmp_path), timeout=240)
    for result in loaded:
        assert result["own"] * 4 >= frozen
        bound = result["own"] + 2 * 2 * stio.BLOCK + 24 * 2**20  # its shard, blocks cut at its ends, reads in flight
        assert result["extra"] <= bound < frozen, (result["extra"], bound)
        assert result["state"] == saved[0]["state"]


def hf_save_worker(rank: int, world: int, directory: str) -> dict:
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64,
                                                                  n_positions=16))
    engine = zerocore.initialize(model, _config(3))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens, labels=tokens).loss)
    engine.step()
    engine.save_checkpoint(directory)
    return _plain(engine.full_state_dict(rank0_only=False))


def test_to_hf_output_loads_with_from_pretrained(tmp_path):
    """A Hugging Face model trained under stage 3 at world 2, saved, converted with to-hf: the output loads
    with ``from_pretrained`` (tied lm_head written once, as Hugging Face expects) with the trained values."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("numpy")  # transformers needs it at import time of its modeling code
    from zerocore.checkpoint import main

    expected = run_ranks(hf_save_worker, 2, str(tmp_path / "ckpt"))[0]
    out = tmp_path / "hf"
    assert main(["to-hf", str(tmp_path / "ckpt"), str(out)]) == 0
    transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16).save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    state = _plain(loaded.state_dict())
    for name, value in expected.items():
        assert state[name] == value, name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_checked_reads_land_every_range_wherever_its_destination_lies(tmp_path, data):
    """``VerifiedFile.read`` with ranges in any order, adjacent or not in the file, landing in one storage
    next to each other (read as one range), with gaps, out of phase with the file, or in tensors of their
    own: every destination gets exactly its bytes."""
    import zerocore._safetensors_io as stio

    size = data.draw(st.integers(1, 3 * 8192 + 77))
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    path = str(tmp_path / f"f{size}.safetensors")
    checksums = stio.write_tensors(path, {"lead": torch.arange(3, dtype=torch.uint8), "x": payload}, block=4096)
    io = stio.open_io({"block_size": 8192, "queue_depth": 4, "thread_count": 2})
    f = stio.VerifiedFile(io, path, checksums)
    try:
        start, _, _ = f.tensor_range("x")
        cuts = sorted(set(data.draw(st.lists(st.integers(1, size - 1), max_size=6)) if size > 1 else []))
        pieces = [(a, b - a) for a, b in zip([0] + cuts, cuts + [size])]
        chosen = data.draw(st.lists(st.sampled_from(pieces), min_size=1, max_size=len(pieces), unique=True))
        shared = stio.aligned_empty(size + 64 * len(chosen), skew=data.draw(st.integers(0, 4095)))
        into, at = [], 0
        for offset, length in chosen:
            if data.draw(st.booleans()):  # in the shared storage, next to the previous one or after a gap
                at += data.draw(st.sampled_from([0, 0, 5, 64]))
                into.append(shared[at : at + length])
                at += length
            else:
                into.append(stio.aligned_empty(length, skew=data.draw(st.integers(0, 4095))))
        order = data.draw(st.permutations(range(len(chosen))))
        ranges = [(start + chosen[i][0], chosen[i][1]) for i in order]
        got = f.read(ranges, into=[into[i] for i in order])
        for i, out in zip(order, got):
            offset, length = chosen[i]
            assert out.data_ptr() == into[i].data_ptr()
            assert torch.equal(out, payload[offset : offset + length]), (offset, length)
    finally:
        f.close()


class _WrappedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))  # a buffer's name is written too

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.linear(h)) * self.scale)


def _blocks_model(wrapped: bool) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    blocks: list[nn.Module] = [_WrappedBlock() for _ in range(3)]
    if wrapped:  # torchtitan's wrappers: activation checkpointing, then compile
        blocks = [torch.compile(checkpoint_wrapper(b), backend="eager") for b in blocks]
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(*blocks), nn.Linear(8, 1))


def wrappers_worker(rank: int, world: int, stage: int, path: str, saved_wrapped: bool) -> dict[str, Any]:
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}

    def train(engine: zerocore.Engine, steps: range) -> None:
        for step in steps:
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).square().mean())
            engine.step()

    saver = zerocore.initialize(_blocks_model(saved_wrapped), config)
    train(saver, range(2))
    saver.save_checkpoint(path, tag="t")
    exported = saver.save_16bit_model(path, "export.safetensors")
    train(saver, range(2, 4))
    after = {k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): v.tolist()
             for k, v in saver.full_state_dict(rank0_only=False).items()}
    saver.close()
    loader = zerocore.initialize(_blocks_model(not saved_wrapped), config)
    loader.load_checkpoint(path, tag="t")
    train(loader, range(2, 4))
    resumed = {k.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): v.tolist()
               for k, v in loader.full_state_dict(rank0_only=False).items()}
    from safetensors import safe_open

    with safe_open(exported, "pt") as f:
        keys = sorted(f.keys())
    return {"after": after, "resumed": resumed, "export_keys": keys}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("saved_wrapped", [True, False], ids=["saved_wrapped", "saved_plain"])
def test_checkpoints_name_parameters_without_compile_and_checkpoint_wrappers(stage, saved_wrapped, tmp_path):
    """Note [Names without wrappers]: a model trained with compiled (and checkpoint-wrapped) blocks resumes
    uncompiled and the other way round, bit for bit, and its 16-bit export loads into the plain class."""
    result = run_ranks(wrappers_worker, 2, stage, str(tmp_path), saved_wrapped, timeout=180)[0]
    assert result["resumed"] == result["after"]
    assert result["export_keys"] == sorted(_blocks_model(False).state_dict()), result["export_keys"]
