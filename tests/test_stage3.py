"""Stage 3: repeated modules, tied weights, checkpointing, no-param modules, inference, meta-device
build, divergence detection, memory at rest and during a step, comm volume, gathered()."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import zerocore
from _dist import run_ranks
from _parity import ReferencePair

pytestmark = pytest.mark.timeout(300)
VOCAB, DIM = 24, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.linear(h)))


class Gelu(nn.Module):  # a module without parameters
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(h)


class Zoo(nn.Module):
    """A block called twice, a checkpointed block, a parameterless module and a tied embedding/head."""

    def __init__(self, checkpoint_mode: str = "none") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.act = Gelu()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.checkpoint_mode = checkpoint_mode
        self.extra_block_on_rank: int | None = None
        self.start_with_last_block = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.start_with_last_block:  # a different unit order than the one recorded in step 1
            h = self.blocks[2](h)
        h = self.blocks[0](self.blocks[0](h))
        if self.checkpoint_mode == "none":
            h = self.blocks[1](h)
        else:
            h = checkpoint(self.blocks[1], h, use_reentrant=self.checkpoint_mode == "reentrant")
        if self.extra_block_on_rank is not None and dist.get_rank() == self.extra_block_on_rank:
            h = self.blocks[1](h)  # a rank-dependent branch: breaks the SPMD contract
        h = self.blocks[2](self.act(h))
        return self.head(h)


def config(**zero) -> dict:
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (3, 5), generator=g), torch.randint(0, VOCAB, (3, 5), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1))


def train_beside_replica(engine: zerocore.Engine, model: nn.Module, rank: int, world: int, steps: int,
                         label: str = "") -> nn.Module:
    """Trains the engine and a replicated reference (fp32 and float64, built from ``model`` before the engine
    took it) side by side, then applies the parity rule (tests/_parity.py) to every final value. The
    reference sees every rank's batch: the mean of per-rank mean losses, as data parallelism averages."""
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                                                                 foreach=False))
    for step in range(steps):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
        reference.train_step(lambda module, dtype: sum(loss_of(module, *data(step, r)) for r in range(world)) / world)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=label)
    return reference.fp32


def zoo_worker(rank: int, world: int, mode: str) -> bool:
    torch.manual_seed(0)
    model = Zoo(mode)
    replica = copy.deepcopy(model)
    engine = zerocore.initialize(model, config())
    assert [u.name for u in engine.stage3.units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    reference = train_beside_replica(engine, replica, rank, world, steps=6, label=mode)
    # inference: eval + no_grad gathers and releases without backward
    engine.eval()
    reference.eval()
    with torch.no_grad():
        tokens, _ = data(99, 0)
        torch.testing.assert_close(engine(tokens), reference(tokens), rtol=1e-4, atol=1e-5)
    live = engine.stage3.live_elements
    root = engine.stage3.units[0].numel
    assert live == root, f"only the persistent root stays gathered after inference, live={live}"
    return True


@pytest.mark.parametrize("mode", ["none", "reentrant", "non_reentrant"])
def test_repeated_tied_checkpointed_and_parameterless_modules_match_a_replicated_model(mode):
    assert all(run_ranks(zoo_worker, 2, mode))


def meta_worker(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    reference = Zoo()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Zoo()
    engine = zerocore.initialize(model, config())
    state = engine.full_state_dict(rank0_only=False)
    expected = reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    plain = Zoo()
    on_rank0 = engine.full_state_dict()  # a collective: every rank calls it, rank 0 gets the tensors
    if rank == 0:
        plain.load_state_dict(on_rank0, strict=True)
    else:
        assert on_rank0 == {}
    # at rest every rank holds exactly its padded shard of every unit
    for unit in engine.stage3.units:
        for storage in unit.storages:
            assert storage.full.untyped_storage().nbytes() == 0 or unit.persistent
            assert storage.shard.numel() == storage.layout.shard_size
    return True


def test_meta_device_build_equals_unsharded_init_with_the_same_seed():
    assert all(run_ranks(meta_worker, 2))


def divergence_worker(rank: int, world: int, strict: bool) -> str:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config(), strict_spmd=strict)
    loss = loss_of(engine, *data(0, rank))
    engine.backward(loss)
    engine.step()
    model.extra_block_on_rank = 1
    try:
        engine.backward(loss_of(engine, *data(1, rank)))
    except RuntimeError as error:
        try:  # the engine cannot go on; what the user calls next names the divergence again (not a TypeError)
            engine.close()
        except RuntimeError as again:
            assert "diverged" in str(again), again
        return str(error)
    return "no error"


@pytest.mark.parametrize("strict", [False, True])
def test_rank_dependent_branch_raises_on_every_rank_naming_rank_step_and_module(strict):
    for message in run_ranks(divergence_worker, 2, strict, timeout=120):
        assert "diverged at step 1" in message and "rank 1" in message and "blocks." in message, message


def evaluation_on_rank_0_worker(rank: int, world: int, through: str) -> str:
    """The commonest rank-dependent branch: an evaluation on rank 0 alone between steps (``if rank == 0:``
    around the validation loop), through the module or the engine. Its gathers pair with the other rank's next
    backward: every rank raises, naming the evaluation, instead of waiting forever in mismatched collectives."""
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    if rank == 0:
        with torch.no_grad():
            (engine if through == "engine" else model)(data(9, 0)[0])
    try:
        engine.backward(loss_of(engine, *data(1, rank)))
        engine.step()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("through", ["module", "engine"])
def test_an_evaluation_on_rank_0_alone_raises_on_every_rank_saying_so(through):
    for message in run_ranks(evaluation_on_rank_0_worker, 2, through, timeout=120):
        assert "diverged" in message and "evaluation or generate() on some ranks only" in message, message


def memory_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config(stage3_max_live_parameters=600))
    engine.reset_comm_stats()
    for step in range(3):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
    runtime = engine.stage3
    largest = max(u.numel for u in runtime.units)
    report = engine.memory_report()
    return {"peak_bytes": runtime.last_step_peak_bytes, "largest": largest, "report": report,
            "shards": sum(u.buffer.layout.shard_size for u in runtime.units), "comm": engine.comm_report(),
            "persistent": sum(u.numel for u in runtime.units if u.persistent),
            "psi": sum(u.numel for u in runtime.units), "block0": runtime.units[1].numel,
            "last": next(u.numel for u in runtime.units if u.index == runtime.recorded_order[-1])}


def test_stage3_memory_and_comm_volume():
    for result in run_ranks(memory_worker, 2):
        report = result["report"]
        b = report["bytes"]
        psi = result["psi"]
        # at rest: each rank's parameter bytes are its padded shard, fp32 here
        assert b["params"] == 4 * result["shards"] == 4 * psi // 2
        assert report["model_state_bytes"] == report["formula"]["total"] == (4 + 4 + 8) * psi // 2
        # gathered elements stay within stage3_max_live_parameters plus the unit being gathered on demand
        assert result["peak_bytes"] <= 4 * (600 + result["largest"]), result
        assert b["gathered_params_peak_last_step"] == result["peak_bytes"]
        c = result["comm"]["collectives"]
        steps = 3
        # Psi reduce-scattered per step; Psi gathered in forward plus once more for blocks.0, which runs twice
        # and is released in between; once an order is recorded (steps 2 and 3) the step starts the next
        # forward's first gather, the root's (Note [Gathers started in the step]; no room for more under
        # max_live), so the last step's is one more; in backward every unit but the persistent root is gathered
        # again, except, from step 2 on, the forward's last unit (Note [Last unit stays for the backward]).
        assert c["reduce_scatter"]["logical_elements"] == steps * psi
        assert c["all_gather_forward"]["logical_elements"] == steps * (psi + result["block0"]) + result["persistent"]
        assert c["all_gather_backward"]["logical_elements"] == (steps * (psi - result["persistent"])
                                                                - (steps - 1) * result["last"])


class Chain(nn.Module):
    """Embedding, six blocks in a row, head: a unit per block, prefetched in order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def prefetch_worker(rank: int, world: int, zero: dict) -> dict:
    torch.manual_seed(0)
    engine = zerocore.initialize(Chain(), config(**zero))
    engine.reset_comm_stats()
    for step in range(3):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
    runtime = engine.stage3
    peak = runtime.last_step_peak_bytes // engine.compute_dtype.itemsize
    comm, params = engine.comm_report(), {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    with torch.no_grad():  # evaluations after the step (a teacher model's forwards): no backward to keep for
        for step in range(2):
            engine(data(step, rank)[0])
    evaluation_peak = runtime.peak_live_bytes // engine.compute_dtype.itemsize
    return {"peak": peak, "evaluation_peak": evaluation_peak, "psi": sum(u.numel for u in runtime.units),
            "root": next(u.numel for u in runtime.units if u.persistent),
            "block": max(u.numel for u in runtime.units if not u.persistent),
            "buckets": comm["buckets"], "collectives": comm["collectives"], "params": params}


def test_unset_prefetch_gathers_one_unit_ahead_and_a_set_budget_is_honoured():
    unset = run_ranks(prefetch_worker, 2, {})[0]
    whole = run_ranks(prefetch_worker, 2, {"stage3_prefetch_bucket_size": 10**9})[0]
    assert unset["buckets"]["prefetch_source"].startswith("default") and unset["buckets"]["prefetch_elements"] == 1
    assert whole["buckets"]["prefetch_source"] == "config: zero_optimization.stage3_prefetch_bucket_size"
    # DeepSpeed's 5e7 (or any budget above the model) gathers the whole model ahead; unset, the root stays
    # gathered and one block is ahead of the one computing (the block the step gathered ahead counts: it
    # made every later forward call start one more, three blocks at a time), and in backward the block
    # before the one computing (the forward's last block stays for the backward)
    assert whole["peak"] == whole["evaluation_peak"] == whole["psi"]
    assert unset["peak"] == unset["evaluation_peak"] == unset["root"] + 2 * unset["block"] < unset["psi"], unset
    # the same gathers, only issued later, and the same training; the last step starts the next forward's
    # gathers under the budget (Note [Gathers started in the step]): all six blocks against the first one
    elements = {which: {kind: r["collectives"][kind]["logical_elements"] for kind in
                        ("all_gather_forward", "all_gather_backward", "reduce_scatter")} for which, r in
                (("unset", unset), ("whole", whole))}
    assert elements["whole"]["all_gather_forward"] - elements["unset"]["all_gather_forward"] == 5 * unset["block"]
    for kind in ("all_gather_backward", "reduce_scatter"):
        assert elements["unset"][kind] == elements["whole"][kind]
    for name, value in unset["params"].items():
        assert value == whole["params"][name], name
    # DeepSpeed's stage3_max_live_parameters 0 (axolotl's zero3.json): nothing is prefetched, each block is
    # gathered when it runs (the root stays, the forward's last block is kept for the backward), same training
    none = run_ranks(prefetch_worker, 2, {"stage3_max_live_parameters": 0})[0]
    assert none["peak"] == none["root"] + none["block"] < unset["peak"], none
    assert none["params"] == unset["params"]


def order_change_worker(rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            if step == 1:  # an evaluation on another path (generate) gathers on demand without a warning
                model.start_with_last_block = True
                with torch.no_grad():
                    engine(data(step, rank)[0])
            model.start_with_last_block = step == 2
            engine.backward(loss_of(engine, *data(step, rank)))
            engine.step()
    # step 2 changes the order, and becomes the schedule; step 3 changes it back; step 4 follows it
    changed = [str(w.message) for w in caught if "forward order changed" in str(w.message)]
    assert len(changed) == 2, [str(w.message) for w in caught]
    assert "step 2: expected module 'blocks.0'" in changed[0] and "'blocks.2'" in changed[0]
    assert "step 3: expected module 'blocks.2'" in changed[1] and "'blocks.0' ran" in changed[1]
    # after the step: sharded, or gathering the updated values for the next forward (Note [Gathers started in
    # the step]); nothing stays gathered from before the update
    assert all(u.state.value in ("sharded", "gathering") for u in engine.stage3.units)
    return engine.stage3.order_changes


def test_order_change_warns_once_per_change_and_falls_back_to_on_demand_gathers():
    assert all(n >= 1 for n in run_ranks(order_change_worker, 2))


def gathered_worker(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    weight = model.blocks[1].linear.weight
    with zerocore.gathered([weight], modifier_rank=0):
        assert weight.shape == (DIM, DIM)
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.5)
    state = engine.full_state_dict(rank0_only=False)
    assert torch.all(state["blocks.1.linear.weight"] == 0.5)
    with zerocore.gathered(weight):  # read only
        seen = weight.detach().clone()
    assert torch.all(seen == 0.5)
    with pytest.raises(ValueError, match="no zerocore engine"):
        with zerocore.gathered(nn.Parameter(torch.zeros(2))):
            pass
    return True


def test_gathered_modifier_rank_writes_back_to_every_shard():
    assert all(run_ranks(gathered_worker, 2))


def decoding_worker(rank: int, world: int) -> list[int]:
    """Greedy decoding inside ``zerocore.gathered(model.parameters())``, rank r generating 2 + 2r tokens, as
    ``generate()`` does when sequences end at different lengths on different ranks (DeepSpeed needs
    ``synced_gpus`` there): with every unit held whole, no forward issues a collective, so nothing waits."""
    torch.manual_seed(0)
    model = Zoo()
    plain = copy.deepcopy(model)
    engine = zerocore.initialize(model, config())
    for step in range(2):  # trained first: the values decoded from are those of the shards after a step
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
    plain.load_state_dict(engine.full_state_dict(rank0_only=False))
    engine.eval()
    calls = []
    with torch.no_grad(), zerocore.gathered(model.parameters()):
        before = engine.comm_report()["collectives"]
        tokens = data(9, rank)[0][:1]
        for _ in range(2 + 2 * rank):
            logits = model(tokens)[:, -1]
            torch.testing.assert_close(logits, plain(tokens)[:, -1], rtol=0, atol=0)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        calls.append(sum(c["calls"] for c in engine.comm_report()["collectives"].values()) -
                     sum(c["calls"] for c in before.values()))
    engine.train()
    # a write on modifier_rank survives a forward inside the block (the forward does not release the unit)
    weight = model.blocks[1].linear.weight
    with zerocore.gathered([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.fill_(0.25)
        model(tokens)
    assert torch.all(engine.full_state_dict(rank0_only=False)["blocks.1.linear.weight"] == 0.25)
    # an update inside the block would leave its whole copy stale: refused on every rank, nothing changed
    engine.backward(loss_of(engine, *data(3, rank)))
    with zerocore.gathered(model.parameters()):
        with pytest.raises(RuntimeError, match=r"step\(\) inside a zerocore.gathered\(\) block"):
            engine.step()
    assert engine.global_steps == 2
    engine.step()  # and training goes on in lockstep
    # a gather that raises part-way into a block (on every rank alike) lets go of the units held so far
    real = engine.stage3.ensure_gathered

    def unreadable(unit, label):
        if unit.name == "blocks.1":
            raise OSError("unreadable parameter shard")
        real(unit, label)

    engine.stage3.ensure_gathered = unreadable
    with pytest.raises(OSError, match="unreadable"):
        with zerocore.gathered(model.parameters()):
            pass
    engine.stage3.ensure_gathered = real
    assert not any(unit.user_holds for unit in engine.stage3.units)
    engine.backward(loss_of(engine, *data(4, rank)))
    engine.step()  # not refused
    calls.append(tokens.shape[1])
    return calls


def test_decoding_inside_gathered_issues_no_collective_so_ranks_may_stop_at_different_lengths():
    assert run_ranks(decoding_worker, 2) == [[0, 7], [0, 9]]


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.inner = Block()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.proj(h)))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Outer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def nested_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    model = Nested()
    replica = copy.deepcopy(model)
    engine = zerocore.initialize(model, config(), units=[Outer, Block])
    names = [u.name for u in engine.stage3.units]
    inner = engine.stage3.units[names.index("layers.0.inner")]
    assert {id(p) for p in inner.params} == {id(p) for p in model.layers[0].inner.parameters()}
    train_beside_replica(engine, replica, rank, world, steps=4, label="nested")
    return names


def test_nested_units_given_by_class():
    for names in run_ranks(nested_worker, 2):
        assert names == ["<root>", "layers.0", "layers.0.inner", "layers.1", "layers.1.inner"]


class MoE(nn.Module):
    """A mixture of experts in a list, each token routed by its id: a rank whose tokens are all even runs
    expert 0 only, one whose tokens are all odd expert 1 only (DeepSpeed's per-module gathers hang here)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = nn.ModuleList(Block() for _ in range(3))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            chosen = route == e
            if chosen.any():
                out[chosen] = expert(h[chosen])
        return self.norm(h + out)


class MoEModel(nn.Module):
    """Each token goes to expert ``token id % routes`` of each layer."""

    def __init__(self, routes: int = 2, reuse_first: bool = False, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoE() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.routes = routes
        self.reuse_first = reuse_first  # the first layer runs again after the last (a unit called twice)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in [*self.layers, *self.layers[:1]] if self.reuse_first else self.layers:
            h = layer(h, tokens % self.routes)
        return self.head(h)


def moe_data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, target = data(step, rank)
    return tokens - tokens % 2 + rank % 2, target  # rank 0 even tokens, rank 1 odd


def moe_uneven_data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """With 3 routes: rank 0's batch reaches every expert of each layer, rank 1's only expert 0."""
    tokens, target = data(step, rank)
    return (tokens if rank == 0 else tokens - tokens % 3), target


def moe_worker(rank: int, world: int, units: list | None, uneven: bool = False, reuse_first: bool = False,
               no_sync: bool = False) -> tuple[list[str], list[str]]:
    """``no_sync``: each step's first micro-batch (its step number + 10) accumulates inside no_sync()."""
    import os
    os.environ["ZEROCORE_SHARED_MEMORY"] = "1"  # the transport that compares the ranks' collectives one by one
    batch_of = moe_uneven_data if uneven else moe_data
    torch.manual_seed(0)
    model = MoEModel(routes=3 if uneven else 2, reuse_first=reuse_first)
    reference = ReferencePair(copy.deepcopy(model), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                                                weight_decay=0.01, foreach=False))
    engine = zerocore.initialize(model, config(), units=units)
    engine.comm.set_logging(True)
    micro_batches = (10, 0) if no_sync else (0,)
    for step in range(3):
        for micro in micro_batches:
            loss = loss_of(engine, *batch_of(step + micro, rank)) / len(micro_batches)
            with engine.no_sync() if micro else contextlib.nullcontext():
                engine.backward(loss)
        engine.step()
        reference.train_step(lambda module, dtype: sum(loss_of(module, *batch_of(step + micro, r))
                                                       for r in range(world) for micro in micro_batches)
                             / (world * len(micro_batches)))
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label="moe")
    return [u.name for u in engine.stage3.units], list(engine.comm.log())


def test_a_mixture_of_experts_routing_ranks_to_other_experts_trains_with_its_layers_as_units():
    """By default the outermost repeated blocks are units: the experts, listed inside each layer, are gathered
    with it, so ranks whose tokens go to different experts still gather the same modules (Note [Stage 3
    units]); made units of their own they diverge, and the error names the way out."""
    for names, _ in run_ranks(moe_worker, 2, None):
        assert names == ["<root>", "layers.0", "layers.1"]
    errors = run_ranks(moe_worker, 2, [MoE, Block], expect_errors=True)
    for status, message in errors:
        assert status == "error" and "RanksDivergedError" in message and "units=[" in message, message


def test_a_mixture_of_experts_whose_ranks_reach_different_numbers_of_experts_issues_the_same_collectives():
    """Note [Parameters this backward will not reach]: a layer whose every expert got a gradient on rank 0
    launched its reduce-scatter at once, while rank 1's waited for experts it never ran, until the end of the
    backward: the ranks' collectives came in different orders ('different collectives' on shared memory)."""
    (_, log), (_, other) = run_ranks(moe_worker, 2, None, True)
    assert log == other


def test_a_mixture_of_experts_layer_called_twice_with_no_sync_accumulation_issues_the_same_collectives():
    """A layer run again after the last (a unit called twice) whose ranks reach different experts, with
    micro-steps inside no_sync(): the second call's backward prefetched from the unit's last call, so it
    gathered units whose backward was over, released on one rank (its batch reached all their experts) and
    still held on the other: different gathers (Note [Stage 3 prefetch plan]); and inside no_sync() such a
    unit stayed gathered to the end of the backward on the rank that missed an expert."""
    (_, log), (_, other) = run_ranks(moe_worker, 2, None, True, True, True)
    assert log == other


def reused_layer_gathers_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    engine = zerocore.initialize(MoEModel(reuse_first=True), config())
    runtime, gathers = engine.stage3, []
    gather = runtime._gather
    runtime._gather = lambda unit, label, step=None: (gathers.append((unit.name, label)), gather(unit, label, step))
    for step in range(3):
        loss = loss_of(engine, *moe_data(step, rank))
        gathers.clear()
        engine.backward(loss)
        engine.step()
    return [name for name, label in gathers if label == "all_gather_backward"]


def test_the_second_backward_of_a_unit_called_twice_prefetches_what_comes_before_its_first_call():
    """layers.0 runs first and last: the backward meets its last call first, then layers.1, then its first
    call, whose prefetch looked before its last call again and gathered layers.1 a second time (its backward
    over, released)."""
    for gathers in run_ranks(reused_layer_gathers_worker, 2):
        assert gathers.count("layers.1") == 1, gathers


def no_sync_release_worker(rank: int, world: int) -> dict[str, int]:
    torch.manual_seed(0)
    engine = zerocore.initialize(MoEModel(routes=3, layers=4), config())
    peaks = {}
    for step, kind in enumerate(("first", "synced", "no_sync")):  # (the first forward does not prefetch)
        loss = loss_of(engine, *moe_uneven_data(step, rank))
        with engine.no_sync() if kind == "no_sync" else contextlib.nullcontext():
            engine.backward(loss)
        peaks[kind] = engine.stage3.peak_live_bytes
        if kind == "no_sync":
            engine.backward(loss_of(engine, *moe_uneven_data(step + 10, rank)))
        engine.step()
    return peaks


def test_inside_no_sync_a_layer_whose_experts_this_rank_missed_is_released_when_its_backward_is_over():
    """Note [Parameters this backward will not reach]: rank 1's tokens reach one expert of three; inside
    no_sync() its layers stayed gathered to the end of the backward (every layer at once), while a synced
    backward released each when the one before it began."""
    for peaks in run_ranks(no_sync_release_worker, 2):
        assert peaks["no_sync"] == peaks["synced"], peaks


def bf16_memory_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    # Every parameter is a multiple of 64 * world elements, so Psi is exact (no layout padding).
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(3)])
    engine = zerocore.initialize(model, {**config(), "bf16": {"enabled": True}})
    engine.backward(engine(torch.randn(2, 128).bfloat16()).float().square().mean())
    engine.step()
    # no root unit here (the model's own module has no parameters): the schedule is still recorded
    assert engine.stage3.recorded_order == [u.index for u in engine.stage3.units]
    return engine.memory_report()


def test_stage3_bf16_model_state_is_16_bytes_per_param_over_n():
    psi, n = 3 * 128 * 128, 2
    for report in run_ranks(bf16_memory_worker, n):
        b = report["bytes"]
        assert report["psi"] == report["psi_padded"] == psi
        assert (b["params"], b["grads"], b["master_params"], b["optimizer_moments"]) == (
            2 * psi // n, 2 * psi // n, 4 * psi // n, 8 * psi // n)
        assert report["model_state_bytes"] == (2 + 2 + 12) * psi // n == report["formula"]["total"]
        assert b["gathered_params_live"] == 0  # at rest nothing is gathered (no root parameters here)


def close_worker(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    with pytest.raises(ValueError, match="already managed"):
        zerocore.initialize(model, config())
    expected = engine.full_state_dict(rank0_only=False)
    engine.close()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())  # whole again
    loss_of(model, *data(1, rank)).backward()  # plain use works: no hooks left
    again = zerocore.initialize(model, {**config(), "zero_optimization": {"stage": 2}})
    again.backward(loss_of(again, *data(2, rank)))
    again.step()
    return True


def test_close_hands_the_model_back_whole_and_a_new_engine_can_take_it():
    assert all(run_ranks(close_worker, 2))


def ema_worker(rank: int, world: int, stage: int) -> bool:
    """An EMA model (timm's ModelEmaV2) or a reference model deep-copied from the engine's model is a plain
    model, as under DDP (Note [Copies of an engine's model]): it carries none of the engine's hooks, so it
    evaluates on rank 0 alone (which had diverged the ranks at stage 3: the copy's hooks gathered the
    original's units), gives its state_dict() while the original is sharded, and pickles; the engine trains
    as without it."""
    finals = []
    for with_ema in (False, True):
        torch.manual_seed(0)
        model = Zoo()
        engine = zerocore.initialize(model, {**config(), "zero_optimization": {"stage": stage}})
        ema = None
        for step in range(3):
            engine.backward(loss_of(engine, *data(step, rank)))
            engine.step()
            if not with_ema:
                continue
            with zerocore.gathered(list(model.parameters())), torch.no_grad():
                if ema is None:
                    ema = copy.deepcopy(model)
                else:
                    for mine, theirs in zip(ema.parameters(), model.parameters()):
                        mine.mul_(0.5).add_(theirs, alpha=0.5)
            expected = {k: v.clone() for k, v in ema.state_dict().items()}  # the original is sharded again
            plain = Zoo()
            plain.load_state_dict(expected)
            if rank == 0:  # evaluation on one rank: no collective
                tokens = data(9, 0)[0]
                with torch.no_grad():
                    assert torch.equal(ema(tokens), plain(tokens))
                saved = io.BytesIO()
                torch.save(ema, saved)
                saved.seek(0)
                loaded = torch.load(saved, weights_only=False)
                with torch.no_grad():
                    assert torch.equal(loaded(tokens), plain(tokens))
        finals.append(engine.full_state_dict(rank0_only=False))
        engine.close()
    return all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deep_copy_of_the_model_is_a_plain_model_an_ema_evaluated_on_one_rank(stage):
    assert all(run_ranks(ema_worker, 2, stage))


def sharded_access_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    h = torch.randn(2, DIM)
    out = model.blocks[1](h)  # a unit called directly gathers itself
    assert out.shape == (2, DIM) and torch.isfinite(out).all()
    try:
        model.blocks[1].linear(h)  # a module inside a sharded unit, called on its own
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_module_run_while_sharded_raises_naming_the_parameter():
    for message in run_ranks(sharded_access_worker, 2):
        assert "blocks.1.linear.weight" in message and "zerocore.gathered" in message, message


def refusals_of(*actions: Callable[[], Any]) -> list[str]:
    """Each action's RuntimeError message, or "no error: <what it returned>"."""
    messages = []
    for action in actions:
        try:
            messages.append(f"no error: {action()!r}")
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def assert_each_names_the_weight(messages: list[str], count: int) -> None:
    assert len(messages) == count, messages
    for message in messages:
        assert "'blocks.1.linear.weight'" in message and "zerocore.gathered" in message, message


def sharded_read_worker(rank: int, world: int) -> list[str]:
    """Issue 9 item 5: a parameter read at rest (outside any gather) raises instead of computing on NaN."""
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    weight = model.blocks[1].linear.weight
    # Metadata needs no values: what optimizers, schedulers and Hugging Face's num_parameters()/dtype read.
    assert isinstance(weight, nn.Parameter) and weight.shape == (DIM, DIM) and weight.dtype == torch.float32
    assert weight.numel() == DIM * DIM and weight.requires_grad and weight.is_leaf and weight.device.type == "cpu"
    assert weight in set(model.parameters()) and "sharded by ZeRO stage 3" in repr(weight)
    messages = refusals_of(lambda: weight.sum(), lambda: torch.nn.functional.linear(torch.randn(2, DIM), weight),
                           lambda: weight.data, lambda: weight.detach(), lambda: weight[0, 0].item(),
                           lambda: copy.deepcopy(model.blocks[1]), lambda: torch.save(weight, io.BytesIO()))
    # The refusals changed nothing: training goes on and matches what the gathered values say.
    engine.backward(loss_of(engine, *data(1, rank)))
    engine.step()
    with zerocore.gathered([weight]):
        inside = weight.detach().clone()
        assert type(weight) is nn.Parameter and torch.isfinite(inside).all()
    full = engine.full_state_dict(rank0_only=False)
    assert torch.equal(full["blocks.1.linear.weight"], inside)
    engine.close()
    assert type(weight) is nn.Parameter and torch.equal(weight.detach(), inside)
    return messages


def test_reading_a_sharded_parameter_at_rest_raises_instead_of_computing_on_placeholders():
    for messages in run_ranks(sharded_read_worker, 2):
        assert_each_names_the_weight(messages, 7)


def conversion_worker(rank: int, world: int) -> list[str]:
    """A script or trainer that moves an already placed model (model.to(device), model.float()) at stage 3:
    torch returns each parameter itself, so nothing is read and the run goes on unchanged, as DeepSpeed's
    stage 3 allows it; a conversion that would change a sharded parameter still raises, naming it."""
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    weight = model.blocks[1].linear.weight
    before = engine.full_state_dict(rank0_only=False)
    for same in (lambda: model.to("cpu"), lambda: model.to(torch.float32), lambda: model.float(), lambda: model.cpu(),
                 lambda: model.to(device="cpu", dtype=torch.float32, non_blocking=True), lambda: weight.to(weight)):
        same()
    assert model.blocks[1].linear.weight is weight and "sharded by ZeRO stage 3" in repr(weight)
    after = engine.full_state_dict(rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    messages = refusals_of(lambda: weight.to(torch.float64), lambda: weight.to("cpu", copy=True),
                           lambda: weight.half(), lambda: weight.to(memory_format=torch.channels_last))
    engine.backward(loss_of(engine, *data(1, rank)))
    engine.step()
    assert all(torch.isfinite(v).all() for v in engine.full_state_dict(rank0_only=False).values())
    return messages


def test_a_conversion_to_what_a_sharded_parameter_already_is_passes_and_any_other_raises():
    for messages in run_ranks(conversion_worker, 2):
        assert_each_names_the_weight(messages, 4)


def state_dict_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config())
    engine.backward(loss_of(engine, *data(0, rank)))
    engine.step()
    try:
        model.state_dict()  # torch.save(model.state_dict()) / save_pretrained would write NaN placeholders
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    full = engine.full_state_dict(rank0_only=False)
    with zerocore.gathered(list(model.parameters())):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert inside.keys() == full.keys() and all(torch.equal(inside[k], full[k]) for k in full)
    engine.close()
    after = model.state_dict()
    assert all(torch.equal(after[k], full[k]) for k in full)
    return message


def test_state_dict_while_sharded_raises_naming_the_way_out_and_never_returns_nan():
    for message in run_ranks(state_dict_worker, 2):
        assert "full_state_dict()" in message and "engine.close()" in message and "zerocore.gathered" in message, \
            message


def test_spare_gather_storage_hands_pages_over_and_refuses_what_it_cannot():
    """Note [Spare gather storage]: a released unit's memory serves the next gather of its size, without a copy
    and with every view seeing it; past the capacity a release is freed unless freeing older, smaller spares
    makes room for it; move_storage refuses bad input."""
    from zerocore._gather_spares import GatherSpares
    from zerocore._native import _C

    spares = GatherSpares(capacity=2 * 4000)
    full = torch.arange(1000, dtype=torch.float32)
    view = full[10:20]  # a parameter's view, as autograd would save it
    spares.release(full)
    assert full.untyped_storage().nbytes() == 0 and spares.held_bytes == 4000
    other = torch.zeros(1000)
    other_address = other.data_ptr()
    spares.release(other)
    third = torch.zeros(1000)
    spares.release(third)  # past the capacity, no smaller spare to free: freed, not kept
    assert spares.held_bytes == 8000 and third.untyped_storage().nbytes() == 0
    spares.fill(full, 4000)  # the newest spare of the size: other's pages
    assert full.untyped_storage().nbytes() == 4000 and spares.held_bytes == 4000
    full.copy_(torch.arange(1000, dtype=torch.float32) * 2)
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32) * 2)  # views see the memory again
    assert full.data_ptr() == other_address  # the pages of a released buffer, not new ones
    spares.fill(third, 2000)  # no spare of that size: a fresh allocation
    assert third.untyped_storage().nbytes() == 2000 and spares.held_bytes == 4000
    larger = torch.zeros(1500)
    larger_address = larger.data_ptr()
    spares.release(third)  # 2000 bytes: fits beside the 4000 held
    spares.release(larger)  # 6000 bytes: smaller spares, oldest first, are freed until it fits (the 4000 one)
    assert spares.held_bytes == 8000 and larger.untyped_storage().nbytes() == 0
    spares.fill(larger, 6000)
    assert larger.data_ptr() == larger_address and spares.held_bytes == 2000
    huge = torch.zeros(3000)
    spares.release(huge)  # larger than the whole capacity: freed, the spare kept
    assert huge.untyped_storage().nbytes() == 0 and spares.held_bytes == 2000
    with pytest.raises(ValueError, match="must be empty"):
        _C.move_storage(full, third)
    with pytest.raises(ValueError, match="share one storage"):
        _C.move_storage(full, view)


def _emptied(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.parametrize("case", ["dst reaches past", "dst offset reaches past", "dst dtype", "src view at offset",
                                  "src view short"])
def test_move_storage_refuses_what_would_read_past_or_empty_a_base(case):
    """Finding: a dst larger than the moved bytes read past them (a crash or foreign memory), and a src view
    took its whole base's memory; each is refused, both storages left as they were."""
    from zerocore._native import _C

    base = torch.arange(8, dtype=torch.float32)
    dst, src, message = {
        "dst reaches past": (_emptied(torch.zeros(8)), torch.ones(4), "reaches 32 bytes .* only 16"),
        "dst offset reaches past": (_emptied(torch.zeros(8)[2:6]), torch.ones(4), "storage offset 2.* only 16"),
        "dst dtype": (_emptied(torch.zeros(2, dtype=torch.float64)), torch.ones(3), "not a whole number of dst's"),
        "src view at offset": (_emptied(torch.zeros(4)), base[2:6], "src must cover its whole storage"),
        "src view short": (_emptied(torch.zeros(4)), base[:4], "src must cover its whole storage"),
    }[case]
    before = src.clone()
    with pytest.raises(ValueError, match=message):
        _C.move_storage(dst, src)
    assert dst.untyped_storage().nbytes() == 0 and torch.equal(src, before)
    assert torch.equal(base, torch.arange(8, dtype=torch.float32))


def spare_reuse_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    engine = zerocore.initialize(model, {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
                                 units=[nn.Sequential])
    reference = copy.deepcopy(engine.full_state_dict(rank0_only=False))
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step + 10 * rank))
        engine.backward(engine(x).square().mean())
        report = engine.memory_report()["bytes"]  # every unit released: after the step some gather again
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    two_largest = sum(sorted((u.numel for u in engine.stage3.units), reverse=True)[:2]) * 4
    engine.close()
    return {"spares": report["gather_spares"], "bound": two_largest,
            "changed": any(not torch.equal(state[k], reference[k]) for k in state)}


def test_stage3_keeps_spares_within_two_units_and_trains():
    for result in run_ranks(spare_reuse_worker, 2):
        assert 0 < result["spares"] <= result["bound"] and result["changed"]


def gathers_after_step_worker(rank: int, world: int) -> dict:
    """Once an order is recorded, step() starts the next forward's first gathers (Note [Gathers started in the
    step]): a unit in flight is still at rest for the user (state_dict and compute raise as for a sharded one),
    a unit module called on its own lands it, and its values are the updated ones."""
    torch.manual_seed(0)
    model = Zoo()
    engine = zerocore.initialize(model, config(stage3_max_live_parameters=600))
    for step in range(2):
        engine.backward(loss_of(engine, *data(step, rank)))
        engine.step()
    states = {u.name: u.state.value for u in engine.stage3.units}
    errors = []
    for read in (lambda: model.state_dict(), lambda: model.embed.weight.sum()):
        try:
            read()
            errors.append("no error")
        except RuntimeError as error:
            errors.append(str(error))
    h = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(7))
    direct = model.blocks[0](h)  # gathers (or lands) its own unit
    full = engine.full_state_dict(rank0_only=False)
    expected = nn.functional.layer_norm(
        h + torch.tanh(nn.functional.linear(h, full["blocks.0.linear.weight"], full["blocks.0.linear.bias"])),
        (DIM,), full["blocks.0.norm.weight"], full["blocks.0.norm.bias"])
    torch.testing.assert_close(direct, expected, rtol=0, atol=0)
    before = engine.comm_report()["collectives"]["all_gather_forward"]["calls"]
    engine(data(2, rank)[0])  # the root's gather is the one already in flight
    forward_gathers = engine.comm_report()["collectives"]["all_gather_forward"]["calls"] - before
    return {"states": states, "errors": errors, "forward_gathers": forward_gathers}


def test_the_step_starts_the_next_forwards_first_gathers_and_reads_stay_right():
    for result in run_ranks(gathers_after_step_worker, 2):
        # max_live 600 leaves no room for a prefetch beside the root (384 elements): only the root is ahead
        assert result["states"] == {"<root>": "gathering", "blocks.0": "sharded", "blocks.1": "sharded",
                                    "blocks.2": "sharded"}, result
        assert "state_dict() of a ZeRO stage 3 model" in result["errors"][0], result
        assert "'embed.weight'" in result["errors"][1] and "zerocore.gathered" in result["errors"][1], result
        # blocks.0 twice (released in between), blocks.1, blocks.2; the root's came from the step
        assert result["forward_gathers"] == 4, result


