"""Parameter offload (issue 11): stage 3 with ``offload_param: {device: nvme}`` against the same training with
the parameter shards in memory, in the same run; the optimizer state is on NVMe in both (ZeRO-Infinity's
usual pairing), so the difference is the parameter shards alone.

    python bench/param_offload.py [--world 2] [--dtype bf16|fp32] [--layers 16 --dim 1024 --seq 64 --batch 1
                                  --vocab 8192] [--steps 6] [--warmup 2] [--dir DIR] [--json]

The model is the GPT of ``_peers.py`` (16 layers of d=1024, vocabulary 8192 by default: 218.4M parameters);
``stage3_param_persistence_threshold: 0`` so that every block is its own unit, sharded at rest (the root
unit, embeddings and head, always stays gathered in stage 3). Two systems, each in its own fresh ``--world``
Gloo rank processes: ``params_in_memory`` and ``params_on_nvme`` (``max_in_cpu: 0``: every shard to the file).
Per system: the median training step (forward + backward + ``step()``, the slowest rank's), the peak RSS
during the training steps (``VmHWM`` reset once the engine is built), ``memory_report()``'s parameter bytes
and parameter-file figures (file size, bytes read and written per step, gathers served by the read-ahead),
and the final losses (they must be equal: the offload is bitwise). The expected RSS saving is the in-memory
shards' bytes minus the two aligned I/O buffers of the largest shard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    current_rss_mib,
    format_table,
    median,
    print_header,
    reset_hwm,
    run_header,
    run_ranks,
    vm_hwm_mib,
)
from _peers import batch, build_model, loss_of, zerocore_config

SYSTEMS = ("params_in_memory", "params_on_nvme")


def _config(system: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    config = zerocore_config(cfg, 3, False, cfg["dtype"] == "bf16")
    zero = config["zero_optimization"]
    zero.update(stage3_param_persistence_threshold=0, sub_group_size=5e7,
                offload_optimizer={"device": "nvme", "nvme_path": root})
    if system == "params_on_nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}
    config["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1}
    return config


def _rank_main(rank: int, world: int, system: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import zerocore

    engine = zerocore.initialize(build_model(cfg), _config(system, cfg, root))
    out: dict[str, Any] = {"rss_init_mib": current_rss_mib()}
    reset_hwm()  # VmHWM from here: the training steps alone
    times, losses, moved = [], [], []
    dist.barrier()
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = batch(cfg, step, rank)
        before = engine.memory_report()["nvme"]
        t0 = time.perf_counter()
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        after = engine.memory_report()["nvme"]
        moved.append((after["param_bytes_read"] - before["param_bytes_read"],
                      after["param_bytes_written"] - before["param_bytes_written"]))
    out["peak_train_mib"] = vm_hwm_mib()
    report = engine.memory_report()
    out.update(times=times, losses=losses, moved=moved, params_bytes=report["bytes"]["params"],
               buffers=report["bytes"]["nvme_param_buffers"], nvme=report["nvme"])
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dir", default=None, help="directory for the NVMe files (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
           "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup}
    header = run_header({"world": args.world, **cfg})
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for system in SYSTEMS:
            ranks = run_ranks(_rank_main, args.world, system, cfg, root, timeout=1800)
            steps = [max(r["times"][i] for r in ranks) for i in range(args.warmup, args.warmup + args.steps)]
            results[system] = {
                "step_s": median(steps), "peak_train_mib": [round(r["peak_train_mib"]) for r in ranks],
                "params_bytes": [r["params_bytes"] for r in ranks], "buffers": [r["buffers"] for r in ranks],
                "param_file_bytes": [r["nvme"]["param_file_bytes"] for r in ranks],
                "read_per_step": median([m[0] for m in ranks[0]["moved"][args.warmup:]]),
                "written_per_step": median([m[1] for m in ranks[0]["moved"][args.warmup:]]),
                "reads_ahead_used": [r["nvme"]["param_reads_ahead_used"] for r in ranks],
                "losses": ranks[0]["losses"]}
    base, off = results["params_in_memory"], results["params_on_nvme"]
    summary = {"step_ratio": off["step_s"] / base["step_s"],
               "rss_saving_mib": [b - o for b, o in zip(base["peak_train_mib"], off["peak_train_mib"])],
               "expected_saving_mib": [round((p - b) / 2**20) for p, b in zip(base["params_bytes"], off["buffers"])],
               "losses_equal": base["losses"] == off["losses"]}
    if args.json:
        print(json.dumps({"header": header, "results": results, "summary": summary}))
        return
    print_header(header)
    rows = [[s, f"{r['step_s'] * 1000:.0f}", "/".join(map(str, r["peak_train_mib"])),
             "/".join(f"{b / 2**20:.0f}" for b in r["params_bytes"]), f"{r['param_file_bytes'][0] / 2**20:.0f}",
             f"{r['read_per_step'] / 2**20:.0f}/{r['written_per_step'] / 2**20:.0f}",
             "/".join(map(str, r["reads_ahead_used"]))] for s, r in results.items()]
    print(format_table(["system", "step ms", "peak RSS MiB (ranks)", "param shards in RAM MiB",
                        "param file MiB", "param MiB read/written per step", "gathers read ahead"], rows))
    print(f"step time x in-memory: {summary['step_ratio']:.2f}; peak RSS saving per rank "
          f"{summary['rss_saving_mib']} MiB (expected {summary['expected_saving_mib']}); losses equal: "
          f"{summary['losses_equal']}")


if __name__ == "__main__":
    main()
