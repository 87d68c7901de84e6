"""One optimizer param group flattened into a bucketed buffer (stages 1-2).

Note [Stage 1-2 storage]
------------------------
Per group (one flat buffer per param group):

* ``param_buffer``  compute dtype, the whole padded flat buffer; every parameter's ``.data`` is a view.
* gradients, stage 1: ``grad_buffer`` (compute dtype, the whole flat buffer); every ``.grad`` is a view
                    and accumulates in place across micro-steps. At the boundary backward the buckets are
                    reduce-scattered and this rank's reduced shard is written back over its region.
* gradients, stage 2: ``grad_shard`` (compute dtype, this rank's shard only). Every backward outside
                    ``no_sync`` reduce-scatters its buckets and adds this rank's shard into ``grad_shard``;
                    ``.grad`` is freed as soon as it was copied into its bucket.

This rank's shard of every bucket is registered with the OptimizerState (Note [Optimizer state
ownership]), which owns the fp32 master (in fp32 training: the shard of ``param_buffer`` itself) and the
moments. A bucket is the unit of both collectives: the reduce-scatter of gradients in backward and the
all-gather of updated parameters after the step (see Note [Flat-partition geometry] in layout.hpp).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._optimizer_state import OptimizerState, Shard, shard_geometry
from .layout import Bucket, FlatLayout


def sum_of_squares(shards: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of gradient shards, accumulated in fp32 (padding is zero and adds nothing); inf or
    NaN when any gradient is."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for shard in shards:
        if shard.numel():
            total += torch.linalg.vector_norm(shard, dtype=torch.float32) ** 2
    return total


class FlatParamGroup:
    """Flattens ``params`` into a bucketed buffer; registers this rank's shard of every bucket with the
    optimizer state."""

    param_buffer: torch.Tensor  # 1-D, compute dtype, layout.total_size
    grad_buffer: torch.Tensor | None  # stage 1: 1-D compute dtype, layout.total_size
    grad_shard: torch.Tensor | None  # stage 2: 1-D compute dtype, layout.shard_size

    def __init__(
        self,
        params: list[nn.Parameter],
        names: Sequence[str],
        layout: FlatLayout,
        *,
        index: int,
        rank: int,
        grads_sharded: bool,
        compute_dtype: torch.dtype,
        device: torch.device,
        optimizer_state: OptimizerState,
    ) -> None:
        self.params = params
        self.layout = layout
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.buckets: list[Bucket] = layout.buckets
        self.offsets: list[int] = layout.offsets().tolist()
        # This rank's fp32 master values are read from the parameters before they are cast to the compute dtype.
        masters: list[torch.Tensor | None] = [None] * len(self.buckets)
        if compute_dtype != torch.float32:
            for bucket, b in enumerate(self.buckets):
                master = masters[bucket] = torch.zeros(b.shard_size, dtype=torch.float32, device=device)
                for piece in layout.pieces(rank, bucket):
                    source = params[piece.tensor].detach().reshape(-1)
                    start = piece.shard_offset - b.shard_offset
                    master[start : start + piece.length] = source[piece.tensor_offset : piece.tensor_offset + piece.length]
        self.param_buffer = torch.zeros(layout.total_size, dtype=compute_dtype, device=device)
        for param, offset in zip(params, self.offsets):
            view = self.param_buffer[offset : offset + param.numel()].view(param.shape)
            view.copy_(param.detach())
            param.data = view
        self.grad_buffer = None if grads_sharded else torch.zeros_like(self.param_buffer)
        self.grad_shard = torch.zeros(layout.shard_size, dtype=compute_dtype, device=device) if grads_sharded else None
        self.shards: list[Shard] = []
        shapes = [tuple(p.shape) for p in params]
        for bucket in range(len(self.buckets)):
            runs, pieces = shard_geometry(layout, rank, bucket, names, shapes, [index] * len(params))
            self.shards.append(optimizer_state.add_shard(
                f"group {index} bucket {bucket}", self.param_shard_slice(bucket), self.grad_slice(bucket), runs,
                pieces, master_values=masters[bucket]))

    # ---- per-bucket views -----------------------------------------------------------------------------
    def param_shard_slice(self, bucket: int) -> torch.Tensor:
        """This rank's shard of ``bucket`` inside ``param_buffer`` (where the all-gather reads it)."""
        b = self.buckets[bucket]
        start = b.flat_start + self.rank * b.shard_size
        return self.param_buffer[start : start + b.shard_size]

    def param_bucket(self, bucket: int) -> torch.Tensor:
        b = self.buckets[bucket]
        return self.param_buffer[b.flat_start : b.flat_start + b.padded_size]

    def param_bucket_params(self, bucket: int) -> list[nn.Parameter]:
        """The parameters whose values live in ``bucket``."""
        b = self.buckets[bucket]
        return self.params[b.first_tensor : b.end_tensor]

    def grad_slice(self, bucket: int) -> torch.Tensor:
        """This rank's reduced gradient shard of ``bucket`` (valid after the boundary backward)."""
        b = self.buckets[bucket]
        if self.grad_shard is not None:
            return self.grad_shard[b.shard_offset : b.shard_offset + b.shard_size]
        start = b.flat_start + self.rank * b.shard_size
        assert self.grad_buffer is not None
        return self.grad_buffer[start : start + b.shard_size]

    def grad_view(self, index: int) -> torch.Tensor:
        """Stage 1: parameter ``index``'s gradient as a view of ``grad_buffer``."""
        assert self.grad_buffer is not None
        param = self.params[index]
        offset = self.offsets[index]
        return self.grad_buffer[offset : offset + param.numel()].view(param.shape)

    # ---- state transitions ----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
            for index, param in enumerate(self.params):
                param.grad = self.grad_view(index)
        else:
            assert self.grad_shard is not None
            self.grad_shard.zero_()
            for param in self.params:
                param.grad = None

    # ---- memory ---------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        return {"params": nbytes(self.param_buffer), "grads": nbytes(self.grad_buffer) + nbytes(self.grad_shard)}
