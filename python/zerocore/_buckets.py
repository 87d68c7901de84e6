"""Bucket sizes: the config's when the user set them, otherwise sizes that overlap communication.

DeepSpeed's defaults (5e8 elements) put any model under a few hundred million parameters into one bucket,
so nothing is reduced until backward ends and nothing overlaps. Unset, zerocore uses DDP's reference,
25 MiB of gradients per bucket (``bucket_cap_mb=25``), and says so in ``comm_report()["buckets"]``.

Stage 3's forward prefetch likewise: DeepSpeed's 5e7 elements is less than one transformer block from hidden
size 2048 up, so on the models it was set for it means "the next unit". On a smaller model it gathers the
whole model ahead, the memory stage 3 exists to save (about 40 MB of peak RSS on bench/train_step.py's
27.4M-parameter GPT in fp32, for 1-3% of step time). Unset, zerocore prefetches one unit ahead, as FSDP does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .config import ZeroOptimizationConfig

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class BucketSizes:
    reduce: int  # elements per gradient bucket (stages 1-2: also the unit of the parameter all-gather)
    allgather_in_flight: int | None  # stages 1-2: cap on parameter all-gather elements in flight; None: none
    reduce_source: str
    allgather_source: str

    @classmethod
    def resolve(cls, zero: ZeroOptimizationConfig, grad_dtype: torch.dtype) -> BucketSizes:
        width = torch.empty((), dtype=grad_dtype).element_size()
        if zero.reduce_bucket_size is None:
            reduce = DEFAULT_BUCKET_BYTES // width
            reduce_source = (f"default: reduce_bucket_size unset, {reduce} elements = 25 MiB of "
                             f"{str(grad_dtype).replace('torch.', '')} gradients (DDP's bucket size)")
        else:
            reduce, reduce_source = zero.reduce_bucket_size, "config: zero_optimization.reduce_bucket_size"
        if zero.allgather_bucket_size is None:
            gather, gather_source = None, "default: allgather_bucket_size unset, no cap on gathers in flight"
        else:
            gather, gather_source = zero.allgather_bucket_size, "config: zero_optimization.allgather_bucket_size"
        return cls(reduce, gather, reduce_source, gather_source)

    def report(self) -> dict[str, Any]:
        return {"reduce_bucket_elements": self.reduce, "reduce_bucket_source": self.reduce_source,
                "allgather_in_flight_elements": self.allgather_in_flight,
                "allgather_source": self.allgather_source}


# The next unit whatever its size: a unit larger than what is left of a positive budget is still started
# (Note [Stage 3 prefetch plan] in cpp/include/zerocore/prefetch_plan.hpp), and then the budget is spent.
ONE_UNIT_AHEAD = 1


def stage3_prefetch_budget(zero: ZeroOptimizationConfig) -> tuple[int, str]:
    """Stage 3's forward prefetch budget in elements, and where it comes from."""
    if zero.stage3_prefetch_bucket_size is None:
        return ONE_UNIT_AHEAD, "default: stage3_prefetch_bucket_size unset, one unit ahead (as FSDP prefetches)"
    return zero.stage3_prefetch_bucket_size, "config: zero_optimization.stage3_prefetch_bucket_size"
