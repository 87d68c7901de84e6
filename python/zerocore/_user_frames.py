"""Where a warning raised deep inside the engine points: at the user's line.

A hard-coded ``stacklevel`` counts zerocore's own frames, and the count changes with the path that reached the
warning (``engine.step()`` directly, through torch's LR scheduler wrapper of ``optimizer.step``, through
``deepspeed.initialize``'s engine, through Accelerate): one level too few names a zerocore file, which a user
can do nothing with. :func:`user_stacklevel` counts the frames instead, up to the first one outside zerocore and
torch.
"""

from __future__ import annotations

import os
import sys

import torch

_INTERNAL = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
             os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function that names the first frame
    outside zerocore and torch (the outermost frame when there is none)."""
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level
