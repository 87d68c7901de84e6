"""Checkpoint save and load throughput, as ratios measured in the same run (issue 10):

* the disk's own sequential bandwidth: each rank writes (and fsyncs) then reads back a file of the size of
  its checkpoint shard, in 16 MiB blocks;
* zerocore ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (stage 2, fp32; bytes = the files written);
* ``torch.distributed.checkpoint`` (DCP) ``save`` / ``load`` of DDP's model and ``AdamW(fused=True)`` state,
  the same tensors a DDP user checkpoints.

    python bench/checkpoint.py [--world 2] [--layers 6 --dim 512 --seq 128 --vocab 8192] [--rounds 3]

Prints per system the median seconds over ``--rounds`` and GB/s of checkpoint bytes (all ranks together),
and the ratio to the disk's bandwidth. The page cache is not dropped (no root here), so reads can be faster
than the disk: the disk figure is measured the same way. DCP needs numpy (its object collectives decode
through it): ``pip install numpy`` first; zerocore itself does not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, run_ranks  # noqa: E402
from _peers import ADAMW, batch, build_model, loss_of, zerocore_config  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _disk(path: str, nbytes: int) -> tuple[float, float]:
    block = os.urandom(16 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass
    read = time.perf_counter() - start
    os.remove(path)
    return write, read


def _rank_main(rank: int, world: int, cfg: dict[str, Any], root: str, rounds: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import zerocore

    out: dict[str, list[float]] = {k: [] for k in ("disk_write", "disk_read", "zc_save", "zc_load", "dcp_save",
                                                   "dcp_load")}
    engine = zerocore.initialize(build_model(cfg), zerocore_config(cfg, 2, False, False))
    x, y = batch(cfg, 0, rank)
    engine.backward(loss_of(engine(x), y))
    engine.step()

    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch.distributed.checkpoint as dcp

    ddp = DDP(build_model(cfg), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), **ADAMW, fused=True)
    loss_of(ddp(x), y).backward()
    opt.step()

    sizes = {}
    for r in range(rounds):
        zc = os.path.join(root, f"zc{r}")
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(zc)
        dist.barrier()
        out["zc_save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.load_checkpoint(zc)
        dist.barrier()
        out["zc_load"].append(time.perf_counter() - start)
        sizes["zc"] = _dir_bytes(zc)

        d = os.path.join(root, f"dcp{r}")
        state = {"model": ddp.module.state_dict(), "optim": opt.state_dict()}
        dist.barrier()
        start = time.perf_counter()
        dcp.save(state, checkpoint_id=d)
        dist.barrier()
        out["dcp_save"].append(time.perf_counter() - start)
        start = time.perf_counter()
        dcp.load(state, checkpoint_id=d)
        dist.barrier()
        out["dcp_load"].append(time.perf_counter() - start)
        sizes["dcp"] = _dir_bytes(d)

        per_rank = sizes["zc"] // world
        dist.barrier()
        write, read = _disk(os.path.join(root, f"disk{r}.{rank}"), per_rank)
        out["disk_write"].append(write)
        out["disk_read"].append(read)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(zc)
            shutil.rmtree(d)
    out["bytes"] = [float(sizes["zc"]), float(sizes["dcp"])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": args.vocab}
    root = tempfile.mkdtemp(dir=args.dir, prefix="zerocore-ckpt-bench-")
    try:
        results = run_ranks(_rank_main, args.world, cfg, root, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    zc_bytes, dcp_bytes = results[0]["bytes"]
    slowest = {k: median([max(r[k][i] for r in results) for i in range(args.rounds)])
               for k in results[0] if k != "bytes"}
    disk = {"save": zc_bytes / slowest["disk_write"], "load": zc_bytes / slowest["disk_read"]}
    print(f"# world {args.world}, {args.rounds} rounds, median of the slowest rank; zerocore checkpoint "
          f"{zc_bytes / 1e6:.1f} MB, DCP checkpoint {dcp_bytes / 1e6:.1f} MB (all ranks)")
    print(f"{'what':<34} {'seconds':>8} {'GB/s':>7} {'x disk':>7}")
    rows = [("disk sequential write + fsync", "disk_write", zc_bytes, "save"),
            ("disk sequential read", "disk_read", zc_bytes, "load"),
            ("zerocore save_checkpoint", "zc_save", zc_bytes, "save"),
            ("zerocore load_checkpoint", "zc_load", zc_bytes, "load"),
            ("torch DCP save (DDP + AdamW)", "dcp_save", dcp_bytes, "save"),
            ("torch DCP load (DDP + AdamW)", "dcp_load", dcp_bytes, "load")]
    for label, key, nbytes, kind in rows:
        rate = nbytes / slowest[key]
        print(f"{label:<34} {slowest[key]:8.3f} {rate / 1e9:7.2f} {rate / disk[kind]:7.2f}")


if __name__ == "__main__":
    main()
