"""Gloo collectives side by side: torch.distributed's ops vs zerocore's _C.Comm algorithms, same fp32 buffer.

    python bench/collectives.py [--mb 110] [--world 2] [--repeat 5] [--json] [--timeout 600]

For one buffer of ``--mb`` MB (10^6 bytes, fp32; 110 MB ~ the 27.4M-parameter GPT of bench/train_step.py)
this times, in one set of ``--world`` spawned Gloo ranks over loopback:

  torch    reduce_scatter_tensor  (input: the buffer, output: its 1/world shard)
  torch    all_gather_into_tensor (input: a 1/world shard, output: the buffer)
  torch    all_reduce, broadcast  (the buffer, in place; broadcast from rank 0)
  zerocore Comm.reduce_scatter with every registered algorithm (reduce_scatter | all_reduce | send_recv)
  zerocore Comm.all_gather     with every registered algorithm (all_gather | broadcast | all_reduce)

Each op runs once untimed, then ``--repeat`` times between barriers; a repeat's time is the slowest rank's
(issue to wait() returning), and the table shows the median, the minimum and the ratio of the median to
torch's all_reduce. See Note [Collective algorithms] in bindings/comm.hpp for why the algorithms exist.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import BenchError, format_table, median, print_header, run_header, run_ranks  # noqa: E402

ALIGN = 64  # elements; keeps every shard aligned as zerocore's layout does


def _ops(world: int, rank: int, n: int) -> tuple[list[tuple[str, str, Any]], Any, dict[str, str]]:
    """The ops as (name, algorithm, callable) in run order (each blocks until done on this rank), an untimed
    refill of the buffers, and the algorithms zerocore's "auto" picks on this backend."""
    import torch
    import torch.distributed as dist

    import zerocore  # noqa: F401 - loads the extension
    from zerocore._native import _C

    group = dist.group.WORLD
    buf = torch.empty(n, dtype=torch.float32)
    shard = torch.empty(n // world, dtype=torch.float32)
    ops: list[tuple[str, str, Any]] = [
        ("torch.reduce_scatter_tensor", "-", lambda: dist.reduce_scatter_tensor(shard, buf)),
        ("torch.all_gather_into_tensor", "-", lambda: dist.all_gather_into_tensor(buf, shard)),
        ("torch.all_reduce", "-", lambda: dist.all_reduce(buf)),
        ("torch.broadcast", "-", lambda: dist.broadcast(buf, src=0)),
    ]
    def comm_or_refusal(reduce_scatter: str, all_gather: str) -> Any:
        # ZeRO++'s algorithms need options (node groups) this plain group cannot give: every rank refuses
        # alike, and the refusal becomes the row's error instead of failing the run
        try:
            return _C.Comm(group, reduce_scatter, all_gather), None
        except ValueError as exc:
            return None, exc

    def run(comm: Any, refusal: Exception | None, op: str) -> None:
        if refusal is not None:
            raise refusal
        getattr(comm, op)(buf).wait()

    for algo in _C.collective_algorithms()["reduce_scatter"]:
        comm, refusal = comm_or_refusal(algo, "auto")
        ops.append(("zerocore.Comm.reduce_scatter", algo, lambda c=comm, r=refusal: run(c, r, "reduce_scatter")))
    for algo in _C.collective_algorithms()["all_gather"]:
        comm, refusal = comm_or_refusal("auto", algo)
        ops.append(("zerocore.Comm.all_gather", algo, lambda c=comm, r=refusal: run(c, r, "all_gather")))
    auto = _C.Comm(group, "auto", "auto")
    ops_auto = {"reduce_scatter": auto.reduce_scatter_algo, "all_gather": auto.all_gather_algo}

    # Values stay finite and the same across repeats: refill (untimed) before every run.
    source = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 1e-3

    def refill() -> None:
        buf.copy_(source)
        shard.copy_(source[: n // world])

    return ops, refill, ops_auto


def _rank_main(rank: int, world: int, n: int, repeat: int) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
    ops, refill, auto = _ops(world, rank, n)
    results = []
    for name, algo, fn in ops:
        times: list[float] = []
        error = None
        try:
            for i in range(repeat + 1):
                refill()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
                if i:
                    times.append(elapsed)
        except Exception as exc:  # noqa: BLE001 - an unsupported op is a row, not a failed run
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        # every rank reaches this point (an unsupported op raises on all of them before communicating)
        t = torch.tensor(times if times and not error else [float("nan")] * repeat, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results.append({"op": name, "algorithm": algo, "times_s": t.tolist(), "error": error})
    return {"results": results, "auto": auto}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=110.0, help="buffer size in MB (10^6 bytes), fp32")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is killed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    quantum = ALIGN * args.world
    n = max(quantum, int(args.mb * 1e6 / 4) // quantum * quantum)
    header = run_header({"world": args.world, "elements": n, "bytes": 4 * n, "repeat": args.repeat})
    try:
        out = run_ranks(_rank_main, args.world, n, args.repeat, timeout=args.timeout)[0]
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)

    rows_json = []
    baseline = None
    for r in out["results"]:
        ok = [t for t in r["times_s"] if t == t]
        r["median_ms"] = 1e3 * median(ok) if ok else None
        r["min_ms"] = 1e3 * min(ok) if ok else None
        if r["op"] == "torch.all_reduce":
            baseline = r["median_ms"]
    for r in out["results"]:
        r["ratio_to_all_reduce"] = (r["median_ms"] / baseline) if r["median_ms"] and baseline else None
        rows_json.append(r)
    header["zerocore_auto_algorithms_gloo"] = out["auto"]

    if args.json:
        print(json.dumps({"header": header, "results": rows_json}, indent=1))
        return
    print_header(header)
    rows = []
    for r in rows_json:
        if r["error"]:
            rows.append([r["op"], r["algorithm"], "n/a", "n/a", "n/a", r["error"]])
        else:
            gbps = 4 * n / (r["median_ms"] * 1e-3) / 1e9
            rows.append([r["op"], r["algorithm"], f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}",
                         f"{r['ratio_to_all_reduce']:.2f}", f"{gbps:.2f}"])
    print(format_table(["op", "algorithm", "median ms", "min ms", "x all_reduce", "buffer GB/s"], rows, left=2))
    print("# x all_reduce: median / torch.all_reduce median on the same buffer; buffer GB/s: buffer bytes / median")


if __name__ == "__main__":
    main()
