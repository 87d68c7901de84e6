"""The "shared_memory" collective algorithms (Note [Shared-memory collectives] in
bindings/shared_memory_collectives.cpp, Note [Shared-memory transport] in zerocore/shared_memory_channel.hpp):
results bitwise those of send_recv and broadcast at sizes spanning many pipeline steps, collectives left in flight
and waited out of order, the fallback when any rank cannot share memory, and failures (a peer that died, a peer
that never comes, ranks in different collectives) raising on the ranks that wait instead of hanging.
test_comm_strategies.py runs the algorithm through the registry's common checks too."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zerocore import _C

from _dist import run_ranks

RUN_TIMEOUT = 180.0

# Elements per shard: empty, one, a sub-slot boundary's neighbours at world 2-4 (sub-slots of 256, 170.5 and
# 128 KiB), and enough for dozens of steps through a depth-4 ring of slots.
SHARDS = (1, 7, 32767, 32768, 65537, 300001)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bucket(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 131 + rank)
    return torch.randn(numel, generator=gen).mul(rank + 1).to(dtype)


def _parity_worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    shm = _C.Comm(group, "shared_memory", "shared_memory")
    ref = _C.Comm(group, "send_recv", "broadcast")
    assert (shm.reduce_scatter_algo, shm.all_gather_algo) == ("shared_memory", "shared_memory")
    assert shm.shared_memory_bytes > 0 and ref.shared_memory_bytes == 0
    checked = 0
    for seed, (dtype, shard) in enumerate((d, s) for d in DTYPES for s in SHARDS):
        numel = shard * world
        mine = slice(rank * shard, (rank + 1) * shard)
        a, b = _bucket(rank, numel, dtype, seed), _bucket(rank, numel, dtype, seed)
        shm.reduce_scatter(a, 1).wait()
        ref.reduce_scatter(b, 1).wait()
        assert torch.equal(a[mine], b[mine]), (dtype, shard)
        wide_a, wide_b = torch.full((shard,), float("nan")), torch.full((shard,), float("nan"))
        bucket = _bucket(rank, numel, dtype, seed)
        shm.reduce_scatter_widened(bucket, wide_a, 1.0 / 3, False, 2).wait()
        ref.reduce_scatter_widened(bucket, wide_b, 1.0 / 3, False, 2).wait()
        assert torch.equal(wide_a, wide_b), (dtype, shard)
        gathered = torch.full((numel,), float("nan"), dtype=dtype)
        gathered[mine] = _bucket(rank, shard, dtype, seed)
        shm.all_gather(gathered, 3).wait()
        expected = torch.cat([_bucket(r, shard, dtype, seed) for r in range(world)])
        assert torch.equal(gathered, expected), (dtype, shard)
        checked += 1
    return {"checked": checked, "stats": {op: (s.calls, s.backend_calls) for op, s in shm.stats().items()}}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_results_are_bitwise_those_of_send_recv_and_broadcast(world):
    for result in run_ranks(_parity_worker, world, timeout=RUN_TIMEOUT):
        n = len(DTYPES) * len(SHARDS)
        assert result["checked"] == n
        assert result["stats"] == {"reduce_scatter": (2 * n, 0), "all_gather": (n, 0)}  # nothing through Gloo


def _in_flight_worker(rank: int, world: int) -> None:
    """Collectives issued back to back and waited in reverse order, interleaved with the backend's own
    collectives on the same Comm: each lands whole."""
    comm = _C.Comm(dist.group.WORLD)
    shards = [5, 70001, 1, 40000, 123457, 64]
    pending, buckets = [], []
    for i, shard in enumerate(shards):
        bucket = torch.full((shard * world,), float(-1 - i))
        bucket[rank * shard:(rank + 1) * shard] = torch.arange(shard, dtype=torch.float32) + 1000 * rank + i
        buckets.append(bucket)
        pending.append(comm.all_gather(bucket, i))
        total = torch.full((1,), float(rank + 1))
        comm.all_reduce(total, False, 100 + i).wait()
        assert total.item() == world * (world + 1) / 2
    for p in reversed(pending):
        p.wait()
    for i, (shard, bucket) in enumerate(zip(shards, buckets)):
        expected = torch.cat([torch.arange(shard, dtype=torch.float32) + 1000 * r + i for r in range(world)])
        assert torch.equal(bucket, expected), i


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_in_flight_complete_in_any_wait_order(world):
    run_ranks(_in_flight_worker, world, timeout=RUN_TIMEOUT)


def _fallback_worker(rank: int, world: int) -> dict[str, Any]:
    if rank == world - 1:
        os.environ["ZEROCORE_SHARED_MEMORY"] = "0"  # one rank alone is enough for every rank to fall back
    try:
        auto = _C.Comm(dist.group.WORLD)
        out: dict[str, Any] = {"auto": (auto.reduce_scatter_algo, auto.all_gather_algo, auto.shared_memory_bytes)}
        bucket = torch.full((3 * world,), float(rank))
        auto.reduce_scatter(bucket, 0).wait()
        assert bucket[rank * 3:(rank + 1) * 3].tolist() == [world * (world - 1) / 2] * 3
        with pytest.raises(ValueError) as info:
            _C.Comm(dist.group.WORLD, "shared_memory", "auto")
        out["error"] = str(info.value)
        return out
    finally:
        os.environ.pop("ZEROCORE_SHARED_MEMORY", None)


def test_any_rank_that_cannot_share_memory_makes_every_rank_fall_back():
    world = 3
    results = run_ranks(_fallback_worker, world, timeout=RUN_TIMEOUT)
    for rank, result in enumerate(results):
        assert result["auto"] == ("send_recv", "broadcast", 0), rank
        assert "'shared_memory' collective algorithm is not available here" in result["error"]
        assert f"rank {world - 1} could not use a shared-memory segment" in result["error"]
    assert "ZEROCORE_SHARED_MEMORY=0" in results[world - 1]["error"]


def _peer_exits_worker(rank: int, world: int) -> dict[str, Any]:
    comm = _C.Comm(dist.group.WORLD, "auto", "shared_memory")
    if rank == 1:
        return {"left": True}  # this process ends without issuing the all-gather rank 0 waits for
    time.sleep(1.0)
    bucket = torch.zeros(2 * 1000)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        comm.all_gather(bucket, 0).wait()
    waited = time.monotonic() - started
    with pytest.raises(RuntimeError, match="earlier shared-memory collective failed"):
        comm.all_gather(bucket, 1).wait()  # the channel stays failed: never a wrong result
    return {"error": str(info.value), "waited": waited}


def test_a_peer_that_exits_fails_the_wait_instead_of_hanging():
    results = run_ranks(_peer_exits_worker, 2, timeout=RUN_TIMEOUT, pg_timeout=120.0)
    assert "rank 1" in results[0]["error"] and "exited" in results[0]["error"], results[0]["error"]
    assert results[0]["waited"] < 30.0  # seen by its pid, not at the 120 s process-group timeout


def _peer_stalls_worker(rank: int, world: int) -> dict[str, Any]:
    comm = _C.Comm(dist.group.WORLD, "shared_memory", "auto")
    if rank == 1:
        time.sleep(6.0)  # alive, but never issues the collective
        return {}
    with pytest.raises(RuntimeError) as info:
        comm.reduce_scatter(torch.ones(2 * 10), 0).wait()
    return {"error": str(info.value)}


def test_a_peer_that_never_comes_fails_the_wait_at_the_process_group_timeout():
    results = run_ranks(_peer_stalls_worker, 2, timeout=RUN_TIMEOUT, pg_timeout=2.0)
    assert "waited 2000 ms (the process group's timeout) for rank 1" in results[0]["error"], results[0]["error"]


def _mismatch_worker(rank: int, world: int) -> dict[str, Any]:
    comm = _C.Comm(dist.group.WORLD, "auto", "shared_memory")
    bucket = torch.zeros(world * (4 if rank == 0 else 8))  # rank 0 gathers 4 elements per rank, the others 8
    with pytest.raises(RuntimeError) as info:
        comm.all_gather(bucket, 0).wait()
    return {"error": str(info.value)}


def test_ranks_in_different_collectives_fail_on_every_rank():
    results = run_ranks(_mismatch_worker, 2, timeout=RUN_TIMEOUT, pg_timeout=60.0)
    assert "are in different collectives" in results[0]["error"] or "failed in a collective" in results[0]["error"]
    assert any("are in different collectives" in r["error"] for r in results), results


def _dropped_in_flight_worker(rank: int, world: int) -> list[float]:
    comm = _C.Comm(dist.group.WORLD, "auto", "shared_memory")
    bucket = torch.zeros(world * 50000)
    bucket[rank * 50000:(rank + 1) * 50000] = rank + 1
    if rank == 1:
        time.sleep(1.0)  # rank 0 drops its Comm before this rank has issued the matching all-gather
    pending = comm.all_gather(bucket, 0)
    if rank == 0:
        del comm  # a Comm dropped with a collective in flight lets it finish (its peers are issuing theirs)
    pending.wait()
    return [float(bucket[r * 50000:(r + 1) * 50000].sum()) for r in range(world)]


def test_a_comm_dropped_with_a_collective_in_flight_lets_it_finish():
    for result in run_ranks(_dropped_in_flight_worker, 2, timeout=RUN_TIMEOUT):
        assert result == [50000.0, 100000.0]


def _stale_segments_worker(rank: int, world: int, stale: str, live: str) -> bool:
    _C.Comm(dist.group.WORLD)  # rank 0 sweeps before creating its own segment
    dist.barrier()
    return not os.path.exists(stale) and os.path.exists(live)


def test_a_segment_left_by_a_rank_0_killed_in_the_rendezvous_is_removed_by_the_next():
    """A process killed between creating its segment and the rendezvous's unlink leaves a 4 MiB file in /dev/shm;
    the next rank 0 on the host removes it, and only it: a segment whose creator lives is left alone."""
    import subprocess
    import sys

    namespace = os.stat("/proc/self/ns/pid").st_ino
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process (pid reuse within this test is not a concern)
    stale = f"/dev/shm/zerocore-{namespace}-{gone.pid}-0-{os.urandom(8).hex()}"
    live = f"/dev/shm/zerocore-{namespace}-{os.getpid()}-0-{os.urandom(8).hex()}"
    other = f"/dev/shm/zerocore-{namespace + 1}-{gone.pid}-0-{os.urandom(8).hex()}"  # another pid namespace
    for path in (stale, live, other):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    try:
        assert run_ranks(_stale_segments_worker, 2, stale, live, timeout=RUN_TIMEOUT) == [True, True]
        assert os.path.exists(other)
    finally:
        for path in (stale, live, other):
            if os.path.exists(path):
                os.unlink(path)
