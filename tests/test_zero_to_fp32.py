"""``zerocore.deepspeed.utils.zero_to_fp32``: DeepSpeed's functions and command line for the fp32 model of a saved
checkpoint, on checkpoints zerocore's engine wrote at stages 2 and 3: the state dict is the engine's, with frozen
parameters, persistent buffers and tied names; the files torch and safetensors load; the refusals."""

from __future__ import annotations

import io
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from _dist import run_ranks
from _models import ResidualBlock

pytestmark = pytest.mark.timeout(300)


class Checkpointed(nn.Module):
    """A tied head, a frozen layer, a persistent and a non-persistent buffer, and repeated blocks (stage 3 units)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList([ResidualBlock() for _ in range(2)])
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(tokens))) * self.scale[0]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def save_worker(rank: int, world: int, directory: str, stage: int) -> bytes:
    torch.manual_seed(0)
    model = Checkpointed()
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        tokens = torch.randint(0, 12, (3, 5), generator=g)
        engine.backward(F.cross_entropy(engine(tokens).reshape(-1, 12), tokens.reshape(-1)))
        engine.step()
    engine.save_checkpoint(directory)
    state = engine.full_state_dict(rank0_only=False)
    engine.close()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module", params=[2, 3])
def saved(request, tmp_path_factory) -> tuple[str, dict]:
    directory = str(tmp_path_factory.mktemp(f"stage{request.param}"))
    state = torch.load(io.BytesIO(run_ranks(save_worker, 2, directory, request.param)[0]), weights_only=False)
    return directory, state


def test_zero_to_fp32_reads_the_model_as_the_engine_holds_it(saved):
    from zerocore.deepspeed.utils.zero_to_fp32 import LazyTensor, get_fp32_state_dict_from_zero_checkpoint

    directory, expected = saved
    state = get_fp32_state_dict_from_zero_checkpoint(directory)
    assert set(state) == set(Checkpointed().state_dict()) == set(expected) | {"head.weight"}  # persistent only
    for name, value in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    assert state["head.weight"] is state["embed.weight"]  # a tied parameter under each name, as DeepSpeed's
    lazy = get_fp32_state_dict_from_zero_checkpoint(directory, tag="global_step2", lazy_mode=True)
    assert isinstance(lazy["blocks.0.up.weight"], LazyTensor) and lazy["blocks.0.up.weight"].shape == (16, 8)
    assert all(torch.equal(lazy[name].contiguous(), value) for name, value in expected.items())
    trainable = get_fp32_state_dict_from_zero_checkpoint(directory, exclude_frozen_parameters=True)
    assert set(state) - set(trainable) == {"frozen.weight", "frozen.bias"}  # the buffer stays


@pytest.mark.parametrize("safe,shard", [(False, "5GB"), (True, "5GB"), (False, 600)])
def test_convert_writes_what_torch_and_safetensors_load(saved, tmp_path, safe, shard):
    from safetensors.torch import load_file

    from zerocore.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    directory, expected = saved
    written = convert_zero_checkpoint_to_fp32_state_dict(directory, tmp_path / "out", max_shard_size=shard,
                                                         safe_serialization=safe)
    files = [name for name in written if not name.endswith(".json")]
    if shard == 600:
        index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    else:
        assert files == ["model.safetensors" if safe else "pytorch_model.bin"]
    state = {}
    for name in files:
        path = str(tmp_path / "out" / name)
        state.update(load_file(path) if safe else torch.load(path, weights_only=True))
    # the tied head: once in safetensors (Hugging Face's loaders tie it again), under both names in torch's file
    assert set(state) == set(expected) - ({"head.weight"} if safe else set())
    for name, value in state.items():
        assert torch.equal(value, expected[name]), name
    if not safe and shard == "5GB":
        assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
        model = Checkpointed()
        model.load_state_dict(state)  # strict: every key of the model's state dict is there


def test_load_state_dict_from_zero_checkpoint_and_the_command_line(saved, tmp_path, capsys):
    from zerocore.deepspeed.utils import zero_to_fp32

    directory, expected = saved
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(Checkpointed(), directory)
    for name, value in expected.items():
        assert torch.equal(model.state_dict()[name], value), name
    assert zero_to_fp32.main([directory, str(tmp_path / "cli"), "--safe_serialization"]) == 0
    assert (tmp_path / "cli" / "model.safetensors").exists() and "model.safetensors" in capsys.readouterr().out


def test_zero_to_fp32_names_what_it_cannot_read(saved, tmp_path):
    from zerocore.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    directory, _ = saved
    with pytest.raises(ValueError, match="pass the directory above it"):
        get_fp32_state_dict_from_zero_checkpoint(f"{directory}/global_step2")
    deepspeeds = str(pathlib.Path(__file__).parent / "fixtures" / "deepspeed" / "stage1-fp32")
    with pytest.raises(ValueError, match="is a DeepSpeed checkpoint: run the zero_to_fp32.py"):
        get_fp32_state_dict_from_zero_checkpoint(deepspeeds)
    with pytest.raises(FileNotFoundError, match="latest"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))