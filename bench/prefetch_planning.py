"""Stage 3's prefetch questions per step against the number of units (Note [Stage 3 prefetch plan]): the runtime's
PrefetchPlanner (the units' states read in place) against the per-call functions as the runtime asked them before
(four n-length lists built and checked at every unit visit), the same questions alternating in one process; and a
whole stage-3 step (world size 1, a stack of tiny Linear units) to show what the planning is a share of.

    python bench/prefetch_planning.py [--units 100,1000,4000] [--rounds 5] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import zerocore
from zerocore import _C


def questions_with_functions(n: int) -> float:
    """A forward's and a backward's questions, as the runtime asked them before: lists rebuilt per visit."""
    order, numel, persistent, states = list(range(n)), [4096] * n, [False] * n, [True] * n
    start = time.perf_counter()
    for position in range(n):
        _C.plan_forward_prefetch(recorded_order=order, position=position, unit_numel=numel,
                                 unit_sharded=[s for s in states], unit_persistent=persistent, live_elements=0,
                                 max_live=10**9, prefetch_budget=8192)
    for unit in reversed(range(n)):
        _C.plan_backward_prefetch(recorded_order=order, unit=unit, visit=0, unit_numel=numel,
                                  unit_sharded=[s for s in states], unit_persistent=persistent, live_elements=0,
                                  max_live=10**9)
    return time.perf_counter() - start


def questions_with_planner(n: int) -> float:
    order, numel, persistent = list(range(n)), [4096] * n, [False] * n
    states = bytearray(b"\x01" * n)
    start = time.perf_counter()
    planner = _C.PrefetchPlanner(order, numel, persistent)  # once per recorded order; counted here anyway
    for position in range(n):
        planner.forward(position=position, unit_sharded=states, live_elements=0, max_live=10**9,
                        prefetch_budget=8192)
    for unit in reversed(range(n)):
        planner.backward(unit=unit, visit=0, unit_sharded=states, live_elements=0, max_live=10**9)
    return time.perf_counter() - start


def step_seconds(n: int, steps: int) -> float:
    """The median of ``steps`` stage-3 steps (after two that record the order) of n Linear(8, 8) units."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(n)))
    engine = zerocore.initialize(model, {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x = torch.randn(4, 8)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", default="100,1000,4000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    rows = []
    for n in (int(u) for u in args.units.split(",")):
        before, after = [], []
        for _ in range(args.rounds):  # alternating, so both see the same machine
            before.append(questions_with_functions(n))
            after.append(questions_with_planner(n))
        step = step_seconds(n, 3)
        row = {"units": n, "questions_functions_ms": 1e3 * statistics.median(before),
               "questions_planner_ms": 1e3 * statistics.median(after), "step_ms": 1e3 * step}
        rows.append(row)
        print(f"{n:>6} units: a step's prefetch questions {row['questions_functions_ms']:8.2f} ms as asked before, "
              f"{row['questions_planner_ms']:6.2f} ms with the planner; a whole step {row['step_ms']:8.1f} ms",
              flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
