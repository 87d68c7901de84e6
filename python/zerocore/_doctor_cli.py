"""``python -m zerocore.doctor``'s command line: arguments, the table and the JSON output of
:func:`zerocore.doctor.doctor`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._estimate_cli import _parse_count, add_planning_arguments
from .doctor import doctor

_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def _parse_size(text: str) -> int:
    """``256M``, ``1G``, ``4096``: bytes."""
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text.strip().lower()[-1:], 1)
    number = text.strip()[:-1] if scale != 1 else text.strip()
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 256M, 1G)") from None
    if not 4096 <= value <= 1 << 40:
        raise argparse.ArgumentTypeError(f"the probe size must be in [4K, 1T], got {text!r}")
    return value


def _rank_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of ranks: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number of ranks must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerocore.doctor",
        description="Checks this machine for a zerocore run: the build, cores per rank, host memory against the "
                    "plan, each nvme_path's file system, O_DIRECT, free space and measured bandwidth, and predicts "
                    "whether the optimizer phase of a step is bound by the disk or the CPU. Exit code 1 when a "
                    "check fails.")
    parser.add_argument("--config", help="DeepSpeed JSON config (its nvme_paths are probed)")
    parser.add_argument("--params", type=_parse_count, help="trainable parameters (7e9, 7B): plans memory per rank")
    parser.add_argument("--world", type=_rank_count, help="data-parallel ranks (default: $WORLD_SIZE or 1)")
    parser.add_argument("--local-world", type=_rank_count, help="ranks on this machine (default: "
                        "$LOCAL_WORLD_SIZE or --world)")
    parser.add_argument("--nvme-path", action="append", default=[], help="another directory to probe (repeatable)")
    parser.add_argument("--probe-size", type=_parse_size, default=256 << 20,
                        help="bytes written and read back per directory (default 256M)")
    add_planning_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = parser.parse_args(argv)
    try:
        result = doctor(args.config, params=args.params, world_size=args.world, local_world_size=args.local_world,
                        nvme_paths=args.nvme_path, probe_bytes=args.probe_size, precision=args.precision,
                        hidden_size=args.hidden_size)
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        for check in result["checks"]:
            print(f"[{_MARK[check['status']]}] {check['name']}: {check['detail']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
