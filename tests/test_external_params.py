"""Stage 3 external parameters (issue 9, item 13; Note [External parameters] in _stage3.py): a parameter
used outside its unit's own forward is gathered for as long as it is used, and training matches a
replicated model within the fp32 reference's rounding noise."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from _dist import run_ranks
from _parity import ReferencePair

pytestmark = pytest.mark.timeout(300)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.extra = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, nn.Parameter]:
        return torch.tanh(self.fc(h)), self.extra  # hands out its own parameter


class Parent(nn.Module):
    """Reads its children's weights directly, adds a bias a child returned, and reads a ModuleList item's
    weight from the parent: all across unit boundaries."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.proj.weight, self.proj.bias)  # proj's own forward never runs
        for block in self.blocks:
            out, extra = block(h)
            h = out + extra
        h = h + F.linear(h, self.blocks[0].fc.weight)  # block 0's weight again, after block 0 was released
        return h


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def external_worker(rank: int, world: int, units: str, checkpointed: bool) -> bool:
    torch.manual_seed(0)
    model = Parent()
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                                                                 foreach=False))
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    chosen = {"default": None, "blocks": [Block], "every": [Block, nn.Linear]}[units]
    engine = zerocore.initialize(model, config, units=chosen)
    if checkpointed:
        forward = model.forward
        model.forward = lambda x: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)
    for step in range(4):
        x, y = _data(step, rank)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        reference.train_step(lambda module, dtype: sum(F.mse_loss(module(_data(step, r)[0].to(dtype)),
                                                                  _data(step, r)[1].to(dtype))
                                                       for r in range(world)) / world)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=units)
    with torch.no_grad():  # inference: the pinned units are released when the forward ends
        engine.eval()
        x, _ = _data(9, 0)
        torch.testing.assert_close(engine(x), reference.fp32.eval()(x), rtol=1e-4, atol=1e-5)
        kept = sum(u.numel for u in engine.stage3.units if u.persistent)  # the root unit, if it owns parameters
        assert engine.stage3.live_elements == kept
    return True


@pytest.mark.parametrize("units,checkpointed", [("default", False), ("blocks", False), ("every", False),
                                                 ("every", True)])
def test_parameters_used_outside_their_unit_match_a_replicated_model(units, checkpointed):
    assert all(run_ranks(external_worker, 2, units, checkpointed))


# ---- a pending backward's pinned units, and unit outputs pytree does not see ----------------------------------
@dataclasses.dataclass
class BlockOutput:  # not registered with pytree: a leaf to it
    hidden: torch.Tensor
    extra: torch.Tensor


class MappingOutput(dict):  # a dict subclass: a leaf to pytree too
    pass


class OutputBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(8, 8)
        self.cache: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> Any:
        out = torch.tanh(self.fc(h))
        if self.kind == "dataclass":
            return BlockOutput(out, out * 0.5)
        if self.kind == "mapping":
            return MappingOutput(hidden=out)
        self.cache = out  # a side channel: the unit returns nothing
        return None


class OutputNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OutputBlock(kind) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            out = block(h)
            h = {"dataclass": lambda: out.hidden + out.extra, "mapping": lambda: out["hidden"],
                 "side channel": lambda: block.cache}[block.kind]()
        return h + F.linear(h, self.blocks[0].fc.weight)  # an external parameter read as well


def flows_worker(rank: int, world: int, flow: str) -> bool:
    torch.manual_seed(0)
    kind = flow if flow in ("dataclass", "mapping", "side channel") else "dataclass"
    model = OutputNet(kind)
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                                                                 foreach=False))
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "gradient_accumulation_steps": 2 if flow == "retain_graph" else 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = zerocore.initialize(model, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = _data(step, rank)
            loss = F.mse_loss(engine(x), y)
            if flow == "eval between":  # a no-grad forward (a logged metric) before the training backward
                with torch.no_grad():
                    engine(x)
            if flow == "retain_graph":  # the same graph back-propagated twice in one window
                engine.backward(loss, retain_graph=True)
                engine.step()
            engine.backward(loss)
            engine.step()
            reference.train_step(lambda module, dtype: sum(F.mse_loss(module(_data(step, r)[0].to(dtype)),
                                                                      _data(step, r)[1].to(dtype))
                                                           for r in range(world)) / world)
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label=flow)
    unseen = [str(w.message) for w in caught if "returned no tensor that requires grad" in str(w.message)]
    assert len(unseen) == (3 if flow == "side channel" else 0), unseen  # once per unit
    return True


@pytest.mark.parametrize("flow", ["eval between", "retain_graph", "dataclass", "mapping", "side channel"])
def test_pinned_units_outlive_an_eval_forward_and_a_retained_graph_and_any_output_type(flow):
    assert all(run_ranks(flows_worker, 2, flow))
