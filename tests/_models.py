"""Small models for the engine tests, built identically on every rank from a seed."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            # bias=False: the key bias gets an exactly-zero true gradient (softmax is shift-invariant), so Adam
            # would amplify rounding noise in it and no elementwise comparison could be meaningful.
            nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, bias=False)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class OddParams(nn.Module):
    """Tied embedding/head, a frozen layer, an unused layer and a one-element parameter."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(dim, dim)
        self.unused = nn.Linear(dim, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(tokens)))
        h = self.hidden(h) * self.scale
        return self.head(h)


class ResidualBlock(nn.Module):
    """h + down(tanh(up(h))), width 8: a block models repeat (stage 3 units) in the DeepSpeed-module tests."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "transformer": TinyTransformer, "odd": OddParams}[name]()


def batch(name: str, generator: torch.Generator, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "mlp":
        return torch.randn(size, 12, generator=generator), torch.randn(size, 5, generator=generator)
    vocab = 50 if name == "transformer" else 20
    tokens = torch.randint(0, vocab, (size, 6), generator=generator)
    return tokens, torch.randint(0, vocab, (size, 6), generator=generator)


def loss_fn(name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output = output.to(torch.promote_types(output.dtype, torch.float32))  # bf16/fp16 up to fp32; fp64 stays
    if name == "mlp":
        return nn.functional.mse_loss(output, target.to(output.dtype))
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
