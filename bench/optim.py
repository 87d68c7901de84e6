#!/usr/bin/env python
"""Benchmark: zerocore's CPU Adam against torch's optimizers, and the mixed-precision ZeRO step.

    python bench/optim.py [--sizes 10e6,100e6] [--threads 1,2] [--repeat 7] [--json]

Part 1, fp32 params: one AdamW step over a flat fp32 tensor of N params by zerocore.optim.CPUAdam (one fused
op call), torch.optim.AdamW(fused=True), torch.optim.AdamW(foreach=True) and DeepSpeed's DeepSpeedCPUAdam
when it imports. The contenders run interleaved, one step each per repeat (in rotating order), and each
reports the median. GB/s counts the 28 bytes per param an ideal step moves (reads p, g, m, v; writes p, m, v);
"of stream" divides it by the bandwidth of the same 4-read/3-write pattern measured in this run by the C++
harness (`zerocore-bench stream --kernel adam`, median GB/s of its faster store kind).

Part 2, the mixed-precision ZeRO step: bf16 grads in, fp32 master params and moments, bf16 params out, and a
multiplier (loss-scale unscale times clip coefficient) applied to the grads. zerocore does it in one pass
(ops.adam_step with grad_scale and param_out); torch composes it: grad to fp32 times the multiplier (one
torch.mul pass), AdamW(fused=True).step(), and the bf16 params copied out. Both take the multiplier as given:
computing a clip coefficient needs a grad-norm pass either way.

Threads: torch.set_num_threads(T) and zerocore.ops.set_num_threads(T) for each T of --threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import zerocore
from zerocore import ops
from zerocore.optim import CPUAdam

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "build" / "bench" / "zerocore-bench"
BYTES_PER_PARAM = 28  # fp32 Adam: reads p, g, m, v and writes p, m, v
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
MULTIPLIER = 0.37 / 1024  # e.g. unscale by 1/1024 and clip by 0.37


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------------------
# The C++ stream harness
# -------------------------------------------------------------------------------------------------------------


def ensure_harness(path: Path, build: bool) -> tuple[Path | None, str | None]:
    """The zerocore-bench binary, building it when missing; (None, why) when there is none."""
    if path.exists():
        return path, None
    if not build or path != HARNESS:
        return None, f"{path} does not exist"
    commands = [
        ["cmake", "-S", str(REPO), "-B", str(HARNESS.parent), "-DZEROCORE_BUILD_BENCH=ON",
         "-DZEROCORE_BUILD_PYTHON=OFF", "-DZEROCORE_CUDA=OFF", "-G", "Ninja"],
        ["cmake", "--build", str(HARNESS.parent), "-j1"],
    ]
    for command in commands:
        log(f"building the stream harness: {shlex.join(command)}")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as error:
            return None, f"`{shlex.join(command)}` failed: {error}"
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
            return None, f"`{shlex.join(command)}` failed (exit {done.returncode}):\n{tail}"
    return (path, None) if path.exists() else (None, f"the build did not produce {path}")


def stream_bandwidth(harness: Path, elements: int, threads: list[int], repeat: int) -> dict[int, dict[str, Any]]:
    """{threads: {"median_gbps", "best_gbps", "stores"}} of the Adam-shaped stream on `elements` per array."""
    command = [str(harness), "stream", "--json", "--threads", ",".join(map(str, threads)), "--elements",
               str(elements), "--kernel", "adam", "--repeat", str(max(repeat, 3))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(command)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    report = json.loads(done.stdout)
    rows = {(r["threads"], r["kernel"], r["stores"]): r for r in report["results"]}
    out = {}
    for roof in report["roofline"]:
        if roof["kernel"] != "adam":
            continue
        row = rows[roof["threads"], "adam", roof["stores"]]
        out[roof["threads"]] = dict(median_gbps=row["median_gbps"], best_gbps=row["best_gbps"],
                                    stores=roof["stores"], path=report["path"])
    return out


# -------------------------------------------------------------------------------------------------------------
# Timing
# -------------------------------------------------------------------------------------------------------------


def interleaved_medians(contenders: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Median seconds of one call of each contender; one call each per repeat, rotating the order."""
    for fn in contenders.values():  # warm-up: allocates lazy state, faults pages in
        fn()
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def deepspeed_adam() -> type | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001  (not installed, or installed without its CPU op)
        return None
    return DeepSpeedCPUAdam


def fp32_contenders(n: int, gen: torch.Generator) -> dict[str, Callable[[], None]]:
    """One flat fp32 param per contender, all reading one shared gradient."""
    p0 = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)

    def make(factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Callable[[], None]:
        param = torch.nn.Parameter(p0.clone())
        param.grad = grad
        return factory([param]).step

    contenders = {
        "zerocore CPUAdam": make(lambda ps: CPUAdam(ps, **HYPER)),
        "torch AdamW fused": make(lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER)),
        "torch AdamW foreach": make(lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER)),
    }
    ds = deepspeed_adam()
    if ds is not None:
        contenders["DeepSpeedCPUAdam"] = make(lambda ps: ds(ps, adamw_mode=True, **HYPER))
    return contenders


class MixedStep:
    """bf16 grad in, fp32 master and moments, bf16 params out, grads times MULTIPLIER."""

    def __init__(self, n: int, gen: torch.Generator) -> None:
        master = torch.randn(n, generator=gen)
        self.grad = (torch.randn(n, generator=gen) * 1024).to(torch.bfloat16)
        # zerocore: one op call.
        self.z_master = master.clone()
        self.z_m, self.z_v = torch.zeros(n), torch.zeros(n)
        self.z_out = torch.empty(n, dtype=torch.bfloat16)
        self.z_step = 0
        # torch: fp32 grad buffer, fused AdamW on the master, copy out.
        self.t_master = torch.nn.Parameter(master.clone())
        self.t_master.grad = torch.empty(n)
        self.t_out = torch.empty(n, dtype=torch.bfloat16)
        self.t_opt = torch.optim.AdamW([self.t_master], fused=True, **HYPER)
        # A 1-element (not 0-d) fp32 multiplier makes torch.mul compute in fp32 and cast bf16 on the fly.
        self.t_multiplier = torch.tensor([MULTIPLIER])

    def zerocore(self) -> None:
        self.z_step += 1
        ops.adam_step(self.z_master, self.grad, self.z_m, self.z_v, step=self.z_step, lr=HYPER["lr"],
                      beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"], grad_scale=MULTIPLIER, param_out=self.z_out)

    @torch.no_grad()
    def torch_composed(self) -> None:
        torch.mul(self.grad, self.t_multiplier, out=self.t_master.grad)
        self.t_opt.step()
        self.t_out.copy_(self.t_master)

    def check(self) -> str:
        """After the same number of steps the two agree to fp32 rounding (call before timing diverges them)."""
        ok = torch.allclose(self.z_master, self.t_master.detach(), rtol=1e-5, atol=1e-6)
        ok = ok and torch.equal(self.z_out, self.z_master.to(torch.bfloat16))
        ok = ok and torch.equal(self.t_out, self.t_master.detach().to(torch.bfloat16))
        return "ok" if ok else "MISMATCH"


# -------------------------------------------------------------------------------------------------------------
# Main
# -------------------------------------------------------------------------------------------------------------


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(float(item)) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from error
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_int_list, default=parse_int_list("10e6,100e6"),
                        help="params per flat tensor, comma-separated (default 10e6,100e6)")
    parser.add_argument("--threads", type=parse_int_list, default=[1, 2], help="thread counts (default 1,2)")
    parser.add_argument("--repeat", type=int, default=7, help="timed steps per contender (default 7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--zerocore-bench", type=Path, default=HARNESS,
                        help=f"the C++ harness (default {HARNESS.relative_to(REPO)}, built when missing)")
    parser.add_argument("--no-build", action="store_true", help="do not build the harness when it is missing")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    command = shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]) if argv is None else shlex.join(argv)
    info = zerocore.build_info()
    meta = dict(
        command=command,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        zerocore=info["version"],
        simd=info["simd_best"],
        cpu=cpu_model(),
        cpu_count=os.cpu_count(),
        deepspeed=deepspeed_adam() is not None,
    )
    if not args.json:
        print(f"# {meta['command']}")
        print(f"# {meta['date']}  torch {meta['torch']}  zerocore {meta['zerocore']} ({meta['simd']})  "
              f"{meta['cpu']}, {meta['cpu_count']} CPUs  DeepSpeedCPUAdam: "
              f"{'yes' if meta['deepspeed'] else 'not importable'}")

    harness, why = ensure_harness(args.zerocore_bench, build=not args.no_build)
    if harness is None:
        log(f"warning: no stream harness, so no 'of stream' column: {why}")
        meta["stream_unavailable"] = why

    saved_threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(args.seed)
    fp32_rows: list[dict[str, Any]] = []
    mixed_rows: list[dict[str, Any]] = []
    stream: dict[str, Any] = {}
    try:
        for n in args.sizes:
            streams: dict[int, dict[str, Any]] = {}
            if harness is not None:
                log(f"stream harness: {n:.3g} elements, threads {args.threads}")
                try:
                    streams = stream_bandwidth(harness, n, args.threads, args.repeat)
                except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError, KeyError) as error:
                    log(f"warning: stream harness failed: {error}")
                stream[str(n)] = {str(t): s for t, s in streams.items()}

            contenders = fp32_contenders(n, gen)
            for threads in args.threads:
                torch.set_num_threads(threads)
                ops.set_num_threads(threads)
                log(f"fp32 step: {n:.3g} params, {threads} threads")
                for name, seconds in interleaved_medians(contenders, args.repeat).items():
                    gbps = BYTES_PER_PARAM * n / seconds / 1e9
                    s = streams.get(threads)
                    fp32_rows.append(dict(size=n, threads=threads, contender=name, ms=seconds * 1e3, gbps=gbps,
                                          of_stream=gbps / s["median_gbps"] if s else None))
            del contenders

            mixed = MixedStep(n, gen)
            mixed.zerocore()
            mixed.torch_composed()
            agreement = mixed.check()
            for threads in args.threads:
                torch.set_num_threads(threads)
                ops.set_num_threads(threads)
                log(f"mixed-precision step: {n:.3g} params, {threads} threads")
                times = interleaved_medians({"zerocore": mixed.zerocore, "torch": mixed.torch_composed}, args.repeat)
                mixed_rows.append(dict(size=n, threads=threads, zerocore_ms=times["zerocore"] * 1e3,
                                       torch_ms=times["torch"] * 1e3, speedup=times["torch"] / times["zerocore"],
                                       check=agreement))
            del mixed
    finally:
        torch.set_num_threads(saved_threads)
        ops.set_num_threads(0)

    if args.json:
        print(json.dumps(dict(meta=meta, fp32=fp32_rows, stream=stream, mixed=mixed_rows), indent=1))
        return 0

    print(f"\nfp32 AdamW step, {BYTES_PER_PARAM} B/param (median of {args.repeat}, interleaved)")
    print(f"{'params':>8} {'thr':>3}  {'contender':<22} {'ms/step':>9} {'GB/s':>7} {'of stream':>9}")
    for row in fp32_rows:
        frac = f"{row['of_stream']:.2f}" if row["of_stream"] is not None else "-"
        print(f"{row['size']:>8.3g} {row['threads']:>3}  {row['contender']:<22} {row['ms']:>9.3f} "
              f"{row['gbps']:>7.2f} {frac:>9}")
    if stream:
        print("\nAdam-shaped stream (zerocore-bench stream --kernel adam; median GB/s, faster store kind)")
        for n, per_threads in stream.items():
            cells = "  ".join(f"{t} thr: {s['median_gbps']:.2f} ({s['stores']})" for t, s in per_threads.items())
            print(f"{int(n):>8.3g}  {cells}")
    elif "stream_unavailable" in meta:
        lines = meta["stream_unavailable"].splitlines()
        print(f"\n(no stream harness: {lines[0]}{' ... ' + lines[-1] if len(lines) > 1 else ''})")

    print(f"\nmixed-precision ZeRO step: bf16 grad x {MULTIPLIER:.3g} -> fp32 master/moments -> bf16 params "
          "(target speedup >= 1.3)")
    print(f"{'params':>8} {'thr':>3}  {'zerocore ms':>11} {'torch ms':>9} {'speedup':>8}  check")
    for row in mixed_rows:
        print(f"{row['size']:>8.3g} {row['threads']:>3}  {row['zerocore_ms']:>11.3f} {row['torch_ms']:>9.3f} "
              f"{row['speedup']:>7.2f}x  {row['check']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
