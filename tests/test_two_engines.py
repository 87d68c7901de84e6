"""Two engines in one process, as a GAN trains them (DeepSpeed's DCGAN tutorial: one engine per network).

The generator's loss is computed through the discriminator, so its backward reaches the discriminator's
parameters too. Torch would accumulate those into ``.grad``; an engine's gradients belong to its own
backward's reductions, so they are refused with the way out (freeze the other network for that backward, as
the tutorial says), on every rank, and both engines train on. The discriminator's two losses (real and fake
batches) back-propagated one after the other go through ``no_sync()``; a gradient penalty takes
``torch.autograd.grad(create_graph=True)`` through the discriminator inside its loss. Each case trains
against two DDP + AdamW references (the parity rule of tests/_parity.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _parity import ReferencePair

pytestmark = pytest.mark.timeout(300)


class Residual(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)
        self.outer = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class Net(nn.Module):
    """Repeated blocks, so stage 3 makes units of them."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, 16)
        self.blocks = nn.ModuleList([Residual(), Residual()])
        self.out = nn.Linear(16, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def gradient_penalty(discriminator: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    mix = torch.rand(real.shape[0], 1, generator=torch.Generator().manual_seed(7)).to(real.dtype)
    points = (mix * real + (1 - mix) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(discriminator(points).sum(), points, create_graph=True)
    return ((grad.norm(dim=1) - 1) ** 2).mean()


def discriminator_losses(discriminator: nn.Module, real: torch.Tensor, fake: torch.Tensor,
                         penalty: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fake_loss = F.softplus(discriminator(fake)).mean()
    if penalty:
        fake_loss = fake_loss + gradient_penalty(discriminator, real, fake)
    return F.softplus(-discriminator(real)).mean(), fake_loss


def set_trainable(model: nn.Module, trainable: bool) -> None:
    for param in model.parameters():
        param.requires_grad_(trainable)


def gan_worker(rank: int, world: int, stage_g: int, stage_d: int, penalty: bool) -> list[str]:
    torch.manual_seed(0)
    generator, discriminator = Net(4, 8), Net(8, 1)
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)  # noqa: E731
    ref_g = ReferencePair(generator, adamw, wrap=DDP)
    ref_d = ReferencePair(discriminator, adamw, wrap=DDP)

    def config(stage: int) -> dict:
        return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300}}

    engine_g = zerocore.initialize(generator, config(stage_g))
    engine_d = zerocore.initialize(discriminator, config(stage_d))
    refusals = []
    for step in range(4):
        batches = torch.Generator().manual_seed(1000 * step + rank)
        z, real = torch.randn(6, 4, generator=batches), torch.randn(6, 8, generator=batches)

        # The discriminator: real and fake losses back-propagated one after the other, one update.
        fake = engine_g(z).detach()
        with engine_d.no_sync():
            real_loss, _ = discriminator_losses(engine_d, real, fake, penalty)
            engine_d.backward(real_loss)
        _, fake_loss = discriminator_losses(engine_d, real, fake, penalty)
        engine_d.backward(fake_loss)
        engine_d.step()
        for k, dtype in enumerate((torch.float32, torch.float64)):
            ref_fake = ref_g.modules[k](z.to(dtype)).detach()
            ref_real_loss, ref_fake_loss = discriminator_losses(ref_d.modules[k], real.to(dtype), ref_fake, penalty)
            (ref_real_loss + ref_fake_loss).backward()
            ref_d.optimizers[k].step()
            ref_d.optimizers[k].zero_grad()
            if k == 0:
                torch.testing.assert_close(real_loss.detach() + fake_loss.detach(),
                                           (ref_real_loss + ref_fake_loss).detach(), rtol=1e-4, atol=1e-6)

        # The generator, first as the DCGAN code writes it: its loss reaches the discriminator's parameters.
        with pytest.raises(RuntimeError, match="another engine's backward") as refused:
            engine_g.backward(F.softplus(-engine_d(engine_g(z))).mean())
        refusals.append(str(refused.value))
        # Then as DeepSpeed's tutorial says: the discriminator frozen for the generator's backward.
        set_trainable(discriminator, False)
        g_loss = F.softplus(-engine_d(engine_g(z))).mean()
        engine_g.backward(g_loss)
        engine_g.step()
        set_trainable(discriminator, True)
        for k, dtype in enumerate((torch.float32, torch.float64)):
            set_trainable(ref_d.models[k], False)
            ref_loss = F.softplus(-ref_d.modules[k](ref_g.modules[k](z.to(dtype)))).mean()
            ref_loss.backward()
            ref_g.optimizers[k].step()
            ref_g.optimizers[k].zero_grad()
            set_trainable(ref_d.models[k], True)
            if k == 0:
                torch.testing.assert_close(g_loss.detach(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    ref_g.assert_matches(engine_g.full_state_dict(rank0_only=False), label="generator")
    ref_d.assert_matches(engine_d.full_state_dict(rank0_only=False), label="discriminator")
    engine_g.close()
    engine_d.close()
    return refusals


@pytest.mark.parametrize("stage_g,stage_d,penalty", [(1, 1, False), (2, 3, True), (3, 2, False), (3, 3, True)])
def test_gan_with_two_engines(stage_g: int, stage_d: int, penalty: bool) -> None:
    for refusals in run_ranks(gan_worker, 2, stage_g, stage_d, penalty, timeout=240):
        assert len(refusals) == 4
        # names the discriminator's parameter and the fix
        assert all("'out.bias'" in message and "requires_grad_(False)" in message for message in refusals)


def stray_backward_worker(rank: int, world: int, stage: int) -> str:
    model = Net(4, 1)
    engine = zerocore.initialize(model, {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                         "zero_optimization": {"stage": stage}})
    with pytest.raises(RuntimeError, match="outside engine.backward") as refused:
        engine(torch.randn(3, 4)).sum().backward()
    engine.close()
    return str(refused.value)


def test_a_plain_loss_backward_is_named_as_such() -> None:
    """With no other engine in backward, the refusal keeps saying to call engine.backward()."""
    for message in run_ranks(stray_backward_worker, 2, 3, timeout=120):
        assert "another engine" not in message and "instead of loss.backward()" in message


def shared_frozen_worker(rank: int, world: int, stage: int) -> str:
    """Two networks over one frozen encoder, each its own engine: stages 1-2 hold the encoder whole and no engine
    changes it, so the second engine may take it; a shared trainable parameter is refused."""
    torch.manual_seed(0)
    encoder = nn.Linear(8, 8).requires_grad_(False)
    first, second = nn.Sequential(encoder, nn.Linear(8, 1)), nn.Sequential(encoder, nn.Linear(8, 1))
    config = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    engines = [zerocore.initialize(first, config), zerocore.initialize(second, config)]
    for engine in engines:
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    with pytest.raises(ValueError, match="already managed by another zerocore engine") as refused:
        zerocore.initialize(nn.Sequential(first[1]), config)
    return str(refused.value)


@pytest.mark.parametrize("stage", [1, 2])
def test_two_engines_may_share_a_frozen_module_held_whole_but_not_a_trained_one(stage: int) -> None:
    for message in run_ranks(shared_frozen_worker, 2, stage):
        assert "'0.weight'" in message
