"""``deepspeed.runtime.zero.stage3.unwrap_model_for_generation`` for scripts switched to zerocore (TRL's generation
under ZeRO-3 calls it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from .partition_parameters import GatheredParameters

__all__ = ["unwrap_model_for_generation"]


@contextlib.contextmanager
def unwrap_model_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """DeepSpeed's: ``model`` (the engine, or its module) with every parameter gathered for the whole block, so a
    generation loop's forwards gather nothing (a stage-3 forward otherwise gathers each unit once per token); the
    parameters are released on exit, discarding writes, as ``GatheredParameters`` without a modifier rank. Every
    rank enters it, as it is a collective. DeepSpeed also takes its ZeRO-3 hooks off inside; zerocore's do nothing
    on gathered units, so they stay."""
    with GatheredParameters(model.parameters()):
        yield model
