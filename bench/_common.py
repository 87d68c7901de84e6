"""Shared helpers for the Python benchmarks: a bounded spawn-based Gloo rank runner, RSS probes, the run header
and a plain-text table printer.

``run_ranks(fn, world, *args, timeout=...)`` runs ``fn(rank, world, *args)`` in ``world`` fresh spawned processes
(Gloo over loopback, 1 intra-op and 1 inter-op thread each) and returns the per-rank results. Any rank error,
a rank that dies, or a run that exceeds ``timeout`` seconds raises ``BenchError``, and every child still alive
is killed, so a benchmark can never hang forever.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import platform
import queue as queue_module
import resource
import shlex
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

THREADS_PER_RANK = 1


class BenchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_thread_env() -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(THREADS_PER_RANK)


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Any,
            pg_timeout: float) -> None:
    _set_thread_env()
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(THREADS_PER_RANK)
    try:
        torch.set_num_interop_threads(THREADS_PER_RANK)
    except RuntimeError:
        pass
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 600.0,
              pg_timeout: float | None = None) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` fresh spawned Gloo ranks, bounded by ``timeout`` seconds."""
    _set_thread_env()  # inherited by the children before they import torch
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    pg_timeout = pg_timeout if pg_timeout is not None else max(30.0, timeout)
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, out, pg_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world)) - set(outcomes))
                raise BenchError(f"ranks {missing} did not finish within {timeout:.0f}s")
            try:
                rank, status, payload = out.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (status, payload)
                if status == "error":  # the other ranks would only wait for this one
                    break
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in outcomes]
                if dead:
                    raise BenchError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
    if errors:
        raise BenchError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [outcomes[r][1] for r in range(world)]


# ---- measurements ---------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def current_rss_mib() -> float:
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)
    except OSError:
        return float("nan")


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


# ---- reporting ------------------------------------------------------------------------------------------------
def run_header(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    header = {
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads_per_rank": {"intra_op": THREADS_PER_RANK, "inter_op": THREADS_PER_RANK,
                             "OMP_NUM_THREADS": THREADS_PER_RANK},
        "backend": "gloo (loopback)",
    }
    header.update(extra or {})
    return header


def print_header(header: dict[str, Any]) -> None:
    for key, value in header.items():
        if key == "load_average" and value:
            value = " ".join(f"{v:.2f}" for v in value)
        print(f"# {key}: {value}")


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns are left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in columns]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(v.rjust(w) if n and i >= left else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def vm_hwm_mib() -> float:
    """The address space's high-water RSS (VmHWM), which /proc/self/clear_refs can reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_hwm() -> bool:
    """Resets VmHWM (and with it ru_maxrss) to the current RSS (Linux >= 4.0); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
