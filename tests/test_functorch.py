"""torch.func transforms through the engine (Note [torch.func transforms]): grad, vjp, jacrev, jacfwd, jvp,
hessian and vmap of ``engine(...)``, losses built from them trained by ``engine.backward``, and per-sample
gradients with ``functional_call``: stages 1-3 give what the same calls give on a plain replicated model,
and a rank-dependent branch inside a transform still raises on every rank (Note [Divergence tags])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)
DIM = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.tanh(self.linear(h)))


class Net(nn.Module):
    """Three repeated blocks (stage-3 units, gathered and released around every use) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 3)
        self.register_buffer("scale", torch.full((3,), 0.5))
        self.extra_block_on_rank: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for index, block in enumerate(self.blocks):
            h = block(h)
            if index == 1 and self.extra_block_on_rank is not None and dist.get_rank() == self.extra_block_on_rank:
                h = block(h)  # a rank-dependent branch: breaks the SPMD contract
        return self.head(h) * self.scale


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def config(stage: int) -> dict:
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def inputs(rank: int, step: int = 0) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def square_sum(model, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


def _vjp_of_ones(model, x: torch.Tensor) -> torch.Tensor:
    out, vjp_fn = torch.func.vjp(model, x)
    return vjp_fn(torch.ones_like(out))[0]


def _one_step_matches_reference(engine, reference: nn.Module, x: torch.Tensor, world: int) -> None:
    """One training step of the engine equals the replicated model's (on the rank-averaged loss)."""
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    engine.backward(square_sum(engine, x))
    engine.step()
    (sum(square_sum(reference, inputs(r)) for r in range(world)) / world).backward()
    optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), reference(x), **TOL)


TRANSFORMS = {
    "grad": lambda model, x: torch.func.grad(lambda x: square_sum(model, x))(x),
    "vjp": lambda model, x: _vjp_of_ones(model, x),
    "jacrev": lambda model, x: torch.func.jacrev(model)(x[0]),
    "jacfwd": lambda model, x: torch.func.jacfwd(model)(x[0]),
    "jvp": lambda model, x: torch.func.jvp(model, (x,), (torch.ones_like(x),))[1],
    "hessian": lambda model, x: torch.func.hessian(lambda x: square_sum(model, x))(x[0]),
    "vmap": lambda model, x: torch.func.vmap(model)(x),
    "vmap_grad": lambda model, x: torch.func.vmap(torch.func.grad(lambda xi: square_sum(model, xi[None])))(x),
}


def transforms_worker(rank: int, world: int, stage: int) -> bool:
    reference = build()
    engine = zerocore.initialize(build(), config(stage))
    x = inputs(rank)
    for name, transform in TRANSFORMS.items():
        torch.testing.assert_close(transform(engine, x), transform(reference, x), **TOL, msg=name)
    # The engine is still a training engine afterwards: one step equals the replicated model's.
    _one_step_matches_reference(engine, reference, x, world)
    if engine.stage3 is not None:  # every unit sharded again at the step
        assert all(unit.state.value == "sharded" or unit.persistent for unit in engine.stage3.units)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_transforms_of_the_engine_equal_the_replicated_model(stage):
    assert all(run_ranks(transforms_worker, 2, stage))


def _penalty(model, x):  # an input-gradient penalty: a loss built from a torch.func.grad result
    gx = torch.func.grad(lambda x: square_sum(model, x))(x)
    return square_sum(model, x) + gx.square().sum()


def _nested(model, x):
    gg = torch.func.grad(lambda x: torch.func.grad(lambda y: square_sum(model, y))(x).sin().sum())(x)
    return square_sum(model, x) + gg.square().sum()


def _vjp_penalty(model, x):
    out, fn = torch.func.vjp(model, x)
    return out.square().sum() + fn(torch.ones_like(out))[0].square().sum()


LOSSES = {
    "vmap": lambda model, x: torch.func.vmap(model)(x).square().sum(),
    "vmap_per_sample": lambda model, x: torch.func.vmap(lambda xi: square_sum(model, xi[None]))(x).sum(),
    "grad_penalty": _penalty,
    "nested_grad": _nested,
    "vjp_penalty": _vjp_penalty,
}


def training_worker(rank: int, world: int, stage: int, name: str) -> bool:
    loss_of = LOSSES[name]
    reference = build()
    engine = zerocore.initialize(build(), config(stage))
    engine.broadcast_buffers = False  # several forwards per backward (DDP's in-forward broadcast would bump versions)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(2):
        engine.backward(loss_of(engine, inputs(rank, step)))
        engine.step()
        optimizer.zero_grad()
        (sum(loss_of(reference, inputs(r, step)) for r in range(world)) / world).backward()
        optimizer.step()
        with torch.no_grad():
            torch.testing.assert_close(engine(inputs(rank, 9)), reference(inputs(rank, 9)), **TOL)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_losses_built_with_transforms_train_like_the_replicated_model(stage):
    for name in LOSSES:  # one process pair per loss keeps every case's engine fresh
        assert all(run_ranks(training_worker, 2, stage, name)), name


def per_sample_worker(rank: int, world: int, stage: int) -> bool:
    reference = build()
    engine = zerocore.initialize(build(), config(stage))
    model = engine.module
    with zerocore.gathered(list(model.parameters())):
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(module, params, xi):
        return torch.func.functional_call(module, (params, buffers), (xi[None],)).square().sum()

    x = inputs(rank)
    grads = torch.func.vmap(torch.func.grad(lambda p, xi: loss(model, p, xi)), in_dims=(None, 0))(params, x)
    expected_params = {name: p.detach() for name, p in reference.named_parameters()}
    expected = torch.func.vmap(torch.func.grad(lambda p, xi: loss(reference, p, xi)), in_dims=(None, 0))(
        expected_params, x)
    assert grads.keys() == expected.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], **TOL, msg=name)
    # and the engine still trains as the replicated model afterwards
    _one_step_matches_reference(engine, reference, x, world)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_sample_gradients_with_functional_call_equal_the_replicated_model(stage):
    assert all(run_ranks(per_sample_worker, 2, stage))


def divergence_worker(rank: int, world: int, strict: bool, transform: str) -> str:
    model = build()
    engine = zerocore.initialize(model, config(3), strict_spmd=strict)
    model.extra_block_on_rank = 1
    try:
        TRANSFORMS[transform](engine, inputs(rank))
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_rank_dependent_branch_inside_a_transform_raises_on_every_rank(strict, transform):
    for message in run_ranks(divergence_worker, 2, strict, transform, timeout=120):
        assert "diverged at step 0" in message and "rank 1" in message and "blocks." in message, message
