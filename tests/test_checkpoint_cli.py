"""``python -m zerocore.checkpoint``: ``to-hf`` never writes over a checkpoint or a previous output unasked,
and bad arguments or a damaged ``latest`` end in one ``error:`` line and exit code 2, not a traceback."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks
from zerocore.checkpoint import main

pytestmark = pytest.mark.timeout(120)


def save_worker(rank: int, world: int, directory: str) -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = zerocore.initialize(model, {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": 2}})
    engine.backward(model(torch.ones(2, 8)).square().mean())
    engine.step()
    engine.save_checkpoint(directory)
    return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli") / "ckpt"
    assert run_ranks(save_worker, 1, str(directory), timeout=90) == [True]
    return directory


def _digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("where", ["tag", "itself", "inside_tag", "parent", "symlink"])
def test_to_hf_refuses_an_output_overlapping_the_checkpoint(where, checkpoint, tmp_path, capsys):
    """Finding: ``to-hf ck ck/global_step1`` replaced the checkpoint's own model.safetensors with the output,
    and the checkpoint no longer loaded."""
    link = tmp_path / "link"
    link.symlink_to(checkpoint / "global_step1")
    out = {"tag": checkpoint / "global_step1", "itself": checkpoint, "inside_tag": checkpoint / "global_step1" / "hf",
           "parent": checkpoint.parent, "symlink": link}[where]
    before = _digests(checkpoint)
    line = _error(["to-hf", str(checkpoint), str(out), "--overwrite"], capsys)
    assert "overlaps the checkpoint" in line
    assert _digests(checkpoint) == before
    assert not (checkpoint / "global_step1" / "hf").exists()


def test_to_hf_refuses_to_replace_a_previous_output_unless_asked(checkpoint, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["to-hf", str(checkpoint), str(out)]) == 0
    first = _digests(out)
    (out / "model.safetensors").write_bytes(b"someone's edited weights")
    line = _error(["to-hf", str(checkpoint), str(out), "--dtype", "bf16"], capsys)
    assert "already holds model.safetensors" in line and "--overwrite" in line
    assert (out / "model.safetensors").read_bytes() == b"someone's edited weights"
    # --overwrite replaces it, and a sharded output then removes the stale single file
    assert main(["to-hf", str(checkpoint), str(out), "--overwrite"]) == 0
    assert _digests(out) == first
    assert main(["to-hf", str(checkpoint), str(out), "--overwrite", "--max-shard-size", "100B"]) == 0
    names = sorted(os.listdir(out))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names and len(names) > 2


@pytest.mark.parametrize("size", ["0", "-5", "abc", "nanGB", "infMB", "0.1B"])
def test_a_bad_max_shard_size_is_a_usage_error(size, checkpoint, tmp_path, capsys):
    line = _error(["to-hf", str(checkpoint), str(tmp_path / "hf"), f"--max-shard-size={size}"], capsys)
    assert "--max-shard-size" in line and repr(size) in line
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("size", [0, -5, 2.5, True, None, "abc", "0.1B"])
def test_to_hf_from_python_refuses_a_bad_max_shard_size_before_writing(size, checkpoint, tmp_path):
    with pytest.raises(ValueError, match="max_shard_size"):
        zerocore.checkpoint.to_hf(str(checkpoint), str(tmp_path / "hf"), max_shard_size=size)
    assert not (tmp_path / "hf").exists()


def test_to_hf_from_python_takes_a_size_string_as_save_pretrained_does(checkpoint, tmp_path):
    written = zerocore.checkpoint.to_hf(str(checkpoint), str(tmp_path / "hf"), max_shard_size="100B")
    assert "model.safetensors.index.json" in written and len(written) > 2


def _copy_with_latest(checkpoint: Path, tmp_path: Path, latest: bytes) -> Path:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    (copy / "latest").write_bytes(latest)
    return copy


@pytest.mark.parametrize("command", ["info", "to-hf"])
@pytest.mark.parametrize("latest,message", [(b"../../etc", "must be a plain directory name"),
                                            (b"\xff\xfe\x00", "is not text")])
def test_a_bad_latest_is_refused_not_followed(command, latest, message, checkpoint, tmp_path, capsys):
    """Finding: ``info`` followed a ``latest`` holding ``../../etc`` (to-hf checked it as a tag), and a
    non-UTF-8 ``latest`` raised UnicodeDecodeError."""
    copy = _copy_with_latest(checkpoint, tmp_path, latest)
    argv = [command, str(copy)] + ([str(tmp_path / "hf")] if command == "to-hf" else [])
    line = _error(argv, capsys)
    assert message in line and "latest" in line


def test_info_of_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    file = tmp_path / "some_file"
    file.write_text("x")
    assert "is a file, not a checkpoint directory" in _error(["info", str(file)], capsys)
    assert "does not exist" in _error(["info", str(tmp_path / "missing")], capsys)
