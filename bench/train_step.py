"""Training-step time and peak RSS of one GPT-style model under DDP, torch's ZeRO, FSDP2, DeepSpeed ZeRO and
zerocore, on Gloo, in fp32 and bf16 -- each peer in the fastest setting its users would pick.

    python bench/train_step.py [--world 2] [--steps 12] [--warmup 3] [--layers 6 --dim 512 --seq 128 --batch 2]
                               [--vocab 8192] [--dtypes fp32,bf16 | --bf16] [--only ddp,zero2,...] [--rounds 1]
                               [--bucket 6.5e6] [--timeout 900] [--json] [--freeze] [--compile]

The model: token embedding + learned positions, ``--layers`` pre-LN blocks (causal attention through
F.scaled_dot_product_attention, GELU MLP of 4*dim), final LayerNorm and an untied LM head, built in fp32 from
seed 0 identically on every rank. The defaults (6 layers, d=512, vocab 8192, seq 128) give ~27.4M parameters.
Every rank trains on its own random tokens (seeded by step and rank, the same for every system); the loss is
cross-entropy on fp32 logits everywhere, so the losses of all systems agree to fp32 (or bf16) rounding --
printed as a sanity check.

Optimizer: AdamW, lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01, the gradient norm clipped at 1.0
(DeepSpeed's and zerocore's default, which their default configs leave in place; Hugging Face Trainer's
``max_grad_norm``; the torch peers call ``clip_grad_norm_(..., foreach=True)``). Every torch peer and
DeepSpeed use ``torch.optim.AdamW(..., fused=True)`` (torch's fastest AdamW; the fused kernel runs on CPU
since torch 2.4); zerocore uses its own SIMD CPU Adam. DeepSpeed gets the fused torch AdamW as a client
optimizer (``zero_allow_untested_optimizer``): its DeepSpeedCPUAdam would need a C++ JIT build of the
cpu_adam op, and its config optimizer (FusedAdam) has no prebuilt op on CPU either.

Systems (``--only`` picks a subset; DeepSpeed's are skipped with a note when ``import deepspeed`` fails):
  ddp          DDP(gradient_as_bucket_view=True) + fused AdamW. The bucket-view gradients are DDP's documented
               saving of the grad<->bucket copies. static_graph is left off: its documented gains are for
               unused parameters / reentrant checkpointing, neither of which this model has.
  torch_zero   DDP as above + ZeroRedundancyOptimizer(AdamW, fused=True, parameters_as_bucket_view=True),
               the documented "speed up communication" setting. overlap_with_ddp needs a DDP comm hook and
               a different step loop (the step happens inside backward), so it is not a plain-step peer.
  fsdp2        fully_shard on every block, then on the root, with fully_shard's defaults (reshard after
               forward for the blocks, not for the root, as its docs recommend) + fused AdamW.
  ds_zero1/2/3 DeepSpeed ZeRO stage 1/2/3 with DeepSpeed's defaults (buckets 5e8 elements, overlap_comm per
               stage default) + the fused AdamW client optimizer; accelerator "cpu", Gloo.
  ds_zero0     DeepSpeed's stage 0 (plain data parallelism: what a ds_z0 config asks for; zerocore runs it as
               stage 1, so zero1 is its peer), the same client optimizer.
  zero1/2/3    zerocore "default": the config a user writes -- only "zero_optimization": {"stage": N} and
               the "optimizer" block (nothing is required beyond them: no batch keys, no buckets).
  zeroN_tuned  zerocore "tuned": explicit batch keys, reduce/allgather buckets of ``--bucket`` elements
               (default 6.5e6, ~25 MiB of fp32 like DDP's bucket), ``--rs-algo``/``--ag-algo``.
  zero3 and zero3_tuned gather a unit per block (zerocore's default units).
  zeroN_gloo   zerocore "default" with comm_algorithms send_recv + broadcast: the bytes through Gloo's
               loopback sockets, as "auto" does across hosts, instead of the shared-memory transport it picks
               when every rank is on one host (Note [Shared-memory collectives]).

Precision (``--dtypes``, default ``fp32,bf16``: one table per dtype, ratios against DDP of the same dtype;
``--bf16`` is ``--dtypes bf16``):
  ddp, torch_zero  torch.autocast("cpu", dtype=torch.bfloat16) around forward + loss: fp32 params, grads,
                   all-reduce and AdamW -- what a DDP user does.
  fsdp2            MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the torchtitan/tutorial policy.
  zerocore         "bf16": {"enabled": true}: bf16 params and grads, fp32 reduce and master weights.
  DeepSpeed        "bf16": {"enabled": true}: bf16 params and grads, fp32 master weights; DeepSpeed reduces in
                   bf16 by default under bf16 (communication_data_type), which is left as is.

DeepSpeed without touching the main venv (a second venv sees .venv's torch and zerocore through a .pth;
DS_BUILD_OPS=0 builds no op, --no-deps keeps pip from fetching another torch), then run this script with it:

    python3 -m venv .venv-ds
    echo "import site; site.addsitedir('$(pwd)/.venv/lib/python3.11/site-packages')" \\
        > .venv-ds/lib/python3.11/site-packages/zz_main_venv.pth
    .venv-ds/bin/pip install --no-deps -r bench/requirements-deepspeed.txt
    DS_BUILD_OPS=0 .venv-ds/bin/pip install --no-deps --no-build-isolation deepspeed==0.19.8
    .venv-ds/bin/pip list | grep -E '^(torch|deepspeed) '    # torch must still be the +cpu build
    .venv-ds/bin/python bench/train_step.py

On its first use DeepSpeed JIT-compiles its small shm_comm op (~1 min on 2 cores, then cached under
~/.cache/torch_extensions; ninja and a C++ compiler needed) during deepspeed.initialize, outside the timed steps;
training communicates over torch.distributed (Gloo) all the same. Under .venv-ds every rank also imports numpy
(torch picks it up), which adds ~10 MiB to every system's RSS baseline alike.

Each system runs alone in a fresh set of ``--world`` spawned rank processes (1 intra-op and 1 inter-op thread
each), one system at a time; with ``--rounds R`` the sequence runs R times per dtype, alternating its order.
A step is forward + backward + optimizer step (+ zero_grad); its time is the slowest rank's, and the table
shows the median over the ``--steps`` steps after ``--warmup`` (pooled over rounds), its ratio to DDP, the
same ratio per round (each round's median against DDP's of that round: rounds minutes apart move together on
a shared VM, so the paired ratios spread less than the pooled one moves between runs), the per-rank RSS
right after the model was built (interpreter + torch + the model), and the per-rank peak RSS (ru_maxrss) at
the end of training (max over ranks and rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (BenchError, current_rss_mib, format_table, median, peak_rss_mib, print_header,  # noqa: E402
                     run_header, run_ranks)
from _peers import (ADAMW, DEEPSPEED_SYSTEMS, PRECISION, SYSTEMS, batch, build_model,  # noqa: E402
                    build_trainer, deepspeed_status)

DTYPES = ("fp32", "bf16")


def _rank_main(rank: int, world: int, system: str, cfg: dict[str, Any], dtype: str) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    model = build_model(cfg)
    if cfg["compile"]:
        import torch

        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block)
    rss_build = current_rss_mib()
    trainer = build_trainer(system, model, cfg, world, dtype)
    del model
    engine = trainer.engine
    extra: dict[str, Any] = {}
    times: list[float] = []
    losses: list[float] = []
    dist.barrier()
    for step in range(cfg["warmup"] + cfg["steps"]):
        if engine is not None and step == cfg["warmup"]:
            engine.reset_comm_stats()
        x, y = batch(cfg, step, rank)
        t0 = time.perf_counter()
        loss = trainer.step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    rss_end = current_rss_mib()
    if engine is not None:
        report = engine.comm_report()
        extra["comm"] = {"algorithms": report["algorithms"], "collectives_measured_steps": report["collectives"],
                         "buckets": report["buckets"].get("reduce_bucket_source"),
                         "host_syncs_per_step": report["host_syncs_per_step"]}
        extra["model_state_bytes"] = engine.memory_report()["model_state_bytes"]
    dist.barrier()
    return {"times": times, "losses": losses, "rss_build_mib": rss_build, "peak_rss_mib": peak_rss_mib(),
            "rss_end_mib": rss_end, **extra}


# ---- the driver ---------------------------------------------------------------------------------------------
def _count_params(cfg: dict[str, Any]) -> int:
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def _summarize(system: str, runs: list[list[dict[str, Any]]], cfg: dict[str, Any]) -> dict[str, Any]:
    """runs: per round, the per-rank results."""
    measured: list[float] = []
    per_round: list[float] = []
    for ranks in runs:
        slowest = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))][cfg["warmup"]:]
        measured += slowest
        per_round.append(median(slowest))
    last = runs[-1]
    mean_loss = [sum(r["losses"][i] for r in last) / len(last) for i in range(len(last[0]["losses"]))]
    out = {
        "system": system,
        "label": SYSTEMS[system],
        "median_step_ms": 1e3 * median(measured),
        "min_step_ms": 1e3 * min(measured),
        "per_round_median_ms": [1e3 * m for m in per_round],
        "rss_build_mib": [max(run[r]["rss_build_mib"] for run in runs) for r in range(len(last))],
        "peak_rss_mib": [max(run[r]["peak_rss_mib"] for run in runs) for r in range(len(last))],
        "rss_end_mib": [max(run[r]["rss_end_mib"] for run in runs) for r in range(len(last))],
        "loss_first": mean_loss[0],
        "loss_last": mean_loss[-1],
    }
    if "comm" in last[0]:
        out["comm"] = last[0]["comm"]
        out["model_state_bytes"] = [r["model_state_bytes"] for r in last]
    return out


def _run_dtype(dtype: str, systems: list[str], args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in systems}
    failures: dict[str, str] = {}
    for round_index in range(args.rounds):
        order = systems if round_index % 2 == 0 else list(reversed(systems))
        for system in order:
            if system in failures:
                continue
            print(f"... {dtype} round {round_index + 1}/{args.rounds}: {system}", file=sys.stderr, flush=True)
            try:
                runs[system].append(run_ranks(_rank_main, args.world, system, cfg, dtype, timeout=args.timeout))
            except BenchError as exc:
                failures[system] = str(exc)
                print(f"!!! {dtype} {system} failed:\n{exc}", file=sys.stderr, flush=True)
    results = [_summarize(s, runs[s], cfg) for s in systems if runs[s] and s not in failures]
    ddp = next((r for r in results if r["system"] == "ddp"), None)
    for r in results:
        r["ratio_to_ddp"] = r["median_step_ms"] / ddp["median_step_ms"] if ddp else None
        # paired: each round's median against DDP's in the same round (rounds minutes apart drift together)
        r["paired_ratios_to_ddp"] = ([mine / theirs for mine, theirs in
                                      zip(r["per_round_median_ms"], ddp["per_round_median_ms"])] if ddp else [])
    return {"dtype": dtype, "precision": PRECISION[dtype], "results": results, "failures": failures}


def _print_table(table: dict[str, Any], steps: int) -> None:
    print(f"\n## {table['dtype']}: {table['precision']}")
    rows = []
    for r in table["results"]:
        ratio = f"{r['ratio_to_ddp']:.2f}" if r["ratio_to_ddp"] else "n/a"
        paired = r["paired_ratios_to_ddp"]
        per_round = (f"{median(paired):.2f} ({'/'.join(f'{x:.2f}' for x in paired)})" if len(paired) > 1
                     else ratio)
        algos = r.get("comm", {}).get("algorithms")
        rows.append([r["system"], r["label"], f"{r['median_step_ms']:.1f}", ratio, per_round,
                     "/".join(f"{v:.0f}" for v in r["rss_build_mib"]),
                     "/".join(f"{v:.0f}" for v in r["peak_rss_mib"]),
                     "/".join(f"{p - b:.0f}" for p, b in zip(r["peak_rss_mib"], r["rss_build_mib"])),
                     "/".join(f"{v:.0f}" for v in r["rss_end_mib"]),
                     f"{r['loss_first']:.4f} -> {r['loss_last']:.4f}",
                     f"rs={algos['reduce_scatter']} ag={algos['all_gather']}" if algos else "-"])
    print(format_table(["system", "what (torch peers and DeepSpeed: torch AdamW fused=True)", "median step ms",
                        f"x DDP {table['dtype']}", "x DDP per round: median (each)", "RSS after build MiB",
                        "peak RSS MiB", "peak - build MiB", "RSS after the steps MiB",
                        "mean loss first -> last", "zerocore algorithms"], rows, left=2))
    for r in table["results"]:
        if "comm" in r:
            per_op = ", ".join(f"{op}: {s['calls']} calls / {s['backend_calls']} backend calls / "
                               f"{s['algorithm_bytes'] / 2**20:.1f} MiB sent"
                               for op, s in r["comm"]["collectives_measured_steps"].items())
            states = "/".join(f"{b / 2**20:.0f}" for b in r["model_state_bytes"])
            print(f"# {r['system']} comm_report over {steps} measured steps (rank 0): {per_op}; "
                  f"model state MiB per rank: {states}; buckets: {r['comm']['buckets']}; host syncs per step: "
                  f"{r['comm']['host_syncs_per_step']}")
    for s, message in table["failures"].items():
        print(f"# note: {table['dtype']} {s} failed: {message.strip().splitlines()[-1][:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="measured steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of fp32,bf16; a table each")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision only (same as --dtypes bf16)")
    parser.add_argument("--bucket", type=float, default=6.5e6,
                        help="zeroN_tuned reduce/allgather bucket, elements (default ~25 MiB of fp32, like DDP's)")
    parser.add_argument("--rs-algo", default="auto", help="zeroN_tuned reduce_scatter algorithm")
    parser.add_argument("--ag-algo", default="auto", help="zeroN_tuned all_gather algorithm")
    parser.add_argument("--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the sequence, alternating its order")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per system run before it is killed")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block before the system wraps the model (torchtitan's way with "
                             "FSDP2; the blocks share one graph), default inductor backend; warmup absorbs it")
    parser.add_argument("--freeze", action="store_true",
                        help="freeze the embeddings and every block's linear layers (a partial fine-tune: the "
                             "LayerNorms and the head train)")
    args = parser.parse_args()

    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    dtypes = ["bf16"] if args.bf16 else [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes: a comma-separated subset of {','.join(DTYPES)}, got {args.dtypes!r}")
    if args.dim % max(1, args.dim // 64):
        parser.error("--dim must divide into heads of 64 (or be < 64)")
    cfg = {"layers": args.layers, "dim": args.dim, "seq": args.seq, "batch": args.batch, "vocab": args.vocab,
           "steps": args.steps, "warmup": args.warmup, "bucket": int(args.bucket), "freeze": args.freeze,
           "compile": args.compile, "comm_algorithms": {"reduce_scatter": args.rs_algo, "all_gather": args.ag_algo}}
    notes: list[str] = []
    ds_version = None
    if any(s in DEEPSPEED_SYSTEMS for s in systems):
        ds_version, why = deepspeed_status()
        if ds_version is None:
            skipped = [s for s in systems if s in DEEPSPEED_SYSTEMS]
            systems = [s for s in systems if s not in DEEPSPEED_SYSTEMS]
            ds_venv = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-ds")
            hint = (f"; {ds_venv}/bin/python has it" if os.path.exists(os.path.join(ds_venv, "bin", "python"))
                    else "; see this script's docstring for the install")
            notes.append(f"{','.join(skipped)} skipped: {why} ({sys.executable}){hint}")
    import zerocore

    adam = (f"ddp, torch_zero, fsdp2{', ds_zero*' if ds_version else ''}: torch.optim.AdamW(fused=True); "
            f"zerocore: zerocore CPUAdam ({zerocore.build_info()['simd_active']}); "
            + ", ".join(f"{k}={v}" for k, v in ADAMW.items()))
    header = run_header({"world": args.world, "model": {k: cfg[k] for k in ("layers", "dim", "seq", "batch", "vocab",
                                                                            "freeze", "compile")},
                         "params": _count_params(cfg), "dtypes": ",".join(dtypes), "steps": args.steps,
                         "warmup": args.warmup, "rounds": args.rounds, "optimizer": adam,
                         "deepspeed": ds_version or "not available",
                         "zerocore_tuned_bucket_elements": cfg["bucket"],
                         "zerocore_default_buckets": "unset: the engine's choice, printed per row below"})
    tables = [_run_dtype(dtype, systems, args, cfg) for dtype in dtypes]
    if args.json:
        print(json.dumps({"header": header, "tables": tables, "notes": notes}, indent=1))
        return
    print_header(header)
    print("# RSS columns: per rank (rank0/rank1/...); step time: slowest rank, median of measured steps")
    for table in tables:
        _print_table(table, args.steps)
    for note in notes:
        print(f"# note: {note}")


if __name__ == "__main__":
    main()
