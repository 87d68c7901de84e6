"""ZeRO-Offload's copies on a GPU (Note [Offload copies]): the step of bf16 training with
``offload_optimizer: cpu``, its copies on two streams of their own against every copy on the current stream
(the CPU waiting for each), alternating in one process; median step and the step's share of it.

    python bench/offload_copies.py [--params 2e8] [--stage 2] [--steps 6] [--rounds 2] [--json-out FILE]

Needs a CUDA device (bench/gpu_check.sh runs it); NCCL at world size 1. The model is a stack of square
Linear layers (``--params`` elements); every system sees the same batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import zerocore
from zerocore._host_copies import StreamCopies


class CurrentStreamCopies:
    """The baseline: the copies on the current stream, the CPU waiting for each copy to the host."""

    def __init__(self, device: torch.device) -> None:
        pass

    def to_host(self, pairs):
        for dst, src in pairs:
            dst.copy_(src)

    def wait_on_host(self, ticket) -> None:
        pass

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


def run(copies: type, width: int, layers: int, stage: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    engine = zerocore.initialize(model, config)
    engine.optimizer_state.copies_type = copies
    generator = torch.Generator().manual_seed(1)
    step_times, totals = [], []
    for index in range(steps + 2):  # two warm-up steps
        x = torch.randn(8, width, generator=generator).cuda().bfloat16()  # the model's dtype under bf16
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.backward(engine(x).float().square().mean())
        torch.cuda.synchronize()
        before_step = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        end = time.perf_counter()
        if index >= 2:
            step_times.append(end - before_step)
            totals.append(end - start)
    assert isinstance(engine.optimizer_state._copies, copies)
    engine.close()
    return {"step_s": statistics.median(step_times), "iteration_s": statistics.median(totals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=2e8)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/offload_copies.py needs a CUDA device")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    width = 2048
    layers = max(1, round(args.params / (width * width + width)))
    results: dict[str, list[dict]] = {"streams": [], "current stream": []}
    for _ in range(args.rounds):
        for name, copies in (("streams", StreamCopies), ("current stream", CurrentStreamCopies)):
            results[name].append(run(copies, width, layers, args.stage, args.steps))
    summary = {name: {key: statistics.median(r[key] for r in rows) for key in ("step_s", "iteration_s")}
               for name, rows in results.items()}
    params = layers * (width * width + width)
    for name, row in summary.items():
        print(f"offload copies on {name:<15} step {row['step_s'] * 1e3:8.1f} ms  iteration "
              f"{row['iteration_s'] * 1e3:8.1f} ms  ({params / 1e6:.0f}M params, stage {args.stage}, bf16)")
    ratio = summary["streams"]["step_s"] / summary["current stream"]["step_s"]
    print(f"step time, streams / current stream: {ratio:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"params": params, "stage": args.stage, "summary": summary, "runs": results,
                       "step_ratio": ratio}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
