"""What ``data_types.grad_accum_dtype: "fp32"`` costs in bf16 training (Note [fp32 gradient accumulation]): the time
of an accumulation window (``--micro-steps`` forward + backward + step()) with gradients summed in bf16 and in fp32,
at each stage, in the same run, alternating, and the gradient bytes memory_report() counts for each.

    python bench/grad_accum_dtype.py [--world 2] [--micro-steps 4] [--windows 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import run_header, run_ranks


def window_worker(rank: int, world: int, stage: int, fp32: bool, micro_steps: int, windows: int, width: int,
                  layers: int) -> tuple[float, int]:
    """The median window time after two warm-up windows, and this rank's gradient bytes."""
    import torch
    from torch import nn

    import zerocore

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    config = {"bf16": {"enabled": True}, "gradient_accumulation_steps": micro_steps,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if fp32:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine = zerocore.initialize(model, config)
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(rank)).bfloat16()
    times = []
    for _ in range(windows + 2):
        start = time.perf_counter()
        for _ in range(micro_steps):
            engine.backward(engine(x).float().square().mean())
            engine.step()
        times.append(time.perf_counter() - start)
    grads = engine.memory_report()["bytes"]["grads"]
    engine.close()
    return statistics.median(times[2:]), grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--micro-steps", type=int, default=4)
    parser.add_argument("--windows", type=int, default=8, help="timed windows (after two warm-up ones)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs bf16 then fp32 accumulation per stage")
    args = parser.parse_args()
    header = run_header({"world": args.world, "micro_steps": args.micro_steps})
    print(f"{header['command']}  ({header['date']})")
    print("stage  round  bf16 ms/window  fp32 ms/window  fp32 / bf16  grads bf16 MiB  grads fp32 MiB")
    for rnd in range(args.rounds):
        for stage in (1, 2, 3):
            row = []
            for fp32 in (False, True):
                out = run_ranks(window_worker, args.world, stage, fp32, args.micro_steps, args.windows, args.width,
                                args.layers)
                row.append((max(t for t, _ in out), out[0][1]))  # the slowest rank's window
            (bf16_t, bf16_g), (fp32_t, fp32_g) = row
            print(f"{stage:5d}  {rnd:5d}  {bf16_t * 1e3:14.1f}  {fp32_t * 1e3:14.1f}  {fp32_t / bf16_t:11.3f}  "
                  f"{bf16_g / 2**20:14.1f}  {fp32_g / 2**20:14.1f}", flush=True)


if __name__ == "__main__":
    main()
