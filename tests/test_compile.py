"""torch.compile with the engine: blocks compiled before initialize (torchtitan's way with FSDP2) and DeepSpeed's
engine.compile() after it, at every stage, train as the uncompiled model does (bitwise with aot_eager), with
the gather and release hooks outside the compiled code and one graph for all blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class CompiledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(16, 32), nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.down(torch.relu(self.up(h))))


def compiled_units_worker(rank: int, world: int, how: str, stage: int = 3) -> dict:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    blocks = [CompiledBlock() for _ in range(torch._dynamo.config.recompile_limit + 2)]
    if how == "wrapped":  # torchtitan's way with FSDP2: each block compiled before sharding
        blocks = [torch.compile(block, backend="aot_eager") for block in blocks]
    elif how == "in place":
        for block in blocks:
            block.compile(backend="aot_eager")
    model = nn.Sequential(nn.Linear(4, 16), nn.Sequential(*blocks), nn.Linear(16, 1))
    if how == "engine":
        model.forward = model.forward  # an instance forward, as Accelerate's output cast leaves: still compiled
    if how == "whole before":  # the compiled model handed to initialize, run through the engine
        model = torch.compile(model, backend="aot_eager")
    engine = zerocore.initialize(model, {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                         "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                                               # stages 1-2: a block's gathers land on its own
                                                               "allgather_bucket_size": 600,
                                                               "reduce_bucket_size": 600}})
    compiled = []
    if how == "engine":  # DeepSpeed's engine.compile(), as Accelerate calls it
        # fullgraph: no graph break inside a unit's forward (nor in the whole module at stages 1-2)
        engine.compile(backend="aot_eager", compile_kwargs={"fullgraph": True})
        engine.compile(backend="aot_eager")  # again: nothing more
        compiled = engine._compiled_modules
        assert engine.is_compiled
    run = engine
    if how == "whole after":  # compiled after initialize and called directly
        run = torch.compile(model, backend="aot_eager")
    elif how == "whole in place":
        model.compile(backend="aot_eager")
    losses = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            loss = run(x).square().mean()
        except Exception as error:  # noqa: BLE001 - dynamo wraps it in its own error type
            return {"error": str(error)}
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {k.replace("_orig_mod.", ""): v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}
    return {"losses": losses, "state": state, "graphs": counters["frames"]["ok"], "compiled": compiled,
            "unique_graphs": counters["stats"]["unique_graphs"]}  # (frames are not counted under fullgraph)


def test_units_compiled_one_by_one_train_as_uncompiled_with_one_graph_for_all():
    """Each unit compiled before initialize keeps the gather hooks outside the compiled code. Tracing the
    stage-3 parameter lookup had specialized the graph on each parameter's id: one graph per block, and the
    blocks past torch._dynamo's recompile limit ran uncompiled."""
    compiled = run_ranks(compiled_units_worker, 2, "wrapped", timeout=240)
    eager = run_ranks(compiled_units_worker, 2, "eager", timeout=120)
    assert compiled[0]["graphs"] == 1, compiled[0]["graphs"]
    assert compiled[0]["losses"] == eager[0]["losses"] and compiled[0]["state"] == eager[0]["state"]
    in_place = run_ranks(compiled_units_worker, 2, "in place", timeout=240)[0]  # the hooks break its graph
    assert "error" not in in_place, in_place
    assert in_place["losses"] == eager[0]["losses"] and in_place["state"] == eager[0]["state"]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("how", ["whole after", "whole before", "whole in place"])
def test_a_whole_model_compiled_trains_as_uncompiled(how, stage):
    """torch.compile(model) of the whole model, after initialize (called directly) or before it, or
    model.compile(). Stage 3's gather and release hooks run eagerly between graphs (Note [Hooks outside
    compiled code]), each block's forward compiled with its parameters gathered; it had failed tracing the
    gather hooks. At stages 1-2 the step's all-gathers land before a compiled forward; dynamo had refused the
    landing on first read. The blocks share their graphs: a graph per block would pass torch._dynamo's
    recompile limit and leave the rest eager."""
    compiled = run_ranks(compiled_units_worker, 2, how, stage, timeout=240)
    eager = run_ranks(compiled_units_worker, 2, "eager", stage, timeout=120)
    assert "error" not in compiled[0], compiled[0]
    assert compiled[0]["losses"] == eager[0]["losses"] and compiled[0]["state"] == eager[0]["state"]
    assert 1 <= compiled[0]["unique_graphs"] <= 4, compiled[0]["unique_graphs"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_compile_trains_as_uncompiled(stage):
    """engine.compile() (DeepSpeed's, which Accelerate calls) after initialize: at stage 3 each block's forward
    is compiled with the hooks outside it, one graph for all blocks, the root left eager; at stages 1-2 the
    whole module, whose forward then lands the step's gathers first. Same losses and parameters as eager."""
    compiled = run_ranks(compiled_units_worker, 2, "engine", stage, timeout=240)
    eager = run_ranks(compiled_units_worker, 2, "eager", stage, timeout=120)
    assert "error" not in compiled[0], compiled[0]
    blocks = torch._dynamo.config.recompile_limit + 2
    if stage == 3:
        assert compiled[0]["compiled"] == [f"1.{i}" for i in range(blocks)], compiled[0]["compiled"]
        assert compiled[0]["unique_graphs"] == 1, compiled[0]["unique_graphs"]
    else:
        assert compiled[0]["compiled"] == [""] and compiled[0]["unique_graphs"] >= 1, compiled[0]
    assert compiled[0]["losses"] == eager[0]["losses"] and compiled[0]["state"] == eager[0]["state"]


@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_blocks_at_stages_1_and_2_train_past_the_first_step(stage):
    """After step() the parameters' all-gathers land on first read (Note [Gathers land on first read]), which
    compiled code cannot do (dynamo failed tracing the landing at the third forward): a model with compiled
    code lands them before each forward."""
    compiled = run_ranks(compiled_units_worker, 2, "wrapped", stage, timeout=240)
    eager = run_ranks(compiled_units_worker, 2, "eager", stage, timeout=120)
    assert "error" not in compiled[0], compiled[0]
    assert compiled[0]["losses"] == eager[0]["losses"]


class Head(nn.Module):
    """Reads the first block's weight, which is another unit's: a read outside that unit's forward."""

    def __init__(self, blocks: nn.ModuleList, eager: bool) -> None:
        super().__init__()
        self.blocks, self.eager = [blocks], eager  # (a list: the blocks are not this module's children)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.eager:
            return self.read_eagerly(h)
        return nn.functional.linear(h, self.blocks[0][0].up.weight)

    @torch.compiler.disable
    def read_eagerly(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h, self.blocks[0][0].up.weight)


class ReadsAnotherUnit(nn.Module):
    def __init__(self, eager_head: bool) -> None:
        super().__init__()
        self.first = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(CompiledBlock() for _ in range(3))
        self.head = Head(self.blocks, eager_head)
        self.last = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for block in self.blocks:
            h = block(h)
        return self.last(self.head(h))


def external_read_worker(rank: int, world: int, eager_head: bool, compiled: bool) -> dict:
    torch.manual_seed(0)
    model = ReadsAnotherUnit(eager_head)
    engine = zerocore.initialize(model, {"gradient_clipping": 0.0, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    run = torch.compile(model, backend="aot_eager") if compiled else model
    losses = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            loss = run(x).square().mean()
        except Exception as error:  # noqa: BLE001 - dynamo wraps it in its own error type
            # caught, the run goes on uncompiled, as a script falling back to eager would
            losses.append(str(error))
            run = model
            loss = run(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.tolist() for k, v in engine.full_state_dict(rank0_only=False).items()}}


def test_a_weight_of_another_unit_read_in_compiled_code_is_refused_and_read_eagerly_it_trains():
    """Only uncompiled code gathers a parameter read outside its unit's forward (Note [External parameters]):
    in compiled code the read is refused on every rank, naming the parameter and the ways out, never computed
    on the placeholder, and the run goes on uncompiled; the reading code kept out of the compiled code with
    torch.compiler.disable trains as the uncompiled model does."""
    eager = run_ranks(external_read_worker, 2, False, False, timeout=120)
    for result, expected in zip(run_ranks(external_read_worker, 2, False, True, timeout=240), eager):
        message = result["losses"][0]
        assert "'blocks.0.up.weight'" in message and "torch.compiler.disable" in message, message
        assert result["losses"][1:] == expected["losses"] and result["state"] == expected["state"]
    disabled = run_ranks(external_read_worker, 2, True, True, timeout=240)[0]
    assert disabled["losses"] == run_ranks(external_read_worker, 2, True, False, timeout=120)[0]["losses"]


def compile_refusals_worker(rank: int, world: int) -> list[str]:
    engine = zerocore.initialize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), {"zero_optimization": {"stage": 3}})
    errors = []
    for kwargs in ({"schedule": [(0, "pass")]}, {"compiled_autograd_enabled": True},
                   {"compile_kwargs": {"backend": "eager"}}):
        try:
            engine.compile(**kwargs)
        except ValueError as error:
            errors.append(str(error))
    assert not engine.is_compiled
    engine.close()
    try:
        engine.compile()
    except RuntimeError as error:
        errors.append(str(error))
    return errors


def test_engine_compile_refuses_what_it_does_not_do_before_compiling_anything():
    errors = run_ranks(compile_refusals_worker, 1, timeout=60)[0]
    assert len(errors) == 4, errors
    assert "DeepCompile" in errors[0] and "compiled_autograd_enabled" in errors[1] and "backend=" in errors[2], errors
    assert "compile()" in errors[3], errors
