"""Optimizer-state offload (issue 11): ``offload_optimizer: cpu`` and ``nvme`` train bitwise like the state
in memory (same kernel, same element order), checkpoints go through the file, and every failure of the state
file is an error on every rank, naming the path, before anything changes (or, mid-step, after every rank
issued the same collectives)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import zerocore
from _dist import run_ranks
from _models import batch, build, loss_fn

pytestmark = pytest.mark.timeout(300)


def _config(stage: int, dtype: str, offload: str | None, path: str, sub_group_size: int = 37) -> dict:
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                    "stage3_param_persistence_threshold": 0}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if offload == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        # a small sub-group size: many sub-groups, several per shard, so the pipeline really rotates
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        config["zero_optimization"]["sub_group_size"] = sub_group_size
        config["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}
    return config


def _state(engine: zerocore.Engine) -> list[torch.Tensor]:
    state = engine.optimizer_state
    out = []
    for shard in state.shards:
        with state.resident(shard) as values:
            out += [values[k].clone() for k in ("master", "exp_avg", "exp_avg_sq")]
    return out


def train_worker(rank: int, world: int, model: str, stage: int, dtype: str, offload: str | None,
                 path: str) -> dict:
    engine = zerocore.initialize(build(model), _config(stage, dtype, offload, path))
    losses = []
    for step in range(4):
        x, y = batch(model, torch.Generator().manual_seed(100 * step + rank))
        loss = loss_fn(model, engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.memory_report()
    nvme_io = engine.comm_report()["nvme_io"]  # before _state() reads the file once more
    # plain lists: tensors would travel back through shared memory the exiting worker takes with it
    params = {k: v.float().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    result = {"losses": losses, "params": params, "state": [t.tolist() for t in _state(engine)],
              "placement": report["optimizer_placement"], "nvme": report["nvme"],
              "moments_in_memory": report["bytes"]["optimizer_moments"], "nvme_io": nvme_io}
    engine.close()
    torch.distributed.barrier()  # every rank closed
    result["files_left"] = sorted(os.listdir(path)) if offload == "nvme" else []
    return result


CASES = [(1, "fp32", 1), (2, "bf16", 2), (3, "fp32", 2), (3, "bf16", 4), (1, "bf16", 4), (2, "fp32", 1)]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("stage,dtype,world", CASES)
def test_offloaded_training_is_bitwise_the_in_memory_training(offload, stage, dtype, world, tmp_path):
    model = "transformer"
    expected = run_ranks(train_worker, world, model, stage, dtype, None, str(tmp_path))
    path = tmp_path / "nvme"
    path.mkdir()
    actual = run_ranks(train_worker, world, model, stage, dtype, offload, str(path))
    for rank, (got, want) in enumerate(zip(actual, expected)):
        assert got["losses"] == want["losses"], rank
        assert got["params"] == want["params"], rank
        assert got["state"] == want["state"], rank
        assert got["placement"] == offload
        assert got["files_left"] == [], "close() leaves no state file behind"
        if offload == "nvme":
            assert got["moments_in_memory"] == 0
            assert got["nvme"]["file_bytes"] >= sum(len(t) * 4 for t in got["state"][1::3]) * 2
            assert got["nvme"]["bytes_read"] > 0 and got["nvme"]["bytes_written"] > 0
            # each step reads and writes the whole state file once (the initial write is before the steps)
            assert got["nvme_io"]["bytes_read_per_step"] == got["nvme"]["file_bytes"]


def _train(engine: zerocore.Engine, rank: int, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        x, y = batch("transformer", torch.Generator().manual_seed(100 * step + rank))
        loss = loss_fn("transformer", engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def checkpoint_worker(rank: int, world: int, path: str, directory: str, save_offload: str | None,
                      load_offload: str | None) -> dict:
    engine = zerocore.initialize(build("transformer"), _config(2, "bf16", save_offload, path))
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(directory)
    expected = _train(engine, rank, 2, 2)
    engine.close()
    engine = zerocore.initialize(build("transformer", seed=7), _config(2, "bf16", load_offload, path))
    engine.load_checkpoint(directory)
    assert _train(engine, rank, 2, 2) == expected
    engine.close()
    torch.distributed.barrier()  # every rank closed
    return {"files_left": sorted(os.listdir(path))}


@pytest.mark.parametrize("save_offload,load_offload", [("nvme", "nvme"), (None, "nvme"), ("nvme", None)])
def test_checkpoints_go_through_the_state_file(save_offload, load_offload, tmp_path):
    path = tmp_path / "nvme"
    path.mkdir()
    for result in run_ranks(checkpoint_worker, 2, str(path), str(tmp_path / "ckpt"), save_offload, load_offload):
        assert result["files_left"] == []


# ---- failures ---------------------------------------------------------------------------------------------
def init_error_worker(rank: int, world: int, path: str, disk_full: bool) -> tuple[str, int | None, str]:
    """initialize with the state file under ``path``; returns the error's type, errno and message."""
    if disk_full:  # this machine's disk is not small enough: the allocation fails as a full disk's would
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
    try:
        zerocore.initialize(build("mlp"), _config(1, "fp32", "nvme", path))
    except OSError as error:
        return type(error).__name__, error.errno, str(error)
    return "no error", None, ""


def test_a_missing_nvme_path_is_named(tmp_path):
    missing = tmp_path / "not-there"
    kind, _, message = run_ranks(init_error_worker, 1, str(missing), False)[0]
    assert kind == "FileNotFoundError" and f"offload_optimizer.nvme_path: {missing} does not exist" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_nvme_path_is_named(tmp_path):
    tmp_path.chmod(0o500)
    try:
        kind, _, message = run_ranks(init_error_worker, 1, str(tmp_path), False)[0]
    finally:
        tmp_path.chmod(0o700)
    assert kind == "PermissionError" and f"offload_optimizer.nvme_path: {tmp_path} is not writable" in message


def test_a_full_disk_at_initialize_names_the_file_and_size(tmp_path):
    """The state file is fully allocated at initialize, so a disk too small fails there, naming the file,
    size and offset, and leaves no file behind."""
    import re

    kind, code, message = run_ranks(init_error_worker, 1, str(tmp_path), True)[0]
    assert code == errno.ENOSPC, (kind, message)
    assert re.search(r"cannot allocate \d+ bytes for the optimizer state at offset 0 of .*\.swp: No space left",
                     message), message
    assert os.listdir(tmp_path) == []


def one_rank_path_missing_worker(rank: int, world: int, path: str) -> str:
    """Rank 1's nvme_path does not exist (a directory missing on one node): every rank raises from
    initialize, none waits in a collective for the other."""
    mine = path if rank == 0 else os.path.join(path, "missing-on-this-node")
    try:
        zerocore.initialize(build("transformer"), _config(3, "bf16", "nvme", mine))
    except OSError as error:
        return str(error)
    return "no error"


def test_a_path_missing_on_one_rank_raises_on_every_rank(tmp_path):
    messages = run_ranks(one_rank_path_missing_worker, 2, str(tmp_path), timeout=90)
    assert "1 of 2 ranks could not create their NVMe files" in messages[0]
    assert "missing-on-this-node does not exist" in messages[1]
    assert os.listdir(tmp_path) == []  # rank 0's file is removed


def truncated_worker(rank: int, world: int, path: str) -> str:
    engine = zerocore.initialize(build("transformer"), _config(2, "bf16", "nvme", path))
    x, y = batch("transformer", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("transformer", engine(x), y))
    engine.step()
    if rank == 1:  # the state file shrinks behind the engine's back (it has no name: through /proc)
        os.truncate(f"/proc/self/fd/{engine.optimizer_state.store.fd}", 100)
    engine.backward(loss_fn("transformer", engine(x), y))
    before = engine.full_state_dict(rank0_only=False)
    with pytest.raises(OSError, match="the step was refused on every rank, nothing changed") as caught:
        engine.step()
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    return str(caught.value)


def test_a_truncated_state_file_refuses_the_step_on_every_rank(tmp_path):
    messages = run_ranks(truncated_worker, 2, str(tmp_path))
    assert "was truncated to 100 of" in messages[1] and ".swp" in messages[1]
    assert "1 other rank(s) cannot read their optimizer state file" in messages[0]


def failing_io_worker(rank: int, world: int, path: str, stage: int) -> str:
    engine = zerocore.initialize(build("transformer"), _config(stage, "bf16", "nvme", path))
    store = engine.optimizer_state.store
    if rank == 0:  # the fourth I/O completion of the step fails, as a dying disk would
        real, calls = store.io.wait, [0]

        def wait(request: int) -> None:
            calls[0] += 1
            if calls[0] == 4:
                raise OSError(errno.EIO, f"read of 4096 bytes at offset 8192 of {store.path} failed: "
                                         "Input/output error (errno 5)", store.path)
            real(request)

        store.io = type("FailingIO", (), {"__getattr__": lambda self, name: getattr(real.__self__, name),
                                           "wait": staticmethod(wait)})()
    x, y = batch("transformer", torch.Generator().manual_seed(rank))
    engine.backward(loss_fn("transformer", engine(x), y))
    with pytest.raises(OSError, match="the NVMe I/O of the step failed on 1 of 2 ranks") as caught:
        engine.step()
    return str(caught.value)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_io_error_mid_step_raises_on_every_rank_without_a_hang(stage, tmp_path):
    messages = run_ranks(failing_io_worker, 2, str(tmp_path), stage, timeout=120)
    assert "offset 8192" in messages[0] and "Input/output error" in messages[0]
    assert "its I/O succeeded" in messages[1]


# ---- a killed run -----------------------------------------------------------------------------------------
_KILLED_RUN = r"""
import datetime, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
import zerocore
from _dist import free_port
from _models import batch, build, loss_fn
from test_offload import _config

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
engine = zerocore.initialize(build("transformer"), _config(2, "bf16", "nvme", sys.argv[2]))
x, y = batch("transformer", torch.Generator().manual_seed(0))
engine.backward(loss_fn("transformer", engine(x), y))
engine.step()
print("training", engine.optimizer_state.store.size, flush=True)
time.sleep(600)
"""


def test_a_killed_run_leaves_no_state_file_behind(tmp_path):
    """SIGKILL (the OOM killer, a scheduler's hard kill) runs no cleanup: the state file has no name from the
    moment it is open, so the kernel frees it with the process's descriptors and nothing stays on the disk."""
    import contextlib
    import select
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "nvme"
    path.mkdir()
    tests = os.path.dirname(os.path.abspath(__file__))
    stderr = open(tmp_path / "stderr.txt", "w")  # noqa: SIM115 - closed below; a file cannot fill up as a pipe can
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, tests, str(path)], stdout=subprocess.PIPE,
                            stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while not line and proc.poll() is None and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        assert line.startswith("training"), (line, proc.poll(), (tmp_path / "stderr.txt").read_text()[-3000:])
        size = int(line.split()[1])
        # the run holds its state (allocated, a step done) in a file that has no name any more
        held = {}
        for fd in os.listdir(f"/proc/{proc.pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{proc.pid}/fd/{fd}")
                if link.startswith(str(path / "zerocore-optimizer-rank0-")):
                    held[link] = os.stat(f"/proc/{proc.pid}/fd/{fd}").st_size
        assert held and all(link.endswith(".swp (deleted)") for link in held), held
        assert set(held.values()) == {size} and size > 0, (held, size)
        assert os.listdir(path) == []
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        stderr.close()
    assert os.listdir(path) == []


class DeferredCopies:
    """The copy streams of Note [Offload copies] as the CPU can run them: a copy to the host lands only when
    waited for (its stream running behind) and its destination reads NaN until then, so an update that reads a
    staging buffer before waiting for it, or after waiting for another shard's copies, goes NaN."""

    def __init__(self, device: torch.device) -> None:
        self.queue: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.landed = 0
        self.log: list[str] = []

    def to_host(self, pairs):
        for dst, _ in pairs:
            dst.fill_(float("nan"))
        self.queue.append(list(pairs))
        self.log.append("to_host")
        return len(self.queue)

    def wait_on_host(self, ticket: int) -> None:
        for pairs in self.queue[self.landed:ticket]:  # one stream: everything queued before lands first
            for dst, src in pairs:
                dst.copy_(src)
        self.landed = max(self.landed, ticket)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.log.append("to_device")


def _optimizer_state(dtype: torch.dtype, staged: bool):
    """Three shards (one of them two param groups) of ``dtype`` parameters, the state on the host: as it is
    on a CPU-only machine, or (``staged``) as offloaded from a GPU: a separate fp32 master and host staging
    buffers the gradients come into and the parameters leave from, through DeferredCopies."""
    from zerocore._optimizer_state import OptimizerState
    from zerocore._shard_geometry import ShardPiece, ShardRun

    state = OptimizerState(torch.device("cpu"))
    if staged:
        state.stages_through_host = lambda device: True
        state.keeps_separate_master = lambda dtype, device: True
        state.copies_type = DeferredCopies
    g = torch.Generator().manual_seed(0)
    for index, numel in enumerate((37, 64, 5)):
        master = torch.randn(numel, generator=g)
        runs = [ShardRun(0, numel, 0)] if index != 1 else [ShardRun(0, 40, 0), ShardRun(40, numel, 1)]
        state.add_shard(f"shard{index}", master.to(dtype), torch.zeros(numel), runs,
                        [ShardPiece(f"p{index}", (numel,), 0, 0, numel)], master_values=master)
    state.build()
    return state


class _NoHome:
    """A parameter home that does nothing (the step then loads and unloads shards through ``before_shard``)."""

    def unload_shard(self, written: bool, in_step: bool) -> None:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_shard_load", [False, True])
def test_the_offloaded_step_waits_for_each_shards_copies_and_updates_as_in_memory(dtype, per_shard_load):
    """Note [Offload copies]: every shard's gradients (and 16-bit parameters) are queued to the host before the
    first update (or, with parameter shards on NVMe, each once loaded), each update waits for its own shard's
    copies, and the parameters go back before ``after_shard``: the result is bitwise the in-memory step's."""
    groups = [{"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01, "adamw_mode": True,
               "bias_correction": True}, {"lr": 3e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.0,
                                          "adamw_mode": True, "bias_correction": True}]
    plain, staged = _optimizer_state(dtype, False), _optimizer_state(dtype, True)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        for index, shard in enumerate(plain.shards):
            grads = torch.randn(shard.numel, generator=g)
            shard.grads.copy_(grads)
            staged.shards[index].grads.copy_(grads)
        seen = []

        def after_shard(index: int) -> None:  # (stages 1-2 all-gather the shard's parameters here)
            seen.append((index, staged.shards[index].params.clone()))

        loaded = []
        plain.step(groups, grad_scale=0.5)
        if per_shard_load:  # OptimizerState.step passes before_shard itself for NVMe parameter shards
            staged._load_params = lambda index, writes_every_param: loaded.append(index)
            staged.shards[0].param_home = _NoHome()
        staged.step(groups, grad_scale=0.5, after_shard=after_shard)
        staged.shards[0].param_home = None
        assert loaded == ([0, 1, 2] if per_shard_load else [])
        for index, (shard, other) in enumerate(zip(plain.shards, staged.shards)):
            assert torch.equal(shard.params, other.params), (step, index)
            assert torch.equal(shard.master, other.master) and torch.equal(shard.exp_avg, other.exp_avg)
            assert torch.equal(seen[index][1], shard.params), "after_shard ran before the parameters were back"
        log = staged._copies.log
        assert log.count("to_host") == 3 * (step + 1) and staged._copies.landed == len(staged._copies.queue)
        this_step = log[-6:]
        assert this_step == (["to_host", "to_device"] * 3 if per_shard_load else ["to_host"] * 3 + ["to_device"] * 3)

