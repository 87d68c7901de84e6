"""Demo: train a small GPT with zerocore on a synthetic corpus, on CPU (Gloo) or GPUs (NCCL).

    python -m zerocore.examples.train_gpt                       # 2 CPU ranks, stage 2, ~1.8M params
    python -m zerocore.examples.train_gpt --stage 1 --bf16 --steps 40 --json
    python -m zerocore.examples.train_gpt --config ds_config.json --lr 1e-3   # flags override the JSON
    torchrun --nproc-per-node 8 -m zerocore.examples.train_gpt             # NCCL, cuda:LOCAL_RANK if CUDA
    python -m zerocore.examples.train_gpt --preset nvme-3b --nvme-path /var/tmp/zc   # 3B params, state on NVMe

Without ``torchrun`` it spawns ``--nproc`` ranks itself (MASTER_ADDR=127.0.0.1, a free port); under
``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK set) it runs as the launched rank. Rank 0 prints a progress line
every ``--log-every`` steps and, at the end, the first and final loss and "OK". The exit code is non-zero
when a rank fails or the final loss (mean of the last few steps) is not below the first.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import math
import os
import socket
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist

import zerocore
from zerocore.examples.gpt import GPT, CharTokenizer, generate, make_corpus, sample_batch

# Named bundles of flags (explicit flags still win). nvme-3b: issue 11's scale demonstration, a model whose
# states (16 bytes per parameter in bf16 with Adam: 49 GB) are twice this 24 GiB machine's RAM, on 2 ranks with
# stage 3 and the optimizer state on NVMe; needs --nvme-path on a disk with ~40 GB free.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "nvme-3b": ("3.0B-parameter GPT, stage 3, bf16, meta-device init, optimizer state on NVMe (--nvme-path)",
                {"layers": 32, "dim": 2816, "heads": 22, "seq_len": 64, "batch_size": 1, "steps": 5, "stage": 3,
                 "bf16": True, "meta_init": True, "log_every": 1, "no_sample": True, "sub_group_size": 50_000_000,
                 # Adam's first steps move every weight by ~lr at once: on 128-token batches 1e-5 made the
                 # loss of a 3B (and of a 0.4B) model jump, with or without offload; 1e-6 trains the 0.4B one
                 "lr": 2e-7}),
}
# Values used when neither a flag nor the --config JSON sets them.
_DEFAULTS = {"stage": 2, "lr": 3e-3, "clip": 1.0, "grad_accum": 1, "batch_size": 8, "log_every": 10}
_FINAL_WINDOW = 5  # the final loss is the mean of this many last steps


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, except None: those say in their help where the value comes from instead."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zerocore.examples.train_gpt",
                                description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    d = "(default: %s, or the --config value)"
    p.add_argument("--config", metavar="PATH", help="DeepSpeed-style JSON config; explicit flags override it")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), help="ZeRO stage " + d % _DEFAULTS["stage"])
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true", default=None, help="bfloat16 compute, fp32 master weights")
    prec.add_argument("--fp16", action="store_true", default=None, help="float16 compute with loss scaling")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps")
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (ignored under torchrun) (default: 2)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"),
                   help="auto: cuda when available; cuda uses NCCL and one GPU per rank "
                        "(default: cpu when spawning, auto under torchrun)")
    p.add_argument("--log-every", type=int, help="steps per progress line " + d % _DEFAULTS["log_every"])
    p.add_argument("--batch-size", type=int, help="micro-batch per rank " + d % _DEFAULTS["batch_size"])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, help="peak learning rate (warmup, then cosine) " + d % _DEFAULTS["lr"])
    p.add_argument("--grad-accum", type=int, help="micro-batches per step " + d % _DEFAULTS["grad_accum"])
    p.add_argument("--clip", type=float, help="gradient clipping, 0 = off " + d % _DEFAULTS["clip"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--meta-init", action="store_true",
                   help="build the model on the meta device (needs --stage 3 and engine support)")
    p.add_argument("--nvme-path", metavar="DIR",
                   help="optimizer state on NVMe under DIR (offload_optimizer: {device: nvme})")
    p.add_argument("--sub-group-size", type=int, default=None,
                   help="elements per NVMe sub-group (zero_optimization.sub_group_size)")
    p.add_argument("--no-sample", action="store_true", help="skip the text sample at the end")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="; ".join(f"{name}: {text}" for name, (text, _) in sorted(PRESETS.items())))
    p.add_argument("--json", action="store_true",
                   help="print one JSON summary line on stdout (progress goes to stderr)")
    return p


def _set(config: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        config = config.setdefault(key, {})
    config[leaf] = value


def build_config(args: argparse.Namespace, world_size: int) -> tuple[zerocore.ZeroConfig, int]:
    """The engine config (the JSON, then explicit flags, then demo defaults) and the micro-batch size."""
    raw: dict[str, Any] = {}
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            raw = copy.deepcopy(json.load(f))
        if not isinstance(raw, dict):
            raise ValueError(f"{args.config}: expected a JSON object")
    zero = raw.setdefault("zero_optimization", {})
    params = raw.setdefault("optimizer", {"type": "AdamW"}).setdefault("params", {})
    explicit = {"stage": (zero, "stage"), "lr": (params, "lr"), "clip": (raw, "gradient_clipping"),
                "grad_accum": (raw, "gradient_accumulation_steps")}
    for name, (section, key) in explicit.items():
        if getattr(args, name) is not None:
            section[key] = getattr(args, name)
        else:
            section.setdefault(key, _DEFAULTS[name])
    if args.nvme_path:
        _set(raw, "zero_optimization.offload_optimizer", {"device": "nvme", "nvme_path": args.nvme_path})
        raw.setdefault("aio", {}).setdefault("thread_count", 2)
    if args.sub_group_size is not None:
        _set(raw, "zero_optimization.sub_group_size", args.sub_group_size)
    if args.bf16 or args.fp16:
        if "bfloat16" in raw:  # DeepSpeed's alias of "bf16"
            raw["bf16"] = raw.pop("bfloat16")
        _set(raw, "bf16.enabled", bool(args.bf16))
        _set(raw, "fp16.enabled", bool(args.fp16))
    gas = raw["gradient_accumulation_steps"]
    micro = args.batch_size or raw.get("train_micro_batch_size_per_gpu")
    if micro is None and raw.get("train_batch_size") is not None and isinstance(gas, int):
        micro = max(1, raw["train_batch_size"] // (gas * world_size))
    micro = micro or _DEFAULTS["batch_size"]
    if "train_batch_size" in raw and (args.batch_size is not None or args.grad_accum is not None):
        raw["train_batch_size"] = micro * gas * world_size  # explicit flags win over the JSON's total
    raw["train_micro_batch_size_per_gpu"] = micro
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        config = zerocore.ZeroConfig.from_deepspeed(raw, strict=False)
    config.check_batch_sizes(world_size)
    return config, micro


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def train(args: argparse.Namespace, config: zerocore.ZeroConfig, micro: int, device: torch.device) -> int:
    """One rank's training run; returns the exit code (0 OK, 1 the loss did not decrease)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    info = sys.stderr if args.json else sys.stdout

    def say(*parts: Any) -> None:
        if rank == 0:
            print(*parts, file=info, flush=True)

    torch.manual_seed(args.seed)
    text = make_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    stage = config.zero_optimization.stage
    kwargs: dict[str, Any] = {}
    if args.meta_init:  # only reachable with --stage 3 (checked in main)
        if "init_fn" not in inspect.signature(zerocore.initialize).parameters:
            raise ValueError("--meta-init: this zerocore cannot materialize a meta-device model yet "
                             "(zerocore.initialize has no init_fn)")
        with torch.device("meta"):
            model = GPT(tokenizer.vocab_size, args.seq_len, args.layers, args.dim, args.heads)
        kwargs = {"init_fn": model.init_weights, "device": device}
    else:
        model = GPT(tokenizer.vocab_size, args.seq_len, args.layers, args.dim, args.heads).to(device)
    engine = zerocore.initialize(model, config, **kwargs)
    engine.reset_comm_stats()  # count training traffic only, not the initial broadcast
    total, warmup = args.steps, max(1, args.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: min(
        (s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))))
    memory = engine.memory_report()
    gas = engine.config.gradient_accumulation_steps
    tokens_per_step = micro * args.seq_len * gas * world
    say(f"zerocore {zerocore.__version__} | stage {stage} | {world} ranks on {device.type} ({dist.get_backend()}) | "
        f"{memory['compute_dtype']} | {memory['psi'] / 1e6:.2f}M params | vocab {tokenizer.vocab_size} | "
        f"{tokens_per_step} tokens/step (micro {micro} x seq {args.seq_len} x accum {gas} x {world} ranks)")
    say(f"model state per rank {_mib(memory['model_state_bytes'])} ({memory.get('formula_text', 'ZeRO')}) vs "
        f"DDP {_mib(memory['ddp_bytes'])}")

    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own slice of the batch
    losses: list[float] = []
    comm_total = 0
    compute_s = step_s = 0.0  # forward + backward, and engine.step() (with NVMe offload: the state's I/O)
    start = last_time = time.perf_counter()
    last_step = 0
    for step in range(1, total + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(gas):
            x, y = sample_batch(data, micro, args.seq_len, generator, device)
            tick = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            tock = time.perf_counter()
            engine.step()
            compute_s += tock - tick
            step_s += time.perf_counter() - tock
            step_loss += loss.detach().float() / gas
        schedule.step()
        step_loss = step_loss.reshape(1)
        dist.all_reduce(step_loss)  # outside the engine: not counted in comm_report
        losses.append(step_loss.item() / world)
        if step % args.log_every == 0 or step == total:
            now = time.perf_counter()
            report = engine.comm_report()
            comm = sum(c["algorithm_bytes"] for c in report["collectives"].values())
            io = report["nvme_io"]["bytes_read"] + report["nvme_io"]["bytes_written"]
            nvme = (f" | fwd+bwd {compute_s:.1f}s, step {step_s:.1f}s, NVMe {io / 2**30:.1f} GiB at "
                    f"{io / max(step_s, 1e-9) / 1e9:.2f} GB/s (rank 0)") if io else ""
            compute_s = step_s = 0.0
            comm_total += comm
            engine.reset_comm_stats()
            say(f"step {step:>4}/{total} | loss {losses[-1]:.4f} | "
                f"{tokens_per_step * (step - last_step) / (now - last_time):>8.0f} tok/s | "
                f"model state/rank {_mib(memory['model_state_bytes'])} (DDP {_mib(memory['ddp_bytes'])}) | "
                f"comm/step {_mib(comm / (step - last_step))} (rank 0 sent){nvme}")
            last_time, last_step = now, step
    elapsed = time.perf_counter() - start

    first = losses[0]
    window = min(_FINAL_WINDOW, len(losses))
    final = sum(losses[-window:]) / window
    ok = math.isfinite(final) and final < first
    if not args.no_sample:
        prompt = tokenizer.encode("the ").view(1, -1).to(device)  # every rank samples (stage 3 gathers collectively)
        sample = tokenizer.decode(generate(engine, prompt, 60, args.seq_len)[0]).replace("\n", " / ")
        say(f"sample: {sample!r}")
    # no engine.close(): under stage 3 it hands every parameter back whole, which a model sized to need
    # NVMe offload does not fit (the 3B preset ran out of memory there); the NVMe state file is removed
    # when the process exits
    if rank == 0:
        say(f"first loss {first:.4f} -> final loss {final:.4f} (mean of the last {window} steps) in "
            f"{elapsed:.1f}s, {tokens_per_step * total / elapsed:.0f} tok/s")
        if args.json:
            print(json.dumps({
                "ok": ok, "first_loss": first, "final_loss": final, "final_loss_window": window,
                "steps": total, "stage": stage, "world_size": world, "device": device.type,
                "dtype": memory["compute_dtype"], "params": memory["psi"],
                "model_state_bytes": memory["model_state_bytes"], "ddp_bytes": memory["ddp_bytes"],
                "comm_bytes_per_step": comm_total / total, "tokens_per_s": tokens_per_step * total / elapsed,
                "elapsed_s": elapsed, "skipped_steps": engine.skipped_steps,
                "losses": [round(v, 5) for v in losses]}), flush=True)
        if ok:
            say("OK")
        else:
            print(f"FAILED: the final loss {final:.4f} is not below the first loss {first:.4f}",
                  file=sys.stderr, flush=True)
    return 0 if ok else 1


def run_rank(local_rank: int, args: argparse.Namespace, config: zerocore.ZeroConfig, micro: int,
             device_type: str, spawn: tuple[int, int] | None) -> None:
    """Entry point of one rank: a spawned child (``spawn`` = (world_size, port)) or a torchrun process."""
    torch.set_num_threads(args.threads)
    if spawn is not None:
        world, port = spawn
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    code = 1
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=300))
        code = train(args, config, micro, device)
    except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
        if not isinstance(e, ValueError):
            traceback.print_exc()
        print(f"train_gpt: error on rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.preset:
        given = parser.parse_args(argv)  # what the command line set explicitly
        defaults = vars(_parser().parse_args([]))
        for name, value in PRESETS[args.preset][1].items():
            if getattr(given, name) == defaults[name]:
                setattr(args, name, value)
        if args.preset == "nvme-3b" and not args.nvme_path:
            parser.error("--preset nvme-3b needs --nvme-path DIR (about 20 GB per rank of optimizer state)")
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else (args.nproc if args.nproc is not None else 2)
    if torchrun and args.nproc not in (None, world):
        print(f"train_gpt: under torchrun WORLD_SIZE={world}; ignoring --nproc {args.nproc}", file=sys.stderr)
    for name in ("steps", "nproc", "log_every", "batch_size", "seq_len", "layers", "dim", "heads", "grad_accum",
                 "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.dim % args.heads:
        parser.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    device = args.device or ("auto" if torchrun else "cpu")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available (use --device cpu)")
        if not torchrun and world > torch.cuda.device_count():
            parser.error(f"--nproc {world} > {torch.cuda.device_count()} visible GPUs")
    try:
        config, micro = build_config(args, world)
    except (OSError, ValueError) as e:
        parser.error(f"config: {e}")
    if args.log_every is None:
        args.log_every = config.steps_per_print if args.config else _DEFAULTS["log_every"]
    if args.meta_init and config.zero_optimization.stage != 3:
        parser.error(f"--meta-init needs --stage 3 (stage {config.zero_optimization.stage} keeps full "
                     "parameters on every rank, so the model must be built on a real device)")

    if torchrun:
        run_rank(int(os.environ.get("LOCAL_RANK", 0)), args, config, micro, device, None)
        return 0
    spawn = (world, _free_port())
    if world == 1:
        run_rank(0, args, config, micro, device, spawn)
        return 0
    import torch.multiprocessing as mp

    from zerocore.examples import train_gpt  # the importable module, not __main__, for the children

    try:
        mp.spawn(train_gpt.run_rank, args=(args, config, micro, device, spawn), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        print(f"train_gpt: rank {e.error_index} exited with code {e.exit_code}", file=sys.stderr)
        return 1
    except mp.ProcessRaisedException as e:
        print(f"train_gpt: a rank failed:\n{e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
