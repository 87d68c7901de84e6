"""Where a training step's time goes: forward, backward and optimizer step timed separately, per rank,
for DDP (fused AdamW) and zerocore's default configs, on bench/train_step.py's model and data.

    python bench/step_phases.py [--systems ddp,zero1,zero2,zero3] [--steps 8] [--warmup 3] [--world 2]
                                [--dtype fp32|bf16]

bf16 as in bench/train_step.py: DDP's forward and loss under ``torch.autocast``, zerocore with ``bf16.enabled``.

Prints, per system, the median milliseconds of each phase on every rank (rank0/rank1/...).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, run_ranks  # noqa: E402
from _peers import ADAMW, batch, build_model, loss_of, zerocore_config  # noqa: E402

MODEL = {"layers": 6, "dim": 512, "seq": 128, "batch": 2, "vocab": 8192}


def _rank_main(rank: int, world: int, system: str, steps: int, warmup: int, dtype: str) -> dict[str, float]:
    import torch

    bf16 = dtype == "bf16"
    model = build_model(MODEL)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(wrapped.parameters(), fused=True, **ADAMW)
        autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

        def forward(x, y):
            with autocast():
                return loss_of(wrapped(x), y)

        def backward(loss) -> None:
            loss.backward()

        def step() -> None:
            opt.step()
            opt.zero_grad()
    else:
        import zerocore

        engine = zerocore.initialize(model, zerocore_config(MODEL, int(system[-1]), tuned=False, bf16=bf16))
        forward, backward, step = (lambda x, y: loss_of(engine(x), y)), engine.backward, engine.step
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for i in range(warmup + steps):
        x, y = batch(MODEL, i, rank)
        t0 = time.perf_counter()
        loss = forward(x, y)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        if i >= warmup:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                phases[name].append(seconds)
    return {name: 1e3 * median(values) for name, values in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="ddp,zero1,zero2,zero3")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    for system in args.systems.split(","):
        results: list[dict[str, Any]] = run_ranks(_rank_main, args.world, system, args.steps, args.warmup, args.dtype,
                                                  timeout=600)
        print(f"{system:6s} " + "  ".join(
            f"{name} " + "/".join(f"{r[name]:.0f}" for r in results) + " ms" for name in results[0]))


if __name__ == "__main__":
    main()
