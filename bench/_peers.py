"""The model, the data and every system of ``bench/train_step.py``, built on one rank.

``build_trainer(system, model, cfg, world, dtype)`` wraps a freshly built model for one system and returns a
``Trainer``: ``trainer.step(x, y)`` runs forward + loss + backward + optimizer step (+ zero_grad) and returns
the loss. Why each peer is configured the way it is, is written in train_step.py's docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
# every system clips the gradient norm at 1.0: DeepSpeed's default since 0.19 (and so zerocore's, which the
# default configs leave to it) and Hugging Face Trainer's max_grad_norm
CLIP = 1.0

# name -> label; zeroN is zerocore's default config, zeroN_tuned the hand-tuned one.
SYSTEMS = {
    "ddp": "DDP(gradient_as_bucket_view) + torch AdamW(fused)",
    "torch_zero": "DDP(gradient_as_bucket_view) + ZeroRedundancyOptimizer(torch AdamW(fused), "
                  "parameters_as_bucket_view)",
    "fsdp2": "FSDP2 fully_shard per block + root (default resharding) + torch AdamW(fused)",
    "ds_zero0": "DeepSpeed stage 0 (plain data parallelism) + torch AdamW(fused) client optimizer",
    "ds_zero1": "DeepSpeed ZeRO-1 (default buckets) + torch AdamW(fused) client optimizer",
    "ds_zero2": "DeepSpeed ZeRO-2 (default buckets) + torch AdamW(fused) client optimizer",
    "ds_zero3": "DeepSpeed ZeRO-3 (default buckets) + torch AdamW(fused) client optimizer",
    "zero1": "zerocore stage 1, default config (stage + optimizer only) + zerocore CPUAdam",
    "zero1_tuned": "zerocore stage 1, tuned: --bucket reduce/allgather buckets + zerocore CPUAdam",
    "zero2": "zerocore stage 2, default config + zerocore CPUAdam",
    "zero2_tuned": "zerocore stage 2, tuned: --bucket buckets + zerocore CPUAdam",
    "zero3": "zerocore stage 3, default config (a unit per block) + zerocore CPUAdam",
    "zero3_tuned": "zerocore stage 3, tuned: --bucket buckets (a unit per block) + zerocore CPUAdam",
    # the default config with the bytes through Gloo's sockets instead of shared memory: the algorithms "auto"
    # falls back to across hosts (Note [Shared-memory collectives])
    "zero1_gloo": "zerocore stage 1, default config, Gloo transport (send_recv + broadcast) + zerocore CPUAdam",
    "zero2_gloo": "zerocore stage 2, default config, Gloo transport (send_recv + broadcast) + zerocore CPUAdam",
    "zero3_gloo": "zerocore stage 3, default config, Gloo transport (send_recv + broadcast) + zerocore CPUAdam",
}
GLOO_TRANSPORT = {"reduce_scatter": "send_recv", "all_gather": "broadcast"}
DEEPSPEED_SYSTEMS = ("ds_zero0", "ds_zero1", "ds_zero2", "ds_zero3")
PRECISION = {
    "fp32": "fp32 everywhere",
    "bf16": "ddp/torch_zero: torch.autocast('cpu', bf16) around forward+loss, fp32 params/grads/all-reduce/AdamW; "
            "fsdp2: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); zerocore: bf16.enabled (bf16 "
            "params/grads, fp32 reduce and master weights); DeepSpeed: bf16.enabled (bf16 params/grads, bf16 "
            "reduce -- its default communication_data_type under bf16 -- fp32 master weights)",
}


# ---- the model and the data ---------------------------------------------------------------------------------
def build_model(cfg: dict[str, Any]):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
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
            b, t, c = x.shape
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab: int, seq: int, dim: int, layers: int) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block(dim, max(1, dim // 64)) for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    model = GPT(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["layers"])
    if cfg.get("freeze"):  # a partial fine-tune: embeddings and every block's linear layers frozen
        for module in [model.tok, model.pos] + [m for b in model.blocks for m in (b.qkv, b.proj, b.fc, b.out)]:
            module.requires_grad_(False)
    return model


def batch(cfg: dict[str, Any], step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(logits, y):
    """Cross-entropy in fp32 for every system (torch.autocast runs it in fp32 too), so losses compare."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---- configs ------------------------------------------------------------------------------------------------
def _optimizer_block() -> dict[str, Any]:
    return {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                                        "weight_decay": ADAMW["weight_decay"]}}


def zerocore_config(cfg: dict[str, Any], stage: int, tuned: bool, bf16: bool) -> dict[str, Any]:
    """default: what a user writes -- the stage and the optimizer, nothing else (plus bf16 when asked).
    tuned: the hand-picked config (explicit batch keys, --bucket reduce/allgather buckets)."""
    config: dict[str, Any] = {"optimizer": _optimizer_block(), "zero_optimization": {"stage": stage}}
    if tuned:
        config.update({"train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
                       "gradient_clipping": CLIP})
        config["zero_optimization"].update(reduce_bucket_size=cfg["bucket"], allgather_bucket_size=cfg["bucket"])
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def deepspeed_config(cfg: dict[str, Any], stage: int, bf16: bool) -> dict[str, Any]:
    """DeepSpeed's defaults for everything but what it requires (a batch size) and what the client optimizer
    needs (zero_allow_untested_optimizer); steps_per_print only silences its periodic log line."""
    return {"train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9}


# ---- one system on one rank ---------------------------------------------------------------------------------
class Trainer:
    def __init__(self, step: Callable[[Any, Any], Any], engine: Any = None) -> None:
        self.step = step
        self.engine = engine  # zerocore's engine (comm/memory reports), else None


def _torch_trainer(module: Any, opt: Any, autocast: Callable[[], Any]) -> Trainer:
    """A plain torch step: forward and loss (under ``autocast``), backward, the gradient norm clipped at
    ``CLIP`` (foreach), optimizer step, zero_grad."""
    import torch

    def step(x, y):
        with autocast():
            loss = loss_of(module(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP, foreach=True)
        opt.step()
        opt.zero_grad()
        return loss
    return Trainer(step)


def build_trainer(system: str, model: Any, cfg: dict[str, Any], world: int, dtype: str) -> Trainer:
    import contextlib

    import torch

    bf16 = dtype == "bf16"

    def fused_adamw(params):
        return torch.optim.AdamW(params, fused=True, **ADAMW)

    if system in ("ddp", "torch_zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, gradient_as_bucket_view=True)
        if system == "ddp":
            opt = fused_adamw(wrapped.parameters())
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW,
                                          parameters_as_bucket_view=True, fused=True, **ADAMW)
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        return _torch_trainer(wrapped, opt, autocast)

    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
                     else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        return _torch_trainer(model, fused_adamw(model.parameters()), contextlib.nullcontext)

    if system in SYSTEMS and system.startswith("zero"):
        import zerocore

        tuned = system.endswith("_tuned")
        config = zerocore_config(cfg, int(system[4]), tuned, bf16)
        algorithms = cfg["comm_algorithms"] if tuned else GLOO_TRANSPORT if system.endswith("_gloo") else None
        engine = zerocore.initialize(model, config, comm_algorithms=algorithms)
    elif system in DEEPSPEED_SYSTEMS:
        import sys

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with contextlib.redirect_stdout(sys.stderr):  # its "op built" prints would break --json on stdout
            import deepspeed

            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=fused_adamw(model.parameters()),
                                                   config=deepspeed_config(cfg, int(system[-1]), bf16))
    else:
        raise ValueError(f"unknown system {system!r}")

    def step(x, y):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss
    return Trainer(step, engine if system.startswith("zero") else None)


def deepspeed_status() -> tuple[str | None, str]:
    """(version, "") when ``import deepspeed`` works in this interpreter, else (None, why not)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None, "`import deepspeed` finds no module in this interpreter"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as exc:  # noqa: BLE001 - any import failure means "skip", with its reason
        return None, f"`import deepspeed` failed: {type(exc).__name__}: {exc}"
    return deepspeed.__version__, ""
