"""ZeRO++ (issue 12): the quantized collectives (Note [Quantized collectives] in
bindings/quantized_collectives.cpp) against results rebuilt from explicitly quantized and dequantized
shards, on one machine pretending to be nodes of 2 ranks; and the engine's qwZ, hpZ and qgZ."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from zerocore import _C
from zerocore._topology import build_topology

pytestmark = pytest.mark.timeout(300)

GROUP = 64


def _qdq(values: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """dequantize(quantize(values)) in fp32 through the kernels' own ops."""
    n = values.numel()
    q = torch.empty(_C.quantized_bytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty(_C.quantize_num_groups(n, group))
    _C.quantize(values.contiguous(), bits, group, q, scales)
    out = torch.empty(n)
    _C.dequantize(q, scales, n, bits, group, out)
    return out


def _bucket(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


def collectives_worker(rank: int, world: int, node_size: int) -> dict:
    topo = build_topology(dist.group.WORLD, node_size)
    comm = _C.Comm(dist.group.WORLD, "hierarchical", "quantized", quantization_group_size=GROUP, node_size=node_size,
                   node_group=topo.node_group, cross_group=topo.cross_group)
    for seed, (shard, dtype) in enumerate([(1, torch.float32), (5, torch.bfloat16), (300, torch.float32),
                                           (1000, torch.bfloat16), (0, torch.float32)]):
        numel = shard * world
        # all-gather: every slot is dequantize(quantize(its owner's shard)), this rank's too
        bucket = _bucket(rank, numel, dtype, seed)
        comm.all_gather(bucket, seed, "weights").wait()
        for owner in range(world):
            expected = _qdq(_bucket(owner, numel, dtype, seed)[owner * shard:(owner + 1) * shard].float(), 8)
            assert torch.equal(bucket[owner * shard:(owner + 1) * shard], expected.to(dtype)), (owner, shard, dtype)
        # reduce-scatter: stage one sums the node's int4 contributions, stage two the nodes' int4 partials
        bucket = _bucket(rank, numel, dtype, seed + 50)
        comm.reduce_scatter(bucket, seed).wait()
        nodes = world // node_size
        me = slice(rank * shard, (rank + 1) * shard)
        total = torch.zeros(shard)
        for n in range(nodes):
            partial = torch.zeros(shard)
            for local in range(node_size):
                partial += _qdq(_bucket(n * node_size + local, numel, dtype, seed + 50)[me].float(), 4)
            total += _qdq(partial, 4)
        assert torch.equal(bucket[me], total.to(dtype)), (shard, dtype, bucket[me], total)
    stats = {op: (s.algorithm_bytes, s.unquantized_bytes, s.backend_calls) for op, s in comm.stats().items()}
    return {"stats": stats}


@pytest.mark.parametrize("world,node_size", [(4, 2), (2, 1), (2, 2), (4, 4)])
def test_quantized_collectives_equal_explicitly_quantized_values(world, node_size):
    results = run_ranks(collectives_worker, world, node_size, timeout=180)
    for result in results:
        weights, reduce = result["stats"]["weights"], result["stats"]["reduce_scatter"]
        assert weights[0] < 0.55 * weights[1]  # int8 + scales against the bucket's own dtype
        assert reduce[0] < 0.35 * reduce[1]
