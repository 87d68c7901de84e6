"""engine.load_hf_weights (Note [Loading Hugging Face weights] in _hf_weights.py): pretrained safetensors
weights, a single file or shards with an index, loaded into a running engine at every stage, each rank reading
only its shards' share of the trainable weights; checked against an engine built from the same weights loaded
into the plain model first, step by step."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks
from test_stage3 import Block
from zerocore._safetensors_io import write_tensors

pytestmark = pytest.mark.timeout(300)

VOCAB, DIM = 24, 16


class Pretrained(nn.Module):
    """Tied embedding and head, repeated blocks (stage 3's units), a frozen layer, BatchNorm's buffers (an
    int64 among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        h = self.norm(self.frozen(h).transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def _weights() -> dict[str, torch.Tensor]:
    """What save_pretrained would write of a trained model: bf16, the tied head left out."""
    torch.manual_seed(1)
    model = Pretrained()
    model(torch.randint(0, VOCAB, (4, 6)))  # BatchNorm's running statistics move
    return {name: (value.to(torch.bfloat16) if value.is_floating_point() else value).contiguous()
            for name, value in model.state_dict().items() if name != "head.weight"}


def write_pretrained(directory: str, sharded: bool, weights: dict[str, torch.Tensor] | None = None,
                     pickled: bool = False) -> str:
    """As save_pretrained writes them: safetensors, or (``pickled``) older checkpoints' pytorch_model.bin."""
    weights = _weights() if weights is None else weights
    os.makedirs(directory, exist_ok=True)
    base = "pytorch_model.bin" if pickled else "model.safetensors"

    def write(file: str, tensors: dict[str, torch.Tensor]) -> None:
        torch.save(tensors, file) if pickled else write_tensors(file, tensors)

    if not sharded:
        write(os.path.join(directory, base), weights)
        return directory
    names = sorted(weights)
    stem, ext = base.split(".")
    halves = {f"{stem}-00001-of-00002.{ext}": names[::2], f"{stem}-00002-of-00002.{ext}": names[1::2]}
    for file, part in halves.items():
        write(os.path.join(directory, file), {n: weights[n] for n in part})
    with open(os.path.join(directory, base + ".index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, part in halves.items() for n in part}}, f)
    return directory


def _config(stage: int, dtype: str) -> dict:
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train(engine: zerocore.Engine, rank: int) -> list[float]:
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens, target = torch.randint(0, VOCAB, (3, 5), generator=g), torch.randint(0, VOCAB, (3, 5), generator=g)
        loss = nn.functional.cross_entropy(engine(tokens).float().reshape(-1, VOCAB), target.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def load_worker(rank: int, world: int, stage: int, dtype: str, directory: str, meta: bool) -> dict:
    import zerocore._hf_weights as hf

    weights = _weights()
    # the reference: the plain model holds the weights before initialize (what from_pretrained gives)
    torch.manual_seed(2)
    plain = Pretrained()
    plain.load_state_dict({k: v.to(plain.state_dict()[k].dtype) for k, v in weights.items()}, strict=False)
    reference = zerocore.initialize(plain, _config(stage, dtype))
    expected_losses = _train(reference, rank)
    expected = {name: zerocore.safe_get_full_fp32_param(p) for name, p in plain.named_parameters() if p.requires_grad}
    expected_state = reference.full_state_dict(rank0_only=False)
    reference.close()

    read_elements = [0]
    real_read = hf._read

    def counting_read(tensor, first, count):  # the trainable weights' reads (frozen and buffers: hf._whole)
        read_elements[0] += count
        return real_read(tensor, first, count)

    hf._read = counting_read
    hf._CHUNK_ELEMENTS = 37  # pieces cut into chunks at odd places
    torch.manual_seed(3)  # other values everywhere: the load must replace all of them
    if meta:
        with torch.device("meta"):
            model = Pretrained()
    else:
        model = Pretrained()
    engine = zerocore.initialize(model, _config(stage, dtype))
    result = engine.load_hf_weights(directory)
    loaded = engine.full_state_dict(rank0_only=False)
    seen = {"result": [list(result.missing_keys), list(result.unexpected_keys)], "read": read_elements[0],
            "differ": [k for k, v in weights.items() if not torch.equal(loaded[k], v.to(loaded[k].dtype))]}
    seen["masters_differ"] = [n for n, p in model.named_parameters() if p.requires_grad
                              and not torch.equal(zerocore.safe_get_full_fp32_param(p), weights[n].float())]
    seen["losses"] = _train(engine, rank) == expected_losses
    seen["trained_differ"] = [n for n, p in model.named_parameters() if p.requires_grad
                              and not torch.equal(zerocore.safe_get_full_fp32_param(p), expected[n])]
    state = engine.full_state_dict(rank0_only=False)
    seen["trained_differ"] += [k for k, v in expected_state.items() if not torch.equal(state[k], v)]
    engine.close()
    return seen


@pytest.mark.parametrize("stage,dtype,world,sharded,meta,pickled", [
    (1, "fp32", 2, False, False, False), (2, "bf16", 3, True, False, False), (3, "bf16", 2, True, False, False),
    (3, "fp32", 3, False, True, False), (3, "bf16", 2, True, True, True), (2, "fp32", 2, False, False, True),
])
def test_pretrained_weights_load_as_if_the_plain_model_held_them(stage, dtype, world, sharded, meta, pickled,
                                                                 tmp_path):
    directory = write_pretrained(str(tmp_path / "pretrained"), sharded, pickled=pickled)
    trainable = sum(p.numel() for p in Pretrained().parameters() if p.requires_grad)
    results = run_ranks(load_worker, world, stage, dtype, directory, meta)
    for seen in results:
        assert seen["result"] == [[], []]
        assert seen["differ"] == [] and seen["masters_differ"] == []
        assert seen["losses"] and seen["trained_differ"] == [], seen["trained_differ"]
    # each trainable element is read by exactly one rank
    assert sum(seen["read"] for seen in results) == trainable


def refusal_worker(rank: int, world: int, directory: str, case: str) -> str:
    torch.manual_seed(3)
    model = Pretrained()
    engine = zerocore.initialize(model, _config(3, "bf16"))
    before = zerocore.safe_get_full_fp32_param(model.embed.weight)
    path = os.path.join(directory, f"rank{rank}") if case in ("ranks differ", "odd header") else directory
    try:
        result = engine.load_hf_weights(path, strict=case != "not strict")
        outcome = f"loaded {list(result.missing_keys)} {list(result.unexpected_keys)}"
    except (ValueError, OSError) as error:
        outcome = str(error)
    unchanged = torch.equal(before, zerocore.safe_get_full_fp32_param(model.embed.weight))
    _train(engine, rank)  # the engine goes on
    engine.close()
    return f"{outcome} | unchanged={unchanged}"


@pytest.mark.parametrize("case", ["missing", "not strict", "shape", "truncated", "ranks differ", "no weights",
                                  "odd header"])
def test_weights_that_do_not_fit_are_refused_on_every_rank_with_nothing_changed(case, tmp_path):
    weights = _weights()
    directory = str(tmp_path / "pretrained")
    if case in ("missing", "not strict"):
        del weights["blocks.1.linear.bias"]
        weights["extra.weight"] = torch.zeros(2)
    if case == "shape":
        weights["frozen.weight"] = torch.zeros(DIM, DIM + 1, dtype=torch.bfloat16)
    if case == "ranks differ":
        write_pretrained(os.path.join(directory, "rank0"), False, weights)
        weights["embed.weight"] = weights["embed.weight"] + 1
        write_pretrained(os.path.join(directory, "rank1"), False, weights)
    elif case == "no weights":
        os.makedirs(directory)
    else:
        write_pretrained(directory, False, weights)
    if case == "odd header":  # valid JSON, but a list where safetensors has a dict: on rank 1's copy only
        write_pretrained(os.path.join(directory, "rank0"), False, weights)
        os.makedirs(os.path.join(directory, "rank1"))
        header = b"[1, 2]"
        with open(os.path.join(directory, "rank1", "model.safetensors"), "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
    if case == "truncated":
        file = os.path.join(directory, "model.safetensors")
        data_start = 8 + int.from_bytes(open(file, "rb").read(8), "little")
        os.truncate(file, (data_start + os.path.getsize(file)) // 2)  # half the tensors' bytes
    for message in run_ranks(refusal_worker, 2, directory, case):
        if case == "not strict":
            assert message == "loaded ['blocks.1.linear.bias'] ['extra.weight'] | unchanged=False", message
            continue
        assert message.endswith("unchanged=True"), message
        if case == "odd header":  # rank 1 says what is wrong, rank 0 that rank 1 refused
            assert "is not laid out as Hugging Face weights" in message or "rank 1 refused" in message, message
            continue
        assert {"missing": "missing: ['blocks.1.linear.bias']; unexpected: ['extra.weight']",
                "shape": "parameter 'frozen.weight' is [16, 16] in the model but [16, 17]",
                "truncated": "the file is truncated or damaged",
                "ranks differ": "the ranks read different weights",
                "no weights": "holds none of model.safetensors"}[case] in message, message


class WithHead(nn.Module):
    """A Hugging Face-style task model: its base model under ``base_model_prefix``, and a head."""

    base_model_prefix = "base"

    def __init__(self) -> None:
        super().__init__()
        self.base = Pretrained()
        self.classifier = nn.Linear(VOCAB, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.base(tokens))


class Base(Pretrained):
    base_model_prefix = "base"  # as a Hugging Face base model class says it too


def prefix_worker(rank: int, world: int, base_only: str, with_head: str) -> list:
    torch.manual_seed(3)
    engine = zerocore.initialize(WithHead(), _config(3, "bf16"))
    into_task = engine.load_hf_weights(base_only, strict=False)  # the base model's files: keys without "base."
    loaded = engine.full_state_dict(rank0_only=False)
    base_equal = all(torch.equal(loaded[f"base.{k}"], v.to(loaded[f"base.{k}"].dtype)) for k, v in _weights().items())
    engine.close()
    engine = zerocore.initialize(Base(), _config(3, "bf16"))
    into_base = engine.load_hf_weights(with_head, strict=False)  # a task model's files: "base." taken off
    engine.close()
    return [list(into_task.missing_keys), list(into_task.unexpected_keys), base_equal,
            list(into_base.missing_keys), list(into_base.unexpected_keys)]


def test_a_base_model_prefix_is_added_or_taken_off_as_from_pretrained_does(tmp_path):
    base_only = write_pretrained(str(tmp_path / "base"), False)
    task = {f"base.{k}": v for k, v in _weights().items()}
    task.update({"classifier.weight": torch.zeros(3, VOCAB), "classifier.bias": torch.zeros(3)})
    with_head = write_pretrained(str(tmp_path / "task"), True, task)
    for seen in run_ranks(prefix_worker, 2, base_only, with_head):
        assert seen == [["classifier.bias", "classifier.weight"], [], True, [],
                        ["classifier.bias", "classifier.weight"]], seen


def export_worker(rank: int, world: int, stage: int, directory: str, phase: str) -> dict:
    torch.manual_seed(4)
    model = Pretrained()
    engine = zerocore.initialize(model, _config(stage, "bf16"))
    if phase == "train":
        _train(engine, rank)
        engine.save_checkpoint(directory)
    else:
        engine.load_hf_weights(directory)
    masters = {n: zerocore.safe_get_full_fp32_param(p).view(torch.int32).reshape(-1).tolist()
               for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.tolist() for n, b in model.named_buffers()}
    engine.close()
    return {"masters": masters, "buffers": buffers}


def test_an_exported_checkpoint_loads_into_another_run(tmp_path):
    """A run's checkpoint exported with ``python -m zerocore.checkpoint to-hf`` (fp32 masters, sharded) and
    loaded by a run of another world size and stage: the masters bit for bit, and the buffers."""
    from zerocore.checkpoint import main

    trained = run_ranks(export_worker, 2, 2, str(tmp_path / "ckpt"), "train")[0]
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "4KB"]) == 0
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    for seen in run_ranks(export_worker, 3, 3, str(tmp_path / "hf"), "load"):
        assert seen == trained


def nvme_worker(rank: int, world: int, directory: str, nvme: str) -> list[str]:
    torch.manual_seed(3)
    model = Pretrained()
    config = _config(3, "bf16")
    config["zero_optimization"].update(
        offload_optimizer={"device": "nvme", "nvme_path": nvme}, sub_group_size=50,
        offload_param={"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0})
    config["aio"] = {"block_size": 4096, "queue_depth": 4, "thread_count": 1}
    engine = zerocore.initialize(model, config)
    engine.load_hf_weights(directory)
    weights = _weights()
    differ = [n for n, p in model.named_parameters() if p.requires_grad
              and not torch.equal(zerocore.safe_get_full_fp32_param(p), weights[n].float())]
    loaded = engine.full_state_dict(rank0_only=False)
    differ += [k for k, v in weights.items() if not torch.equal(loaded[k], v.to(loaded[k].dtype))]
    _train(engine, rank)
    engine.close()
    return differ


def test_weights_reach_state_and_parameter_shards_on_nvme(tmp_path):
    """With the optimizer state and the parameter shards in NVMe files (offload_optimizer and offload_param
    "nvme"), each rank's elements are written into the files, a sub-group at a time."""
    directory = write_pretrained(str(tmp_path / "pretrained"), False)
    (tmp_path / "nvme").mkdir()
    for differ in run_ranks(nvme_worker, 2, directory, str(tmp_path / "nvme")):
        assert differ == []


def frozen_groups_worker(rank: int, world: int, directory: str) -> list:
    import zerocore._gathered as gathered_module

    torch.manual_seed(3)
    model = Pretrained()
    for block in model.blocks:  # a LoRA-like run: the base model's blocks frozen
        block.requires_grad_(False)
    engine = zerocore.initialize(model, _config(3, "bf16"))
    block_elements = sum(p.numel() for p in model.blocks[0].parameters())
    gathered_module._WRITE_GROUP_ELEMENTS = block_elements  # one block gathered at a time
    stage3 = engine.stage3
    stage3.peak_live_bytes = stage3.live_bytes
    before = stage3.live_bytes
    engine.load_hf_weights(directory)
    extra_peak = stage3.peak_live_bytes - before
    loaded = engine.full_state_dict(rank0_only=False)
    weights = _weights()
    differ = [k for k, v in weights.items() if not torch.equal(loaded[k], v.to(loaded[k].dtype))]
    engine.close()
    root = sum(unit.nbytes for unit in stage3.units if unit.persistent)  # the root: gathered once, kept
    every_unit = sum(unit.nbytes for unit in stage3.units)
    return [differ, extra_peak, root + block_elements * 2, every_unit]


def test_frozen_weights_are_written_a_group_at_a_time(tmp_path):
    """Frozen parameters (a LoRA run's base model) go through zerocore.gathered(modifier_rank=0) a bounded
    group at a time: stage 3 never holds more of them gathered than one group (here one block, bf16) beside
    the persistent root unit."""
    directory = write_pretrained(str(tmp_path / "pretrained"), False)
    for differ, extra_peak, root_and_one_block, every_unit in run_ranks(frozen_groups_worker, 2, directory):
        assert differ == []
        assert 0 < extra_peak <= root_and_one_block < every_unit, (extra_peak, root_and_one_block, every_unit)


def read_failure_worker(rank: int, world: int, directory: str, stage: int, where: str) -> dict:
    import zerocore._hf_weights as hf

    torch.manual_seed(3)
    engine = zerocore.initialize(Pretrained(), _config(stage, "fp32"))
    # which rank's read fails, after the files were checked (a disk error, a file truncated while read): rank 1's
    # share of the trainable weights (_read), rank 0's read of the frozen ones (_whole there), rank 1's read of
    # the buffers (_whole there: rank 1 reads no frozen values)
    failing_rank, function = {"trainable": (1, "_read"), "frozen": (0, "_whole"), "buffers": (1, "_whole")}[where]
    if rank == failing_rank:
        def broken(*args: object) -> torch.Tensor:
            raise OSError(5, "Input/output error (injected)")

        setattr(hf, function, broken)
    try:
        engine.load_hf_weights(directory)
        error = None
    except OSError as caught:
        error = f"{type(caught).__name__}: {caught}"
    losses = _train(engine, rank)  # every rank raised alike: training goes on in lockstep
    engine.close()
    return {"error": error, "losses": losses}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("where", ["trainable", "frozen", "buffers"])
def test_a_read_that_fails_on_one_rank_raises_on_every_rank(tmp_path, stage, where):
    """After the files are checked, a read can still fail (a disk error) on one rank: its own share of the
    trainable weights, rank 0's read of the frozen ones, a rank's read of the buffers. Every rank raises, the
    failing one its error and the others one naming it, and the ranks stay in lockstep."""
    directory = write_pretrained(str(tmp_path / "pretrained"), False)
    failing_rank = 0 if where == "frozen" else 1
    results = run_ranks(read_failure_worker, 2, directory, stage, where)
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, result)
        if rank == failing_rank:
            assert "Input/output error (injected)" in result["error"]
        else:
            assert f"rank {failing_rank} could not read" in result["error"], result["error"]
    assert results[0]["losses"] != [] and len(results[0]["losses"]) == len(results[1]["losses"])
