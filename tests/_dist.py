"""run_ranks(fn, world_size): runs fn(rank, world_size, *args) in world_size processes on Gloo over loopback.

Each rank's return value comes back in a list; an exception on any rank fails the caller with that rank's
traceback; a rank that does not finish within ``timeout`` seconds fails the caller and every process is
killed, so a hang becomes a fast failure instead of a stuck CI.

Ranks are forked from a forkserver that has imported torch and zerocore once, instead of spawned: a fresh
interpreter spends ~1.8 s of CPU importing torch, which on two cores was most of a small multi-rank test.
torch._dynamo is preloaded too: torch.optim.Optimizer imports it on first construction, another ~1.2 s of CPU
per rank in every test that builds an optimizer (nearly all of them). The forkserver never runs a torch op
(and these imports start no thread), so no OpenMP or other worker threads exist when it forks, and every
rank still starts from the same clean state (a process of its own, its own process group). The ranks see the
environment the forkserver started with (the first run_ranks call's): a test that needs a variable set for
its ranks sets it inside the rank function, as _worker sets MASTER_ADDR and RANK.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue: Any,
            pg_timeout: float) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zerocore", "hypothesis"]
_context: Any = None


def rank_context() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


class RankError(AssertionError):
    """A rank raised; the message holds its traceback."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 60.0, expect_errors: bool = False) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on every rank and returns the results by rank.

    With ``expect_errors`` the per-rank outcome ``("ok", result)`` or ``("error", traceback)`` is returned
    instead of raising.
    """
    ctx = rank_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, pg_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    import queue as queue_module
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (a hang?); "
                                   f"finished: {outcomes}")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
                outcomes[rank] = (status, payload)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in outcomes]
                if dead:
                    raise RankError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if expect_errors:
        return [outcomes[r] for r in range(world_size)]
    errors = {r: payload for r, (status, payload) in outcomes.items() if status == "error"}
    if errors:
        raise RankError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [outcomes[r][1] for r in range(world_size)]
