"""``python -m zerocore.estimate``'s command line: argument parsing, the table and the JSON output of
:func:`zerocore.estimate_memory` (which lives in ``estimate.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ._deepspeed_json import load_json
from ._hf_auto import PRECISIONS, for_planning
from .config import STAGE_0_RUNS_AS_STAGE_1, ZeroConfig
from .estimate import INT64_MAX, estimate_memory

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _parse_count(text: str) -> int:
    """``7e9``, ``7B``, ``6.7b``, ``7_000_000_000``."""
    cleaned = text.strip().lower().replace("_", "").replace(",", "")
    scale = _SUFFIXES.get(cleaned[-1:], 1)
    number = cleaned[:-1] if scale != 1 else cleaned
    try:
        value = int(number) * scale if number.isdigit() else float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 7e9, 7B, 7000000000)") from None
    if not 1 <= value <= INT64_MAX or value != int(value):  # inf and nan fail the range before int() sees them
        raise argparse.ArgumentTypeError(f"not a whole number of parameters in [1, 2**63 - 1]: {text!r}")
    return int(value)


def add_planning_arguments(parser: argparse.ArgumentParser) -> None:
    """--bf16 / --fp16 / --fp32 and --hidden-size: what a Hugging Face Trainer's config leaves "auto" and a plan
    needs (the estimate's and the doctor's command lines)."""
    precision = parser.add_mutually_exclusive_group()
    for name in PRECISIONS:
        what = "fp32 compute (no bf16, no fp16)" if name == "fp32" else f"{name} compute"
        precision.add_argument(f"--{name}", dest="precision", action="store_const", const=name,
                               help=f"override: {what}; needed where the config's precision is \"auto\"")
    parser.add_argument("--hidden-size", type=int, help="the model's hidden size, for 'auto' bucket sizes")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"


def _asks_stage_0(data: Any, stage: int | None) -> bool:
    if stage is None:
        section = data.get("zero_optimization") if isinstance(data, dict) else None
        stage = section.get("stage") if isinstance(section, dict) else None
    return stage == 0 and not isinstance(stage, bool)


def _table(result: dict[str, Any], params: int, stage_0: bool = False) -> str:
    where = result["where"]
    approx = " (one flat tensor: padding is a lower bound)" if result["approximate"] else ""
    placement = result["optimizer_placement"] + (", pinned" if result["pinned_host"] else "")
    lines = [f"zerocore memory estimate: {params:,} parameters{approx}",
             (f"ZeRO stage {result['stage']}{' (stage 0 runs as stage 1)' if stage_0 else ''}, "
              f"{result['compute_dtype']} on {result['device']}, "
              f"world size {result['world_size']}, optimizer state: {placement}"),
             "", f"{'per rank':<34}{'bytes':>18}    where"]
    for key, value in result["bytes"].items():
        lines.append(f"  {key:<32}{_gib(value):>18}    {where[key]}")
    lines.append(f"  {'total':<32}{_gib(result['total_bytes']):>18}    "
                 f"(device {_gib(result['device_bytes'])}, host {_gib(result['host_bytes'])})")
    if result["optimizer_placement"] == "nvme":
        lines.append(f"  {'nvme file':<32}{_gib(result['nvme_file_bytes']):>18}    nvme")
    if result["nvme_param_file_bytes"]:
        lines.append(f"  {'nvme parameter file':<32}{_gib(result['nvme_param_file_bytes']):>18}    nvme")
    if result.get("per_rank"):
        lines.append(f"every one of the {result['world_size']} ranks holds the same bytes")
    lines += ["", "These are the bytes held between steps. A step adds gradient bucket buffers (and, in stage 3,",
              "gathered units): zerocore.estimate_memory(model, ...)['step'] plans them for a model (build it",
              "under torch.device('meta'))."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerocore.estimate",
        description="Per-rank memory of a zerocore ZeRO run, planned by the engine's own layout code. A Hugging "
                    "Face Trainer's DeepSpeed config is read as it is: its \"auto\" training arguments (lr, "
                    "clipping, ...) change no byte; an \"auto\" precision needs --bf16, --fp16 or --fp32 and \"auto\" "
                    "bucket sizes --hidden-size.")
    parser.add_argument("--params", type=_parse_count, required=True,
                        help="trainable parameters (7e9, 7B): one flat tensor, so padding is a lower bound")
    parser.add_argument("--world", type=int, required=True, help="data-parallel ranks")
    parser.add_argument("--config", help="a DeepSpeed JSON config (default: zerocore's defaults, stage 1 fp32)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3),
                        help="override zero_optimization.stage (0, DeepSpeed's plain data parallelism, runs and "
                             "plans as stage 1)")
    parser.add_argument("--device", default="cuda", help="where the engine runs: cuda (default) or cpu")
    parser.add_argument("--rank", type=int, help="report this rank (default: the largest of any rank)")
    add_planning_arguments(parser)
    parser.add_argument("--no-strict", action="store_true", help="ignore unsupported DeepSpeed keys (warns)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        data = for_planning(load_json(args.config) if args.config else {}, args.precision, args.hidden_size)
        with warnings.catch_warnings():
            # stage 0's warning is about clipping in a training script; a plan only needs to say what it plans
            warnings.filterwarnings("ignore", message=re.escape(STAGE_0_RUNS_AS_STAGE_1))
            config = ZeroConfig.from_deepspeed(data, strict=not args.no_strict, hidden_size=args.hidden_size)
            if args.stage is not None:
                config = dataclasses.replace(config, zero_optimization=dataclasses.replace(
                    config.zero_optimization, stage=args.stage))
        result = estimate_memory(args.params, config, args.world, args.rank, device=args.device,
                                 hidden_size=args.hidden_size)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, default=list))  # per_rank: every rank's entry
    else:
        print(_table(result, args.params, stage_0=_asks_stage_0(data, args.stage)))
    return 0
