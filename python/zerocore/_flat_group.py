"""One optimizer param group flattened into a bucketed buffer, with this rank's sharded optimizer state.

Note [Stage 1-2 storage]
------------------------
Per group (one flat buffer per param group, so every shard has uniform hyper-parameters):

* ``param_buffer``  compute dtype, the whole padded flat buffer; every parameter's ``.data`` is a view.
* ``master``        fp32, this rank's shard (``layout.shard_size``). In fp32 training the rank's shard
                    of ``param_buffer`` *is* the master (no copy).
* ``exp_avg``, ``exp_avg_sq``  fp32, this rank's shard.
* gradients, stage 1: ``grad_buffer`` (compute dtype, the whole flat buffer); every ``.grad`` is a view
                    and accumulates in place across micro-steps. At the boundary backward the buckets are
                    reduce-scattered and this rank's reduced shard is written back over its region.
* gradients, stage 2: ``grad_shard`` (compute dtype, this rank's shard only). Every backward outside
                    ``no_sync`` reduce-scatters its buckets and adds this rank's shard into ``grad_shard``;
                    ``.grad`` is freed as soon as it was copied into its bucket.

A bucket is the unit of both collectives: the reduce-scatter of gradients in backward and the
all-gather of updated parameters after the step (see Note [Flat-partition geometry] in layout.hpp).
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .layout import Bucket, FlatLayout


def sum_of_squares(shards: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of gradient shards, accumulated in fp32 (padding is zero and adds nothing)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for shard in shards:
        if shard.numel():
            total += torch.linalg.vector_norm(shard, dtype=torch.float32) ** 2
    return total


class FlatParamGroup:
    """Flattens ``params`` into a bucketed buffer and holds this rank's master shard and Adam moments."""

    param_buffer: torch.Tensor  # 1-D, compute dtype, layout.total_size
    master: torch.Tensor  # 1-D fp32, layout.shard_size (aliases param_buffer's shards in fp32 training)
    exp_avg: torch.Tensor  # 1-D fp32, layout.shard_size
    exp_avg_sq: torch.Tensor  # 1-D fp32, layout.shard_size
    grad_buffer: torch.Tensor | None  # stage 1: 1-D compute dtype, layout.total_size
    grad_shard: torch.Tensor | None  # stage 2: 1-D compute dtype, layout.shard_size

    def __init__(
        self,
        params: list[nn.Parameter],
        layout: FlatLayout,
        *,
        rank: int,
        stage: int,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.params = params
        self.layout = layout
        self.rank = rank
        self.stage = stage
        self.compute_dtype = compute_dtype
        self.buckets: list[Bucket] = layout.buckets
        self.offsets: list[int] = layout.offsets().tolist()
        shard = layout.shard_size
        self._fp32_master = compute_dtype == torch.float32
        # The master shard is read from the parameters before they are cast to the compute dtype.
        if not self._fp32_master:
            self.master = torch.zeros(shard, dtype=torch.float32, device=device)
            for piece in layout.pieces(rank):
                source = params[piece.tensor].detach().reshape(-1)
                self.master[piece.shard_offset : piece.shard_offset + piece.length] = source[
                    piece.tensor_offset : piece.tensor_offset + piece.length
                ]
        self.param_buffer = torch.zeros(layout.total_size, dtype=compute_dtype, device=device)
        for param, offset in zip(params, self.offsets):
            view = self.param_buffer[offset : offset + param.numel()].view(param.shape)
            view.copy_(param.detach())
            param.data = view
        if self._fp32_master:
            self.master = torch.empty(0, dtype=torch.float32, device=device)  # see master_slice()
        self.exp_avg = torch.zeros(shard, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(shard, dtype=torch.float32, device=device)
        self.grad_buffer = torch.zeros_like(self.param_buffer) if stage == 1 else None
        self.grad_shard = torch.zeros(shard, dtype=compute_dtype, device=device) if stage == 2 else None
        self.step_count = 0

    # ---- per-bucket views -----------------------------------------------------------------------------
    def param_shard_slice(self, bucket: int) -> torch.Tensor:
        """This rank's shard of ``bucket`` inside ``param_buffer`` (where the all-gather reads it)."""
        b = self.buckets[bucket]
        start = b.flat_start + self.rank * b.shard_size
        return self.param_buffer[start : start + b.shard_size]

    def param_bucket(self, bucket: int) -> torch.Tensor:
        b = self.buckets[bucket]
        return self.param_buffer[b.flat_start : b.flat_start + b.padded_size]

    def _local(self, tensor: torch.Tensor, bucket: int) -> torch.Tensor:
        b = self.buckets[bucket]
        return tensor[b.shard_offset : b.shard_offset + b.shard_size]

    def master_slice(self, bucket: int) -> torch.Tensor:
        return self.param_shard_slice(bucket) if self._fp32_master else self._local(self.master, bucket)

    def moment_slices(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._local(self.exp_avg, bucket), self._local(self.exp_avg_sq, bucket)

    def grad_slice(self, bucket: int) -> torch.Tensor:
        """This rank's reduced gradient shard of ``bucket`` (valid after the boundary backward)."""
        if self.grad_shard is not None:
            return self._local(self.grad_shard, bucket)
        b = self.buckets[bucket]
        start = b.flat_start + self.rank * b.shard_size
        assert self.grad_buffer is not None
        return self.grad_buffer[start : start + b.shard_size]

    def grad_view(self, index: int) -> torch.Tensor:
        """Stage 1: parameter ``index``'s gradient as a view of ``grad_buffer``."""
        assert self.grad_buffer is not None
        param = self.params[index]
        offset = self.offsets[index]
        return self.grad_buffer[offset : offset + param.numel()].view(param.shape)

    def sync_master_from_params(self) -> None:
        """After the parameters were overwritten (``zerocore.gathered`` with a modifier rank)."""
        if not self._fp32_master:
            for bucket in range(len(self.buckets)):
                self.master_slice(bucket).copy_(self.param_shard_slice(bucket))

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

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced gradient shard of every bucket."""
        return [self.grad_slice(bucket) for bucket in range(len(self.buckets))]

    # ---- memory ---------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        grads = nbytes(self.grad_buffer) + nbytes(self.grad_shard)
        return {
            "params": nbytes(self.param_buffer),
            "grads": grads,
            "master_params": nbytes(self.master),
            "optimizer_moments": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq),
        }
