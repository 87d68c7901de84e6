"""Parameter offload (issue 11): ``offload_param: {device: nvme}`` keeps stage-3 parameter shards beyond
``max_in_cpu`` elements in a file per rank (Note [NVMe parameter shards]) and trains bitwise like the shards
in memory; checkpoints, writes inside ``zerocore.gathered`` and failures to make the file behave as without
it."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch
import zerocore
from _dist import run_ranks
from _models import batch, build, loss_fn
from test_offload import _train

pytestmark = pytest.mark.timeout(300)


def _config(dtype: str, path: str | None, optimizer: str | None = None, max_in_cpu: int = 0) -> dict:
    zero: dict = {"stage": 3, "reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "zero_optimization": zero}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": max_in_cpu}
        config["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 2}
    if optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path}
        zero["sub_group_size"] = 37
    elif optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    return config


def _state(engine: zerocore.Engine) -> list[list[float]]:
    state = engine.optimizer_state
    out = []
    for shard in state.shards:
        with state.resident(shard) as values:
            out += [values[k].tolist() for k in ("master", "exp_avg", "exp_avg_sq")]
    return out


def train_worker(rank: int, world: int, dtype: str, path: str | None, optimizer: str | None,
                 max_in_cpu: int, zeropp: dict | None = None) -> dict:
    config = _config(dtype, path, optimizer, max_in_cpu)
    config["zero_optimization"].update(zeropp or {})
    engine = zerocore.initialize(build("transformer"), config)
    at_init = engine.memory_report()
    losses = _train(engine, rank, 0, 3)
    # a write inside gathered(modifier_rank=0) reaches the shards, in the file too
    params = [p for p in engine.module.parameters() if p.requires_grad]
    with zerocore.gathered(params[:3], modifier_rank=0):
        for p in params[:3]:
            p.data.mul_(0.5)
    losses += _train(engine, rank, 3, 2)
    report = engine.memory_report()
    result = {"losses": losses, "state": _state(engine),
              "params": {k: v.float().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()},
              "param_bytes_at_init": at_init["bytes"]["params"], "param_bytes": report["bytes"]["params"],
              "nvme": report["nvme"], "buffers": report["bytes"]["nvme_param_buffers"],
              "shards": [u.buffer.shard_size * u.buffer.shard.element_size() for u in engine.stage3.units]}
    engine.close()
    torch.distributed.barrier()  # every rank closed
    result["files_left"] = sorted(os.listdir(path)) if path else []
    return result


@pytest.mark.parametrize("dtype,world,optimizer", [("fp32", 1, None), ("bf16", 2, "nvme"), ("bf16", 4, None),
                                                   ("fp32", 2, "cpu")])
def test_parameter_shards_on_nvme_train_bitwise_like_in_memory(dtype, world, optimizer, tmp_path):
    # the reference keeps everything in memory: offloaded optimizer state is bitwise the same (test_offload)
    expected = run_ranks(train_worker, world, dtype, None, None, 0)
    actual = run_ranks(train_worker, world, dtype, str(tmp_path), optimizer, 0)
    for rank, (got, want) in enumerate(zip(actual, expected)):
        assert got["losses"] == want["losses"], rank
        assert got["params"] == want["params"], rank
        assert got["state"] == want["state"], rank
        assert got["param_bytes"] == 0 and got["param_bytes_at_init"] == 0, "no shard stays in memory"
        assert want["param_bytes"] == sum(want["shards"]) > 0
        assert got["nvme"]["param_file_bytes"] >= sum(got["shards"])
        assert got["nvme"]["param_bytes_read"] > 0 and got["nvme"]["param_bytes_written"] > 0
        # from the second step on, gathers find their shard read ahead along the recorded order
        assert got["nvme"]["param_reads_ahead_used"] > 0
        assert got["buffers"] >= max(got["shards"])
        assert got["files_left"] == [], "close() leaves no parameter file behind"


def test_parameter_shards_on_nvme_under_zeropp_train_bitwise_like_in_memory(tmp_path):
    """qwZ gathers read the file like any gather; hpZ's backward gathers come from the kept slices and read
    nothing (2 nodes of 2 ranks)."""
    zeropp = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_node_size": 2}
    expected = run_ranks(train_worker, 4, "bf16", None, None, 0, zeropp, timeout=240)
    actual = run_ranks(train_worker, 4, "bf16", str(tmp_path), None, 0, zeropp, timeout=240)
    for rank, (got, want) in enumerate(zip(actual, expected)):
        assert got["losses"] == want["losses"] and got["params"] == want["params"], rank
        assert got["param_bytes"] == 0 and got["files_left"] == []


def test_max_in_cpu_keeps_the_first_shards_in_memory(tmp_path):
    whole = run_ranks(train_worker, 2, "bf16", None, None, 0)
    shards = whole[0]["shards"]
    budget = sum(shards[:2]) // 2  # elements (bf16): the first two units' shards stay in memory, the rest go
    got = run_ranks(train_worker, 2, "bf16", str(tmp_path), None, budget)
    for rank in range(2):
        assert got[rank]["losses"] == whole[rank]["losses"] and got[rank]["params"] == whole[rank]["params"]
    assert got[0]["param_bytes"] == sum(shards[:2])
    assert got[0]["nvme"]["param_file_bytes"] >= sum(shards[2:]) > 0


def state_off_memory_worker(rank: int, world: int, path: str, optimizer: str | None) -> list[str]:
    engine = zerocore.initialize(build("transformer"), _config("fp32", path, optimizer))
    _train(engine, rank, 0, 1)
    refused = []
    for shard, piece in engine.optimizer_state.pieces():
        names = ["master"] + (["exp_avg", "exp_avg_sq"] if optimizer == "nvme" else [])
        for name in names:  # a parameter shard on NVMe has no storage between steps: torch would read freed memory
            with pytest.raises(RuntimeError, match=r"resident\(shard\)"):
                getattr(shard, name)
            refused.append(name)
        with engine.optimizer_state.resident(shard) as values:
            start = piece.shard_offset
            assert torch.isfinite(values["master"][start : start + piece.length]).all()
    engine.close()
    return refused


@pytest.mark.parametrize("optimizer", [None, "nvme"])
def test_state_on_nvme_is_read_through_resident_and_never_through_freed_memory(optimizer, tmp_path):
    for refused in run_ranks(state_off_memory_worker, 2, str(tmp_path), optimizer):
        assert refused and set(refused) == ({"master"} if optimizer is None else {"master", "exp_avg", "exp_avg_sq"})


def checkpoint_worker(rank: int, world: int, path: str, directory: str, save_offload: bool,
                      load_offload: bool) -> list[float]:
    engine = zerocore.initialize(build("transformer"), _config("bf16", path if save_offload else None))
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(directory)
    expected = _train(engine, rank, 2, 2)
    engine.close()
    engine = zerocore.initialize(build("transformer", seed=7), _config("bf16", path if load_offload else None))
    engine.load_checkpoint(directory)
    assert _train(engine, rank, 2, 2) == expected
    engine.close()
    torch.distributed.barrier()
    return sorted(os.listdir(path))


@pytest.mark.parametrize("save_offload,load_offload", [(True, False), (False, True)])
def test_checkpoints_resume_bitwise_with_parameters_on_nvme(save_offload, load_offload, tmp_path):
    path = tmp_path / "nvme"
    path.mkdir()
    for files_left in run_ranks(checkpoint_worker, 2, str(path), str(tmp_path / "ckpt"), save_offload,
                                load_offload):
        assert files_left == []


def one_rank_path_missing_worker(rank: int, world: int, path: str) -> str:
    mine = path if rank == 0 else os.path.join(path, "missing-on-this-node")
    try:
        zerocore.initialize(build("transformer"), _config("bf16", mine))
    except OSError as error:
        return str(error)
    return "no error"


def test_a_parameter_path_missing_on_one_rank_raises_on_every_rank(tmp_path):
    messages = run_ranks(one_rank_path_missing_worker, 2, str(tmp_path), timeout=90)
    assert "offload_param.nvme_path" in messages[1] and "missing-on-this-node does not exist" in messages[1]
    assert "1 of 2 ranks could not create their NVMe files" in messages[0]
    assert os.listdir(tmp_path) == []


def _failing_io(files: Any) -> list[bool]:
    """Makes the parameter file's I/O completions fail, as a dying disk's would, while the returned
    switch is on."""
    real, failing = files.io.wait, [True]

    def wait(request: int) -> None:
        if failing[0]:
            raise OSError(errno.EIO, "Input/output error (errno 5)", files.path)
        real(request)

    files.io = type("FailingIO", (), {"__getattr__": lambda self, name: getattr(real.__self__, name),
                                      "wait": staticmethod(wait)})()
    return failing


def failing_read_worker(rank: int, world: int, path: str, where: str) -> str:
    # fp32 for the step: its shards are read, updated and written back (16-bit ones are not read)
    engine = zerocore.initialize(build("transformer"), _config("bf16" if where == "gather" else "fp32", path))
    _train(engine, rank, 0, 1)
    failing = _failing_io(engine.param_file) if rank == 1 else [False]
    x, y = batch("transformer", torch.Generator().manual_seed(rank))
    try:
        if where == "gather":
            engine(x)
        else:
            failing[0] = False  # the forward's and backward's reads succeed ...
            engine.backward(loss_fn("transformer", engine(x), y))
            failing[0] = rank == 1  # ... the step's loads and write-backs fail on rank 1
            engine.step()
    except OSError as error:
        return str(error)
    return "no error"


def test_a_failed_shard_read_in_a_gather_raises_on_every_rank_without_a_hang(tmp_path):
    messages = run_ranks(failing_read_worker, 2, str(tmp_path), "gather", timeout=120)
    for rank, message in enumerate(messages):
        assert "rank(s) [1] could not read their parameter shard" in message, message
    assert "Input/output error" in messages[1] and "its read succeeded" in messages[0]


def test_a_failed_shard_write_in_the_step_raises_on_every_rank_without_a_hang(tmp_path):
    messages = run_ranks(failing_read_worker, 2, str(tmp_path), "step", timeout=120)
    for message in messages:
        assert "the NVMe I/O of the step failed on 1 of 2 ranks" in message, message
    assert "Input/output error" in messages[1] and "its I/O succeeded" in messages[0]
