"""Stage 3's guard against ranks that run different modules (a rank-dependent branch over a unit).

Note [Divergence tags]
----------------------
Every gather of a unit is paired with a tiny all-gather of a tag (unit, call count in this step, step,
whether this rank failed to read its shard: Note [NVMe parameter shards], and what the gather is for:
forward, backward, ...) from every rank, issued just before the unit's own all-gather and never waited
for on its own: the unit's wait first waits for the tag and compares every rank's tag with this rank's.
On the CPU the comparison reads memory the collective just wrote (no device sync), and a mismatch raises
on every rank, naming the rank, the step and both modules, before the unit's possibly mismatched gather
is waited for. On an accelerator the comparison stays on the device and accumulates into a flag that
``step()`` reads with the gradient norm (its one host sync), and raises then. So the default path has no
blocking round-trip per gather (prefetches really run ahead), and divergence is still never silent.

The strict mode (``initialize(..., strict_spmd=True)``) keeps the older check: every gather first waits
for the tag exchange on the host, so ranks that would gather units of different sizes are stopped before
their collectives mismatch (which, on NCCL, can otherwise only end in the process group's timeout).
"""

from __future__ import annotations

from typing import Any

import torch

from ._transforms import outside_transforms


_FIELDS = 5  # per rank: unit, call count in this step, step, whether this rank failed to read its shard, purpose
# What a gather is for, by its label; a rank gathering a unit for its forward while another gathers the same
# unit for its backward is out of lockstep even where unit, call and step agree (a rank-dependent extra call
# of the last unit, whose backward needs no gather, Note [Last unit stays for the backward]).
_PURPOSES = ("all_gather_forward", "all_gather_backward", "all_gather_external", "all_gather_state_dict",
             "all_gather_user", "all_gather_load", "all_gather_close")


class RanksDivergedError(RuntimeError):
    """Ranks ran different modules: they are out of lockstep, so no further collective may be issued."""


class ShardReadError(OSError):
    """A rank could not read its parameter shard (Note [NVMe parameter shards]): every rank raises it at the same
    gather, so they stay in lockstep without playing anything out."""


class DivergenceCheck:
    def __init__(self, engine: Any, names: dict[int, str], strict: bool) -> None:
        self.engine = engine
        self.comm = engine.comm
        self.rank = engine.rank
        self.world = engine.world_size
        self.device = engine.device
        self.names = names
        self.strict = strict
        self.flag = torch.zeros((), dtype=torch.float32, device=self.device)  # accelerators: mismatches this step
        self.step_tags: list[torch.Tensor] = []
        self.read_failure: str | None = None  # the last shard this rank could not read, for the messages

    def _tag(self, unit: int, call: int, step: int, failed: bool, label: str) -> torch.Tensor:
        purpose = _PURPOSES.index(label) if label in _PURPOSES else len(_PURPOSES)
        values = [0] * (_FIELDS * self.world)
        values[_FIELDS * self.rank : _FIELDS * (self.rank + 1)] = [unit, call, step, int(failed), purpose]
        tag = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cpu":
            return tag
        # a copy from pageable memory would wait for the stream: a host sync per gather
        return tag.pin_memory().to(self.device, non_blocking=True)

    @outside_transforms  # tags are the engine's tensors, never a transform's (Note [torch.func transforms])
    def before_gather(self, unit: int, call: int, step: int, label: str, read_failure: str | None = None) -> Any:
        """Issues the tag exchange for one gather (``label``: what it is for); what the unit hands to
        :meth:`after_gather` at its wait. ``read_failure``: this rank could not read its shard (Note [NVMe
        parameter shards])."""
        if read_failure is not None:
            self.read_failure = read_failure
        tag = self._tag(unit, call, step, read_failure is not None, label)
        work = self.comm.all_gather(tag, unit, "unit_tag")
        if self.strict:
            work.wait()
            self.engine.host_syncs += 1  # a blocking exchange before the gather: the strict mode's price
            self._verify(tag, step)
            return None
        return work, tag, step

    @outside_transforms
    def after_gather(self, pending: Any) -> None:
        if pending is None:
            return
        work, tag, step = pending
        work.wait()
        if tag.device.type == "cpu":
            self._verify(tag, step)
        else:  # a failed read makes this rank's row differ too: the step raises, naming it
            rows = tag.view(-1, _FIELDS)
            self.flag += (rows != rows[self.rank]).any().float()
            self.step_tags.append(tag)

    def verdict(self) -> torch.Tensor:
        """Non-zero when a deferred (accelerator) comparison of this step found ranks apart."""
        return self.flag

    @outside_transforms
    def end_step(self, diverged: bool, step: int) -> None:
        """Called by the step after its one host sync; raises when any rank saw ranks apart."""
        tags, self.step_tags = self.step_tags, []
        self.flag.zero_()
        if diverged:
            for tag in tags:
                self._verify(tag, step)
            if self.read_failure is not None:
                raise ShardReadError(f"offload_param: step {step}: this rank could not read a parameter shard from its "
                              f"NVMe file ({self.read_failure}); load the last checkpoint once the disk is fixed")
            raise RanksDivergedError(f"ranks diverged at step {step}: another rank gathered different modules than "
                               f"rank {self.rank} (this rank's tags all matched; see the other ranks' errors). "
                               "Under ZeRO stage 3 every rank must run the same modules in the same order (SPMD).")

    def _verify(self, tag: torch.Tensor, step: int) -> None:
        rows = tag.view(-1, _FIELDS).tolist()
        failed = [rank for rank, row in enumerate(rows) if row[3]]
        if failed:
            module = self.names.get(rows[failed[0]][0], rows[failed[0]][0])
            raise ShardReadError(
                f"offload_param: rank(s) {failed} could not read their parameter shard of module {module!r} from "
                f"their NVMe file at step {step}, so every rank stops at this gather (none is left waiting in a "
                "collective); the shards on disk are unchanged: load the last checkpoint once the disk is fixed. "
                f"This rank: {self.read_failure if self.rank in failed else 'its read succeeded'}")
        rows = [row[:3] + row[4:] for row in rows]
        mine = rows[self.rank]
        for other, row in enumerate(rows):
            if row != mine:
                raise RanksDivergedError(
                    f"ranks diverged at step {step}: rank {other} gathered module {self._what(row)} while rank "
                    f"{self.rank} gathered {self._what(mine)}. Under ZeRO stage 3 every rank must run the same "
                    "modules in the same order (SPMD); a rank-dependent branch over a module with parameters "
                    "breaks that, and so does a forward that raised part-way on some ranks (look for an earlier "
                    "error on any rank first). An evaluation or generate() on some ranks only (`if rank == 0: "
                    "model(x)`) is such a branch: run it on every rank, or on that rank evaluate a plain model "
                    "loaded from engine.full_state_dict() (a collective: every rank calls it). If the model picks "
                    "modules by its inputs (a mixture of experts routing each rank's tokens to other experts), "
                    "make the module that encloses them the unit, so the ranks gather it whole: "
                    "zerocore.initialize(..., units=[TheEnclosingBlockClass]). If a "
                    "module runs only on the ranks whose batch needs it (a vision tower for batches with images), "
                    "name as units only the blocks every rank runs (units=[TheTextBlockClass]), so that module stays "
                    "gathered with the model's root, or run it on every rank (a dummy input, its output times 0)."
                )

    def _what(self, row: list[int]) -> str:
        unit, call, _, purpose = row
        label = _PURPOSES[purpose].removeprefix("all_gather_") if purpose < len(_PURPOSES) else "other"
        return f"{self.names.get(unit, unit)!r} (call {call}, {label} gather)"
