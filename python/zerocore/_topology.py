"""Nodes of the data-parallel group, for ZeRO++'s hierarchical collectives (hpZ, qgZ).

The group's ranks, in group order, are cut into nodes of ``node_size`` consecutive ranks (torchrun numbers
the ranks of a node consecutively, and sets ``LOCAL_WORLD_SIZE`` to the node's size). A rank's *node group*
holds the ranks of its node; its *cross group* holds the rank with its local index in every node. Creating
a process group is itself collective: every rank creates every node group and every cross group, in the same
order, and keeps the two it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    node_size: int
    nodes: int
    node: int  # this rank's node
    local_rank: int  # this rank's index within its node
    node_group: Any  # None where a node is one rank
    cross_group: Any  # None where there is one node


def check_zeropp_partitions(zero: Any, world: int, node_size: int | None) -> None:
    """What hpZ and qgZ need of the world size, checked before any process group is built (and by the
    estimate, which builds none): ``node_size`` is qgZ's (the config's, LOCAL_WORLD_SIZE or the world)."""
    hpz = zero.zero_hpz_partition_size
    if hpz > 1 and world % hpz:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size ({hpz}) must divide the data-parallel group of "
                         f"{world} ranks: each partition of {hpz} consecutive ranks keeps a secondary copy (usually "
                         "the ranks of one node)")
    if zero.zero_quantized_gradients and node_size is not None and world % node_size:
        raise ValueError(f"zero_optimization: a node of {node_size} ranks does not divide the data-parallel group "
                         f"of {world} ranks (zero_quantized_gradients reduces within nodes first); set "
                         "LOCAL_WORLD_SIZE (torchrun does) or zero_optimization.zero_node_size to the ranks per node")


def build_topology(process_group: Any, node_size: int) -> Topology:
    """The nodes of ``process_group`` (collective: every rank of it calls this with the same ``node_size``)."""
    ranks = dist.get_process_group_ranks(process_group)
    world, me = len(ranks), dist.get_rank(process_group)
    if node_size < 1 or world % node_size:
        raise ValueError(f"zero_optimization: a node of {node_size} ranks does not divide the data-parallel group of "
                         f"{world} ranks; set LOCAL_WORLD_SIZE (torchrun does) or zero_optimization.zero_node_size "
                         "to the ranks per node")
    nodes = world // node_size
    node_group = cross_group = None
    if node_size > 1:
        for n in range(nodes):
            group = dist.new_group([ranks[n * node_size + i] for i in range(node_size)])
            if n == me // node_size:
                node_group = group
    if nodes > 1:
        for i in range(node_size):
            group = dist.new_group([ranks[n * node_size + i] for n in range(nodes)])
            if i == me % node_size:
                cross_group = group
    return Topology(node_size, nodes, me // node_size, me % node_size, node_group, cross_group)
