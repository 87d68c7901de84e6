"""``zerocore.deepspeed.utils.zero_to_fp32``: DeepSpeed's functions and command line for the fp32 model of a saved
checkpoint, on checkpoints zerocore's engine wrote at stages 2 and 3: the state dict is the engine's, with frozen
parameters, persistent buffers and tied names; the files torch and safetensors load; the refusals."""

from __future__ import annotations

import io
import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocore
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))
