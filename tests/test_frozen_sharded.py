"""Stage 3 shards frozen parameters (Note [Frozen shards]): the floating-point parameters with
``requires_grad=False`` at ``initialize`` (a LoRA model's base, a frozen block) are sharded like trainable
ones, with no gradient and no optimizer state, gathered with their unit just in time and released after use
(in backward once the unit's input gradients are computed); stages 1-2 keep them whole. What a user sees:
training matches an unsharded model, memory_report() and estimate_memory() count the shard, a frozen
parameter at rest refuses compute like a sharded trainable one, ``zerocore.gathered`` reads and writes it,
state dicts, checkpoints and ``close()`` hand it back whole, a meta-device build materializes it, and
``zero_quantized_nontrainable_weights`` gathers it as int8."""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import _models
import zerocore
from _dist import run_ranks
from _parity import ReferencePair

pytestmark = pytest.mark.timeout(300)
VOCAB, DIM, RANK, SEQ = 24, 32, 4, 5
LR = 1e-2


class Block(nn.Module):
    """A frozen base (Linear and LayerNorm) with trainable low-rank adapters; ``adapted=False``: all frozen."""

    def __init__(self, adapted: bool = True) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.lora_a = nn.Linear(DIM, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, DIM, bias=False)
        self.base.requires_grad_(False)
        self.norm.requires_grad_(False)
        if not adapted:
            self.lora_a.requires_grad_(False)
            self.lora_b.requires_grad_(False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.base(h) + self.lora_b(self.lora_a(h))))


class Lora(nn.Module):
    """A frozen embedding, blocks with frozen bases (those in ``frozen_blocks`` entirely frozen), a trainable
    head. Without ``trainable_input`` block 0's input needs no gradient (it comes from the frozen embedding),
    so a frozen block 0 has an output without gradient too; with it, every block's input needs one."""

    def __init__(self, layers: int = 4, frozen_blocks: tuple[int, ...] = (0, 2), checkpoint_mode: str = "none",
                 trainable_input: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.requires_grad_(False)
        self.shift = nn.Parameter(torch.randn(DIM) * 0.1) if trainable_input else None
        self.blocks = nn.ModuleList(Block(adapted=i not in frozen_blocks) for i in range(layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpoint_mode = checkpoint_mode

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.shift is not None:
            h = h + self.shift
        for block in self.blocks:
            if self.checkpoint_mode == "none":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.checkpoint_mode == "reentrant")
        return self.head(h)


def config(dtype: str = "fp32", **zero) -> dict:
    out = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    if dtype != "fp32":
        out[dtype] = {"enabled": True}
    return out


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (3, SEQ), generator=g), torch.randint(0, VOCAB, (3, SEQ), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output = model(tokens)
    output = output.to(torch.promote_types(output.dtype, torch.float32))  # bf16 up to fp32; float64 stays
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def train(engine: zerocore.Engine, rank: int, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = loss_of(engine, *data(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def frozen_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def gathered_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole value, read inside ``zerocore.gathered`` (a collective)."""
    with zerocore.gathered(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def different(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names=None) -> list[str]:
    return [n for n in (b if names is None else names) if not torch.equal(a[n], b[n])]


def _reference(model: nn.Module) -> ReferencePair:
    return ReferencePair(model, lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR,
                                                            weight_decay=0.01, foreach=False))


# ---- training matches the unsharded model --------------------------------------------------------------------------
STEPS = 6


def parity_worker(rank: int, world: int, dtype: str, mode: str) -> dict:
    """Engine and a replicated fp32/float64 reference (tests/_parity.py) trained side by side; the reference
    sees every rank's batch (the mean of per-rank losses, as data parallelism averages)."""
    torch.manual_seed(0)
    model = Lora(checkpoint_mode=mode, trainable_input=mode != "none")
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = _reference(copy.deepcopy(model))
    engine = zerocore.initialize(model, config(dtype))
    units = [u.name for u in engine.stage3.units]
    losses, reference_losses = [], []
    for step in range(STEPS):
        loss = loss_of(engine, *data(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref, _ = reference.train_step(lambda module, _: sum(loss_of(module, *data(step, r)) for r in range(world))
                                      / world)
        reference_losses.append(ref.item())
    state = engine.full_state_dict(rank0_only=False)
    label = f"{dtype} {mode}"
    if dtype == "fp32":
        reference.assert_matches(state, label=label)
    compute = torch.float32 if dtype == "fp32" else torch.bfloat16
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    changed = different(state, {n: v.to(compute) for n, v in initial.items()}, frozen)
    assert not changed, f"{label}: frozen parameters changed by training: {changed}"
    assert all(state[n].dtype == compute for n in frozen), {n: state[n].dtype for n in frozen}
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert different(state, {n: v.to(compute) for n, v in initial.items()}, trained), f"{label}: nothing trained"
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "a frozen parameter got a .grad"
    return {"units": units, "losses": losses, "reference": reference_losses,
            "state": {k: v.float().tolist() for k, v in state.items()}}


def _check_losses(results: list[dict], rtol: float, atol: float) -> None:
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / len(results)
        expected = results[0]["reference"][step]
        assert abs(mean - expected) <= atol + rtol * abs(expected), (step, mean, expected)


def test_lora_model_fp32_matches_the_unsharded_model_and_every_block_is_a_unit():
    results = run_ranks(parity_worker, 2, "fp32", "none")
    for r in results:  # the entirely frozen blocks are units too (Note [Stage 3 units])
        assert r["units"] == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], r["units"]
    _check_losses(results, rtol=1e-5, atol=1e-6)


def stage2_worker(rank: int, world: int, dtype: str) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Lora(), config(dtype, stage=2))
    losses = train(engine, rank, 0, STEPS)
    state = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "state": {k: v.float().tolist() for k, v in state.items()}}


def test_lora_model_bf16_tracks_the_fp32_model_and_equals_stage_2():
    """As tests/test_engine_parity.py's bf16 rule: bf16 compute with fp32 masters stays within 2% of the fp32
    loss; the frozen parameters are their initial values in bf16, bit for bit. And stage 2, which holds the
    frozen parameters whole, trains bit for bit the same: every value stage 3 gathers is the bf16 value stage 2
    holds, and at 2 ranks a gradient sums the same in any order."""
    results = run_ranks(parity_worker, 2, "bf16", "none")
    for r in results:
        assert r["units"] == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], r["units"]
    _check_losses(results, rtol=0.02, atol=0.0)
    for stage3, stage2 in zip(results, run_ranks(stage2_worker, 2, "bf16")):
        assert stage3["losses"] == stage2["losses"], (stage3["losses"], stage2["losses"])
        assert stage3["state"].keys() == stage2["state"].keys()
        wrong = [k for k, v in stage2["state"].items() if stage3["state"][k] != v]
        assert not wrong, f"stage 3 differs from stage 2 in {wrong}"


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_around_blocks_with_frozen_bases_matches(mode):
    _check_losses(run_ranks(parity_worker, 2, "fp32", mode), rtol=1e-5, atol=1e-6)


# ---- memory_report and estimate_memory count the shard -------------------------------------------------------------
def memory_worker(rank: int, world: int) -> list[dict]:
    out = []
    for stage in (2, 3):
        for dtype in ("fp32", "bf16"):
            cfg = config(dtype, stage=stage)
            torch.manual_seed(0)
            with torch.device("meta"):
                meta = Lora()
            estimate = zerocore.estimate_memory(meta, cfg, world, rank=rank)
            torch.manual_seed(0)
            model = Lora()
            width = 4 if dtype == "fp32" else 2
            whole = sum(p.numel() * width for p in model.parameters() if not p.requires_grad)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            engine = zerocore.initialize(model, cfg)
            report = engine.memory_report()
            train(engine, rank, 0, 2)
            out.append({"stage": stage, "dtype": dtype, "whole": whole, "trainable": trainable,
                        "frozen": report["bytes"]["frozen_params"], "psi": report["psi"],
                        "after_steps": engine.memory_report()["bytes"]["frozen_params"],
                        "estimate": estimate["bytes"]["frozen_params"], "estimate_bytes": estimate["bytes"],
                        "report_bytes": report["bytes"], "totals": (estimate["total_bytes"], report["total_bytes"])})
            engine.close()
    return out


def test_memory_report_counts_the_frozen_shard_at_stage_3_and_the_estimate_agrees():
    for results in run_ranks(memory_worker, 2):
        for r in results:
            label = f"stage {r['stage']} {r['dtype']}: {r['frozen']} frozen bytes of {r['whole']} whole"
            if r["stage"] == 3:  # this rank's shard, padding allowed
                assert 0.4 * r["whole"] < r["frozen"] < 0.6 * r["whole"], label
            else:
                assert r["frozen"] == r["whole"], label
            assert r["after_steps"] == r["frozen"], f"{label}; after two steps {r['after_steps']}"
            assert r["psi"] == r["trainable"], f"{label}: psi {r['psi']} counts trainable elements only"
            assert r["estimate"] == r["frozen"], f"{label}: estimate_memory says {r['estimate']}"
            assert r["estimate_bytes"] == r["report_bytes"], f"{label}: {r['estimate_bytes']} != {r['report_bytes']}"
            assert r["totals"][0] == r["totals"][1], f"{label}: totals {r['totals']}"


# ---- outside forward a frozen parameter is a sharded one -----------------------------------------------------------
def access_worker(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = Lora()
    plain = copy.deepcopy(model)
    initial = frozen_of(model)
    engine = zerocore.initialize(model, config())
    train(engine, rank, 0, 1)
    weight = model.blocks[2].base.weight
    # metadata needs no values
    assert isinstance(weight, nn.Parameter) and weight.shape == (DIM, DIM) and weight.dtype == torch.float32
    assert not weight.requires_grad and weight.numel() == DIM * DIM
    h = torch.randn(2, DIM, generator=torch.Generator().manual_seed(5))
    # computing with it raises, naming it and the way out (Note [Sharded parameters refuse compute])
    for name, read in (("'embed.weight'", lambda: model.embed.weight.sum()),
                       ("'blocks.2.base.weight'", lambda: nn.functional.linear(h, weight)),
                       ("'blocks.0.norm.bias'", lambda: model.blocks[0].norm.bias.detach()),
                       ("'blocks.1.base.weight'", lambda: model.blocks[1].base(h)),  # a module inside a unit
                       ("'blocks.0.", lambda: model.blocks[0].state_dict())):
        try:
            value = read()
            message = f"no error: returned {type(value).__name__}"
        except RuntimeError as error:
            message = str(error)
        assert name in message and "zerocore.gathered" in message, (name, message)
    # an entirely frozen unit called on its own gathers itself and computes with the whole values
    with torch.no_grad():
        torch.testing.assert_close(model.blocks[0](h), plain.blocks[0](h), rtol=0, atol=0)
    # gathered(model.parameters()): the whole original values
    inside = gathered_values(model)
    assert not different(inside, initial), f"gathered() values differ: {different(inside, initial)}"
    # a write on modifier_rank reaches every rank (other ranks' writes are discarded) and stays through training
    with zerocore.gathered([weight], modifier_rank=0):
        assert weight.shape == (DIM, DIM)
        with torch.no_grad():
            weight.fill_(0.5 if rank == 0 else -3.0)
    seen = {"gathered() after the block": gathered_values(model)["blocks.2.base.weight"],
            "full_state_dict()": engine.full_state_dict(rank0_only=False)["blocks.2.base.weight"]}
    wrong = [k for k, v in seen.items() if not torch.all(v == 0.5)]
    assert not wrong, f"rank {rank}: the value written on rank 0 is not what {wrong} see"
    with torch.no_grad():  # the unit's next forward computes with the written values
        plain.blocks[2].base.weight.fill_(0.5)
        torch.testing.assert_close(model.blocks[2](h), plain.blocks[2](h), rtol=0, atol=0)
    train(engine, rank, 1, 2)
    seen = {"gathered() after two steps": gathered_values(model)["blocks.2.base.weight"],
            "full_state_dict() after two steps": engine.full_state_dict(rank0_only=False)["blocks.2.base.weight"]}
    wrong = [k for k, v in seen.items() if not torch.all(v == 0.5)]
    assert not wrong, f"rank {rank}: the value written on rank 0 is not what {wrong} see"
    return True


def test_a_frozen_parameter_at_rest_refuses_compute_and_gathered_reads_and_writes_it():
    assert all(run_ranks(access_worker, 2))


# ---- state dicts hold the frozen parameters whole ------------------------------------------------------------------
def state_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = Lora()
    keys = list(model.state_dict())
    initial = {k: v.to(torch.bfloat16) for k, v in frozen_of(model).items()}
    engine = zerocore.initialize(model, config("bf16"))
    train(engine, rank, 0, 2)
    full = engine.full_state_dict(rank0_only=False)
    assert list(full) == keys, (list(full), keys)
    assert not different(full, initial), f"frozen values differ: {different(full, initial)}"
    on_rank0 = engine.full_state_dict()
    if rank == 0:
        assert list(on_rank0) == keys and not different(on_rank0, full)
    else:
        assert on_rank0 == {}
    with zerocore.gathered(list(model.parameters())):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert not different(inside, full), f"state_dict() inside gathered() differs: {different(inside, full)}"
    plain = Lora()
    plain.load_state_dict(full, strict=True)
    engine.save_16bit_model(directory)
    return {k: v.float().tolist() for k, v in full.items()} if rank == 0 else {}


def test_full_state_dict_and_save_16bit_model_hold_the_frozen_parameters_whole(tmp_path):
    from safetensors.torch import load_file

    expected = run_ranks(state_worker, 2, str(tmp_path))[0]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == sorted(expected)
    assert all(v.dtype == torch.bfloat16 for v in saved.values())
    for name in ("embed.weight", "blocks.0.base.weight", "blocks.0.lora_a.weight", "blocks.1.norm.bias"):
        assert saved[name].shape == torch.Size(torch.tensor(expected[name]).shape), name
    wrong = [k for k, v in saved.items() if v.float().tolist() != expected[k]]
    assert not wrong, f"saved values differ from full_state_dict(): {wrong}"


# ---- checkpoints ---------------------------------------------------------------------------------------------------
TARGET = "blocks.2.base.weight"


def checkpoint_worker(rank: int, world: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = Lora()
    engine = zerocore.initialize(model, config())
    train(engine, rank, 0, 1)
    params = dict(model.named_parameters())
    with zerocore.gathered([params[TARGET], params["embed.weight"]], modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                params[TARGET].copy_(torch.linspace(-1, 1, DIM * DIM).view(DIM, DIM))
                params["embed.weight"].mul_(-1)
            else:  # discarded
                params[TARGET].zero_()
    train(engine, rank, 1, 2)
    engine.save_checkpoint(directory, tag="full")
    engine.save_checkpoint(directory, tag="lora", exclude_frozen_parameters=True)
    saved = gathered_values(model)
    assert torch.equal(saved[TARGET], torch.linspace(-1, 1, DIM * DIM).view(DIM, DIM)), "the write did not reach"
    full = engine.full_state_dict(rank0_only=False)
    assert not different(full, saved), f"full_state_dict() differs from gathered(): {different(full, saved)}"
    train(engine, rank, 3, 1)  # the engine moves on: the checkpoint holds the saved values
    engine.close()

    torch.manual_seed(7)  # a fresh model, other values everywhere
    fresh_model = Lora()
    fresh = zerocore.initialize(fresh_model, config())
    fresh.load_checkpoint(directory, tag="full")
    loaded = gathered_values(fresh_model)
    assert not different(loaded, saved), f"loaded at world 2: {different(loaded, saved)} differ"
    train(fresh, rank, 3, 1)
    after = gathered_values(fresh_model)
    frozen = [n for n, p in fresh_model.named_parameters() if not p.requires_grad]
    assert not different(after, saved, frozen), f"frozen values moved after a step: {different(after, saved, frozen)}"
    fresh.close()

    check_lora_load(directory, 8, world, saved)
    return {k: v.tolist() for k, v in saved.items()}


def check_lora_load(directory: str, seed: int, world: int, saved: dict[str, torch.Tensor]) -> None:
    """Tag "lora" (saved with exclude_frozen_parameters) into a fresh model: its own frozen values stay, its
    trainable ones become the checkpoint's."""
    torch.manual_seed(seed)
    model = Lora()
    own = frozen_of(model)
    engine = zerocore.initialize(model, config())
    engine.load_checkpoint(directory, tag="lora")
    loaded = gathered_values(model)
    trainable = [n for n in saved if n not in own]
    assert not different(loaded, own), f"exclude_frozen_parameters at world {world}: {different(loaded, own)}"
    assert not different(loaded, saved, trainable), \
        f"trainable not loaded at world {world}: {different(loaded, saved, trainable)}"
    engine.close()


def load_elsewhere_worker(rank: int, world: int, directory: str, saved: dict) -> bool:
    torch.manual_seed(9)
    model = Lora()
    engine = zerocore.initialize(model, config())
    engine.load_checkpoint(directory, tag="full")
    loaded = gathered_values(model)
    wrong = [k for k, v in saved.items() if loaded[k].tolist() != v]
    assert not wrong, f"loaded at world {world}: {wrong} differ"
    engine.close()
    check_lora_load(directory, 10, world, {k: torch.tensor(v) for k, v in saved.items()})
    return True


def test_checkpoint_round_trip_of_sharded_frozen_parameters_at_world_2_and_1(tmp_path):
    saved = run_ranks(checkpoint_worker, 2, str(tmp_path))[0]
    assert all(run_ranks(load_elsewhere_worker, 1, str(tmp_path), saved))


def cross_stage_worker(rank: int, world: int, directory: str) -> bool:
    """Saved at stage 2 (frozen parameters whole in the model file) and loaded at stage 3, where each rank
    reads its shard's byte ranges, also converting fp32 to a bf16 shard; and the other way round."""
    torch.manual_seed(0)
    model = Lora()
    engine = zerocore.initialize(model, config(stage=2))
    train(engine, rank, 0, 1)
    engine.save_checkpoint(directory, tag="stage2")
    saved = gathered_values(model)
    engine.close()
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(5)
        model = Lora()
        engine = zerocore.initialize(model, config(dtype))
        engine.load_checkpoint(directory, tag="stage2")
        loaded = gathered_values(model)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        compute = torch.float32 if dtype == "fp32" else torch.bfloat16
        wrong = different(loaded, {n: v.to(compute) for n, v in saved.items()}, frozen)
        assert not wrong, f"stage 2 -> stage 3 {dtype}: {wrong}"
        if dtype == "fp32":
            train(engine, rank, 1, 1)
            engine.save_checkpoint(directory, tag="stage3")
            saved = gathered_values(model)
        engine.close()
    torch.manual_seed(6)
    model = Lora()
    engine = zerocore.initialize(model, config(stage=2))
    engine.load_checkpoint(directory, tag="stage3")
    assert not different(gathered_values(model), saved), "stage 3 -> stage 2"
    return True


def test_sharded_frozen_parameters_load_across_stages_and_dtypes(tmp_path):
    assert all(run_ranks(cross_stage_worker, 2, str(tmp_path)))


def failing_save_worker(rank: int, world: int, directory: str) -> dict:
    """Rank 0's disk fills while it streams the frozen units into the model file: its peers are gathering
    those units with it, so it plays out the remaining gathers before all ranks learn of the failure."""
    import types

    import zerocore._checkpoint_untracked as untracked

    torch.manual_seed(0)
    model = Lora()
    engine = zerocore.initialize(model, config())
    train(engine, rank, 0, 1)

    def fills(path, entries, tensor, *args, **kwargs):
        for name, shape, dtype in entries[: len(entries) // 2]:
            tensor(name, shape, dtype)
        raise OSError(28, "No space left on device", path)

    real = untracked.stio
    if rank == 0:
        untracked.stio = types.SimpleNamespace(write=fills)
    try:
        with pytest.raises(OSError) as raised:
            engine.save_checkpoint(directory, tag="full")
    finally:
        untracked.stio = real
    assert not os.path.exists(os.path.join(directory, "full"))
    train(engine, rank, 1, 1)  # in lockstep still
    engine.save_checkpoint(directory, tag="full")
    saved = gathered_values(model)
    torch.manual_seed(3)
    fresh_model = Lora()
    fresh = zerocore.initialize(fresh_model, config())
    fresh.load_checkpoint(directory, tag="full")
    assert not different(gathered_values(fresh_model), saved)
    return {"message": str(raised.value)}


def test_a_model_file_write_failing_on_rank_0_raises_on_every_rank_and_training_goes_on(tmp_path):
    results = run_ranks(failing_save_worker, 2, str(tmp_path), timeout=120)
    assert "No space left on device" in results[0]["message"]
    assert "rank 0" in results[1]["message"] and "No space left" in results[1]["message"], results[1]


class FrozenBiases(nn.Module):
    """Blocks whose Linear bias is frozen: each unit waits for its input gradients before it is released."""

    def __init__(self, freeze: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(4))
        for block in self.blocks:
            block[0].bias.requires_grad_(not freeze)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def backward_peak_worker(rank: int, world: int, freeze: bool, zero: dict) -> dict:
    cfg = config("bf16", **zero)
    with torch.device("meta"):
        planned = zerocore.estimate_memory(FrozenBiases(freeze), cfg, world, rank=rank)["step"]["gathered_params_peak"]
    torch.manual_seed(0)
    engine = zerocore.initialize(FrozenBiases(freeze), cfg)
    peaks = []
    for step in range(3):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
        peaks.append(engine.memory_report()["bytes"]["gathered_params_peak_last_step"])
    return {"planned": planned, "peaks": peaks}


@pytest.mark.parametrize("zero", [{}, {"stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 1}])
def test_a_unit_waiting_for_its_input_gradients_is_released_before_the_backward_prefetches_past_it(zero):
    """The next unit's input gradients are this unit's output gradients: their hooks run before this unit's
    backward gathers it and prefetches the unit before it, so a model with frozen parameters holds no more
    than one without (the planned peak) -- it held one unit more, above stage3_max_live_parameters too."""
    trainable = run_ranks(backward_peak_worker, 2, False, zero)[0]
    frozen = run_ranks(backward_peak_worker, 2, True, zero)[0]
    assert frozen["planned"] == trainable["planned"]
    for result in (trainable, frozen):
        assert result["peaks"][1:] == [result["planned"]] * 2, result


# ---- close ---------------------------------------------------------------------------------------------------------
def close_worker(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = Lora()
    engine = zerocore.initialize(model, config())
    train(engine, rank, 0, 1)
    weight = model.blocks[1].base.weight
    with zerocore.gathered([weight], modifier_rank=0):
        doubled = weight.detach() * 2
        with torch.no_grad():
            weight.copy_(doubled)  # every rank writes the same; rank 0's is kept
    train(engine, rank, 1, 1)
    expected = engine.full_state_dict(rank0_only=False)
    assert torch.equal(expected["blocks.1.base.weight"], doubled)
    engine.close()
    state = model.state_dict()
    assert not different(state, expected), f"after close(): {different(state, expected)} differ"
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert type(param) is nn.Parameter, (name, type(param))
            assert param.untyped_storage().nbytes() >= param.numel() * param.element_size(), name
    plain = Lora()
    plain.load_state_dict(expected)
    tokens, target = data(5, rank)
    torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)
    loss_of(model, tokens, target).backward()  # plain use works: no hooks left
    again = zerocore.initialize(model, config())  # and a new engine shards it again
    state = again.full_state_dict(rank0_only=False)
    assert not different(state, expected), f"a second engine: {different(state, expected)} differ"
    again.close()
    return True


def test_close_hands_back_whole_frozen_parameters():
    assert all(run_ranks(close_worker, 2))


# ---- meta-device build ---------------------------------------------------------------------------------------------
def lora_init(generator: torch.Generator):
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.1, generator=generator)
            if module.bias is not None:
                nn.init.normal_(module.bias, std=0.01, generator=generator)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, generator=generator)
        elif isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight, mean=1.0, std=0.1, generator=generator)
            nn.init.zeros_(module.bias)
    return init


def meta_worker(rank: int, world: int) -> dict:
    out = {}
    # without init_fn: each module's reset_parameters(), as the eager build with the same seed ran them
    torch.manual_seed(0)
    eager = Lora()
    whole = sum(p.numel() * p.element_size() for p in eager.parameters() if not p.requires_grad)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Lora()
    assert all(p.is_meta for p in model.parameters())
    engine = zerocore.initialize(model, config())
    expected = eager.state_dict()
    state = engine.full_state_dict(rank0_only=False)
    assert state.keys() == expected.keys()
    assert not different(state, expected), f"reset_parameters path: {different(state, expected)} differ"
    assert not different(gathered_values(model), dict(eager.named_parameters()))
    out["frozen"], out["whole"] = engine.memory_report()["bytes"]["frozen_params"], whole
    train(engine, rank, 0, 1)
    engine.close()
    # an init_fn with its own per-rank stream: every rank ends with rank 0's values, frozen ones included
    eager = Lora()
    eager.apply(lora_init(torch.Generator().manual_seed(1234)))
    with torch.device("meta"):
        model = Lora()
    engine = zerocore.initialize(model, config(), init_fn=lora_init(torch.Generator().manual_seed(1234 + rank)))
    state = engine.full_state_dict(rank0_only=False)
    expected = eager.state_dict()
    assert not different(state, expected), f"init_fn path: {different(state, expected)} differ"
    train(engine, rank, 0, 1)
    return out


def test_meta_device_build_materializes_frozen_parameters_sharded_with_the_eager_values():
    for r in run_ranks(meta_worker, 2):
        assert 0.4 * r["whole"] < r["frozen"] < 0.6 * r["whole"], r


# ---- a frozen unit is released in the backward once its input gradients are computed -------------------------------
class ChainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.linear(h)))


class Chain(nn.Module):
    """Embedding, six blocks (1-4 entirely frozen, each with an input that needs a gradient), head; ``probe``
    is called when the gradient reaches the embedding's output: every block's backward is done then."""

    FROZEN = (1, 2, 3, 4)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(ChainBlock() for _ in range(6))
        for i in self.FROZEN:
            self.blocks[i].requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.probe = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.probe is not None and h.requires_grad:
            h.register_hook(self.probe)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def frozen_unit_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Chain()
    reference = _reference(copy.deepcopy(model))
    engine = zerocore.initialize(model, config(stage3_max_live_parameters=1, stage3_prefetch_bucket_size=0))
    live_at_backward_end = []
    model.probe = lambda grad: live_at_backward_end.append(engine.memory_report()["bytes"]["gathered_params_live"])
    engine.reset_comm_stats()
    steps = 3
    for step in range(steps):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
        reference.train_step(lambda module, _: sum(loss_of(module, *data(step, r)) for r in range(world)) / world)
    peak = engine.memory_report()["bytes"]["gathered_params_peak_last_step"]
    backward_elements = engine.comm_report()["collectives"].get("all_gather_backward", {}).get("logical_elements", 0)
    model.probe = None
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label="frozen blocks 1-4")

    def padded(params) -> int:  # a unit's gathered elements, padding included
        return zerocore.FlatLayout([p.numel() for p in params], world, 64, 2**62).total_size

    block = padded(list(model.blocks[0].parameters()))
    root = padded([model.embed.weight, model.head.weight])
    everything = sum(p.numel() for p in model.parameters())
    frozen = sum(p.numel() for i in Chain.FROZEN for p in model.blocks[i].parameters())
    return {"peak": peak, "live_at_backward_end": live_at_backward_end, "block_bytes": 4 * block,
            "root_bytes": 4 * root, "all_bytes": 4 * everything, "backward_elements": backward_elements,
            "frozen_elements": frozen, "steps": steps}


def test_a_unit_of_only_frozen_parameters_trains_and_is_released_during_the_backward():
    for r in run_ranks(frozen_unit_worker, 2):
        # the frozen blocks are gathered for the backward (their weights compute the input gradients) ...
        assert r["backward_elements"] >= r["steps"] * r["frozen_elements"], r
        # ... and released once their input gradients are in: when the gradient reaches the embedding, at most
        # the root, block 0 and one more block are gathered (kept to the end, frozen blocks 1-4 would show)
        assert len(r["live_at_backward_end"]) == r["steps"], r
        for live in r["live_at_backward_end"]:
            assert live <= r["root_bytes"] + 2 * r["block_bytes"], r
        assert r["peak"] <= r["root_bytes"] + 3 * r["block_bytes"] < r["all_bytes"], r


# ---- qwZ for frozen weights ----------------------------------------------------------------------------------------
def qwz_worker(rank: int, world: int) -> dict:
    out = {}
    for label, zero in (("plain", {}), ("qwz", {"zero_quantized_weights": True}),
                        ("qwz+nontrainable", {"zero_quantized_weights": True,
                                              "zero_quantized_nontrainable_weights": True})):
        torch.manual_seed(0)
        model = Lora(frozen_blocks=(0, 1, 2))  # mostly frozen: only block 3's adapters and the head train
        initial = {k: v.to(torch.bfloat16) for k, v in frozen_of(model).items()}
        engine = zerocore.initialize(model, config("bf16", zero_quantization_group_size=64, **zero))
        engine.reset_comm_stats()
        losses = train(engine, rank, 0, 3)
        report = engine.comm_report()
        state = engine.full_state_dict(rank0_only=False)  # exact values, never the quantized ones
        assert not different(state, initial), f"{label}: frozen values {different(state, initial)} changed"
        out[label] = {"losses": losses, "forward_bytes": report["per_step"]["all_gather_forward"]["algorithm_bytes"],
                      "algorithm": report["algorithms"]["parameter_all_gather"]}
        engine.close()
    return out


def test_quantized_nontrainable_weights_gather_frozen_weights_as_int8():
    for r in run_ranks(qwz_worker, 2, timeout=180):
        plain, qwz, both = r["plain"], r["qwz"], r["qwz+nontrainable"]
        assert qwz["algorithm"] == both["algorithm"] == "quantized", r
        assert qwz["forward_bytes"] < plain["forward_bytes"], r
        # frozen weights are most of what the forward gathers: as int8 they cost about half their bf16 bytes
        assert both["forward_bytes"] < 0.7 * qwz["forward_bytes"], r
        for run in (qwz, both):
            assert all(math.isfinite(x) for x in run["losses"]), r
            assert all(abs(x - y) < 0.05 * abs(y) for x, y in zip(run["losses"], plain["losses"])), r


# ---- a model with no trainable parameter: a reference or teacher model sharded for its forward -----------------------
def teacher_worker(rank: int, world: int, directory: str, stage: int) -> dict:
    torch.manual_seed(0)
    model = Lora(frozen_blocks=(0, 1, 2, 3)).requires_grad_(False)
    plain = copy.deepcopy(model)
    cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    with torch.device("meta"):
        meta = Lora(frozen_blocks=(0, 1, 2, 3)).requires_grad_(False)
    estimate = zerocore.estimate_memory(meta, cfg, world, rank=rank)["bytes"]
    engine = zerocore.initialize(model, cfg)
    report = engine.memory_report()["bytes"]
    tokens, _ = data(0, rank)
    with torch.no_grad():
        scored = engine(tokens)
    with_grad = engine(tokens)  # grad enabled, nothing requires it: no backward follows
    out = {"same": torch.equal(scored, plain(tokens)) and torch.equal(with_grad, plain(tokens)),
           "estimate": estimate == report, "frozen": report["frozen_params"],
           "whole": sum(p.numel() * p.element_size() for p in plain.parameters()),
           "live_after": engine.memory_report()["bytes"].get("gathered_params_live", 0),
           "persistent": sum(unit.nbytes for unit in engine.stage3.units if unit.persistent) if stage == 3 else 0}
    try:
        engine.step()
        out["step"] = "no error"
    except RuntimeError as error:
        out["step"] = str(error)
    engine.save_checkpoint(directory, tag="teacher")
    torch.manual_seed(1)
    other = zerocore.initialize(Lora(frozen_blocks=(0, 1, 2, 3)).requires_grad_(False), cfg)
    other.load_checkpoint(directory, tag="teacher")
    with torch.no_grad():
        out["loaded"] = torch.equal(other(tokens), scored)
    for e in (engine, other):
        e.close()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_with_no_trainable_parameter_runs_its_forwards_sharded_at_stage_3(stage, tmp_path):
    """A reference or teacher model: stage 3 shards it; stages 1-2 (and DeepSpeed's stage 0, which TRL gives its
    reference model below ZeRO-3) hold it whole, as DeepSpeed's initialize without an optimizer does."""
    for result in run_ranks(teacher_worker, 2, str(tmp_path), stage):
        assert result["same"] and result["estimate"] and result["loaded"], result
        if stage == 3:
            assert 0.4 * result["whole"] < result["frozen"] < 0.6 * result["whole"], result
        else:
            assert result["frozen"] == result["whole"], result
        assert result["live_after"] == result["persistent"], result  # both forwards released every other unit
        assert "backward" in result["step"], result


class InplaceBlock(nn.Module):
    """Writes its input in place before using it (``nn.ReLU(inplace=True)`` first), with a frozen base."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.base = nn.Linear(DIM, DIM).requires_grad_(False)
        self.lora_a = nn.Linear(DIM, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.act(h)
        return self.base(h) + self.lora_b(self.lora_a(h))  # an addition: nothing saves this output


class InplaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(InplaceBlock() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * 1.0  # not the embedding's own output: relu_ may write it
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def inplace_worker(rank: int, world: int, stage: int) -> list[float]:
    torch.manual_seed(0)
    engine = zerocore.initialize(InplaceNet(), {**config(), "zero_optimization": {"stage": stage}})
    return train(engine, rank, 0, 3)


def test_a_unit_writing_its_input_in_place_trains_as_at_stage_2():
    """Units with frozen weights watch their inputs' gradients with a hook, leaving the inputs as they are: an
    identity autograd function on them (FSDP2's way) makes autograd refuse the module's in-place write."""
    assert run_ranks(inplace_worker, 2, 3) == run_ranks(inplace_worker, 2, 2)


# ---- offload_param: nvme takes the frozen shards too ----------------------------------------------------------------
def frozen_nvme_worker(rank: int, world: int, path: str | None, directory: str) -> dict:
    torch.manual_seed(0)
    model = Lora()
    cfg = config("bf16")
    if path is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
    with torch.device("meta"):
        meta = Lora()
    estimate = zerocore.estimate_memory(meta, cfg, world, rank=rank)
    engine = zerocore.initialize(model, cfg)
    report = engine.memory_report()
    with zerocore.gathered([model.blocks[1].base.weight], modifier_rank=0):
        if rank == 0:
            model.blocks[1].base.weight.fill_(0.25)  # reaches the shard in the file
    losses = train(engine, rank, 0, 3)
    engine.save_checkpoint(directory, tag=str(path is not None))
    loaded = zerocore.initialize(Lora(), cfg)
    loaded.load_checkpoint(directory, tag=str(path is not None))
    out = {"losses": losses, "frozen": report["bytes"]["frozen_params"], "file": report["nvme"]["param_file_bytes"],
           "estimate": (estimate["bytes"], estimate["nvme_param_file_bytes"]) == (report["bytes"],
                                                                                  report["nvme"]["param_file_bytes"]),
           "values": gathered_values(loaded), "mine": gathered_values(model)}
    out["loaded"] = not different(out.pop("values"), out.pop("mine"))
    for e in (engine, loaded):
        e.close()
    out["written"] = bool(torch.all(model.blocks[1].base.weight == 0.25))
    return out


def test_offload_param_nvme_takes_the_frozen_shards_and_trains_bitwise_like_in_memory(tmp_path):
    (tmp_path / "nvme").mkdir()
    on_disk = run_ranks(frozen_nvme_worker, 2, str(tmp_path / "nvme"), str(tmp_path / "a"))
    in_memory = run_ranks(frozen_nvme_worker, 2, None, str(tmp_path / "b"))
    for disk, memory in zip(on_disk, in_memory):
        assert disk["losses"] == memory["losses"], (disk["losses"], memory["losses"])
        assert disk["frozen"] == 0 < memory["frozen"] and disk["file"] > memory["frozen"], (disk, memory)
        assert disk["estimate"] and memory["estimate"] and disk["loaded"] and disk["written"], disk


# ---- any subset frozen: stage 3 trains as stage 2 does --------------------------------------------------------------
def random_freeze_worker(rank: int, world: int, name: str, seed: int, stage: int, bf16: bool) -> tuple:
    model = _models.build(name)
    params = list(model.named_parameters())
    chooser = random.Random(seed)
    frozen = {n for n, _ in params[:-1] if chooser.random() < 0.5} or {params[0][0]}  # the last one trains
    for n, p in params:
        p.requires_grad_(n not in frozen)
    engine = zerocore.initialize(model, {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": bf16},
                                         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x, y = _models.batch(name, generator)
        loss = _models.loss_fn(name, engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # plain lists: tensors would travel back through shared memory that the rank's exit frees
    return losses, {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}


@pytest.mark.parametrize("name, seed, bf16", [("transformer", 0, False), ("transformer", 1, True), ("odd", 2, False),
                                              ("odd", 3, True)])
def test_any_subset_of_frozen_parameters_trains_at_stage_3_bit_for_bit_as_at_stage_2(name, seed, bf16):
    """Random frozen subsets of models with tied, unused and one-element parameters (tests/_models.py)."""
    stage2 = run_ranks(random_freeze_worker, 2, name, seed, 2, bf16)
    stage3 = run_ranks(random_freeze_worker, 2, name, seed, 3, bf16)
    for (losses2, state2), (losses3, state3) in zip(stage2, stage3):
        assert losses2 == losses3
        assert state2 == state3


def whole_frozen_write_worker(rank: int, world: int, stage: int) -> dict[str, list[float]]:
    """The DeepSpeed idiom for loading on one rank, at the stages that keep frozen parameters whole."""
    torch.manual_seed(0)
    model = Lora()
    engine = zerocore.initialize(model, config(stage=stage))
    frozen, trained = model.blocks[1].base.weight, model.head.weight
    with zerocore.gathered(model.parameters(), modifier_rank=0), torch.no_grad():
        frozen.fill_(0.5 if rank == 0 else -3.0)
        trained.fill_(0.25 if rank == 0 else -3.0)
    state = engine.full_state_dict(rank0_only=False)
    after = {"frozen": state["blocks.1.base.weight"].unique().tolist(),
             "trained": state["head.weight"].unique().tolist()}
    train(engine, rank, 0, 2)
    after["frozen after training"] = engine.full_state_dict(rank0_only=False)["blocks.1.base.weight"].unique().tolist()
    return after


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_frozen_parameter_written_on_the_modifier_rank_reaches_every_rank_where_it_is_held_whole(stage):
    """Stages 1-2 hold frozen parameters whole on every rank, outside the engine's buffers: a write on
    modifier_rank inside gathered() stayed on that rank alone (the ranks then trained different models, each
    its own frozen base); stage 3 shards them and always sent it."""
    for after in run_ranks(whole_frozen_write_worker, 2, stage):
        assert after == {"frozen": [0.5], "trained": [0.25], "frozen after training": [0.5]}, after
