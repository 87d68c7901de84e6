"""Layer kinds the other parity tests do not cover, at stages 1-3 against DDP + AdamW (tests/_parity.py's
rule), world 2: recurrent layers (whose forward reads its parameters through ``_flat_weights``), convolutions
with BatchNorm and GroupNorm, ``nn.MultiheadAttention`` and ``nn.TransformerDecoder`` (fused in-projection
weights read directly), ``weight_norm``, ``spectral_norm`` and ``orthogonal`` parametrizations (parameters
under ``parametrizations.``, spectral_norm's buffers updated by every training forward), a
``ParameterList`` and ``ParameterDict``. Between steps an evaluation runs under ``torch.inference_mode()``
(Lightning's validation loop); after training, an evaluation forward (BatchNorm's running statistics, rank 0's
by DDP's rule) is compared by the same rule against DDP's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerocore
from _dist import run_ranks
from _parity import FACTOR, FLOOR, ReferencePair, as_dtype, relative_distance

pytestmark = pytest.mark.timeout(600)

VOCAB = 50


class Recurrent(nn.Module):
    def __init__(self, kind: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = kind(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ConvBlock(8), ConvBlock(8), ConvBlock(8))
        self.norm = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.blocks(self.stem(x))).mean((2, 3)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        # bias=False: an attention key bias has an exactly-zero true gradient (tests/_parity.py)
        self.layers = nn.ModuleList([nn.MultiheadAttention(32, 4, batch_first=True, bias=False) for _ in range(3)])
        self.norms = nn.ModuleList([nn.LayerNorm(32) for _ in range(3)])
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for attention, norm in zip(self.layers, self.norms):
            h = norm(h + attention(h, h, h, need_weights=False)[0])
        return self.head(h)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True, bias=False)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.decoder(h, h))


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)) for _ in range(3)])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


class Reparametrized(nn.Module):
    """Parametrizations that keep state or constrain the weight: spectral_norm's power iteration updates its
    buffers _u and _v in every training forward (and an evaluation forward reads them), orthogonal maps its
    ``original`` through a matrix exponential."""

    def __init__(self) -> None:
        super().__init__()
        self.spectral = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))
        self.orthogonal = nn.utils.parametrizations.orthogonal(nn.Linear(16, 16), orthogonal_map="matrix_exp")
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.orthogonal(torch.tanh(self.spectral(x)))))


class ParameterContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(16, 16) * 0.2) for _ in range(3)])
        self.extra = nn.ParameterDict({"bias": nn.Parameter(torch.randn(16) * 0.1),
                                       "out": nn.Parameter(torch.randn(16, 4) * 0.2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights:
            x = torch.tanh(x @ weight + self.extra["bias"])
        return x @ self.extra["out"]


class Conv1dTranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 5, padding=2)
        self.norm = nn.BatchNorm1d(8)
        self.up = nn.ConvTranspose1d(8, 4, 4, stride=2, padding=1)
        self.out_norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(self.up(F.gelu(self.norm(self.conv(x)))))


def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (4, 8), generator=g)
    return x, (x * 7 + 3) % VOCAB


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# name: (model, batch of a generator, loss)
Batch = Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
ZOO: dict[str, tuple[Callable[[], nn.Module], Batch, Callable[..., torch.Tensor]]] = {
    "lstm": (lambda: Recurrent(nn.LSTM), tokens, token_loss),
    "gru": (lambda: Recurrent(nn.GRU), tokens, token_loss),
    "resnet": (ResNetLike, lambda g: (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)),
               F.cross_entropy),
    "attention": (Attention, tokens, token_loss),
    "decoder": (Decoder, tokens, token_loss),
    "weight_norm": (WeightNormed, lambda g: (torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)),
                    F.mse_loss),
    "reparametrized": (Reparametrized, lambda g: (torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)),
                       F.mse_loss),
    "parameter_containers": (ParameterContainers,
                             lambda g: (torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)), F.mse_loss),
    "conv1d_transpose": (Conv1dTranspose,
                         lambda g: (torch.randn(4, 4, 16, generator=g), torch.randn(4, 4, 32, generator=g)),
                         F.mse_loss),
}


def zoo_worker(rank: int, world: int, stage: int) -> list[str]:
    done = []
    for name, (make, make_batch, loss_fn) in ZOO.items():
        torch.manual_seed(0)
        model = make()
        reference = ReferencePair(
            model, lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01, foreach=False), wrap=DDP)
        engine = zerocore.initialize(model, {
            "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500}})
        for step in range(5):
            x, y = make_batch(torch.Generator().manual_seed(1000 * step + rank))
            if step == 3:  # an evaluation between steps under inference_mode (Lightning's validation loop)
                engine.eval()
                with torch.inference_mode():
                    assert torch.isfinite(engine(x)).all()
                engine.train()
                for module in reference.modules:  # the reference's forward broadcasts rank 0's buffers too
                    module.eval()
                    with torch.no_grad():
                        module(as_dtype(x, next(module.parameters()).dtype))
                    module.train()
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            ref_loss, _ = reference.train_step(
                lambda module, dtype: loss_fn(module(as_dtype(x, dtype)), as_dtype(y, dtype)))
            torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        reference.assert_matches(engine.full_state_dict(rank0_only=False), label=f"{name}, stage {stage}")
        engine.eval()
        outputs = []
        for module in (engine, *reference.modules):
            module.eval()
            with torch.inference_mode():
                outputs.append(module(as_dtype(x, torch.float64) if module is reference.modules[1] else x))
        ours, fp32 = (relative_distance(o, outputs[2]) for o in outputs[:2])
        assert ours <= FACTOR * fp32 + FLOOR, f"{name}, stage {stage}: evaluation output {ours:.3g} from the float64 " \
                                              f"run against DDP's {fp32:.3g}"
        engine.close()
        done.append(name)
    return done


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_layer_kinds_match_ddp(stage: int) -> None:
    for done in run_ranks(zoo_worker, 2, stage, timeout=500):
        assert done == list(ZOO)
