"""Stage 3 when parts of a model run on their own: a tower that only the ranks whose batch needs it run
(units= the blocks every rank runs, against DDP's find_unused_parameters), and a model's own methods that run
parts of it without its forward (Note [Modules of persistent units run on their own] in _stage3_access.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _parity import ReferencePair
from test_stage3 import DIM, VOCAB, Block, config, data

pytestmark = pytest.mark.timeout(300)


class VisionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.linear(h))


class VisionLanguage(nn.Module):
    """A vision tower that only the ranks whose batch has an image run (LLaVA-style), before text blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.vision = nn.ModuleList(VisionBlock() for _ in range(2))
        self.project = nn.Linear(DIM, DIM)
        self.text = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        if image is not None:
            for block in self.vision:
                image = block(image)
            h = torch.cat([self.project(image), h], dim=1)
        for block in self.text:
            h = block(h)
        return self.head(h)[:, -tokens.shape[1]:]


def vision_language_worker(rank: int, world: int, units: list | None) -> list[str]:
    torch.manual_seed(0)
    model = VisionLanguage()
    reference = ReferencePair(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01,
                                                                 foreach=False),
                              wrap=lambda m: DDP(m, find_unused_parameters=True))
    engine = zerocore.initialize(model, config(), units=units)
    for step in range(4):
        tokens, target = data(step, rank)
        # rank 0 has an image at even steps, rank 1 at odd ones: every step one rank skips the tower
        image = torch.randn(tokens.shape[0], 3, DIM, generator=torch.Generator().manual_seed(step)) \
            if (rank + step) % 2 == 0 else None
        loss = nn.functional.cross_entropy(engine(tokens, image).reshape(-1, VOCAB), target.reshape(-1))
        engine.backward(loss)
        engine.step()
        reference.train_step(lambda module, dtype: nn.functional.cross_entropy(
            module(tokens, None if image is None else image.to(dtype)).reshape(-1, VOCAB), target.reshape(-1)))
    reference.assert_matches(engine.full_state_dict(rank0_only=False), label="vision tower on some ranks")
    return [u.name for u in engine.stage3.units]


def test_a_tower_that_some_ranks_skip_trains_outside_the_units_as_ddp_with_unused_parameters():
    """A vision tower run only where the batch has an image: as a unit (the default: its blocks repeat) the
    ranks diverge, and the error names the way out; with units=[the text blocks] it stays gathered with the
    root, the ranks that skip it reduce zeros for its gradients, and training matches DDP's
    find_unused_parameters."""
    errors = run_ranks(vision_language_worker, 2, None, expect_errors=True)
    for status, message in errors:
        assert status == "error" and "RanksDivergedError" in message and "units=[TheTextBlockClass]" in message, \
            message
    for names in run_ranks(vision_language_worker, 2, [Block]):
        assert names == ["<root>", "text.0", "text.1", "text.2"]


class TwoTower(nn.Module):
    """CLIP's shape: two towers of units, their embeddings and projections in the root, and methods that
    run one tower (get_text_features / get_image_features) without the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.patch = nn.Linear(8, DIM)
        self.text = nn.ModuleList(Block() for _ in range(2))
        self.vision = nn.ModuleList(Block() for _ in range(2))
        self.text_projection = nn.Linear(DIM, 8, bias=False)
        self.image_projection = nn.Linear(DIM, 8, bias=False)

    def text_features(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.text:
            h = block(h)
        return self.text_projection(h.mean(1))

    def image_features(self, patches: torch.Tensor) -> torch.Tensor:
        h = self.patch(patches)
        for block in self.vision:
            h = block(h)
        return self.image_projection(h.mean(1))


class ContrastiveLoss(nn.Module):
    """The user's loss over the model's feature methods (a module, so DDP can wrap the reference)."""

    def __init__(self, model: TwoTower) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        text = nn.functional.normalize(self.model.text_features(tokens), dim=-1)
        image = nn.functional.normalize(self.model.image_features(patches), dim=-1)
        logits = 10.0 * text @ image.T
        labels = torch.arange(len(text))
        return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2


def feature_methods_worker(rank: int, world: int, qwz: bool) -> bool:
    torch.manual_seed(0)
    model = TwoTower()
    reference = ReferencePair(ContrastiveLoss(model), lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, weight_decay=0.01, foreach=False), wrap=DDP)
    engine = zerocore.initialize(model, config(zero_quantized_weights=qwz))
    probe = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():  # before any forward or step: the root is sharded
        before = model.image_features(probe)
        if not qwz:
            torch.testing.assert_close(before, reference.models[0].model.image_features(probe))
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens, patches = torch.randint(0, VOCAB, (4, 5), generator=g), torch.randn(4, 6, 8, generator=g)
        loss = ContrastiveLoss(model)(tokens, patches)
        engine.backward(loss)
        engine.step()
        reference_loss, _ = reference.train_step(lambda module, dtype: module(tokens, patches.to(dtype)))
        if not qwz:
            torch.testing.assert_close(loss.detach(), reference_loss, rtol=1e-5, atol=1e-6)
    if not qwz:
        reference.assert_matches({f"model.{k}": v for k, v in engine.full_state_dict(rank0_only=False).items()},
                                 label="feature methods")
    return True


@pytest.mark.parametrize("qwz", [False, True])
def test_a_models_own_methods_gather_the_root_they_run(qwz: bool) -> None:
    """Note [Modules of persistent units run on their own]: the embeddings and projections that the feature
    methods run are the root's; they gather it when it is sharded (before any forward, after a step's update)
    instead of refusing, and training through the methods matches DDP (with qwZ: it runs)."""
    assert all(run_ranks(feature_methods_worker, 2, qwz))
