"""The ZeRO stage as a policy: what is partitioned and when it communicates, read where behaviour differs.

Note [Stage policy]
-------------------
One sharded-state model serves every stage (Note [Optimizer state ownership]); a stage only decides

==================  =======  =======  =======
                    stage 1  stage 2  stage 3
==================  =======  =======  =======
grads_sharded       no       yes      yes      the reduced gradient is kept as this rank's shard only
reduce_every_sync   no       yes      yes      every backward outside no_sync() reduce-scatters
params_sharded      no       no       yes      parameters live as shards and are gathered per unit
==================  =======  =======  =======

Stage 1 reduces only in the backward of the accumulation boundary (earlier micro-steps accumulate into
the full gradient buffer in place), as DeepSpeed does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    grads_sharded: bool
    reduce_every_sync: bool
    params_sharded: bool

    @classmethod
    def for_stage(cls, stage: int) -> StagePolicy:
        if stage not in (1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 1, 2 or 3, got {stage!r}")
        return cls(stage=stage, grads_sharded=stage >= 2, reduce_every_sync=stage >= 2, params_sharded=stage == 3)
