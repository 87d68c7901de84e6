"""What launching gradient buckets in the first backward's completion order saves (Note [Bucket launch order] in
cpp/include/zerocore/ready_tracker.hpp) on a model laid out as Hugging Face's Llama: each layer registers its
norms after the projections they run before. Stage 2, the same run with the order learned and kept at the
reverse layout, alternating: the reducer's pool after the last step and at its peak (the first backward), and
the median step time of the slowest rank.

    python bench/launch_order.py [--world 2] [--width 256] [--layers 4] [--bucket 50000] [--steps 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import run_header, run_ranks


def step_worker(rank: int, world: int, learns: bool, width: int, layers: int, bucket: int,
                steps: int) -> tuple[float, int, int]:
    """The median step time after two warm-up steps, the pool's bytes after the last step and at its peak."""
    import torch
    from torch import nn

    import zerocore

    class Layer(nn.Module):  # Llama's order: the projections first, then the norms they run after
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
            self.gate, self.up = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, 3 * width, bias=False)
            self.down = nn.Linear(3 * width, width, bias=False)
            self.input_norm, self.post_norm = nn.LayerNorm(width), nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.input_norm(x)
            weights = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / width ** 0.5, dim=-1)
            x = x + self.o(weights @ self.v(h))
            h = self.post_norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    torch.manual_seed(0)
    model = nn.Sequential(*(Layer() for _ in range(layers)))
    engine = zerocore.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                         "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket}})
    engine.gradients.learns_launch_order = learns
    x = torch.randn(2, 64, width, generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        times.append(time.perf_counter() - start)
    pool, peak = engine.reducer.buffer_bytes, engine.reducer.peak_buffer_bytes
    engine.close()
    return statistics.median(times[2:]), pool, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket", type=int, default=50_000, help="reduce_bucket_size, elements")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after two warm-up ones)")
    parser.add_argument("--rounds", type=int, default=2, help="each round runs the fixed order, then the learned one")
    args = parser.parse_args()
    header = run_header({"world": args.world, "width": args.width, "layers": args.layers, "bucket": args.bucket})
    print(f"{header['command']}  ({header['date']})")
    print("round  order    step ms  pool after MiB  pool peak MiB")
    for rnd in range(args.rounds):
        for learns in (False, True):
            out = run_ranks(step_worker, args.world, learns, args.width, args.layers, args.bucket, args.steps)
            step = max(t for t, _, _ in out)
            print(f"{rnd:5d}  {'learned' if learns else 'fixed':7s}  {step * 1e3:7.1f}  {out[0][1] / 2**20:14.2f}  "
                  f"{out[0][2] / 2**20:13.2f}", flush=True)


if __name__ == "__main__":
    main()
