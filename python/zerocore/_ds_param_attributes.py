"""DeepSpeed's attributes on stage-3 parameters (``ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``), which scripts
written for DeepSpeed test to find the parameters they must gather.

Note [DeepSpeed's parameter attributes]
---------------------------------------
Under DeepSpeed's ZeRO-3 every partitioned parameter carries ``ds_id``, ``ds_numel``, ``ds_shape`` and
``ds_status`` (a ``ZeroParamStatus``), and scripts key their stage-3 paths on them: DeepSpeed-Chat saves a model
by gathering each parameter that ``hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE`` inside
``GatheredParameters`` and reading ``p.data`` there, and reads every other parameter directly; the Hugging Face
Trainer and PEFT count parameters by ``ds_numel``. Without the attributes such a script reads a stage-3
parameter directly, which zerocore refuses (Note [Sharded parameters refuse compute]): the save fails.

So every parameter stage 3 shards (trainable or frozen) gets them at initialize, and loses them at ``close()``
(the model is plain again; a deepcopy of a parameter never had them: torch copies no attributes): ``ds_id``
unique across engines, in the order the model lists its parameters (every rank builds the same model, so ranks
agree); ``ds_numel`` and ``ds_shape`` the whole parameter's; ``ds_status`` ``NOT_AVAILABLE`` while its unit is
sharded (and while a gather started by the step is still in flight: zerocore lands it on the first read, where
DeepSpeed would say ``INFLIGHT``), ``AVAILABLE`` while gathered
(in a forward, a ``gathered()`` block, or kept whole between steps). The status follows the parameter's class:
the guard class a sharded parameter wears defines ``ds_status`` as a property, which Python looks up before the
instance's own ``AVAILABLE``, so no gather or release writes anything per parameter. Stages 1-2 hold every
parameter whole and, as DeepSpeed, set none of them. The engine never reads them: its state stays its own
(USER_PAINS #6); they are there for the scripts. DeepSpeed's own ``GatheredParameters`` (an import left
unswitched while DeepSpeed is installed) takes such parameters for its own and fails on ``p.all_gather``, a
method zerocore's parameters do not have: switch that import too (``zerocore.deepspeed.zero``).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable

from torch import nn


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``, with its values."""

    AVAILABLE = 1  # whole on every rank
    NOT_AVAILABLE = 2  # sharded
    INFLIGHT = 3  # being gathered (zerocore reports NOT_AVAILABLE: the first read lands the gather)


ATTRIBUTES = ("ds_id", "ds_numel", "ds_shape", "ds_status")
_ids = itertools.count()


def attach(params: Iterable[nn.Parameter]) -> None:
    """Gives each stage-3 parameter DeepSpeed's attributes (Note [DeepSpeed's parameter attributes])."""
    for param in params:
        param.__dict__.update(ds_id=next(_ids), ds_numel=param.numel(), ds_shape=param.shape,
                              ds_status=ZeroParamStatus.AVAILABLE)


def detach(params: Iterable[nn.Parameter]) -> None:
    """The attributes off again: the parameters are plain."""
    for param in params:
        for name in ATTRIBUTES:
            param.__dict__.pop(name, None)
