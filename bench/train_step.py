"""Training-step time and peak RSS of one GPT-style model under DDP, torch's ZeRO, FSDP2 and zerocore, on Gloo.

    python bench/train_step.py [--world 2] [--steps 12] [--warmup 3] [--layers 6 --dim 512 --seq 128 --batch 2]
                               [--vocab 8192] [--only ddp,torch_zero,fsdp2,zero1,zero2,zero3,ds_zero2] [--rounds 1]
                               [--timeout 900] [--json]

The model: token embedding + learned positions, ``--layers`` pre-LN blocks (causal attention through
F.scaled_dot_product_attention, GELU MLP of 4*dim), final LayerNorm and an untied LM head; fp32, built from
seed 0 identically on every rank. The defaults (6 layers, d=512, vocab 8192, seq 128) give ~27.4M parameters.
Every rank trains on its own random tokens (seeded by step and rank, the same for every system), so the
losses of all systems should agree to fp32 rounding -- printed as a sanity check.

Systems (all AdamW, lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01, no clipping):
  ddp        DistributedDataParallel + torch.optim.AdamW (default implementation)
  torch_zero DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  fsdp2      fully_shard on every block, then on the root (reshard_after_forward=True) + AdamW
  zero1      zerocore stage 1 (DeepSpeed-style dict; reduce/allgather bucket --bucket elements)
  zero2      zerocore stage 2 (same)
  zero3      zerocore stage 3 (same; the model's blocks are the units of gathering)
  ds_zero2   DeepSpeed ZeRO-2, only when ``import deepspeed`` works (otherwise skipped with a note)

Each system runs alone in a fresh set of ``--world`` spawned rank processes (1 intra-op and 1 inter-op thread
each), one system at a time; with ``--rounds R`` the whole sequence runs R times, alternating its order.
A step is forward + backward + optimizer step (+ zero_grad); its time is the slowest rank's, and the table
shows the median over the ``--steps`` steps after ``--warmup`` (pooled over rounds), its ratio to DDP, the
per-rank RSS right after the model was built (the baseline: interpreter + torch + the model), and the
per-rank peak RSS (ru_maxrss) at the end of training (max over ranks and rounds).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (BenchError, current_rss_mib, format_table, median, peak_rss_mib, print_header,  # noqa: E402
                     run_header, run_ranks)

SYSTEMS = {
    "ddp": "DDP + AdamW",
    "torch_zero": "DDP + ZeroRedundancyOptimizer(AdamW)",
    "fsdp2": "FSDP2 fully_shard (per block + root)",
    "zero1": "zerocore stage 1",
    "zero2": "zerocore stage 2",
    "zero3": "zerocore stage 3 (a unit per block)",
    "ds_zero2": "DeepSpeed ZeRO-2",
}
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


# ---- the model ----------------------------------------------------------------------------------------------
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
    return GPT(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["layers"])


def _batch(cfg: dict[str, Any], step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# ---- one system on one rank ---------------------------------------------------------------------------------
def _zerocore_config(cfg: dict[str, Any], stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]),
                                                  "eps": ADAMW["eps"], "weight_decay": ADAMW["weight_decay"]}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": cfg["bucket"],
                              "allgather_bucket_size": cfg["bucket"]},
    }


def _rank_main(rank: int, world: int, system: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    model = build_model(cfg)
    rss_build = current_rss_mib()
    peak_build = peak_rss_mib()
    extra: dict[str, Any] = {}
    engine = None

    def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    if system in ("ddp", "torch_zero"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model)
        if system == "ddp":
            opt = torch.optim.AdamW(wrapped.parameters(), **ADAMW)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    elif system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        wrapped = model
        opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    elif system in ("zero1", "zero2", "zero3"):
        import zerocore

        engine = zerocore.initialize(model, _zerocore_config(cfg, int(system[-1])),
                                     comm_algorithms=cfg["comm_algorithms"])
    elif system == "ds_zero2":  # only reached when `import deepspeed` works; not exercised on this machine
        import deepspeed

        ds_config = _zerocore_config(cfg, 2)
        ds_config["optimizer"]["type"] = "AdamW"
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    else:
        raise ValueError(f"unknown system {system!r}")

    total = cfg["warmup"] + cfg["steps"]
    times: list[float] = []
    losses: list[float] = []
    dist.barrier()
    for step in range(total):
        if engine is not None and step == cfg["warmup"] and hasattr(engine, "reset_comm_stats"):
            engine.reset_comm_stats()
        x, y = _batch(cfg, step, rank)
        t0 = time.perf_counter()
        if engine is not None:
            loss = loss_of(engine(x), y)
            engine.backward(loss)
            engine.step()
        else:
            loss = loss_of(wrapped(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    if engine is not None and hasattr(engine, "comm_report"):
        report = engine.comm_report()
        extra["comm"] = {"algorithms": report["algorithms"], "collectives_measured_steps": report["collectives"]}
        extra["model_state_bytes"] = engine.memory_report()["model_state_bytes"]
    dist.barrier()
    return {"times": times, "losses": losses, "rss_build_mib": rss_build, "peak_rss_build_mib": peak_build,
            "peak_rss_mib": peak_rss_mib(), **extra}


# ---- the driver ---------------------------------------------------------------------------------------------
def _count_params(cfg: dict[str, Any]) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def _summarize(system: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any]) -> dict[str, Any]:
    """runs: per round, the per-rank results."""
    measured: list[float] = []
    per_round: list[float] = []
    for ranks in runs:
        slowest = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))][cfg["warmup"]:]
        measured += slowest
        per_round.append(median(slowest))
    last = runs[-1]
    mean_loss = [sum(r["losses"][i] for r in last) / len(last) for i in range(len(last[0]["losses"]))]
    out = {
        "system": system,
        "label": SYSTEMS[system],
        "median_step_ms": 1e3 * median(measured),
        "min_step_ms": 1e3 * min(measured),
        "per_round_median_ms": [1e3 * m for m in per_round],
        "rss_build_mib": [max(run[r]["rss_build_mib"] for run in runs) for r in range(len(last))],
        "peak_rss_mib": [max(run[r]["peak_rss_mib"] for run in runs) for r in range(len(last))],
        "loss_first": mean_loss[0],
        "loss_last": mean_loss[-1],
    }
    if "comm" in last[0]:
        out["comm"] = last[0]["comm"]
        out["model_state_bytes"] = [r["model_state_bytes"] for r in last]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket", type=float, default=6.5e6,
                        help="zerocore reduce/allgather bucket, elements (default ~25 MiB of fp32, like DDP's bucket)")
    parser.add_argument("--rs-algo", default="auto", help="zerocore reduce_scatter algorithm")
    parser.add_argument("--ag-algo", default="auto", help="zerocore all_gather algorithm")
    parser.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the sequence, alternating its order")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per system run before it is killed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    if args.dim % max(1, args.dim // 64):
        parser.error("--dim must divide into heads of 64 (or be < 64)")
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
           "steps": args.steps, "warmup": args.warmup, "bucket": int(args.bucket),
           "comm_algorithms": {"reduce_scatter": args.rs_algo, "all_gather": args.ag_algo}}
    notes: list[str] = []
    if "ds_zero2" in systems and importlib.util.find_spec("deepspeed") is None:
        systems.remove("ds_zero2")
        notes.append("ds_zero2 skipped: `import deepspeed` is not available in this environment")
    params = _count_params(cfg)
    header = run_header({"world": args.world, "model": {k: cfg[k] for k in ("layers", "dim", "seq", "batch", "vocab")},
                         "params": params, "dtype": "fp32", "steps": args.steps, "warmup": args.warmup,
                         "rounds": args.rounds, "zerocore_bucket_elements": cfg["bucket"],
                         "optimizer": "AdamW " + ", ".join(f"{k}={v}" for k, v in ADAMW.items())})

    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    failures: dict[str, str] = {}
    for round_index in range(args.rounds):
        order = systems if round_index % 2 == 0 else list(reversed(systems))
        for system in order:
            if system in failures:
                continue
            print(f"... round {round_index + 1}/{args.rounds}: {system}", file=sys.stderr, flush=True)
            try:
                runs[system].append(run_ranks(_rank_main, args.world, system, cfg, timeout=args.timeout))
            except BenchError as exc:
                failures[system] = str(exc)
                print(f"!!! {system} failed:\n{exc}", file=sys.stderr, flush=True)

    results = [_summarize(s, runs[s], cfg) for s in systems if runs[s] and s not in failures]
    ddp = next((r for r in results if r["system"] == "ddp"), None)
    for r in results:
        r["ratio_to_ddp"] = r["median_step_ms"] / ddp["median_step_ms"] if ddp else None
    for s, message in failures.items():
        notes.append(f"{s} failed: {message.strip().splitlines()[-1][:200]}")

    if args.json:
        print(json.dumps({"header": header, "results": results, "failures": failures, "notes": notes}, indent=1))
        return
    print_header(header)
    rows = []
    for r in results:
        ratio = f"{r['ratio_to_ddp']:.2f}" if r["ratio_to_ddp"] else "n/a"
        algos = r.get("comm", {}).get("algorithms")
        rows.append([r["system"], r["label"], f"{r['median_step_ms']:.1f}", ratio,
                     "/".join(f"{v:.0f}" for v in r["rss_build_mib"]),
                     "/".join(f"{v:.0f}" for v in r["peak_rss_mib"]),
                     "/".join(f"{p - b:.0f}" for p, b in zip(r["peak_rss_mib"], r["rss_build_mib"])),
                     f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
                     f"rs={algos['reduce_scatter']} ag={algos['all_gather']}" if algos else "-"])
    print(format_table(["system", "what", "median step ms", "x DDP", "RSS after build MiB", "peak RSS MiB",
                        "peak - build MiB", "mean loss first -> last", "zerocore algorithms"], rows, left=2))
    print("# RSS columns: per rank (rank0/rank1/...); step time: slowest rank, median of measured steps")
    for r in results:
        if "comm" in r:
            per_op = ", ".join(f"{op}: {s['calls']} calls / {s['backend_calls']} backend calls / "
                               f"{s['algorithm_bytes'] / 2**20:.1f} MiB sent"
                               for op, s in r["comm"]["collectives_measured_steps"].items())
            states = "/".join(f"{b / 2**20:.0f}" for b in r["model_state_bytes"])
            print(f"# {r['system']} comm_report over {args.steps} measured steps (rank 0): {per_op}; "
                  f"model state MiB per rank: {states}")
    for note in notes:
        print(f"# note: {note}")


if __name__ == "__main__":
    main()
