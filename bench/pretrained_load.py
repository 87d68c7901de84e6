"""How a pretrained model's weights reach a sharded (stage 3) run: per rank, the wall time from an empty process
to a model ready to train, the peak memory above the imports, and the bytes of weights read, on ``--world``
Gloo ranks, for the training-step benchmark's GPT saved as Hugging Face safetensors (fp32, one file):

* ``plain``: what a script does without a sharded loader (``from_pretrained``, or DeepSpeed's ``zero.Init``
  path reading on rank 0): every rank builds the model, reads every tensor of the file into a state dict,
  ``load_state_dict``, then ``zerocore.initialize`` shards it;
* ``meta``: every rank builds the model under ``torch.device("meta")``, ``zerocore.initialize`` materializes
  its shards, then ``engine.load_hf_weights(file)`` reads this rank's share of the trainable elements
  (Note [Loading Hugging Face weights]).

Both end with the same engine (checked: the sums of every element of the two full state dicts agree). The file is read
warm from the page cache (it was just written): the figures are memory and CPU, not the disk. Peak memory is
VmHWM after ``/proc/self/clear_refs`` reset it when the ranks start (after the imports).

    python bench/pretrained_load.py [--world 2] [--layers 12 --dim 1024 --seq 128 --vocab 32000] [--rounds 2]
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
from _common import (current_rss_mib, format_table, median, print_header, reset_hwm, run_header,  # noqa: E402
                     run_ranks, vm_hwm_mib)
from _peers import build_model, zerocore_config  # noqa: E402


def _rank(rank: int, world: int, cfg: dict[str, Any], path: str, how: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import zerocore
    import zerocore._hf_weights as hf

    read = [0]
    elements, whole = hf._elements, hf._whole

    def counting(tensor, first, count):
        read[0] += count * tensor.dtype.itemsize
        return elements(tensor, first, count)

    hf._elements = counting
    dist.barrier()
    reset_hwm()
    base = current_rss_mib()
    start = time.perf_counter()
    init_peak = load_extra = None
    if how == "plain":
        model = build_model(cfg)
        tensors = hf._read_headers(path)
        model.load_state_dict({name: whole(t) for name, t in tensors.items()})
        engine = zerocore.initialize(model, zerocore_config(cfg, 3, False, False))
    else:
        with torch.device("meta"):
            model = build_model(cfg)
        engine = zerocore.initialize(model, zerocore_config(cfg, 3, False, False))
        init_peak = vm_hwm_mib() - base
        reset_hwm()
        before_load = current_rss_mib()
        engine.load_hf_weights(path)
        load_extra = vm_hwm_mib() - before_load
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = vm_hwm_mib() - base if init_peak is None else max(init_peak, vm_hwm_mib() - base)
    state = engine.full_state_dict()
    digest = sum(float(v.double().sum()) for v in state.values()) if rank == 0 else None
    engine.close()
    return {"seconds": seconds, "peak_mib": peak, "read_mib": read[0] / 2**20, "digest": digest,
            "load_extra_mib": load_extra}


def _write_weights(cfg: dict[str, Any], path: str) -> int:
    from zerocore._safetensors_io import write_tensors

    model = build_model(cfg)
    write_tensors(path, {k: v.contiguous() for k, v in model.state_dict().items()})
    return os.path.getsize(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "vocab": args.vocab, "batch": 2}
    directory = tempfile.mkdtemp(prefix="zerocore-pretrained-")
    try:
        path = os.path.join(directory, "model.safetensors")
        size = _write_weights(cfg, path)
        print_header(run_header({"world": args.world, "model": cfg, "file_mib": round(size / 2**20, 1)}))
        results: dict[str, list[list[dict[str, Any]]]] = {"plain": [], "meta": []}
        for _ in range(args.rounds):
            for how in results:  # alternated, so drift on this machine hits both
                results[how].append(run_ranks(_rank, args.world, cfg, path, how, timeout=900))
        digests = {how: {r[0]["digest"] for r in rounds} for how, rounds in results.items()}
        rows = []
        for how, rounds in results.items():
            rows.append([how, f"{median([max(r['seconds'] for r in ranks) for ranks in rounds]):.2f}",
                         "/".join(f"{median([ranks[k]['peak_mib'] for ranks in rounds]):.0f}" for k in range(args.world)),
                         "/".join(f"{rounds[0][k]['read_mib']:.0f}" for k in range(args.world))])
        print(format_table(["path", "seconds (slowest rank, median)", "peak MiB above imports (per rank)",
                            "weights read MiB (per rank)"], rows))
        extra = [ranks[k]["load_extra_mib"] for ranks in results["meta"] for k in range(args.world)]
        print(f"# meta: load_hf_weights' own peak above the engine state it started from: at most {max(extra):.0f} MiB")
        same = len(digests["plain"] | digests["meta"]) == 1
        print(f"# the two paths' engines hold the same weights (sum of every element, rank 0): {same} "
              f"({sorted(digests['plain'] | digests['meta'])})")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
