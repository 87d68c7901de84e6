"""Writes to parameters between steps reach the optimizer's fp32 master (issue 9, item 3; Note [Writes to
parameters] in _step.py): ``load_state_dict``, ``nn.init`` and in-place ops after ``initialize`` are
trained from, not reverted by the next step; a write on some ranks only raises on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _config(stage: int, dtype: str, lr: float, offload: str = "none", nvme_path: str = "") -> dict:
    config = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10**9}}
    if offload != "none":
        config["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": nvme_path}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def _train(engine: zerocore.Engine, rank: int, steps: int) -> None:
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x.to(engine.compute_dtype)).float().square().mean())
        engine.step()


def writes_worker(rank: int, world: int, stage: int, dtype: str) -> bool:
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage, dtype, lr=1e-2))
    _train(engine, rank, 3)
    torch.manual_seed(1)
    loaded = {k: v.float() for k, v in Net().state_dict().items()}

    rebound = loaded["fc2.weight"] * 0.5
    through_data = loaded["fc1.weight"] * -2.0

    def write() -> None:
        model.load_state_dict(loaded)  # every rank loads the same values
        with torch.no_grad():
            nn.init.constant_(model.fc2.bias, 0.25)
            model.fc1.bias.fill_(-0.5)
        # other storage, as vector_to_parameters and EMA swaps do: the parameter must go on training
        model.fc2.weight.data = rebound.to(model.fc2.weight.dtype).clone()
        model.fc1.weight.data.copy_(through_data)  # moves no version counter (Note [Writes through .data])

    if stage == 3:  # sharded parameters cannot be written: a clear error, then the way it names
        with pytest.raises(RuntimeError, match=r"zerocore.gathered\(model.parameters\(\), modifier_rank=0\)"):
            model.load_state_dict(loaded)
        with zerocore.gathered(model.parameters(), modifier_rank=0):
            write()
    else:
        write()
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0  # an update of zero: the next step must keep what was written
    _train(engine, rank, 1)
    expected = dict(loaded, **{"fc2.bias": torch.full((4,), 0.25), "fc1.bias": torch.full((16,), -0.5),
                               "fc2.weight": rebound, "fc1.weight": through_data})
    state = engine.full_state_dict(rank0_only=False)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value.to(engine.compute_dtype), rtol=0, atol=0, msg=name)
    # and training goes on from the written values, not from the old master
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2
    _train(engine, rank, 1)
    after = engine.full_state_dict(rank0_only=False)["fc2.weight"].float()
    assert 0 < (after - rebound.to(engine.compute_dtype).float()).abs().max() < 0.05
    moved = engine.full_state_dict(rank0_only=False)["fc1.weight"].float()
    assert 0 < (moved - through_data.to(engine.compute_dtype).float()).abs().max() < 0.05
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_load_state_dict_and_in_place_writes_after_initialize_are_kept(stage, dtype):
    assert all(run_ranks(writes_worker, 2, stage, dtype))


def _train_on(engine: zerocore.Engine, rank: int, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + rank))
    engine.backward(engine(x.to(engine.compute_dtype)).float().square().mean())
    engine.step()


def recovery_worker(rank: int, world: int, stage: int, fail: bool) -> dict[str, list]:
    """A step refused on every rank (here: a write on rank 0 only), caught, the model's state written back
    on every rank as the error says, training on: the refused window's gradients must not reach the next
    update (compared with a run that never had that window)."""
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage, "fp32", lr=1e-2))
    _train_on(engine, rank, 0)
    state = engine.full_state_dict(rank0_only=False)
    if fail:
        if stage == 3:  # the root unit stays gathered from a forward until the step: writable there
            engine(torch.zeros(1, 8))
        if rank == 0:
            with torch.no_grad():
                model.fc1.weight.mul_(1.0)  # a write on rank 0 only
        with pytest.raises(RuntimeError, match="on 1 of 2 ranks only") as caught:
            _train_on(engine, rank, 100)
        assert "gradients were dropped" in "\n".join(caught.value.__notes__)
    with zerocore.gathered(model.parameters(), modifier_rank=0):
        model.load_state_dict(state)
    _train_on(engine, rank, 200)
    return {name: value.tolist() for name, value in engine.full_state_dict(rank0_only=False).items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_refused_step_drops_its_window_gradients(stage):
    failed, clean = run_ranks(recovery_worker, 2, stage, True), run_ranks(recovery_worker, 2, stage, False)
    assert failed == clean  # bitwise, on every rank


def one_rank_worker(rank: int, world: int, stage: int) -> str:
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage, "bf16", lr=1e-2))
    _train(engine, rank, 1)
    if stage == 3:  # stage 3: a unit kept gathered (the root, whole from its forward until the step)
        engine(torch.zeros(1, 8, dtype=engine.compute_dtype))
    if rank == 0:
        with torch.no_grad():
            model.fc1.weight.zero_()
    try:
        _train(engine, rank, 1)
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_write_on_one_rank_only_raises_on_every_rank(stage):
    """Stage 3 keeps this model's one unit (the root) gathered after a forward until the step."""
    for message in run_ranks(one_rank_worker, 2, stage):
        assert "on 1 of 2 ranks only" in message and "modifier_rank" in message, message


def discard_worker(rank: int, world: int, stage: int, dtype: str) -> bool:
    torch.manual_seed(0)
    model = Net()
    engine = zerocore.initialize(model, _config(stage, dtype, lr=1e-2))
    _train(engine, rank, 2)
    before = engine.full_state_dict(rank0_only=False)
    with zerocore.gathered(list(model.parameters())):  # modifier_rank=None: changes are discarded on exit
        with torch.no_grad():
            model.fc1.weight.add_(1.0 + rank)
        assert not torch.equal(model.fc1.weight.detach().float(), before["fc1.weight"].float())
    if stage != 3:  # stages 1-2: the parameters stay whole and hold the old values again
        assert torch.equal(model.fc1.weight.detach().cpu(), before["fc1.weight"])
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(after[k], before[k]) for k in before)
    _train(engine, rank, 1)  # and the next step starts from the old values on every rank
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_changes_inside_gathered_without_modifier_rank_are_discarded(stage, dtype):
    assert all(run_ranks(discard_worker, 2, stage, dtype))


def data_write_worker(rank: int, world: int, stage: int, dtype: str, when: str, offload: str = "none",
                      nvme_path: str = "") -> bool:
    """A write through ``.data`` alone (no version counter moves: Note [Writes through .data]), between steps
    or between backward and step, as EMA swaps and weight clamps do it, is kept and trained from."""
    torch.manual_seed(0)
    model = Net()
    target = torch.linspace(-1, 1, model.fc1.weight.numel()).view_as(model.fc1.weight)
    engine = zerocore.initialize(model, _config(stage, dtype, 1e-2, offload, nvme_path))
    _train(engine, rank, 2)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    if when == "between steps" and stage == 3:  # sharded at rest: refused, naming the way to write
        with pytest.raises(RuntimeError, match=r"data\(\) on parameter 'fc1.weight'.*zerocore.gathered"):
            model.fc1.weight.data.copy_(target)
        return True
    if when == "between steps":
        model.fc1.weight.data.copy_(target)
    engine.backward(engine(x.to(engine.compute_dtype)).float().square().mean())
    if when == "before step":
        model.fc1.weight.data.copy_(target)
    engine.step()
    kept = engine.full_state_dict(rank0_only=False)["fc1.weight"]
    assert torch.equal(kept, target.to(engine.compute_dtype)), (kept - target).abs().max()
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2
    _train(engine, rank, 1)
    moved = engine.full_state_dict(rank0_only=False)["fc1.weight"].float()
    assert 0 < (moved - target.to(engine.compute_dtype).float()).abs().max() < 0.05
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])  # stage 3: units kept gathered (persistence threshold 1e9)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("when", ["between steps", "before step"])
def test_a_write_through_data_is_kept(stage, dtype, when):
    assert all(run_ranks(data_write_worker, 2, stage, dtype, when))


# cpu offload on a CPU-only machine is the in-memory path; the GPU's host-staged one is in test_engine_cuda.py
@pytest.mark.parametrize("stage, dtype, offload", [(1, "bf16", "nvme"), (2, "fp16", "nvme"), (3, "bf16", "nvme"),
                                                   (2, "bf16", "cpu")])
def test_a_write_through_data_is_kept_with_the_optimizer_state_offloaded(stage, dtype, offload, tmp_path):
    """The master lives in host memory or in a file: the write still reaches it (on NVMe, inside the step's
    read-update-write pipeline) instead of being reverted by the update."""
    assert all(run_ranks(data_write_worker, 2, stage, dtype, "before step", offload, str(tmp_path)))


class WritesInForward(nn.Module):
    """Writes to its parameters inside the forward: nn.Embedding(max_norm=) renormalizes the rows it looks up,
    and a forward pre-hook (registered after initialize) shrinks a weight, as weight-renormalizing code does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8, max_norm=1.0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(1)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def _shrink(module: nn.Module, args: tuple) -> None:
    with torch.no_grad():
        module.weight.mul_(0.9)


def forward_writes_worker(rank: int, world: int, stage: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    with torch.no_grad():
        model = WritesInForward()
        model.embed.weight.mul_(3.0)  # rows well above max_norm: every lookup renormalizes
    engine = zerocore.initialize(model, {"optimizer": {"params": {"lr": 1e-2}}, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0}}, units=[nn.Embedding, nn.Linear])
    model.blocks[0].register_forward_pre_hook(_shrink)
    for step in range(3):
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: the same writes everywhere
        tokens, target = torch.randint(0, 20, (4, 5), generator=g), torch.randn(4, 3, generator=g)
        engine.backward(nn.functional.mse_loss(engine(tokens), target))
        engine.step()
    return {k: v.double().flatten().tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}


def test_writes_inside_a_stage3_units_forward_are_kept_as_at_stage_2():
    """Stage 3 releases a unit after its forward: the write reaches the shard first (Unit.release), instead of
    being dropped with the gathered values (embedding rows 2-3x max_norm, the shrunk weight undone)."""
    sharded = run_ranks(forward_writes_worker, 2, 3)[0]
    replicated = run_ranks(forward_writes_worker, 2, 2)[0]
    for name, values in replicated.items():
        ours, theirs = torch.tensor(sharded[name]), torch.tensor(values)
        assert (ours - theirs).norm() <= 1e-5 * theirs.norm(), (name, float((ours - theirs).norm() / theirs.norm()))


def rank_dependent_writes_worker(rank: int, world: int, stage: int) -> str:
    torch.manual_seed(0)
    with torch.no_grad():
        model = WritesInForward()
        model.embed.weight.mul_(3.0)
    engine = zerocore.initialize(model, {"optimizer": {"params": {"lr": 1e-2}}, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0}}, units=[nn.Embedding, nn.Linear])
    g = torch.Generator().manual_seed(rank)  # each rank's own batch: max_norm renormalizes other rows on each
    tokens = torch.arange(10).reshape(2, 5) + 10 * rank
    engine.backward(nn.functional.mse_loss(engine(tokens), torch.randn(2, 3, generator=g)))
    with pytest.raises(RuntimeError) as raised:
        engine.step()
    same = torch.arange(10).reshape(2, 5)  # the same batch everywhere: the same writes, accepted
    engine.backward(nn.functional.mse_loss(engine(same), torch.ones(2, 3)))
    engine.step()
    with zerocore.gathered([model.embed.weight]):  # every rank's copy is the same again
        held = model.embed.weight.detach().double().flatten().tolist()
    return str(raised.value), held


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_writes_that_differ_between_ranks_raise_on_every_rank_naming_the_parameter(stage):
    """Each rank keeps only its shard of a write: the ranks' different renormalized rows would otherwise mix,
    silently, in a way that depends on the sharding (stage 3's per-unit shards keep other rows than stage 2's)."""
    results = run_ranks(rank_dependent_writes_worker, 2, stage)
    for message, _ in results:
        assert "different values on different ranks ('embed.weight')" in message, message
        assert "max_norm" in message
    assert results[0][1] == results[1][1]


def _masters(engine: zerocore.Engine) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for shard, piece in engine.optimizer_state.pieces():
        with engine.optimizer_state.resident(shard) as values:
            part = values["master"][piece.shard_offset : piece.shard_offset + piece.length]
            out.setdefault(piece.name, []).extend(part.tolist())
    return out


def modifier_masters_worker(rank: int, world: int, stage: int) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = zerocore.initialize(model, {"optimizer": {"params": {"lr": 1e-2}}, "bf16": {"enabled": True},
                                         "zero_optimization": {"stage": stage,
                                                               "stage3_param_persistence_threshold": 0}},
                                 units=[nn.Linear])
    for step in range(2):  # masters hold bits below bf16's precision
        g = torch.Generator().manual_seed(10 * step + rank)
        engine.backward(engine(torch.randn(4, 8, generator=g).bfloat16()).float().square().mean())
        engine.step()
    before = _masters(engine)
    with zerocore.gathered([model[4].bias, model[4].weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model[4].bias.fill_(0.5)
    return before, _masters(engine)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_modifier_rank_block_changes_only_the_masters_of_what_it_wrote(stage):
    """The broadcast values are 16-bit: copied whole into the fp32 masters, they cut every master of the
    buffer (the whole model at stages 1-2) to its bf16 rounding, even in a block that wrote nothing."""
    written = []
    for before, after in run_ranks(modifier_masters_worker, 2, stage):  # each rank's masters: its shard's
        written += after.pop("4.bias", [])
        before.pop("4.bias", None)
        assert after == before
    assert written == [0.5] * 4


def writes_before_gathered_worker(rank: int, world: int, stage: int) -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = zerocore.initialize(model, {"optimizer": {"params": {"lr": 1e-2}}, "bf16": {"enabled": True},
                                         "zero_optimization": {"stage": stage}})
    engine.backward(engine(torch.randn(4, 8).bfloat16()).float().square().mean())
    engine.step()
    loaded = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)  # on every rank, in place: the model's from here on
    with zerocore.gathered(list(model.parameters())):  # only a read
        pass
    state = engine.full_state_dict(rank0_only=False)
    return all(torch.equal(state[k].to(v.dtype), v) for k, v in loaded.items())


@pytest.mark.parametrize("stage", [1, 2])
def test_a_read_only_gathered_block_keeps_writes_made_before_it(stage):
    """Leaving the block without a modifier rank undid every write since the step, the load before it too."""
    assert all(run_ranks(writes_before_gathered_worker, 2, stage))


def rebound_at_rest_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    engine = zerocore.initialize(model, {"optimizer": {"params": {"lr": 1e-2}}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}, units=[nn.Linear])
    x = torch.randn(4, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    model[2].bias.data = torch.full((4,), 0.5)  # an EMA swap at rest: the gather would drop it silently
    with pytest.raises(RuntimeError) as raised:
        engine(x)
    engine.backward(engine(x).square().mean())  # the model's own values again: trains on
    engine.step()
    return str(raised.value)


def test_a_stage3_parameter_given_a_tensor_at_rest_is_refused_at_its_gather_naming_it():
    for message in run_ranks(rebound_at_rest_worker, 2):
        assert "['2.bias']" in message and "modifier_rank" in message, message


def resized_worker(rank: int, world: int, stage: int, where: str) -> str:
    """A parameter given a tensor of another shape (an old way to grow an embedding: ``w.data = torch.cat(...)``)
    has no place in the engine's buffer: refused on every rank, naming it, with nothing else changed, and
    training goes on as if it had not been tried (compared with a run without it)."""
    finals, message = [], ""
    for attempt in (False, True):
        torch.manual_seed(0)
        model = Net()
        engine = zerocore.initialize(model, _config(stage, "fp32", lr=1e-2))
        _train(engine, rank, 2)
        if attempt:
            weight = model.fc1.weight
            grown = lambda: torch.cat([weight.data, torch.zeros(2, 8)])  # noqa: E731
            if where == "forward":  # stages 1-2: the parameters are whole between steps
                weight.data = grown()
                with pytest.raises(RuntimeError) as raised:
                    engine(torch.randn(4, 8))
                weight.data = weight.data[:16]  # the rows it had: trains on from its own values
            else:  # inside a modifier block, with another write beside it that must be discarded too
                with pytest.raises(RuntimeError) as raised:
                    with zerocore.gathered(list(model.parameters()), modifier_rank=0):
                        with torch.no_grad():
                            model.fc2.bias.fill_(7.0)
                        weight.data = grown()
                assert tuple(weight.shape) == (16, 8)
            message = str(raised.value)
        _train(engine, rank, 2)
        finals.append(engine.full_state_dict(rank0_only=False))
        engine.close()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    return message


@pytest.mark.parametrize("stage,where", [(1, "forward"), (2, "forward"), (1, "gathered"), (2, "gathered"),
                                         (3, "gathered")])
def test_a_parameter_given_another_shape_is_refused_on_every_rank_changing_nothing(stage, where):
    messages = run_ranks(resized_worker, 2, stage, where)
    if where == "forward":
        assert all("'fc1.weight' has shape [18, 8] but zerocore laid it out as [16, 8]" in m for m in messages)
    else:  # the modifier names the parameter, the others the modifier
        assert "'fc1.weight' was given a tensor of shape (18, 8)" in messages[0], messages[0]
        assert "rank 0 gave a parameter a tensor of another shape" in messages[1], messages[1]
