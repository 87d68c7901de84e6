"""Checkpoint save and load throughput, and consolidation to one fp32 file, against peers in the same run
(issue 10). Every system checkpoints the same model (the training-step benchmark's GPT) after one step on the
same data, on ``--world`` Gloo ranks:

* the disk's own sequential bandwidth: each rank writes (and fsyncs) then reads back a file of the size of
  its zerocore checkpoint shard, in 16 MiB blocks;
* zerocore ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (stage 2, fp32);
* ``torch.distributed.checkpoint`` (DCP) ``save`` / ``load`` of DDP's model and ``AdamW(fused=True)`` state,
  the same tensors a DDP user checkpoints, through ``get_state_dict`` as torch's recipe (and FSDP2) does (DCP
  fsyncs its files, its default); then the zerocore engine's ``load_checkpoint`` of that DCP checkpoint (a run
  moving from DDP or FSDP mid-training, Note [DCP checkpoints]), timed as the zerocore load;
* DeepSpeed ZeRO-2 (fp32, ``AdamW(fused=True)`` client optimizer, built as in ``_peers.py``)
  ``engine.save_checkpoint`` / ``engine.load_checkpoint``, when ``import deepspeed`` works, then the zerocore
  engine's ``load_checkpoint`` of that DeepSpeed checkpoint (Note [DeepSpeed checkpoints]). DeepSpeed does
  not fsync what it writes; its save is shown without and with an fsync of its files (by the rank that
  wrote each), the latter being what zerocore's and DCP's saves include;
* consolidation of the last round's checkpoints into one fp32 safetensors file, each tool's command line run
  as a child process: ``python -m zerocore.checkpoint to-hf CKPT OUT`` against DeepSpeed's
  ``python CKPT/zero_to_fp32.py CKPT OUT --safe_serialization`` (both with their default 5 GB shard size, so
  one file here), ``python -m zerocore.checkpoint to-dcp CKPT OUT`` (the model and the AdamW state as a
  DCP directory FSDP2 resumes from), and ``python -m zerocore.checkpoint to-deepspeed CKPT OUT`` (a DeepSpeed
  universal checkpoint) against DeepSpeed's ``python -m deepspeed.checkpoint.ds_to_universal --input_folder
  CKPT/<tag> --output_folder OUT --inject_missing_state`` (the same universal form, from DeepSpeed's own
  checkpoint), with the child's wall time and peak RSS (``os.wait4`` in a fresh wrapper process, see
  ``_rss.py``). The peak RSS of the same command with ``--help`` (the interpreter and the tool's imports) is
  reported next to it, and so are the model's largest tensor and total fp32 bytes, to read "peak RSS above
  the imports" against. Both children inherit ``OMP_NUM_THREADS=1`` from the rank runner.

Reads are cold: before every timed read (disk read, every load, both consolidations) rank 0 fsyncs the files
of the directory about to be read and drops them from the page cache (``posix_fadvise(DONTNEED)``, no root
needed; ``_pagecache.py``), then all ranks meet at a barrier; ``mincore`` checks what is left cached.
``--warm`` skips the eviction (reads then come from the page cache). Writes are timed as the tools do them
(zerocore and DCP include their fsync). A zerocore load returns with the stages 1-2 parameter all-gathers
in flight, as ``step()`` does (the next forward lands them): its row times the load until it returns on
every rank, and the row "+ parameters landed" until every rank has also waited for those gathers.

    python bench/checkpoint.py [--world 2] [--layers 6 --dim 512 --seq 128 --vocab 8192] [--rounds 3]
                               [--warm] [--no-deepspeed] [--json] [--dir DIR]

Prints per system the median over ``--rounds`` of the slowest rank's seconds, GB/s of the bytes it wrote or
read (all ranks together), the ratio of that rate to the disk's, and the speed ratio on the same model
against DCP and DeepSpeed (their seconds over this row's: above 1 is faster; DeepSpeed's save counted with
the fsync). DCP and DeepSpeed need numpy: run it with the DeepSpeed venv (``.venv-ds/bin/python``). Without
numpy or DeepSpeed their rows are left out, with the reason printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import format_table, median, print_header, run_header, run_ranks  # noqa: E402
from _pagecache import evict_tree, files_under, fsync_tree, resident_fraction  # noqa: E402
from _peers import ADAMW, batch, build_model, deepspeed_config, loss_of, zerocore_config  # noqa: E402
from _rss import run_isolated  # noqa: E402

BLOCK = 16 << 20


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def _write_file(path: str, nbytes: int) -> None:
    block = memoryview(os.urandom(BLOCK))
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[: min(left, BLOCK)])
            left -= BLOCK
        f.flush()
        os.fsync(f.fileno())


def _read_file(path: str) -> None:
    buf = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _deepspeed_available() -> tuple[str | None, str]:
    """(version, "") when ``import deepspeed`` works here, else (None, why not); its import chatter goes to
    stderr so that --json keeps stdout clean."""
    from _peers import deepspeed_status

    with contextlib.redirect_stdout(sys.stderr):
        return deepspeed_status()


def _rank_main(rank: int, world: int, cfg: dict[str, Any], root: str, rounds: int, warm: bool,
               with_dcp: bool, with_ds: bool) -> dict[str, Any]:
    sys.stdout.flush()
    os.dup2(2, 1)  # anything a library prints goes to stderr: stdout is the parent's table or JSON
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zerocore

    keys = ["disk_write", "disk_read", "zc_save", "zc_load", "zc_load_landed"]
    if with_dcp:
        keys += ["dcp_save", "dcp_load", "zc_load_dcp", "zc_load_dcp_landed"]
    if with_ds:
        keys += ["ds_save", "ds_save_fsync", "ds_load", "zc_load_ds", "zc_load_ds_landed"]
    out: dict[str, Any] = {k: [] for k in keys}
    out["resident_after_evict"] = []
    x, y = batch(cfg, 0, rank)

    engine = zerocore.initialize(build_model(cfg), zerocore_config(cfg, 2, False, False))
    engine.backward(loss_of(engine(x), y))
    engine.step()

    ddp = DDP(build_model(cfg), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), **ADAMW, fused=True)
    loss_of(ddp(x), y).backward()
    opt.step()

    ds = None
    if with_ds:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed

            model = build_model(cfg)
            ds, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True,
                                                                                        **ADAMW),
                                               config=deepspeed_config(cfg, 2, False))
        ds.backward(loss_of(ds(x), y))
        ds.step()

    def cold(path: str) -> None:
        """Rank 0 drops ``path``'s files from the page cache; every rank waits for it."""
        if rank == 0 and not warm:
            evict_tree(path)
            out["resident_after_evict"].append(resident_fraction(path))
        dist.barrier()

    # The timing barriers use a group of their own: on the engine's group a barrier would queue behind the
    # parameter all-gathers a zerocore load leaves in flight (as step() does), and time them as the load's.
    clock = dist.new_group(backend="gloo")

    def timed(key: str, fn: Any, *args: Any, then: tuple[str, Any] | None = None, **kwargs: Any) -> None:
        """``key``: until ``fn`` returned on every rank; ``then=(key2, fn2)``: also until ``fn2`` did after it."""
        dist.barrier(group=clock)
        start = time.perf_counter()
        fn(*args, **kwargs)
        dist.barrier(group=clock)
        out[key].append(time.perf_counter() - start)
        if then is not None:
            then[1]()
            dist.barrier(group=clock)
            out[then[0]].append(time.perf_counter() - start)

    sizes: dict[str, int] = {}
    for r in range(rounds):
        last = r == rounds - 1
        zc = os.path.join(root, f"zc{r}")
        timed("zc_save", engine.save_checkpoint, zc)
        sizes["zc"] = _dir_bytes(zc)
        cold(zc)
        timed("zc_load", engine.load_checkpoint, zc, then=("zc_load_landed", engine.land_param_gathers))

        # the disk: each rank writes (fsynced) and reads back a file of its share of the zerocore checkpoint
        disk = os.path.join(root, f"disk{r}")
        if rank == 0:
            os.makedirs(disk, exist_ok=True)
        dist.barrier()
        per_rank = sizes["zc"] // world
        mine = os.path.join(disk, f"rank{rank}.bin")
        timed("disk_write", _write_file, mine, per_rank)
        cold(disk)
        timed("disk_read", _read_file, mine)
        sizes["disk"] = per_rank * world

        d = os.path.join(root, f"dcp{r}")
        if with_dcp:
            # torch's recipe (FSDP2's layout, parameters by name), which zerocore's load_checkpoint reads
            model_sd, optim_sd = get_state_dict(ddp, opt)
            state = {"model": model_sd, "optim": optim_sd}
            timed("dcp_save", dcp.save, state, checkpoint_id=d)
            sizes["dcp"] = _dir_bytes(d)
            cold(d)
            timed("dcp_load", dcp.load, state, checkpoint_id=d)
            cold(d)  # the same checkpoint into the zerocore engine: a run moving from FSDP/DDP mid-training
            timed("zc_load_dcp", engine.load_checkpoint, d, then=("zc_load_dcp_landed", engine.land_param_gathers))

        if ds is not None:
            dsdir = os.path.join(root, f"ds{r}")
            start = time.perf_counter()
            timed("ds_save", ds.save_checkpoint, dsdir)
            # the same durability as zerocore's and DCP's saves: every rank fsyncs the files it wrote (its
            # optimizer partition; rank 0 also the model states, `latest` and the recovery scripts)
            fsync_tree(dsdir, lambda name: f"zero_pp_rank_{rank}_" in name
                       or (rank == 0 and "zero_pp_rank_" not in name))
            dist.barrier()
            out["ds_save_fsync"].append(time.perf_counter() - start)
            sizes["ds"] = _dir_bytes(dsdir)
            cold(dsdir)
            with contextlib.redirect_stdout(sys.stderr):
                timed("ds_load", ds.load_checkpoint, dsdir)
            cold(dsdir)  # the same checkpoint into the zerocore engine: a run moving from DeepSpeed mid-training
            timed("zc_load_ds", engine.load_checkpoint, dsdir, then=("zc_load_ds_landed", engine.land_param_gathers))

        dist.barrier()
        if rank == 0:
            shutil.rmtree(disk)
            shutil.rmtree(d, ignore_errors=True)
            if not last:  # the last round's zerocore and DeepSpeed checkpoints are consolidated afterwards
                shutil.rmtree(zc)
                if ds is not None:
                    shutil.rmtree(dsdir)
        dist.barrier()
    out["bytes"] = sizes
    return out


def _consolidate(root: str, rounds: int, warm: bool, with_ds: bool) -> dict[str, Any]:
    """Times zerocore's to-hf and DeepSpeed's zero_to_fp32 on the last round's checkpoints, each a fresh
    child process per round (alternating which goes first), cold unless ``warm``."""
    zc = os.path.join(root, f"zc{rounds - 1}")
    ds = os.path.join(root, f"ds{rounds - 1}")
    log = os.path.join(root, "child.log")
    commands = {"zc_hf": ([sys.executable, "-m", "zerocore.checkpoint", "to-hf", zc], zc),
                "zc_dcp": ([sys.executable, "-m", "zerocore.checkpoint", "to-dcp", zc], zc),
                "zc_ds": ([sys.executable, "-m", "zerocore.checkpoint", "to-deepspeed", zc], zc)}
    if with_ds:
        commands["ds_fp32"] = ([sys.executable, os.path.join(ds, "zero_to_fp32.py"), ds], ds)
        with open(os.path.join(ds, "latest")) as f:
            tag = os.path.join(ds, f.read().strip())
        commands["ds_univ"] = ([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
                                "--output_folder"], ds)
    extra = {"zc_hf": [], "zc_dcp": [], "zc_ds": [], "ds_fp32": ["--safe_serialization"],
             "ds_univ": ["--inject_missing_state"]}
    # the same command with --help: the interpreter and the tool's imports, nothing converted
    helps = {"zc_hf": 5, "zc_dcp": 5, "zc_ds": 5, "ds_fp32": 2, "ds_univ": 3}
    fields = ("seconds", "peak_rss_bytes", "peak_anon_bytes", "peak_file_bytes")
    res: dict[str, Any] = {k: {f: [] for f in fields + ("resident_after_evict",)} for k in commands}

    def run(cmd: list[str]) -> dict[str, Any]:
        result = run_isolated(cmd, log)
        if result["rc"] != 0:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"{' '.join(cmd)} exited with {result['rc']}:\n{f.read()[-4000:]}")
        return result

    for r in range(rounds):
        order = list(commands) if r % 2 == 0 else list(reversed(commands))
        for key in order:
            cmd, src = commands[key]
            dst = os.path.join(root, f"{key}.out")
            shutil.rmtree(dst, ignore_errors=True)
            if not warm:
                evict_tree(src)
                res[key]["resident_after_evict"].append(resident_fraction(src))
            result = run(cmd + [dst] + extra[key])
            for f in fields:
                res[key][f].append(result[f])
            res[key]["out_bytes"] = _dir_bytes(dst)
            res[key]["out_files"] = sorted(os.listdir(dst))
    for key, (cmd, _) in commands.items():  # the interpreter and the tool's imports, nothing converted
        res[key]["imports"] = run(cmd[:helps[key]] + ["--help"])
    if with_ds:
        res["same_tensors"] = _compare(os.path.join(root, "zc_hf.out"), os.path.join(root, "ds_fp32.out"))
    return res


def _compare(a: str, b: str) -> dict[str, Any]:
    """Whether the two consolidated models hold the same tensor names, shapes and dtypes, and how far apart
    their values are (zerocore's CPUAdam and torch's fused AdamW took the one step)."""
    from safetensors import safe_open

    def tensors(path: str) -> dict[str, Any]:
        found = {}
        for name in files_under(path):
            if name.endswith(".safetensors"):
                with safe_open(name, framework="pt") as f:
                    found.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - not iterable
        return found

    ta, tb = tensors(a), tensors(b)
    same = sorted(ta) == sorted(tb) and all(ta[k].shape == tb[k].shape and ta[k].dtype == tb[k].dtype for k in ta)
    diff = max(((ta[k].double() - tb[k].double()).abs().max().item() for k in ta if k in tb), default=float("nan"))
    return {"same_names_shapes_dtypes": same, "max_abs_diff": diff, "tensors": len(ta)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="do not drop files from the page cache before reads")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even if installed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": args.vocab}

    ds_version, ds_reason = (None, "--no-deepspeed") if args.no_deepspeed else _deepspeed_available()
    with_ds = ds_version is not None
    import importlib.util

    with_dcp = importlib.util.find_spec("numpy") is not None
    dcp_reason = "" if with_dcp else "numpy is not installed (DCP's object collectives decode through it)"
    model = build_model(cfg)
    tensor_bytes = [p.numel() * 4 for p in model.state_dict().values()]
    params = sum(p.numel() for p in model.parameters())
    del model
    header = run_header({"world": args.world, "rounds": args.rounds, "model": cfg, "parameters": params,
                         "reads": "page cache (--warm)" if args.warm else "cold (posix_fadvise DONTNEED before each)",
                         "deepspeed": ds_version or f"absent: {ds_reason}",
                         "dcp": "torch.distributed.checkpoint" if with_dcp else f"absent: {dcp_reason}"})

    root = tempfile.mkdtemp(dir=args.dir, prefix="zerocore-ckpt-bench-")
    try:
        results = run_ranks(_rank_main, args.world, cfg, root, args.rounds, args.warm, with_dcp, with_ds,
                            timeout=args.timeout)
        hf = _consolidate(root, args.rounds, args.warm, with_ds)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    sizes = results[0]["bytes"]
    keys = [k for k in results[0] if k not in ("bytes", "resident_after_evict")]
    per_round = {k: [max(r[k][i] for r in results) for i in range(args.rounds)] for k in keys}
    slowest = {k: median(v) for k, v in per_round.items()}
    resident = [f for r in results for f in r["resident_after_evict"]]
    resident += [f for k in ("zc_hf", "zc_dcp", "ds_fp32") if k in hf for f in hf[k]["resident_after_evict"]]
    header["max_resident_after_evict"] = max(resident) if resident else None

    disk_rate = {"save": sizes["disk"] / slowest["disk_write"], "load": sizes["disk"] / slowest["disk_read"]}
    read_label = "page cache" if args.warm else "cold"
    rows_spec = [("disk sequential write + fsync", "disk_write", "disk", "save"),
                 (f"disk sequential read ({read_label})", "disk_read", "disk", "load"),
                 ("zerocore save_checkpoint", "zc_save", "zc", "save"),
                 (f"zerocore load_checkpoint ({read_label})", "zc_load", "zc", "load"),
                 (f"zerocore load_checkpoint + parameters landed ({read_label})", "zc_load_landed", "zc", "load")]
    if with_dcp:
        rows_spec += [("torch DCP save (DDP + AdamW)", "dcp_save", "dcp", "save"),
                      (f"torch DCP load ({read_label})", "dcp_load", "dcp", "load"),
                      (f"zerocore load_checkpoint of that DCP checkpoint ({read_label})", "zc_load_dcp", "dcp", "load"),
                      (f"  + parameters landed ({read_label})", "zc_load_dcp_landed", "dcp", "load")]
    if with_ds:
        rows_spec += [("DeepSpeed ZeRO-2 save_checkpoint (no fsync)", "ds_save", "ds", "save"),
                      ("DeepSpeed ZeRO-2 save_checkpoint + fsync", "ds_save_fsync", "ds", "save"),
                      (f"DeepSpeed ZeRO-2 load_checkpoint ({read_label})", "ds_load", "ds", "load"),
                      (f"zerocore load_checkpoint of that DeepSpeed checkpoint ({read_label})", "zc_load_ds", "ds",
                       "load"),
                      (f"  + parameters landed ({read_label})", "zc_load_ds_landed", "ds", "load")]
    peer = {"save": {"dcp": "dcp_save", "ds": "ds_save_fsync"}, "load": {"dcp": "dcp_load", "ds": "ds_load"}}
    table = []
    for label, key, size_key, kind in rows_spec:
        rate = sizes[size_key] / slowest[key]
        row = {"what": label, "MB": sizes[size_key] / 1e6, "seconds": slowest[key], "GB/s": rate / 1e9,
               "x disk": rate / disk_rate[kind]}
        if not key.startswith("disk"):
            row["x DCP"] = slowest[peer[kind]["dcp"]] / slowest[key] if with_dcp else None
            row["x DeepSpeed"] = slowest[peer[kind]["ds"]] / slowest[key] if with_ds else None
        table.append(row)

    consolidation = []
    labels = {"zc_hf": "zerocore to-hf", "zc_dcp": "zerocore to-dcp", "zc_ds": "zerocore to-deepspeed",
              "ds_fp32": "DeepSpeed zero_to_fp32.py --safe_serialization",
              "ds_univ": "DeepSpeed ds_to_universal --inject_missing_state"}
    peer_of = {"zc_hf": "ds_fp32", "zc_ds": "ds_univ"}  # (to-dcp writes the moments too: no peer converts the same)
    for key in ("zc_hf", "zc_dcp", "zc_ds", "ds_fp32", "ds_univ"):
        if key not in hf:
            continue
        h, imports = hf[key], hf[key]["imports"]
        secs, peak, anon = median(h["seconds"]), max(h["peak_rss_bytes"]), max(h["peak_anon_bytes"])
        row = {"what": f"{labels[key]} ({read_label})", "seconds": secs, "peak RSS MiB": peak / 2**20,
               "imports RSS MiB": imports["peak_rss_bytes"] / 2**20,
               "RSS above imports MiB": (peak - imports["peak_rss_bytes"]) / 2**20,
               "anon above imports MiB": (anon - imports["peak_anon_bytes"]) / 2**20,
               "file-backed peak MiB": max(h["peak_file_bytes"]) / 2**20,
               "output MB": h["out_bytes"] / 1e6, "files": ", ".join(h["out_files"])}
        rival = peer_of.get(key)
        row["x DeepSpeed"] = median(hf[rival]["seconds"]) / secs if with_ds and rival else None
        consolidation.append(row)
    model_note = {"largest_tensor_MiB": max(tensor_bytes) / 2**20, "model_fp32_MiB": sum(tensor_bytes) / 2**20}
    notes = []
    if not with_dcp:
        notes.append(f"DCP rows left out: {dcp_reason}")
    if not with_ds:
        notes.append(f"DeepSpeed rows left out: {ds_reason}")
    if "same_tensors" in hf:
        notes.append(f"to-hf and zero_to_fp32 outputs: {hf['same_tensors']}")

    if args.json:
        print(json.dumps({"header": header, "bytes": sizes, "model": model_note, "throughput": table,
                          "consolidation": consolidation, "slowest_rank_seconds_per_round": per_round,
                          "raw_consolidation": {k: v for k, v in hf.items()}, "notes": notes}, indent=1))
        return

    def fmt(v: Any, digits: int = 2) -> str:
        return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))

    print_header(header)
    print(f"# median over {args.rounds} rounds of the slowest rank; x disk = GB/s over the disk's; x DCP / "
          f"x DeepSpeed = their seconds over this row's on the same model (DeepSpeed save: with fsync)")
    cols = ["what", "MB", "seconds", "GB/s", "x disk", "x DCP", "x DeepSpeed"]
    print(format_table(cols, [[fmt(row.get("what")), fmt(row["MB"], 1), fmt(row["seconds"], 3),
                               fmt(row["GB/s"]), fmt(row["x disk"]), fmt(row.get("x DCP")),
                               fmt(row.get("x DeepSpeed"))] for row in table]))
    print()
    print(f"# consolidation to fp32 safetensors, one child process each; largest tensor "
          f"{model_note['largest_tensor_MiB']:.1f} MiB, model fp32 {model_note['model_fp32_MiB']:.1f} MiB; "
          f"seconds: median, peak RSS: max over rounds (exact, ru_maxrss); imports: the same command with --help; "
          f"anon / file-backed: sampled from /proc")
    cols = ["what", "seconds", "peak RSS MiB", "imports RSS MiB", "RSS above imports MiB", "anon above imports MiB",
            "file-backed peak MiB", "output MB", "x DeepSpeed"]
    print(format_table(cols, [[row["what"], fmt(row["seconds"], 3)] + [fmt(row[c], 0) for c in cols[2:7]]
                              + [fmt(row["output MB"], 1), fmt(row["x DeepSpeed"])] for row in consolidation]))
    for note in notes:
        print(f"# {note}")


if __name__ == "__main__":
    main()
