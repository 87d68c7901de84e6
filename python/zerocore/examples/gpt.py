"""The demo's model and data: a small pre-LN GPT and a deterministic synthetic English corpus.

Nothing here touches the network or the file system. The corpus comes from a tiny templated grammar
(subject-verb agreement, adjectives, places, times) generated with a fixed seed, so every rank and every
run sees the same text; a character-level tokenizer keeps the vocabulary at a few dozen symbols.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "CharTokenizer", "make_corpus", "sample_batch", "generate"]

_DETERMINERS = ["the", "a", "every", "one", "that"]
_ADJECTIVES = ["small", "old", "quiet", "bright", "happy", "lazy", "clever", "brave", "green", "tired"]
_NOUNS = {"cat": "cats", "dog": "dogs", "bird": "birds", "farmer": "farmers", "teacher": "teachers",
          "child": "children", "robot": "robots", "sailor": "sailors", "baker": "bakers", "fox": "foxes"}
_SINGULARS = sorted(_NOUNS)
_VERBS = [("sees", "see"), ("likes", "like"), ("follows", "follow"), ("helps", "help"), ("finds", "find"),
          ("watches", "watch"), ("calls", "call"), ("visits", "visit")]
_PLACES = ["in the garden", "near the river", "at the market", "on the hill", "by the old mill",
           "under the bridge", "in the kitchen"]
_TIMES = ["today", "every morning", "at night", "after lunch", "in the spring", "again"]


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    plural = rng.random() < 0.3
    noun = rng.choice(_SINGULARS)
    noun = _NOUNS[noun] if plural else noun
    det = rng.choice(["the", "two", "some", "many"]) if plural else rng.choice(_DETERMINERS)
    words = [det] + ([rng.choice(_ADJECTIVES)] if rng.random() < 0.5 else []) + [noun]
    return " ".join(words), plural


def make_corpus(sentences: int = 20_000, seed: int = 1234) -> str:
    """Deterministic templated English, one sentence per line (about 40 characters per sentence)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        subject, plural = _noun_phrase(rng)
        verb = rng.choice(_VERBS)[1 if plural else 0]
        obj, _ = _noun_phrase(rng)
        parts = [subject, verb, obj]
        if rng.random() < 0.5:
            parts.append(rng.choice(_PLACES))
        if rng.random() < 0.3:
            parts.append(rng.choice(_TIMES))
        lines.append(" ".join(parts) + ".")
    return "\n".join(lines) + "\n"


class CharTokenizer:
    """Characters to ids and back; the vocabulary is the sorted set of the text's characters."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``data``: inputs and next-token targets, each ``(batch, seq_len)``."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch, 1), generator=generator)
    windows = data[starts + torch.arange(seq_len + 1)]
    return windows[:, :-1].to(device), windows[:, 1:].to(device)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU MLP, each on a residual branch."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token embedding + learned positions, ``layers`` pre-LN blocks, final LayerNorm, and an LM head whose
    weight IS the token embedding (tied: one parameter, which the engine keeps once)."""

    def __init__(self, vocab_size: int, seq_len: int, layers: int, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"--dim ({dim}) must be divisible by --heads ({heads})")
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self.init_weights)  # a no-op on the meta device; the engine then calls init_weights

    def init_weights(self, module: nn.Module) -> None:
        """GPT-2 init of one module's own parameters: N(0, 0.02), residual projections scaled down by depth,
        zero biases, unit LayerNorms. Also the ``init_fn`` for materializing a meta-device model."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = any(module is b.proj or module is b.out for b in self.blocks)
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * len(self.blocks)) if residual else 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, t, vocab)``, or the mean cross-entropy against ``targets`` when given."""
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def generate(forward: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor, new_tokens: int, seq_len: int,
             temperature: float = 0.7, seed: int = 0) -> torch.Tensor:
    """Samples a continuation of ``idx`` (1, t) through ``forward`` (ids -> logits; the engine's forward, so
    the parameters are wherever the engine keeps them), reproducibly (a seeded CPU generator)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(new_tokens):
        logits = forward(idx[:, -seq_len:])[:, -1].float().cpu()
        probs = torch.softmax(logits / temperature, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator).to(idx.device)], dim=1)
    return idx
