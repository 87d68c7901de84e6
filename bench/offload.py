"""Optimizer-state offload (issue 11): zerocore's ``offload_optimizer: cpu`` and ``nvme`` against the state in
memory, against the pure I/O time of the same bytes, and against DeepSpeed's offload, in the same run.

    python bench/offload.py [--world 2] [--stage 2] [--dtype bf16|fp32] [--layers 16 --dim 1024 --seq 64
                            --batch 1 --vocab 8192] [--steps 8] [--warmup 2] [--sub-group-size 5e7]
                            [--block-size 1048576] [--queue-depth 8] [--threads 1,2] [--dir DIR]
                            [--only zc_none,zc_cpu,zc_nvme,ds_cpu,ds_nvme] [--no-deepspeed] [--json]
                            [--json-file FILE]

The model is the GPT of ``_peers.py`` (the training-step benchmark's), by default 16 layers of d=1024 with a
vocabulary of 8192: 218.4M parameters, so each of 2 ranks holds ~1.31 GB of fp32 optimizer state in bf16
(master + two moments, 12 bytes per parameter over the ranks; 8 in fp32, where the master is the parameter
shard itself). Every system trains it from the same seed on the same data (``_peers.batch``), stage
``--stage`` (default 2), AdamW with ``_peers.ADAMW``'s hyper-parameters, each in its own fresh set of
``--world`` spawned Gloo rank processes (1 intra-op and 1 inter-op thread each), one system at a time:

  zc_none     zerocore, optimizer state in memory: the reference.
  zc_cpu      zerocore ``offload_optimizer: {device: cpu}`` (on this CPU-only machine the state is in host
              memory either way: the same step as the reference is expected).
  zc_nvme_tN  zerocore ``offload_optimizer: {device: nvme, nvme_path: DIR}``, ``sub_group_size``, and the
              ``aio`` section (``--block-size``, ``--queue-depth``, ``thread_count`` N), one row per value
              of ``--threads`` (the C++ engine has at most min(thread_count, queue_depth) requests in flight).
  ds_cpu      DeepSpeed ZeRO-``--stage`` ``offload_optimizer: {device: cpu}`` with its config optimizer
              (AdamW, so DeepSpeedCPUAdam, a JIT-built C++ op), DeepSpeed's defaults otherwise.
  ds_nvme     DeepSpeed ZeRO-3 ``offload_optimizer: {device: nvme}`` (DeepSpeed swaps optimizer state to NVMe
              only in stage 3; in stages 1-2 ``nvme`` means CPU offload), same directory, sub_group_size and
              aio settings; run only when its async_io op can build here (``AsyncIOBuilder().is_compatible()``,
              checked at run time; it needs libaio's headers and library: Debian's ``libaio-dev``), else
              skipped with the reason.

DeepSpeed's rows need ``.venv-ds/bin/python`` (see train_step.py's docstring); without DeepSpeed they are left
out with the reason.

Per system: the time of a full training step (forward + loss + backward + ``engine.step()``) and of the
optimizer step alone (``engine.step()``: gradient norm, the Adam update, the parameter all-gathers; on NVMe
the read/Adam/write pipeline over the sub-groups), each the slowest rank's, median over ``--steps`` steps
after ``--warmup``; the per-rank RSS after the model was built, the peak RSS of the rank process (ru_maxrss,
whole life) and the peak RSS during the training steps alone (``VmHWM`` after resetting it with
``/proc/self/clear_refs`` once the engine is built: the steady state, without initialization's transient
copies); and, for zerocore, the optimizer state's bytes held in RAM (``memory_report()["bytes"]``:
master_params + optimizer_moments) and the NVMe pipeline's three buffers (``nvme_buffers``). The NVMe RSS
saving expected against the reference is the in-RAM state minus those buffers.

For NVMe, after every measured training step both ranks also run the pure I/O of the same bytes with the same
engine, file and buffers: ``engine.optimizer_state.store.step(lambda group, views: None, None)`` reads every
sub-group and writes it back through the same three-deep rotation, with no Adam and no collectives. The ratio
of the optimizer step to that (target <= 1.15) says how much of the step's compute and communication is
hidden behind the I/O; it is given as the ratio of the medians and as the median of each step's ratio to the
I/O pass right after it (the disk's speed drifts during a run), next to the ideal, max(pure I/O, the
in-memory reference's optimizer step). The bytes read and written per step come from ``memory_report()["nvme"]`` deltas. The
state files are evicted from the page cache (``posix_fadvise``, ``_pagecache.py``) before the timed steps, and
``mincore`` says what was left (the sub-groups are 4 KiB aligned, so the engine uses O_DIRECT and the page
cache should not hold them anyway). When ``build/bench/zerocore-bench`` exists, ``zerocore-bench aio`` runs on
the same directory with one rank's state bytes and the same aio settings, and its disk and engine GB/s are
printed next to the step's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    BenchError,
    current_rss_mib,
    format_table,
    median,
    print_header,
    reset_hwm,
    run_header,
    run_ranks,
    vm_hwm_mib,
)
from _pagecache import evict_tree, resident_fraction
from _peers import ADAMW, batch, build_model, loss_of, zerocore_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIO_BENCH = os.path.join(ROOT, "build", "bench", "zerocore-bench")
BASE_SYSTEMS = ("zc_none", "zc_cpu", "zc_nvme", "ds_cpu", "ds_nvme")


def _label(system: str, cfg: dict[str, Any]) -> str:
    if system == "zc_none":
        return "zerocore, optimizer state in memory (reference)"
    if system == "zc_cpu":
        return "zerocore offload_optimizer: cpu"
    if system.startswith("zc_nvme_t"):
        return (f"zerocore offload_optimizer: nvme, sub_group_size {cfg['sub_group_size']:.3g}, aio block "
                f"{cfg['block_size']} qd {cfg['queue_depth']} threads {system[len('zc_nvme_t'):]}")
    if system == "ds_cpu":
        return f"DeepSpeed ZeRO-{cfg['stage']} offload_optimizer: cpu (DeepSpeedCPUAdam)"
    if system == "ds_nvme":
        return "DeepSpeed ZeRO-3 offload_optimizer: nvme (DeepSpeedCPUAdam + async_io)"
    raise ValueError(system)


# ---- memory probes ------------------------------------------------------------------------------------------
def _ru_maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---- configs ------------------------------------------------------------------------------------------------
def _zerocore_config(system: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    config = zerocore_config(cfg, cfg["stage"], False, cfg["dtype"] == "bf16")
    zero = config["zero_optimization"]
    if system == "zc_cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif system.startswith("zc_nvme_t"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": root}
        zero["sub_group_size"] = cfg["sub_group_size"]
        config["aio"] = {"block_size": cfg["block_size"], "queue_depth": cfg["queue_depth"],
                         "thread_count": int(system[len("zc_nvme_t"):])}
    return config


def _deepspeed_config(system: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    """DeepSpeed's defaults but for the offload and what it requires (a batch size); its config optimizer
    (AdamW) becomes DeepSpeedCPUAdam under offload."""
    optimizer = {"type": "AdamW", "params": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                                             "weight_decay": ADAMW["weight_decay"]}}
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": cfg["batch"], "gradient_accumulation_steps": 1,
                              "optimizer": optimizer, "bf16": {"enabled": cfg["dtype"] == "bf16"},
                              "steps_per_print": 10**9}
    if system == "ds_cpu":
        config["zero_optimization"] = {"stage": cfg["stage"], "offload_optimizer": {"device": "cpu"}}
    else:
        config["zero_optimization"] = {"stage": 3, "sub_group_size": cfg["sub_group_size"],
                                       "offload_optimizer": {"device": "nvme", "nvme_path": root}}
        config["aio"] = {"block_size": cfg["block_size"], "queue_depth": cfg["queue_depth"],
                         "intra_op_parallelism": cfg["threads"][0]}
    return config


# ---- one system on one rank ---------------------------------------------------------------------------------
def _param_checksum(engine: Any) -> float:
    """The sum of every parameter in float64, gathered whole (stage 3 holds NaN between gathers)."""
    return float(sum(t.double().sum() for t in engine.full_state_dict(rank0_only=False).values()))


def _rank_main(rank: int, world: int, system: str, cfg: dict[str, Any], root: str) -> dict[str, Any]:
    sys.stdout.flush()
    os.dup2(2, 1)  # anything a library prints goes to stderr: stdout is the parent's table or JSON
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    model = build_model(cfg)
    out: dict[str, Any] = {"rss_build_mib": current_rss_mib()}
    if system.startswith("zc_"):
        import zerocore

        engine = zerocore.initialize(model, _zerocore_config(system, cfg, root))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed

            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=_deepspeed_config(system, cfg, root))
    del model
    zc = system.startswith("zc_")
    store = engine.optimizer_state.store if zc else None
    out["rss_init_mib"] = current_rss_mib()
    out["peak_init_mib"] = max(vm_hwm_mib(), _ru_maxrss_mib())  # everything up to here, initialize included
    if store is not None:  # the state file has no name while in use: reach it through the store's descriptor
        evict_tree(f"/proc/self/fd/{store.fd}")
        out["resident_after_evict"] = resident_fraction(f"/proc/self/fd/{store.fd}")
    out["hwm_reset"] = reset_hwm()
    times: dict[str, list[float]] = {"step": [], "opt": [], "io": []}
    losses: list[float] = []
    step_bytes: list[tuple[int, int]] = []
    io_bytes: list[tuple[int, int]] = []
    total = cfg["warmup"] + cfg["steps"]
    dist.barrier()
    for step in range(total):
        x, y = batch(cfg, step, rank)
        before = (store.bytes_read, store.bytes_written) if store is not None else (0, 0)
        t0 = time.perf_counter()
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        times["step"].append(t2 - t0)
        times["opt"].append(t2 - t1)
        losses.append(float(loss.detach()))
        if store is not None:
            step_bytes.append((store.bytes_read - before[0], store.bytes_written - before[1]))
            # the pure I/O of the same bytes: same engine, file, buffers and rotation; no Adam, no collectives
            dist.barrier()
            before = (store.bytes_read, store.bytes_written)
            t3 = time.perf_counter()
            store.step(lambda group, views: None, None)
            t4 = time.perf_counter()
            store.raise_failure()
            times["io"].append(t4 - t3)
            io_bytes.append((store.bytes_read - before[0], store.bytes_written - before[1]))
            dist.barrier()
    out["peak_train_mib"] = vm_hwm_mib()
    out["rss_end_mib"] = current_rss_mib()
    out.update(times=times, losses=losses, step_bytes=step_bytes, io_bytes=io_bytes)
    if zc:
        report = engine.memory_report()
        out["state_bytes"] = report["bytes"]["master_params"] + report["bytes"]["optimizer_moments"]
        out["nvme_buffers"] = report["bytes"].get("nvme_buffers", 0)
        out["nvme_file_bytes"] = report["nvme"]["file_bytes"]
        out["placement"] = report["optimizer_placement"]
        out["model_state_bytes"] = report["model_state_bytes"]
        out["param_checksum"] = _param_checksum(engine)
        engine.close()
    else:
        out["param_checksum"] = None
    dist.barrier()
    return out


# ---- DeepSpeed and the aio bench, probed in child processes (the driver stays small: its RSS would carry
# over into the ranks' ru_maxrss through the spawn) -------------------------------------------------------------
_DS_PROBE = r"""
import contextlib, io, json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
out = {}
with contextlib.redirect_stdout(sys.stderr):
    try:
        import deepspeed
        out["version"] = deepspeed.__version__
    except Exception as exc:
        out["error"] = f"`import deepspeed` failed: {type(exc).__name__}: {exc}"
    if "version" in out:
        from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
        out["cpu_adam"] = bool(CPUAdamBuilder().is_compatible())
        out["async_io"] = bool(AsyncIOBuilder().is_compatible())
        if not out["async_io"]:
            b = AsyncIOBuilder()
            libaio_link = bool(b.has_function("io_submit", ("aio",)))
            out["async_io_reason"] = (
                "DeepSpeed's AsyncIOBuilder().is_compatible() is False: it cannot compile and link a test program "
                f"calling libaio's io_submit (link test: {libaio_link}; /usr/include/libaio.h present: "
                f"{os.path.exists('/usr/include/libaio.h')}), i.e. the libaio-dev headers/library are missing")
print(json.dumps(out))
"""


def _deepspeed_probe() -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return {"error": f"`import deepspeed` finds no module in {sys.executable}"}
    proc = subprocess.run([sys.executable, "-c", _DS_PROBE], capture_output=True, text=True, timeout=300, check=False)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"the DeepSpeed probe failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}"}


def _aio_bench(root: str, nbytes: int, cfg: dict[str, Any], threads: int) -> dict[str, Any] | None:
    if not os.access(AIO_BENCH, os.X_OK):
        return None
    cmd = [AIO_BENCH, "aio", "--path", root, "--bytes", str(nbytes), "--block-size", str(cfg["block_size"]),
           "--queue-depth", str(cfg["queue_depth"]), "--threads", str(threads), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        return {"error": f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    result = json.loads(proc.stdout)
    result["cmd"] = " ".join(cmd)
    return result


# ---- the driver ---------------------------------------------------------------------------------------------
def _count_params(cfg: dict[str, Any]) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def _slowest(ranks: list[dict[str, Any]], key: str, warmup: int) -> list[float]:
    n = len(ranks[0]["times"][key])
    return [max(r["times"][key][i] for r in ranks) for i in range(n)][warmup:]


def _summarize(system: str, ranks: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    w = cfg["warmup"]
    step, opt = _slowest(ranks, "step", w), _slowest(ranks, "opt", w)
    mean_loss = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))]
    out: dict[str, Any] = {
        "system": system, "label": _label(system, cfg),
        "step_ms": 1e3 * median(step), "opt_ms": 1e3 * median(opt),
        "step_ms_all": [1e3 * t for t in step], "opt_ms_all": [1e3 * t for t in opt],
        "rss_build_mib": [r["rss_build_mib"] for r in ranks],
        "rss_init_mib": [r["rss_init_mib"] for r in ranks],
        "peak_rss_mib": [max(r["peak_init_mib"], r["peak_train_mib"]) for r in ranks],
        "peak_train_mib": [r["peak_train_mib"] for r in ranks],
        "hwm_reset": all(r["hwm_reset"] for r in ranks),
        "losses": mean_loss, "rank_losses": [r["losses"] for r in ranks],
        "param_checksum": ranks[0]["param_checksum"],
    }
    if "state_bytes" in ranks[0]:
        for k in ("state_bytes", "nvme_buffers", "nvme_file_bytes", "placement", "model_state_bytes"):
            out[k] = [r[k] for r in ranks]
    if ranks[0]["times"]["io"]:
        io = _slowest(ranks, "io", w)
        out["io_ms"] = 1e3 * median(io)
        out["io_ms_all"] = [1e3 * t for t in io]
        out["opt_over_io"] = out["opt_ms"] / out["io_ms"]
        # each measured step against the pure I/O pass right after it (the disk's speed drifts over a run)
        out["opt_over_io_paired"] = median([a / b for a, b in zip(opt, io)])
        out["step_bytes"] = [r["step_bytes"][-1] for r in ranks]  # (read, written) per rank, last step
        out["io_bytes"] = [r["io_bytes"][-1] for r in ranks]
        moved = sum(a + b for a, b in out["step_bytes"])  # all ranks, read + written
        out["step_gbps_all_ranks"] = moved / (out["opt_ms"] / 1e3) / 1e9
        out["io_gbps_all_ranks"] = sum(a + b for a, b in out["io_bytes"]) / (out["io_ms"] / 1e3) / 1e9
        out["resident_after_evict"] = max(r["resident_after_evict"] for r in ranks)
    return out


def _fmt(v: Any, digits: int = 2) -> str:
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def _per_rank(values: list[float], digits: int = 0) -> str:
    return "/".join(f"{v:.{digits}f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sub-group-size", type=float, default=5e7, help="zero_optimization.sub_group_size")
    parser.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size (bytes)")
    parser.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth")
    parser.add_argument("--threads", default="1,2",
                        help="aio.thread_count (intra_op_parallelism); comma-separated: one NVMe row each")
    parser.add_argument("--dir", default=None, help="directory for the NVMe state files (default: a temporary "
                                                    "directory under /var/tmp)")
    parser.add_argument("--only", default=",".join(BASE_SYSTEMS), help=f"subset of {','.join(BASE_SYSTEMS)}")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even if installed")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per system run before it is killed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--json-file", default=None, help="also write that JSON object to this file")
    args = parser.parse_args()

    base = [s.strip() for s in args.only.split(",") if s.strip()]
    if any(s not in BASE_SYSTEMS for s in base):
        parser.error(f"--only: a subset of {','.join(BASE_SYSTEMS)}, got {args.only!r}")
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    if not threads or min(threads) < 1:
        parser.error("--threads: positive integers")
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
           "stage": args.stage, "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
           "sub_group_size": int(args.sub_group_size), "block_size": args.block_size,
           "queue_depth": args.queue_depth, "threads": threads}

    notes: list[str] = []
    ds: dict[str, Any] = {"error": "--no-deepspeed"} if args.no_deepspeed else (
        _deepspeed_probe() if {"ds_cpu", "ds_nvme"} & set(base) else {"error": "not asked for (--only)"})
    systems: list[str] = []
    for s in base:
        if s == "zc_nvme":
            systems += [f"zc_nvme_t{t}" for t in threads]
        elif s.startswith("ds_") and "error" in ds:
            notes.append(f"{s} skipped: {ds['error']}")
        elif s == "ds_cpu" and not ds.get("cpu_adam"):
            notes.append("ds_cpu skipped: DeepSpeed's CPUAdamBuilder().is_compatible() is False here")
        elif s == "ds_nvme" and not ds.get("async_io"):
            notes.append(f"ds_nvme skipped: {ds.get('async_io_reason', 'async_io is not compatible')}")
        else:
            systems.append(s)

    import zerocore

    params = _count_params(cfg)
    k = 12 if args.dtype == "bf16" else 8
    header = run_header({"world": args.world, "stage": args.stage, "dtype": args.dtype,
                         "model": {key: cfg[key] for key in ("layers", "dim", "seq", "batch", "vocab")},
                         "params": params, "fp32_state_per_rank_estimate_GB": k * params / args.world / 1e9,
                         "steps": args.steps, "warmup": args.warmup,
                         "nvme": {key: cfg[key] for key in ("sub_group_size", "block_size", "queue_depth", "threads")},
                         "optimizer": "AdamW " + ", ".join(f"{key}={v}" for key, v in ADAMW.items())
                         + f"; zerocore CPUAdam ({zerocore.build_info()['simd_active']}), DeepSpeed: DeepSpeedCPUAdam",
                         "deepspeed": ds.get("version") or f"absent: {ds['error']}"})
    parent = args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None)
    root = tempfile.mkdtemp(dir=parent, prefix="zerocore-offload-bench-")
    header["nvme_path"] = root
    results: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    aio: dict[int, Any] = {}
    try:
        for system in systems:
            print(f"... {system}", file=sys.stderr, flush=True)
            try:
                ranks = run_ranks(_rank_main, args.world, system, cfg, root, timeout=args.timeout)
                results.append(_summarize(system, ranks, cfg))
            except BenchError as exc:
                failures[system] = str(exc)
                print(f"!!! {system} failed:\n{exc}", file=sys.stderr, flush=True)
            left = os.listdir(root)
            if left:
                notes.append(f"{system} left files in the NVMe directory: {left}")
                for name in left:  # DeepSpeed leaves its swap folder (zero_stage_3/...) behind
                    path = os.path.join(root, name)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        nvme_rows = [r for r in results if r["system"].startswith("zc_nvme_t")]
        if nvme_rows:
            state_bytes = nvme_rows[0]["nvme_file_bytes"][0]
            for t in threads:
                print(f"... zerocore-bench aio --threads {t}", file=sys.stderr, flush=True)
                aio[t] = _aio_bench(root, state_bytes, cfg, t)
            if aio.get(threads[0]) is None:
                notes.append(f"zerocore-bench aio rows left out: {AIO_BENCH} does not exist (build it with cmake "
                             "-DZEROCORE_BUILD_BENCH=ON)")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    by = {r["system"]: r for r in results}
    ref, dsc = by.get("zc_none"), by.get("ds_cpu")
    for r in results:
        r["step_x_ref"] = r["step_ms"] / ref["step_ms"] if ref else None
        r["opt_x_ref"] = r["opt_ms"] / ref["opt_ms"] if ref else None
        r["step_x_ds_cpu"] = r["step_ms"] / dsc["step_ms"] if dsc else None
        r["opt_x_ds_cpu"] = r["opt_ms"] / dsc["opt_ms"] if dsc else None
        r["peak_x_ds_cpu"] = max(r["peak_rss_mib"]) / max(dsc["peak_rss_mib"]) if dsc else None
        if ref and "state_bytes" in r:
            expected = [(s - b) / 2**20 for s, b in zip(ref["state_bytes"], r["nvme_buffers"])] \
                if r["system"].startswith("zc_nvme") else [0.0] * len(r["state_bytes"])
            r["expected_saving_mib"] = expected
            r["saving_train_mib"] = [a - b for a, b in zip(ref["peak_train_mib"], r["peak_train_mib"])]
            r["saving_peak_mib"] = [a - b for a, b in zip(ref["peak_rss_mib"], r["peak_rss_mib"])]
        if "io_ms" in r and ref:
            r["ideal_ms"] = max(r["io_ms"], ref["opt_ms"])  # perfect overlap of the I/O with the in-memory step
            r["opt_over_ideal"] = r["opt_ms"] / r["ideal_ms"]
    # zerocore's offloaded training must be bitwise the in-memory one (same kernel, same order)
    if ref:
        for r in results:
            if r["system"].startswith("zc_") and r is not ref:
                same = r["rank_losses"] == ref["rank_losses"] and r["param_checksum"] == ref["param_checksum"]
                r["bitwise_as_ref"] = same
                if not same:
                    notes.append(f"{r['system']}: losses or final parameters differ from zc_none's "
                                 f"(losses {r['losses']} vs {ref['losses']}; checksum {r['param_checksum']!r} vs "
                                 f"{ref['param_checksum']!r})")
    if any(not r["hwm_reset"] for r in results):
        notes.append("/proc/self/clear_refs refused: 'peak RSS in training' is the whole-life peak")
    for s, message in failures.items():
        notes.append(f"{s} failed: {message.strip().splitlines()[-1][:300]}")

    document = {"header": header, "results": results, "aio_bench": aio, "failures": failures, "notes": notes}
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(document, f, indent=1)
    if args.json:
        print(json.dumps(document, indent=1))
        return

    print_header(header)
    print("# times: slowest rank, median of the measured steps; step = forward + backward + engine.step(); "
          "opt = engine.step(); RSS per rank (rank0/rank1/...)")
    rows = []
    for r in results:
        rows.append([r["system"], r["label"], _fmt(r["step_ms"], 0), _fmt(r["step_x_ref"]), _fmt(r["step_x_ds_cpu"]),
                     _fmt(r["opt_ms"], 0), _fmt(r["opt_x_ref"]), _fmt(r["opt_x_ds_cpu"]),
                     _per_rank(r["rss_build_mib"]), _per_rank(r["peak_rss_mib"]), _fmt(r["peak_x_ds_cpu"]),
                     _per_rank(r["peak_train_mib"]),
                     _per_rank([b / 2**20 for b in r["state_bytes"]]) if "state_bytes" in r else "",
                     _per_rank([b / 2**20 for b in r["nvme_buffers"]]) if "nvme_buffers" in r else "",
                     f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                     {True: "yes", False: "NO"}.get(r.get("bitwise_as_ref"), "")])
    print(format_table(["system", "what", "step ms", "x ref", "x DS cpu", "opt step ms", "x ref", "x DS cpu",
                        "RSS after build MiB", "peak RSS MiB", "x DS cpu", "peak RSS in training MiB",
                        "optimizer state in RAM MiB", "NVMe buffers MiB", "mean loss first -> last",
                        "bitwise = ref"], rows, left=2))
    nvme_rows = [r for r in results if "io_ms" in r]
    if nvme_rows:
        print("\n# NVMe: opt step (engine.step()) against the pure I/O of the same bytes (store.step with no "
              "update, same engine and buffers), both ranks at once; GB/s = read + written, all ranks; ideal = "
              "max(pure I/O, in-memory opt step); paired = median over steps of opt / the I/O pass right after it; "
              "zerocore-bench aio: one process, one rank's state bytes, the same aio settings")
        rows = []
        for r in nvme_rows:
            t = int(r["system"][len("zc_nvme_t"):])
            bench = aio.get(t) or {}
            rd, wr = r["step_bytes"][0]
            rows.append([r["system"], _fmt(r["opt_ms"], 0), _fmt(r["io_ms"], 0), _fmt(r["opt_over_io"]),
                         _fmt(r["opt_over_io_paired"]), "yes" if r["opt_over_io"] <= 1.15 else "no",
                         _fmt(r.get("opt_over_ideal")),
                         f"{rd / 1e6:.0f} / {wr / 1e6:.0f}", _fmt(r["step_gbps_all_ranks"]),
                         _fmt(r["io_gbps_all_ranks"]),
                         (f"{bench['engine_read_cold_gbps']:.2f} / {bench['engine_write_gbps']:.2f}"
                          if "engine_read_cold_gbps" in bench else ""),
                         (f"{bench['disk_read_cold_gbps']:.2f} / {bench['disk_write_gbps']:.2f}"
                          if "disk_read_cold_gbps" in bench else ""),
                         (f"{bench['disk_direct_read_gbps']:.2f} / {bench['disk_direct_write_gbps']:.2f}"
                          if "disk_direct_read_gbps" in bench else ""),
                         _fmt(r["resident_after_evict"], 3)])
        print(format_table(["system", "opt step ms", "pure I/O ms", "opt / I/O", "paired", "<= 1.15",
                            "opt / ideal", "MB read / written per rank per step", "step GB/s", "pure I/O GB/s",
                            "zerocore-bench aio engine read / write GB/s (1 process)",
                            "disk buffered read / write+fsync GB/s", "disk O_DIRECT read / write GB/s",
                            "cached after evict"], rows))
    saving_rows = [r for r in results if "expected_saving_mib" in r and r["system"] != "zc_none"]
    if saving_rows:
        print("\n# RSS against the in-memory reference, per rank: saving = reference's peak - this row's; expected "
              "for NVMe = in-RAM optimizer state - the pipeline's buffers")
        print(format_table(["system", "saving, peak in training MiB", "saving, whole-life peak MiB",
                            "expected MiB"],
                           [[r["system"], _per_rank(r["saving_train_mib"]), _per_rank(r["saving_peak_mib"]),
                             _per_rank(r["expected_saving_mib"])] for r in saving_rows]))
    for note in notes:
        print(f"# note: {note}")


if __name__ == "__main__":
    main()
