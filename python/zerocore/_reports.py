"""engine.memory_report() and engine.comm_report(): exact bytes held and collectives issued."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._host_params import HostParamShards

if TYPE_CHECKING:
    from .engine import Engine


def memory_report(engine: Engine) -> dict[str, Any]:
    """Bytes this rank holds for model state, itemized, beside ZeRO's formula for the stage.

    ``psi`` counts trainable elements; ``psi_padded`` adds the layout's alignment and bucket padding,
    which the buffers really hold and the formula is evaluated on. Master params cost nothing extra in
    fp32 training (the rank's shard of the parameter buffer is the master).
    """
    items = {"params": 0, "grads": 0, "master_params": 0, "optimizer_moments": 0}
    for buffer in engine.buffers:
        for key, value in buffer.memory().items():
            items[key] += value
    state = engine.optimizer_state.memory()
    nvme = {"file_bytes": state.pop("nvme_bytes"), "bytes_read": 0, "bytes_written": 0,
            "param_file_bytes": 0, "param_bytes_read": 0, "param_bytes_written": 0}
    if engine.optimizer_state.store is not None:
        nvme["bytes_read"] = engine.optimizer_state.store.bytes_read
        nvme["bytes_written"] = engine.optimizer_state.store.bytes_written
    items.update(state)
    files = engine.param_file  # offload_param: nvme (Note [NVMe parameter shards]), or cpu on a GPU
    items["nvme_param_buffers"] = 0 if files is None else files.bounce.numel() + files.ahead.numel()
    # offload_param: cpu on a GPU (Note [Host parameter shards])
    items["param_offload"] = files.host_bytes if isinstance(files, HostParamShards) else 0
    nvme["param_reads_ahead_used"] = 0
    if files is not None:
        nvme.update(param_file_bytes=files.size, param_bytes_read=files.bytes_read,
                    param_bytes_written=files.bytes_written, param_reads_ahead_used=files.reads_ahead_used)
    if engine.stage3 is not None:
        items.update(engine.stage3.memory())
    items["reduce_buckets"] = engine.reducer.peak_buffer_bytes
    items["allgather_buckets"] = 0  # the all-gather fills the parameter buffer in place
    # Nothing else is held between steps: the step's norm and overflow checks allocate scalars only.
    items["temporaries"] = 0
    # frozen parameters: stage 3's shards (Note [Frozen shards]), and those held whole
    held = {id(p) for buffer in engine.param_storages for p in buffer.params}
    items["frozen_params"] = (sum(buffer.memory()["params"] for buffer in engine.frozen_buffers)
                              + sum(p.numel() * p.element_size() for p in engine.module.parameters() if id(p) not in held))
    psi, psi_padded = _psi(engine)
    n = engine.world_size
    width = torch.empty((), dtype=engine.compute_dtype).element_size()
    optimizer_k = 8 if engine.compute_dtype == torch.float32 else 12
    # gradients accumulate in the compute dtype, or in fp32 (Note [fp32 gradient accumulation])
    g_width = torch.empty((), dtype=engine.config.accumulation_dtype).element_size()
    grads = g_width * psi_padded if engine.stage == 1 else g_width * psi_padded // n
    formula = {
        "params": width * psi_padded if engine.stage < 3 else width * psi_padded // n,
        "grads": grads,
        "optimizer_state": optimizer_k * psi_padded // n,
    }
    formula["total"] = sum(formula.values())
    model_state = items["params"] + items["grads"] + items["master_params"] + items["optimizer_moments"]
    return {
        "stage": engine.stage,
        "world_size": n,
        "compute_dtype": str(engine.compute_dtype).replace("torch.", ""),
        "psi": psi,
        "psi_padded": psi_padded,
        "bytes": items,
        "model_state_bytes": model_state,
        "total_bytes": sum(items.values()),
        "formula": formula,
        "formula_text": {
            1: f"{width}Psi + {g_width}Psi + {optimizer_k}Psi/N",
            2: f"{width}Psi + ({g_width}+{optimizer_k})Psi/N",
            3: f"({width}+{g_width}+{optimizer_k})Psi/N",
        }[engine.stage],
        "ddp_bytes": (2 * width + optimizer_k) * psi,
        # where the optimizer state lives, and on NVMe the files' sizes and the bytes moved so far (the
        # optimizer state's; param_*: the parameter shards' with offload_param: nvme)
        "optimizer_placement": _placement(engine),
        "nvme": nvme,
        # the CUDA caching allocator's counters (None on the CPU): Note [Allocator pressure] in _allocator.py
        "allocator": engine.allocator.report(),
    }


def _placement(engine: Engine) -> str:
    state = engine.optimizer_state
    return "nvme" if state.store is not None else state.placement.type


_COUNTS = ("calls", "logical_elements", "algorithm_bytes", "backend_calls", "unquantized_bytes")


def comm_report(engine: Engine) -> dict[str, Any]:
    """Collectives issued since the last ``reset_comm_stats()``, counted in C++ where they are issued.

    ``logical_elements`` is the collective's size as ZeRO defines it (a reduce-scatter of a bucket counts
    the whole bucket); ``algorithm_bytes`` the bytes this rank sent under the algorithm actually used;
    ``unquantized_bytes`` what a ring would have sent in the bucket's own dtype (equal to ``algorithm_bytes``
    unless ZeRO++ quantized it). Stage 3's gathers inside an hpZ partition are listed as
    ``hpz_partition:<label>``; every other entry is a collective over the whole group.
    """
    stats: dict[str, dict[str, int]] = {}
    for where, comm in engine.comms.all().items():
        prefix = "" if where != "hpz_partition" else "hpz_partition:"  # gathers that never leave the partition
        for op, s in comm.stats().items():
            counts = stats.setdefault(prefix + op, dict.fromkeys(_COUNTS, 0))
            for key in _COUNTS:
                counts[key] += getattr(s, key)
    steps = engine.steps_since_comm_reset
    per_step = {op: {key: value / steps for key, value in counts.items()} for op, counts in stats.items()} if steps else {}
    return {
        "optimizer_steps": steps,
        "per_step": per_step,
        "backend": engine.comm.backend,
        "algorithms": {"reduce_scatter": engine.comm.reduce_scatter_algo, "all_gather": engine.comm.all_gather_algo,
                       "parameter_all_gather": engine.comms.weights.all_gather_algo},
        # host memory the "shared_memory" algorithms map for their transport (Note [Shared-memory collectives])
        "shared_memory_bytes": sum(comm.shared_memory_bytes for comm in engine.comms.all().values()),
        # what gradient buckets travel in: the reduce dtype, or 16-bit gradients summed in fp32 at the receiver
        # (Note [Widening reduce-scatter])
        "gradient_wire_dtype": str(engine.reducer.wire_dtype).removeprefix("torch."),
        "collectives": stats,
        "psi_padded": _psi(engine)[1],
        "buckets": engine.buckets.report() if engine.stage3 is None else {
            "reduce_bucket_elements": None, "reduce_bucket_source": "stage 3: one bucket per unit",
            "prefetch_elements": engine.stage3.prefetch_elements, "prefetch_source": engine.stage3.prefetch_source},
        "host_syncs": engine.host_syncs,
        "host_syncs_per_step": engine.host_syncs / steps if steps else None,
        "ddp_all_reduce_elements_per_step": _psi(engine)[0],
        # optimizer state moved to and from NVMe since the last reset (zeros without NVMe offload)
        "nvme_io": _nvme_io(engine, steps),
    }


def _nvme_io(engine: Engine, steps: int) -> dict[str, Any]:
    store = engine.optimizer_state.store
    read, written = (store.bytes_read, store.bytes_written) if store is not None else (0, 0)
    return {"bytes_read": read, "bytes_written": written,
            "bytes_read_per_step": read / steps if steps else None,
            "bytes_written_per_step": written / steps if steps else None}


def _psi(engine: Engine) -> tuple[int, int]:
    """(trainable elements, elements of the flat buffers that hold them, padding included)."""
    psi = sum(p.numel() for buffer in engine.buffers for p in buffer.params)
    return psi, sum(buffer.layout.total_size for buffer in engine.buffers)
