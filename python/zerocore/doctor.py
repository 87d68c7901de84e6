"""``zerocore.doctor()`` and ``python -m zerocore.doctor``: what this machine gives a configuration before a long
run is launched on it, measured rather than assumed.

Note [Doctor]
-------------
Offloaded runs fail or crawl for reasons a config cannot show: an ``nvme_path`` on tmpfs (RAM, so offloading
saves nothing) or on a file system without O_DIRECT, a disk too slow or too full for the state, more ranks
than cores (the CPU Adam starves), more host memory planned than the machine has, a ``memlock`` limit below the
pinned buffers. The doctor checks each one with the engine's own parts: the memory plan is
``estimate_memory``'s (the engine's layout code), the disk is measured through the same C++ I/O engine and
``aio`` settings the optimizer state file uses (a nameless file written, synced, evicted from the page cache and
read back, so the read comes from the disk), and the optimizer's speed is the CPU Adam kernel's own, timed here
at the threads a rank gets. From those it predicts the optimizer phase of a step on this node: each rank
reads and writes its whole state file once per step (and, with ``offload_param: nvme``, reads its parameter
shards for the forward and the backward gathers and writes them after the step), the node's ranks sharing the
disk, while the Adam kernel runs on their shards; the step pipelines the two, so the slower one sets the time,
and the doctor names it. Every check answers ``ok``, ``warn`` or ``fail`` with what to do.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ._deepspeed_json import load_json
from ._hf_auto import PRECISIONS, for_planning
from ._info import build_info, cpu_cores
from ._native import _C
from ._nvme_state import NamelessFile
from ._safetensors_io import aligned_empty, open_io
from .config import ZeroConfig
from .estimate import estimate_memory

_NOT_DISKS = {"tmpfs": "RAM, so state offloaded there takes the memory offloading was to save",
              "ramfs": "RAM, so state offloaded there takes the memory offloading was to save",
              "overlay": "a container's overlay, usually slow and without O_DIRECT: mount a disk instead",
              "nfs": "a network file system: every step's state would cross the network",
              "nfs4": "a network file system: every step's state would cross the network"}


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    detail: str


def doctor(config: ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None, *,
           params: int | nn.Module | None = None, world_size: int | None = None, local_world_size: int | None = None,
           nvme_paths: Iterable[str] = (), probe_bytes: int = 256 << 20, precision: str | None = None,
           hidden_size: int | None = None) -> dict[str, Any]:
    """Checks this machine for ``config`` (Note [Doctor]).

    Args:
        config: a DeepSpeed config (dict or JSON path) or a :class:`ZeroConfig`; its ``nvme_path``s are probed.
        params: the model (built under ``torch.device("meta")`` when large) or its trainable parameter count
            (planned as one flat tensor, ``estimate_memory``'s approximation): plans the memory per rank and
            predicts the optimizer phase of a step.
        world_size: data-parallel ranks of the run (default: ``WORLD_SIZE`` from the environment, else 1).
        local_world_size: ranks on this machine (default: ``LOCAL_WORLD_SIZE``, else ``world_size``).
        nvme_paths: more directories to probe.
        probe_bytes: bytes written to and read back from each directory (rounded up to 4 KiB).
        precision, hidden_size: for a Hugging Face Trainer's DeepSpeed config (dict or path), whose "auto"
            training arguments (lr, clipping, ...) change no byte of the plan: "bf16", "fp16" or "fp32" overrides
            its precision (and settles an "auto" one), ``hidden_size`` gives its "auto" bucket sizes.

    Returns:
        ``{"ok": no check failed, "checks": [{"name", "status", "detail"}], "disks": {path: measurements},
        "cpu": {...}, "gpus": [per visible GPU: memory and pinned copy GB/s], "plan": estimate_memory's result
        or None, "prediction": {...} or None}``.
    """
    if precision is not None and precision not in PRECISIONS:  # the caller's argument, not the config's
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or None, got {precision!r}")
    checks: list[Check] = []
    parsed = _read_config(config, checks, precision, hidden_size)
    world = int(world_size or os.environ.get("WORLD_SIZE", 1))
    local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", 0) or world)
    if world < 1 or not 1 <= local <= world:
        raise ValueError(f"world_size must be >= 1 and local_world_size in [1, world_size], got {world} and {local}")
    offloads = _offload_devices(parsed)
    _check_build(checks)
    cpu = _check_cpu(checks, local, offloads)
    gpus = _check_gpus(checks, min(probe_bytes, 1 << 30)) if torch.cuda.is_available() else []
    plan = None
    if params is not None and parsed is not None:
        plan = estimate_memory(params, parsed, world)
        _check_memory(checks, plan, local, parsed)
    paths = list(dict.fromkeys([*_nvme_paths(parsed), *nvme_paths]))
    aio = parsed.aio.settings() if parsed is not None else {}
    disks = {path: _check_disk(checks, path, aio, probe_bytes, _nvme_bytes(plan, parsed, path) * local)
             for path in paths}
    prediction = None
    if plan is not None and offloads:
        prediction = _predict(checks, plan, world, local, cpu, disks, parsed)
    return {"ok": all(c.status != "fail" for c in checks), "checks": [asdict(c) for c in checks], "disks": disks,
            "cpu": cpu, "gpus": gpus, "plan": plan, "prediction": prediction}


def _read_config(config: Any, checks: list[Check], precision: str | None,
                 hidden_size: int | None) -> ZeroConfig | None:
    if config is None or isinstance(config, ZeroConfig):
        return config
    try:
        data = load_json(config) if isinstance(config, (str, os.PathLike)) else config
        return ZeroConfig.from_deepspeed(for_planning(data, precision, hidden_size), hidden_size=hidden_size)
    except (ValueError, TypeError, OSError) as error:
        checks.append(Check("config", "fail", str(error)))
        return None


def _offload_devices(config: ZeroConfig | None) -> set[str]:
    if config is None:
        return set()
    zero = config.zero_optimization
    return {zero.offload_optimizer.device, zero.offload_param.device} - {"none"}


def _nvme_paths(config: ZeroConfig | None) -> list[str]:
    if config is None:
        return []
    zero = config.zero_optimization
    return [o.nvme_path for o in (zero.offload_optimizer, zero.offload_param) if o.device == "nvme" and o.nvme_path]


def _nvme_bytes(plan: dict[str, Any] | None, config: ZeroConfig | None, path: str) -> int:
    """One rank's bytes in files under ``path`` (the optimizer state's and the parameter shards')."""
    if plan is None or config is None:
        return 0
    zero = config.zero_optimization
    return sum(plan[key] for offload, key in ((zero.offload_optimizer, "nvme_file_bytes"),
                                              (zero.offload_param, "nvme_param_file_bytes"))
               if offload.device == "nvme" and offload.nvme_path == path)


def _check_build(checks: list[Check]) -> None:
    info = build_info()
    detail = (f"zerocore {info['version']}, CPU kernels {info['simd_active']} (best this CPU runs: "
              f"{info['simd_best']}), CUDA kernels {'built' if info['cuda_compiled'] else 'not built'}")
    status = "ok"
    if info["simd_active"] != info["simd_best"]:
        status, detail = "warn", detail + "; the kernels run a narrower path than this CPU supports (ZEROCORE_SIMD?)"
    if info["cuda_available"] and not info["cuda_compiled"]:
        status, detail = "warn", detail + ("; a GPU is present but the CUDA kernels were not built: reinstall with "
                                           "nvcc on the PATH")
    checks.append(Check("build", status, detail))


def _rank_threads(local: int) -> int:
    """The intra-op threads a rank of the run gets (the CPU Adam's too): OMP_NUM_THREADS when set, else what
    torchrun sets for several ranks per machine (1), else torch's default."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return 1 if local > 1 else torch.get_num_threads()


def _check_cpu(checks: list[Check], local: int, offloads: set[str]) -> dict[str, Any]:
    cores = cpu_cores()
    per_rank = max(1, cores // local)
    threads = _rank_threads(local)
    # the kernels' own rule (Note [Kernel threads under torchrun]), under torchrun's default where it applies
    omp = os.environ.get("OMP_NUM_THREADS", "1" if local > 1 else None)
    adam = _C.default_kernel_threads(threads, omp, str(local), cores)
    detail = (f"{cores} cores for {local} rank(s) here: {cores / local:g} per rank; each rank computes on {threads} "
              "thread(s) (OMP_NUM_THREADS" + (")" if "OMP_NUM_THREADS" in os.environ else ", or torchrun's default)"))
    if offloads:
        detail += f", its offloaded optimizer's CPU Adam on {adam}"
    status = "ok"
    if cores < local:
        status, detail = "warn", detail + "; more ranks than cores: every rank's compute and I/O threads queue"
    elif threads * local > cores:
        status, detail = "warn", (detail + f"; {threads} threads x {local} ranks oversubscribe the cores: set "
                                  f"OMP_NUM_THREADS={per_rank}")
    elif offloads and adam < per_rank:
        status, detail = "warn", (detail + f"; that CPU Adam runs on {adam} thread(s) while {per_rank} cores per rank "
                                  f"are there: set OMP_NUM_THREADS={per_rank} (or zerocore.ops.set_num_threads("
                                  f"{per_rank}) in each rank)")
    if offloads and cores / local < 2:
        status, detail = "warn", detail + ("; offloading runs the optimizer on the CPU, which then shares one core "
                                           "with the rank's other work: fewer ranks per node, or more cores")
    checks.append(Check("cpu", status, detail))
    return {"cores": cores, "ranks_here": local, "cores_per_rank": cores / local, "rank_threads": threads,
            "adam_threads": min(adam, per_rank)}  # what oversubscribed threads get of the cores


def _check_gpus(checks: list[Check], nbytes: int) -> list[dict[str, Any]]:
    """Each visible GPU's memory and its copies to and from pinned host memory (offloaded state crosses them
    every step)."""
    gib, gpus = 2**30, []
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:  # (a memlock limit below the probe, typically)
        checks.append(Check("pinned memory", "warn", f"pinning {nbytes} bytes failed ({error}): raise `ulimit -l`, "
                            "or set pin_memory false (copies from pageable memory are slower)"))
        return gpus
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            free, total = torch.cuda.mem_get_info()
            device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            rates = {}
            for name, dst, src in (("h2d_gbps", device, host), ("d2h_gbps", host, device)):
                dst.copy_(src, non_blocking=True)  # (warm)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                rates[name] = nbytes / (start.elapsed_time(end) / 1e3) / 1e9
            del device
        gpus.append({"index": index, "name": torch.cuda.get_device_name(index), "total_bytes": total,
                     "free_bytes": free, **rates})
        checks.append(Check(f"gpu {index}", "ok", f"{gpus[-1]['name']}, {total / gib:,.1f} GiB ({free / gib:,.1f} "
                            f"free), pinned host to device {rates['h2d_gbps']:.1f} GB/s, device to host "
                            f"{rates['d2h_gbps']:.1f} GB/s"))
    return gpus


def _meminfo() -> dict[str, int]:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def _check_memory(checks: list[Check], plan: dict[str, Any], local: int, config: ZeroConfig) -> None:
    gib = 2**30
    host = plan["host_bytes"] * local
    info = _meminfo()
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    largest = sorted(((v, k) for k, v in plan["bytes"].items() if plan["where"][k] == "host" and v), reverse=True)
    most = ", ".join(f"{key} {value / gib:,.2f}" for value, key in largest[:3])
    detail = (f"the plan holds {host / gib:,.2f} GiB of host memory on this machine ({local} rank(s) x "
              f"{plan['host_bytes'] / gib:,.2f} GiB: most in {most}) between steps")
    if plan["approximate"]:  # one bucket as large as the shard: the largest sub-group a model could have
        detail += (" (a parameter count is planned as one flat tensor: NVMe buffers as large as they can be; "
                   "pass the model built under torch.device('meta') for its own)")
    if total is None:
        checks.append(Check("host memory", "warn", detail + "; /proc/meminfo unreadable, nothing to compare with"))
    elif host > total:
        zero = config.zero_optimization
        if largest and largest[0][1] == "nvme_buffers":
            way = ("lower zero_optimization.sub_group_size: the NVMe pipeline holds three sub-groups of fp32 master "
                   f"and moments (now {zero.sub_group_size:,} elements each)")
        elif zero.offload_optimizer.device != "nvme":
            way = "offload the optimizer state to NVMe (and at stage 3 the parameters), or use more machines"
        else:
            way = "use more machines, or offload stage 3's parameters to NVMe too"
        checks.append(Check("host memory", "fail", detail + f", more than its {total / gib:,.2f} GiB: {way}"))
    elif available is not None and host > available:
        checks.append(Check("host memory", "warn", detail + f", more than the {available / gib:,.2f} GiB free now "
                            "(other processes, or the page cache the kernel gives back)"))
    else:
        checks.append(Check("host memory", "ok", detail + f"; the machine has {total / gib:,.2f} GiB"))
    if plan["device_bytes"] and torch.cuda.is_available():
        free, whole = torch.cuda.mem_get_info()
        status = "fail" if plan["device_bytes"] > whole else "warn" if plan["device_bytes"] > free else "ok"
        checks.append(Check("device memory", status, f"{plan['device_bytes'] / gib:,.2f} GiB per rank planned "
                            f"between steps, on a device of {whole / gib:,.2f} GiB ({free / gib:,.2f} free)"))
    pinned = plan["pinned_host"] and torch.cuda.is_available()
    if pinned:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        need = plan["host_bytes"]
        if soft != resource.RLIM_INFINITY and soft < need:
            checks.append(Check("memlock", "warn", f"pin_memory pins about {need / gib:,.2f} GiB per rank but "
                                f"`ulimit -l` allows {soft / gib:,.2f} GiB: raise it, or set pin_memory false"))


def _filesystem(path: str) -> str:
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def _check_disk(checks: list[Check], path: str, aio: Mapping[str, Any], probe_bytes: int,
                needed: int) -> dict[str, Any]:
    name = f"nvme_path {path}"
    path = os.path.abspath(path)
    result: dict[str, Any] = {"filesystem": _filesystem(path)}
    try:
        result["free_bytes"] = shutil.disk_usage(path).free
        probe = NamelessFile(open_io(aio), path, name, "zerocore-doctor")
    except OSError as error:
        checks.append(Check(name, "fail", str(error)))
        return result
    try:
        result.update(_measure(probe, -(-probe_bytes // 4096) * 4096))
    except OSError as error:
        checks.append(Check(name, "fail", f"the probe file failed: {error}"))
        return result
    finally:
        probe.close()
    gib = 2**30
    detail = (f"{result['filesystem']}, {'O_DIRECT' if result['direct'] else 'no O_DIRECT (page cache)'}, write "
              f"{result['write_gbps']:.2f} GB/s, read {result['read_gbps']:.2f} GB/s, both at once "
              f"{result['read_write_gbps']:.2f} GB/s, "
              f"{result['free_bytes'] / gib:,.1f} GiB free")
    status = "ok"
    if result["filesystem"] in _NOT_DISKS:
        status, detail = "warn", detail + f": {_NOT_DISKS[result['filesystem']]}"
    elif not result["direct"]:
        status, detail = "warn", detail + ": the state's pages pass through the page cache, taking host memory"
    if needed > result["free_bytes"]:
        status, detail = "fail", detail + (f"; the plan's files need {needed / gib:,.2f} GiB here: free space, or "
                                           "another nvme_path")
    elif needed:
        detail += f"; the plan's files need {needed / gib:,.2f} GiB"
    checks.append(Check(name, status, detail))
    return result


def _measure(probe: NamelessFile, nbytes: int) -> dict[str, Any]:
    """Sequential write (synced) and read (after evicting the file's pages) of ``nbytes`` through the engine."""
    io, handle = probe.io, probe.handle

    def evict() -> None:  # clean pages of a synced file go: the reads after it come from the disk
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(probe.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    buffer = aligned_empty(nbytes)
    buffer.random_()  # (compressing or deduplicating devices would flatter zeros)
    start = time.perf_counter()
    io.write(handle, 0, buffer)
    io.wait_all()
    io.fsync(handle)
    write_s = time.perf_counter() - start
    evict()
    start = time.perf_counter()
    io.read(handle, 0, buffer)
    io.wait_all()
    read_s = time.perf_counter() - start
    # the step's pipeline reads one sub-group while it writes another back: both directions at once, which a
    # disk serves faster together than one after the other
    half = nbytes // 2 // 4096 * 4096
    evict()
    start = time.perf_counter()
    io.read(handle, 0, buffer[:half])
    io.write(handle, half, buffer[half:2 * half])
    io.wait_all()
    io.fsync(handle)
    mixed_s = time.perf_counter() - start
    return {"direct": bool(io.direct(handle)), "probe_bytes": nbytes, "write_gbps": nbytes / write_s / 1e9,
            "read_gbps": nbytes / read_s / 1e9, "read_write_gbps": 2 * half / mixed_s / 1e9}


def _adam_elements_per_second(threads: int) -> float:
    from . import ops

    n = 1 << 22
    param, grad, exp_avg, exp_avg_sq = (torch.randn(n) for _ in range(4))
    exp_avg_sq.abs_()
    before = ops.get_num_threads()
    ops.set_num_threads(threads)
    try:
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3)  # (warm: pages, pool threads)
        best = float("inf")
        for step in range(2, 5):
            start = time.perf_counter()
            ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=1e-3)
            best = min(best, time.perf_counter() - start)
    finally:
        ops.set_num_threads(before)
    return n / best


def _predict(checks: list[Check], plan: dict[str, Any], world: int, local: int, cpu: dict[str, Any],
             disks: dict[str, dict[str, Any]], config: ZeroConfig) -> dict[str, Any]:
    """Per step on this node: the optimizer phase (the CPU Adam against the state files' disk time, pipelined)
    and the parameter shards' disk time (read for the forward's and the backward's gathers, written after the
    update)."""
    zero = config.zero_optimization

    def disk_seconds(offload: Any, nbytes: int, passes: int) -> float:
        disk = disks.get(offload.nvme_path or "", {})
        if offload.device != "nvme" or "read_write_gbps" not in disk:
            return 0.0  # (reads and writes overlap as in the probe's mixed pass; the node's ranks share the disk)
        return passes * nbytes * local / (disk["read_write_gbps"] * 1e9)

    state_s = disk_seconds(zero.offload_optimizer, plan["nvme_file_bytes"], 2)
    param_s = disk_seconds(zero.offload_param, plan["nvme_param_file_bytes"], 3)
    parts, adam_s = [], None
    if zero.offload_optimizer.device != "none":
        shard = -(-plan["psi_padded"] // world)
        adam_s = shard / _adam_elements_per_second(cpu["adam_threads"])
        parts.append(f"the CPU Adam on a rank's {shard:,} elements takes {adam_s:.3f} s at {cpu['adam_threads']} "
                     "thread(s)")
    phase = max(state_s, adam_s or 0.0)
    bound = "disk" if state_s > (adam_s or 0.0) else "cpu"
    if state_s:
        parts.append(f"the node's disk reads and writes the {local} rank(s)' optimizer state in {state_s:.3f} s: the "
                     f"optimizer phase takes about {phase:.3f} s, bound by the {'disk' if bound == 'disk' else 'CPU'}")
    nothing_offloaded = zero.offload_param.device == "nvme" and not plan["nvme_param_file_bytes"]
    if nothing_offloaded:
        parts.append(f"offload_param puts nothing on the disk: max_in_cpu ({zero.offload_param.max_in_cpu:,} "
                     "elements) keeps every parameter shard in memory; lower it to offload them")
    elif param_s:
        parts.append(f"the parameter shards take {param_s:.3f} s of disk time (read for the forward's and the "
                     "backward's gathers, written after the update)")
    checks.append(Check("prediction", "warn" if nothing_offloaded else "ok", "per step, " + "; ".join(parts)))
    return {"adam_seconds": adam_s, "state_io_seconds": state_s, "param_io_seconds": param_s,
            "optimizer_phase_seconds": phase, "bound_by": bound}


# ---- python -m zerocore.doctor ----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zerocore.doctor``: prints the checks (or JSON); 1 when one failed, 2 on bad arguments."""
    from ._doctor_cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
