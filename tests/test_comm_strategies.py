"""Comm's collective algorithms as strategies (Note [Collective algorithms] in bindings/comm.hpp).

Every registered algorithm of each logical bucket collective, on Gloo with 2 and 3 ranks (3: shards and
ring estimates that are not powers of two), fp32 and bf16, buckets of 0, 1 and several elements per shard:
the result is the mathematically expected one and equals the native algorithm's; the stats follow the
documented formulas; the log is the same on every rank. The registry's names are what _C lists, "auto" is
the per-backend choice, and an unknown name is a ValueError listing the registered ones.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from zerocore import _C

pytestmark = pytest.mark.timeout(300)

OPS = ("reduce_scatter", "all_gather")
NATIVE = {"reduce_scatter": "reduce_scatter", "all_gather": "all_gather"}
AUTO_ON_GLOO = {"reduce_scatter": "shared_memory", "all_gather": "shared_memory"}  # every rank on this host
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHARD_SIZES = (0, 1, 5)  # elements per shard; 0 is an empty bucket
GATHER_LABEL = "strategy_gather"  # all-gathers are issued under a label, as stage 3 does

# The documented cost of one logical collective of a bucket of B bytes on W ranks (W > 1, B > 0):
# (algorithm_bytes, backend_calls). Table in Note [Collective algorithms].
FORMULAS = {
    "reduce_scatter": {
        "reduce_scatter": lambda b, w: (b * (w - 1) // w, 1),
        "all_reduce": lambda b, w: (2 * b * (w - 1) // w, 1),
        "send_recv": lambda b, w: (b * (w - 1) // w, 2 * (w - 1)),
        "shared_memory": lambda b, w: (b * (w - 1) // w, 0),
    },
    "all_gather": {
        "all_gather": lambda b, w: (b * (w - 1) // w, 1),
        "broadcast": lambda b, w: (b // w * (w - 1), w),
        "all_reduce": lambda b, w: (2 * b * (w - 1) // w, 1),
        "shared_memory": lambda b, w: (b // w * (w - 1), 0),
    },
}

# The quantized algorithms (ZeRO++), tested against explicitly quantized values in test_zeropp.py: their
# results are not the exact ones, so the exact-result checks here leave them out.
QUANTIZED = {"reduce_scatter": ["hierarchical"], "all_gather": ["quantized"]}

RUN_TIMEOUT = 180.0  # per run_ranks call, so a hang fails fast


def _reduce_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (|sum over 3 ranks| < 256), so every sum is exact in bf16 and any order of summation."""
    return ((torch.arange(numel, dtype=torch.float32) % 17) - 8 + 3 * rank).to(dtype)


def _owner_shard(owner: int, shard: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(shard, dtype=torch.float32) % 13) - 6 + 20 * owner).to(dtype)


def _cases(world: int):
    for dtype_name, dtype in DTYPES.items():
        for shard in SHARD_SIZES:
            yield dtype_name, dtype, shard * world


def _run_reduce_scatter(comm: Any, rank: int, world: int, tag0: int) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    for i, (dtype_name, dtype, numel) in enumerate(_cases(world)):
        bucket = _reduce_input(rank, numel, dtype)
        pending = comm.reduce_scatter(bucket, tag0 + i)
        assert pending.tag == tag0 + i
        pending.wait()
        shard = numel // world
        mine = bucket[rank * shard:(rank + 1) * shard].clone()
        expected = sum(_reduce_input(r, numel, torch.float32) for r in range(world))[rank * shard:(rank + 1) * shard]
        assert mine.dtype == dtype
        assert torch.equal(mine.float(), expected), (comm.reduce_scatter_algo, dtype_name, numel, mine, expected)
        out[(dtype_name, numel)] = mine
    return out


def _run_all_gather(comm: Any, rank: int, world: int, tag0: int) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    for i, (dtype_name, dtype, numel) in enumerate(_cases(world)):
        shard = numel // world
        # NaN outside the local shard: an algorithm that sums or keeps what was there shows it.
        bucket = torch.full((numel,), float("nan"), dtype=dtype)
        bucket[rank * shard:(rank + 1) * shard] = _owner_shard(rank, shard, dtype)
        pending = comm.all_gather(bucket, tag0 + i, GATHER_LABEL)
        assert pending.tag == tag0 + i
        pending.wait()
        expected = torch.cat([_owner_shard(r, shard, dtype) for r in range(world)])
        assert bucket.dtype == dtype
        assert torch.equal(bucket, expected), (comm.all_gather_algo, dtype_name, numel, bucket, expected)
        out[(dtype_name, numel)] = bucket.clone()
    return out


def _stats(comm: Any) -> dict[str, dict[str, int]]:
    return {op: {"calls": s.calls, "logical_elements": s.logical_elements, "algorithm_bytes": s.algorithm_bytes,
                 "backend_calls": s.backend_calls} for op, s in comm.stats().items()}


def strategies_worker(rank: int, world: int) -> dict[str, Any]:
    group = dist.group.WORLD
    algorithms = _C.collective_algorithms()
    report: dict[str, Any] = {"algorithms": algorithms, "stats": {}, "logs": {}}

    results: dict[str, dict[str, dict]] = {op: {} for op in OPS}
    for op in OPS:
        for name in FORMULAS[op]:
            comm = _C.Comm(group, **{f"{op}_algo": name})
            assert (comm.reduce_scatter_algo if op == "reduce_scatter" else comm.all_gather_algo) == name
            comm.set_logging(True)
            if op == "reduce_scatter":
                results[op][name] = _run_reduce_scatter(comm, rank, world, tag0=100)
            else:
                results[op][name] = _run_all_gather(comm, rank, world, tag0=200)
            report["stats"][f"{op}/{name}"] = _stats(comm)
            report["logs"][f"{op}/{name}"] = list(comm.log())
    for op in OPS:  # every algorithm agrees with the backend's own collective, bit for bit
        native = results[op][NATIVE[op]]
        for name, got in results[op].items():
            for key, tensor in got.items():
                assert torch.equal(tensor, native[key]), (op, name, key, tensor, native[key])

    # A mixed sequence through a Comm of each (reduce-scatter, all-gather) pair: the log must match across ranks.
    for rs_name, ag_name in itertools.product(FORMULAS["reduce_scatter"], FORMULAS["all_gather"]):
        comm = _C.Comm(group, rs_name, ag_name)
        comm.set_logging(True)
        n = 4 * world
        comm.reduce_scatter(_reduce_input(rank, n, torch.float32), 7).wait()
        bucket = torch.zeros(n)
        comm.all_gather(bucket, 8).wait()
        comm.all_gather(torch.zeros(2 * n, dtype=torch.bfloat16), 9, "fwd").wait()
        comm.all_reduce(torch.ones(3), False, 10).wait()
        comm.all_reduce(torch.ones(1), True, 11).wait()
        comm.broadcast(torch.ones(5), world - 1, 12).wait()
        comm.reduce_scatter(torch.zeros(0), 13).wait()
        report["logs"][f"mixed/{rs_name}+{ag_name}"] = list(comm.log())
        comm.clear_log()
        assert list(comm.log()) == []

    auto = _C.Comm(group)
    report["auto"] = {"reduce_scatter": auto.reduce_scatter_algo, "all_gather": auto.all_gather_algo,
                      "backend": auto.backend}
    explicit_auto = _C.Comm(group, "auto", "auto")
    assert (explicit_auto.reduce_scatter_algo, explicit_auto.all_gather_algo) == (
        auto.reduce_scatter_algo, auto.all_gather_algo)

    errors = {}
    for op, kwargs in (("reduce_scatter", {"reduce_scatter_algo": "magic"}),
                       ("all_gather", {"all_gather_algo": "Broadcast"})):
        with pytest.raises(ValueError) as info:
            _C.Comm(group, **kwargs)
        errors[op] = str(info.value)
    report["errors"] = errors
    return report


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def reports(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    return world, run_ranks(strategies_worker, world, timeout=RUN_TIMEOUT)


def test_registry_lists_exactly_the_registered_algorithms():
    # FORMULAS is the test's list of the registered algorithms, in registration order, each with its cost:
    # a new algorithm adds its row there.
    # shared_memory registers from its own file, after the quantized ones
    registered = {op: [n for n in FORMULAS[op] if n != "shared_memory"] + QUANTIZED[op] + ["shared_memory"]
                  for op in OPS}
    assert _C.collective_algorithms() == registered
    assert NATIVE["reduce_scatter"] in FORMULAS["reduce_scatter"] and NATIVE["all_gather"] in FORMULAS["all_gather"]


def test_every_algorithm_gives_the_expected_result_and_matches_native(reports):
    world, per_rank = reports  # the workers assert values; here: every rank ran every exact algorithm
    for report in per_rank:
        for op in OPS:
            for name in FORMULAS[op]:
                assert f"{op}/{name}" in report["stats"], (world, op, name)


def test_stats_follow_the_documented_formulas(reports):
    world, per_rank = reports
    for op in OPS:
        label = op if op == "reduce_scatter" else GATHER_LABEL
        for name in FORMULAS[op]:
            expected = {"calls": 0, "logical_elements": 0, "algorithm_bytes": 0, "backend_calls": 0}
            for _, dtype, numel in _cases(world):
                nbytes = numel * torch.empty(0, dtype=dtype).element_size()
                algorithm_bytes, backend_calls = FORMULAS[op][name](nbytes, world) if numel else (0, 0)
                expected["calls"] += 1
                expected["logical_elements"] += numel
                expected["algorithm_bytes"] += algorithm_bytes
                expected["backend_calls"] += backend_calls
            for rank, report in enumerate(per_rank):
                assert report["stats"][f"{op}/{name}"] == {label: expected}, (world, rank, op, name)


def test_formulas_by_hand():
    """The table above, spelled out for one case, so a wrong lambda cannot agree with a wrong C++ formula."""
    b, w = 3 * 4 * 5, 3  # 15 fp32 elements over 3 ranks: 60 bytes
    assert FORMULAS["reduce_scatter"]["reduce_scatter"](b, w) == (40, 1)
    assert FORMULAS["reduce_scatter"]["all_reduce"](b, w) == (80, 1)
    assert FORMULAS["all_gather"]["all_gather"](b, w) == (40, 1)
    assert FORMULAS["all_gather"]["broadcast"](b, w) == (40, 3)
    assert FORMULAS["all_gather"]["all_reduce"](b, w) == (80, 1)
    assert FORMULAS["reduce_scatter"]["shared_memory"](b, w) == (40, 0)
    assert FORMULAS["all_gather"]["shared_memory"](b, w) == (40, 0)


def test_collective_log_is_identical_across_ranks(reports):
    world, per_rank = reports
    logs = per_rank[0]["logs"]
    for rank, report in enumerate(per_rank[1:], start=1):
        assert report["logs"] == logs, (world, rank)
    n = 4 * world
    mixed = [f"reduce_scatter:7:{n}", f"all_gather:8:{n}", f"fwd:9:{2 * n}", "all_reduce:10:3", "all_reduce:11:1",
             "broadcast:12:5", "reduce_scatter:13:0"]
    mixed_logs = {key: log for key, log in logs.items() if key.startswith("mixed/")}
    assert len(mixed_logs) == len(FORMULAS["reduce_scatter"]) * len(FORMULAS["all_gather"])
    assert all(log == mixed for log in mixed_logs.values()), mixed_logs
    sizes = [numel for _, _, numel in _cases(world)]
    assert logs["reduce_scatter/all_reduce"] == [f"reduce_scatter:{100 + i}:{n}" for i, n in enumerate(sizes)]
    assert logs["all_gather/broadcast"] == [f"{GATHER_LABEL}:{200 + i}:{n}" for i, n in enumerate(sizes)]


def test_auto_is_the_backend_choice_and_unknown_names_list_the_registry(reports):
    _, per_rank = reports
    algorithms = _C.collective_algorithms()
    for report in per_rank:
        assert report["auto"] == {**AUTO_ON_GLOO, "backend": "gloo"}
        for op, bad in (("reduce_scatter", "magic"), ("all_gather", "Broadcast")):
            names = ["auto", *algorithms[op]]
            listed = ", ".join(f"'{n}'" for n in names[:-1]) + f" or '{names[-1]}'"
            assert report["errors"][op] == f"{op} algorithm must be {listed}, got '{bad}'"
    # Today's wording, unchanged by the move to a registry.
    assert per_rank[0]["errors"]["reduce_scatter"] == (
        "reduce_scatter algorithm must be 'auto', 'reduce_scatter', 'all_reduce', 'send_recv', 'hierarchical' "
        "or 'shared_memory', got 'magic'")
    assert per_rank[0]["errors"]["all_gather"] == (
        "all_gather algorithm must be 'auto', 'all_gather', 'broadcast', 'all_reduce', 'quantized' or 'shared_memory', "
        "got 'Broadcast'")


# ---- the widening reduce-scatter (Note [Widening reduce-scatter]) ----------------------------------------------
WIDENED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: scaled and deposited at the receiver
SHARDS_WIDENED = (0, 1, 4099, 70001)  # 70001: more than one of wait()'s 32768-element chunks, and a ragged last one


def _widening_worker(rank: int, world: int) -> dict[str, Any]:
    """Every algorithm: widens() as documented; where it widens, 16-bit buckets summed in fp32 bitwise as if
    widened and scaled before sending (with a prescale that is not a power of two), at half the bytes."""
    group = dist.group.WORLD
    out: dict[str, Any] = {"widens": {}, "refused": []}
    gen = torch.Generator().manual_seed(1234)
    for name in _C.collective_algorithms()["reduce_scatter"]:
        if name in QUANTIZED["reduce_scatter"]:
            continue
        comm = _C.Comm(group, name, "auto")
        out["widens"][name] = comm.reduce_scatter_widens
        assert comm.reduce_scatter_widens == _C.reduce_scatter_widens(name, "gloo")
        if not comm.reduce_scatter_widens:
            with pytest.raises(ValueError, match="cannot sum in a wider dtype"):
                comm.reduce_scatter_widened(torch.zeros(world, dtype=torch.bfloat16), torch.zeros(1), 0.5)
            out["refused"].append(name)
            continue
        for dtype in WIDENED_DTYPES:
            for shard in SHARDS_WIDENED:
                numel = shard * world
                # random values with full mantissas, the same on every rank's generator draw order
                every = [torch.randn(numel, generator=gen).mul(1 + r).to(dtype) for r in range(world)]
                bucket = every[rank].clone()
                prescale = 1.0 / world
                mine = slice(rank * shard, (rank + 1) * shard)
                expected = every[rank][mine].float() * prescale  # own shard first, then the peers in rank order
                for r in range(world):
                    if r != rank:
                        expected = expected + every[r][mine].float() * prescale
                # deposited into fp32 (the sum itself), copied into the bucket's dtype, added to what is there
                fp32 = torch.full((shard,), float("nan"))
                comm.reduce_scatter_widened(bucket, fp32, prescale, False, 7).wait()
                assert torch.equal(fp32, expected), (name, dtype, shard)
                rounded = torch.full((shard,), float("nan"), dtype=dtype)
                comm.reduce_scatter_widened(bucket, rounded, prescale, False, 8).wait()
                assert torch.equal(rounded, expected.to(dtype))
                held = torch.randn(shard, generator=gen).to(dtype)
                added = held.clone()
                comm.reduce_scatter_widened(bucket, added, prescale, True, 9).wait()
                assert torch.equal(added, held.add(expected).to(dtype))  # bf16 += fp32: summed in fp32, rounded once
                assert torch.equal(bucket, every[rank]), "the bucket keeps its values"
        stats = comm.stats()["reduce_scatter"]
        # each bucket in its own dtype's bytes, 3 deposits each
        sent = sum(d.itemsize * shard * world * (world - 1) // world
                   for d in WIDENED_DTYPES for shard in SHARDS_WIDENED) * 3
        out["bytes"] = (stats.algorithm_bytes, sent)
    send_recv = _C.Comm(group, "send_recv", "auto")
    with pytest.raises(ValueError, match="sums 16-bit or fp32 buckets in fp32"):
        send_recv.reduce_scatter_widened(torch.zeros(world, dtype=torch.float64), torch.zeros(1), 1.0)
    with pytest.raises(ValueError, match="the destination must be"):
        send_recv.reduce_scatter_widened(torch.zeros(2 * world, dtype=torch.bfloat16), torch.zeros(3), 1.0)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_widening_reduce_scatter_sums_16_bit_buckets_in_fp32_bitwise(world):
    results = run_ranks(_widening_worker, world, timeout=RUN_TIMEOUT)
    for result in results:
        assert result["widens"] == {"reduce_scatter": False, "all_reduce": False, "send_recv": True,
                                    "shared_memory": True}
        assert result["refused"] == ["reduce_scatter", "all_reduce"]
        got, want = result["bytes"]
        assert got == want  # the bucket's 16-bit bytes, not fp32's
