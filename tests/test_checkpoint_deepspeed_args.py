"""DeepSpeed's save_checkpoint / load_checkpoint arguments: ``save_latest``, ``exclude_frozen_parameters``,
``load_module_only`` (the weights change, the training state stays), and the refused ``load_module_strict=False``
and ``custom_load_fn`` (Note [Checkpoint format] in python/zerocore/checkpoint.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import zerocore
from zerocore._checkpoint_format import index_bytes, read_index
from _dist import run_ranks
from test_checkpoint import Net, Tied, _config, _train

pytestmark = pytest.mark.timeout(300)


def _latest(directory: str) -> str | None:
    path = os.path.join(directory, "latest")
    return open(path).read() if os.path.exists(path) else None


def _moments(engine: zerocore.Engine) -> list[torch.Tensor]:
    return [t.clone() for s in engine.optimizer_state.shards for t in (s.exp_avg, s.exp_avg_sq)]


def deepspeed_args_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    out = {}
    torch.manual_seed(0)
    saved = zerocore.initialize(Net(), _config(stage))
    _train(saved, rank, 0, 2)
    saved.save_checkpoint(directory, tag="lora", exclude_frozen_parameters=True, save_latest=False)
    out["latest_after_no_latest"] = _latest(directory)
    saved.save_checkpoint(directory, tag="full")
    weights = saved.full_state_dict(rank0_only=False)
    if rank != 0:  # the checkpoint holds rank 0's buffers; the others take them at their next forward, as in DDP
        weights = {k: v for k, v in weights.items() if not k.startswith("norm.running")}
    saved.save_checkpoint(directory, tag="later", save_latest=False)
    out["latest"] = _latest(directory)

    # load_module_only: the weights (and buffers) are the checkpoint's; moments, counters, lr stay this engine's
    torch.manual_seed(1)
    engine = zerocore.initialize(Net(), _config(stage))
    _train(engine, rank, 5, 1)
    moments, lr = _moments(engine), engine.get_lr()
    engine.load_checkpoint(directory, "full", load_module_only=True)
    loaded = engine.full_state_dict(rank0_only=False)
    out["module_only_weights"] = [k for k in weights if not torch.equal(loaded[k], weights[k])]
    out["module_only_moments_kept"] = all(torch.equal(a, b) for a, b in zip(moments, _moments(engine)))
    out["module_only_counters"] = (engine.global_steps, engine.get_lr() == lr)
    _train(engine, rank, 6, 1)  # trains on
    for bad in ({"load_module_strict": False}, {"custom_load_fn": lambda *a: None}):
        with pytest.raises(ValueError, match="not supported"):
            engine.load_checkpoint(directory, "full", **bad)
    engine.close()

    # exclude_frozen_parameters: a load keeps the model's own frozen parameters, the rest is the checkpoint's
    torch.manual_seed(2)
    model = Net()
    own_frozen = {k: v.clone() for k, v in model.frozen.state_dict().items()}
    engine = zerocore.initialize(model, _config(stage))
    engine.load_checkpoint(directory, "lora")
    loaded = engine.full_state_dict(rank0_only=False)
    out["lora_frozen_kept"] = all(torch.equal(loaded[f"frozen.{k}"], v) for k, v in own_frozen.items())
    out["lora_rest_loaded"] = all(torch.equal(loaded[k], weights[k]) for k in weights if not k.startswith("frozen."))
    out["lora_steps"] = engine.global_steps
    _train(engine, rank, 7, 1)
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_checkpoint_arguments(stage, tmp_path):
    for out in run_ranks(deepspeed_args_worker, 2, stage, os.fspath(tmp_path), timeout=180):
        assert out["latest_after_no_latest"] is None and out["latest"] == "full"
        assert out["module_only_weights"] == [] and out["module_only_moments_kept"]
        assert out["module_only_counters"] == (1, True)
        assert out["lora_frozen_kept"] and out["lora_rest_loaded"] and out["lora_steps"] == 2


def skipped_steps_worker(rank: int, world: int, directory: str) -> list:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), {**_config(2, "fp16"), "train_micro_batch_size_per_gpu": 6})
    _train(engine, rank, 0, 1)
    g = torch.Generator().manual_seed(rank)
    loss = nn.functional.cross_entropy(engine(torch.randint(0, 30, (6, 5), generator=g)).float(),
                                       torch.randint(0, 30, (6,), generator=g))
    engine.backward(loss * float("inf"))  # overflows: the step is skipped, and counted, as DeepSpeed counts it
    engine.step()
    seen = [engine.global_steps, engine.skipped_steps, engine.optimizer_state.step_count, engine.global_samples]
    engine.save_checkpoint(directory)
    seen.append(sorted(os.listdir(directory)))
    engine.close()
    if rank == 0:  # the same index as zerocore wrote it before skipped steps were counted in global_steps
        index_path = os.path.join(directory, "global_step2", "index.json")
        index = read_index(os.path.join(directory, "global_step2"))
        del index["counters"]["global_steps_count_skipped"]
        index["counters"]["global_steps"] -= index["counters"]["skipped_steps"]
        with open(index_path, "wb") as f:
            f.write(index_bytes(index))
    torch.distributed.barrier()
    fresh = zerocore.initialize(Net(), _config(2, "fp16"))
    fresh.load_checkpoint(directory)
    seen.append([fresh.global_steps, fresh.skipped_steps, fresh.optimizer_state.step_count])
    _train(fresh, rank, 5, 1)
    seen.append(fresh.global_steps)
    fresh.close()
    return seen


def test_skipped_fp16_steps_count_in_global_steps_as_in_deepspeed(tmp_path):
    for seen in run_ranks(skipped_steps_worker, 2, os.fspath(tmp_path)):
        counted, skipped, updates, samples, tags, loaded, after = seen
        assert (counted, skipped, updates) == (2, 1, 1)
        assert samples == 2 * 12  # steps x the global batch
        assert "global_step2" in tags  # the default tag is DeepSpeed's global_step{global_steps}
        assert loaded == [2, 1, 1] and after == 3


def sixteen_bit_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = Tied()
    model.hidden.requires_grad_(False)  # frozen: a LoRA-style run's base weights
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    tokens = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens).float().square().mean())
    engine.step()
    engine.save_16bit_model(directory, "pytorch_model.bin", exclude_frozen_parameters=True)
    engine.save_fp16_model(directory, "all.safetensors")
    whole = engine.full_state_dict(torch.bfloat16)
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    trainable_only = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    engine.close()
    return {"asks_to_gather": engine.zero_gather_16bit_weights_on_model_save(),
            "consolidated": sorted(consolidated), "same": all(torch.equal(whole[k], v) for k, v in consolidated.items()),
            "dtypes": sorted({str(v.dtype) for v in consolidated.values()}), "trainable_only": sorted(trainable_only)}


def test_sixteen_bit_saves_as_deepspeed_and_accelerate_call_them(tmp_path):
    """save_16bit_model(..., exclude_frozen_parameters=True), save_fp16_model, and what Accelerate's
    get_state_dict calls at stage 3: zero_gather_16bit_weights_on_model_save() and
    _zero3_consolidated_16bit_state_dict() (rank 0 holds it, the others an empty dict)."""
    from safetensors.torch import load_file

    rank0, rank1 = run_ranks(sixteen_bit_worker, 2, os.fspath(tmp_path))
    assert rank0["asks_to_gather"] and rank0["same"] and rank0["dtypes"] == ["torch.bfloat16"]
    assert rank0["consolidated"] == ["embed.weight", "head.weight", "hidden.bias", "hidden.weight"]
    assert rank0["trainable_only"] == ["embed.weight", "head.weight"]
    assert rank1["consolidated"] == [] and rank1["trainable_only"] == []
    assert sorted(torch.load(tmp_path / "pytorch_model.bin", weights_only=True)) == ["embed.weight"]
    assert sorted(load_file(str(tmp_path / "all.safetensors"))) == ["embed.weight", "hidden.bias", "hidden.weight"]


def not_gathering_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Tied(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                          "zero_optimization": {"stage": stage,
                                                                "stage3_gather_16bit_weights_on_model_save": False}})
    tokens = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens).square().mean())
    engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = engine.save_16bit_model(directory, "pytorch_model.bin")
    warned = any("stage3_gather_16bit_weights_on_model_save is false" in str(w.message) for w in caught)
    engine.save_checkpoint(directory)  # what the Trainer saves instead: it still works, and so does training
    engine.backward(engine(tokens).square().mean())
    engine.step()
    engine.close()
    return {"returned": returned, "warned": warned, "asks_to_gather": engine.zero_gather_16bit_weights_on_model_save()}


def test_stage_3_does_not_gather_for_a_16bit_save_when_the_config_says_so(tmp_path):
    """stage3_gather_16bit_weights_on_model_save: false (Stanford Alpaca's config): as in DeepSpeed, stage 3's
    save_16bit_model writes nothing and returns False (the Hugging Face Trainer then saves a checkpoint), with a
    warning naming the key, and zero_gather_16bit_weights_on_model_save() says False (Accelerate asks it). No rank
    issues a collective for it: training goes on in lockstep. Stages 1-2 write the weights whatever the key says,
    as DeepSpeed's do."""
    for rank_result in run_ranks(not_gathering_worker, 2, 3, os.fspath(tmp_path / "z3")):
        assert rank_result == {"returned": False, "warned": True, "asks_to_gather": False}
    assert not (tmp_path / "z3" / "pytorch_model.bin").exists() and _latest(os.fspath(tmp_path / "z3"))
    path = os.fspath(tmp_path / "z2" / "pytorch_model.bin")
    for rank_result in run_ranks(not_gathering_worker, 2, 2, os.fspath(tmp_path / "z2")):
        assert rank_result == {"returned": path, "warned": False, "asks_to_gather": True}
    assert sorted(torch.load(tmp_path / "z2" / "pytorch_model.bin", weights_only=True)) == [
        "embed.weight", "hidden.bias", "hidden.weight"]


def bad_directory_worker(rank: int, world: int, stage: int, directory: str) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Tied(), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                          "zero_optimization": {"stage": stage}})
    tokens = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(rank))
    blocker = os.path.join(directory, "a_file")
    if rank == 0:
        open(blocker, "w").close()  # a file where the directory should be: only rank 0 writes, so only it fails
    try:
        engine.save_16bit_model(os.path.join(blocker, "out"))
        error = None
    except OSError as caught:
        error = f"{type(caught).__name__}: {caught}"
    engine.backward(engine(tokens).square().mean())  # caught and gone on, as a script does: still in lockstep
    engine.step()
    path = engine.save_16bit_model(os.path.join(directory, "good"))
    state = {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return {"error": error, "path": path, "state": state}


@pytest.mark.parametrize("stage", [2, 3])
def test_a_16bit_save_that_fails_on_rank_0_raises_on_every_rank(tmp_path, stage):
    """Only rank 0 writes save_16bit_model's file; when that fails (a bad directory, a full disk) every rank
    raises, naming rank 0's error, instead of the others passing on into the next collective alone."""
    rank0, rank1 = run_ranks(bad_directory_worker, 2, stage, os.fspath(tmp_path))
    assert rank0["error"].startswith("NotADirectoryError")
    assert rank1["error"].startswith("OSError: save_16bit_model: rank 0 could not write") and "a_file" in rank1["error"]
    assert rank0["state"] == rank1["state"] and os.path.exists(rank0["path"])


def module_state_dict_worker(rank: int, world: int, stage: int) -> list:
    torch.manual_seed(0)
    model = Tied()
    model.hidden.requires_grad_(False)
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage}})
    tokens = torch.randint(0, 30, (4, 5), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(tokens).float().square().mean())
    engine.step()  # (stages 1-2 leave the parameter all-gathers in flight: the read must wait for them)
    try:
        whole = engine.module_state_dict()
        trainable = engine.module_state_dict(exclude_frozen_parameters=True)
        expected = engine.full_state_dict(rank0_only=False)
        outcome = [sorted(whole), sorted(trainable), all(torch.equal(whole[k], v) for k, v in expected.items())]
    except RuntimeError as error:
        outcome = [str(error)]
    engine.close()
    return outcome


@pytest.mark.parametrize("stage", [2, 3])
def test_module_state_dict_as_deepspeed_spells_it(stage):
    for outcome in run_ranks(module_state_dict_worker, 2, stage):
        if stage == 3:  # DeepSpeed's would hold the sharded placeholders
            assert len(outcome) == 1 and "engine.full_state_dict()" in outcome[0], outcome
        else:
            assert outcome == [["embed.weight", "head.weight", "hidden.bias", "hidden.weight"],
                               ["embed.weight", "head.weight"], True]
