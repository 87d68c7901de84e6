"""The one owner of the sharded optimizer state: fp32 master weights, Adam moments and the step count.

Note [Optimizer state ownership]
--------------------------------
Whatever the stage, a rank's optimizer state is a list of *shards*: contiguous stretches of a flat
parameter buffer that this rank updates (stages 1-2: this rank's part of every bucket of the model's
buffer; stage 3: this rank's part of every unit). The parameter storage owns the compute-dtype values and
the reduced gradients; this object owns, for every shard,

* ``master``      fp32 weights; in fp32 training the shard of the parameter buffer itself (no copy),
* ``exp_avg``, ``exp_avg_sq``  fp32 moments,

all allocated as one flat tensor each where ``placement`` says: the parameters' device, the CPU
(``offload_optimizer: cpu``; the master is then separate from the parameters even in fp32 when they live on
a GPU), or NVMe (``offload_optimizer: nvme``: one file per rank, Note [NVMe optimizer state]; nothing of it
stays in RAM, so every reader goes through :meth:`OptimizerState.resident`), plus one step count. ``step()`` updates every shard of a param group in one call
into C++ (``ops.multi_tensor_adam_step``). Each shard knows which param group every element belongs to
(``runs``) and which parameter elements it holds (``pieces``, global coordinates for checkpoints).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import ops
from ._host_copies import StreamCopies
from ._shard_geometry import ShardPiece, ShardRun, shard_segments

_WRITE_CHECK_BLOCK = 1 << 18  # elements compared at a time: a temporary that stays in L2
_NORM_BLOCK = 16384  # elements reduced in fp32 before the float64 sum (see grad_sum_of_squares)
_NORM_CHUNK = 32 * _NORM_BLOCK  # 16-bit gradients: elements widened to fp32 at a time (2 MiB)
_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class _StateInMemory:
    """A shard's ``master``, ``exp_avg`` or ``exp_avg_sq``, read through a check because it is not always in
    memory: on NVMe the moments (and a separate master) live only in the file (None here), and a parameter shard
    on NVMe has no storage between steps, where torch would read freed memory (a segfault) instead of raising.
    ``OptimizerState.resident()`` is the way in."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, shard: Shard | None, owner: type | None = None) -> Any:
        if shard is None:
            return self
        value = getattr(shard, self.slot)
        if value is None or (self.name == "master" and shard.holds_no_values()):
            raise RuntimeError(
                f"shard {shard.label!r}: its {self.name} is on NVMe, not in memory; read it inside "
                f"`with engine.optimizer_state.resident(shard) as values: values[{self.name!r}]`")
        return value

    def __set__(self, shard: Shard, value: torch.Tensor | None) -> None:
        setattr(shard, self.slot, value)


class Shard:
    """One shard's optimizer state. ``params`` and ``grads`` belong to the parameter storage; ``master``,
    ``exp_avg`` and ``exp_avg_sq`` are views of the owner's flat tensors (``master`` is ``params`` itself in
    fp32 training)."""

    def __init__(self, label: str, params: torch.Tensor, grads: torch.Tensor, runs: Sequence[ShardRun],
                 pieces: Sequence[ShardPiece]) -> None:
        self.label = label
        self.params = params
        self.grads = grads
        self.runs = tuple(runs)
        self.pieces = tuple(pieces)
        self._master: torch.Tensor | None = params
        self._exp_avg: torch.Tensor | None = torch.empty(0)
        self._exp_avg_sq: torch.Tensor | None = torch.empty(0)
        self.initial_master: torch.Tensor | None = None  # 16-bit training: fp32 values until build()
        self.separate_master = params.dtype != torch.float32  # settled by OptimizerState.build()
        self.flat_offsets: dict[str, int] = {}  # where the views start in the owner's flat tensors
        self.index = -1
        # The ShardedBuffer whose parameter shard is on NVMe (Note [NVMe parameter shards]): ``params`` hold
        # values only between its load_shard() and unload_shard(); None when they always do.
        self.param_home: Any = None

    @contextlib.contextmanager
    def params_loaded(self, write: bool) -> Iterator[None]:
        """``params`` hold the shard's values for the block (written back after it when ``write``)."""
        if self.param_home is None:
            yield
            return
        self.param_home.load_shard()
        try:
            yield
        finally:
            self.param_home.unload_shard(written=write)

    @property
    def numel(self) -> int:
        return self.params.numel()

    master = _StateInMemory()
    exp_avg = _StateInMemory()
    exp_avg_sq = _StateInMemory()

    def holds_no_values(self) -> bool:
        """A parameter shard on NVMe between its loads: storage of zero bytes behind a non-empty tensor."""
        return self.param_home is not None and bool(self.params.numel()) and self.params.untyped_storage().nbytes() == 0


@dataclass(frozen=True)
class NvmePlacement:
    """``offload_optimizer: {device: nvme}``: the state file's directory, the sub-group size and the I/O
    engine's settings (the ``aio`` section)."""

    path: str
    rank: int
    sub_group_size: int
    aio: dict[str, Any]


def _open_store(nvme: NvmePlacement) -> Any:
    from ._nvme_state import NvmeStateStore
    from ._safetensors_io import open_io

    return NvmeStateStore(open_io(nvme.aio), nvme.path, nvme.rank, nvme.sub_group_size)


class OptimizerState:
    """Sharded Adam/AdamW state for every shard of this rank, and its one step count."""

    def __init__(self, placement: torch.device, nvme: NvmePlacement | None = None, pin_memory: bool = False) -> None:
        self.placement = placement
        self.nvme = nvme
        self.pin_memory = pin_memory and placement.type == "cpu" and torch.cuda.is_available()
        self.store: Any = None  # the NvmeStateStore with ``nvme``
        self.init_failure: OSError | None = None  # why the NVMe state file could not be made
        self.shards: list[Shard] = []
        self.step_count = 0
        self.idle_steps: dict[str, int] = {}  # per parameter name: applied steps it got no gradient for
        # The window's gradients are the shards' values times this; set by a clip by hand, which then stands in
        # for the config's clipping (Note [Clipping by hand] in _grad_clip.py); None: not clipped by hand.
        self.hand_clip: float | None = None
        self._plan_key: Any = None  # what the cached slices were made for (see _cache_slices)
        self._built = False
        self.copies_type: Callable[[torch.device], Any] = StreamCopies  # Note [Offload copies]
        self._copies: Any = None

    def add_shard(self, label: str, params: torch.Tensor, grads: torch.Tensor, runs: Sequence[ShardRun],
                  pieces: Sequence[ShardPiece], master_values: torch.Tensor | None = None) -> Shard:
        """Registers a shard before :meth:`build`. ``params`` (1-D, compute dtype) receives the updated
        weights; in 16-bit training ``master_values`` gives its fp32 values (the 16-bit ones lost bits)."""
        if self._built:
            raise RuntimeError("OptimizerState.add_shard() after build()")
        if params.numel() != grads.numel():
            raise ValueError(f"shard {label}: {params.numel()} parameter elements but {grads.numel()} gradients")
        shard = Shard(label, params, grads, runs, pieces)
        shard.index = len(self.shards)
        shard.separate_master = self.keeps_separate_master(params.dtype, params.device)
        self.shards.append(shard)
        if self.nvme is None:
            shard.initial_master = master_values
            return shard
        # On NVMe the initial state goes to the file now: one shard's fp32 values in memory at a time. A
        # failure (path missing or read-only, disk full) is kept, not raised: the other ranks go on through
        # initialize's collectives, and the engine raises on every rank after build() (init_failure).
        if self.init_failure is None:
            try:
                if self.store is None:
                    self.store = _open_store(self.nvme)
                values = None
                if shard.separate_master:
                    values = master_values if master_values is not None else params.detach().float().cpu()
                self.store.add_shard(shard.numel, shard.separate_master, values)
            except OSError as error:
                self.init_failure = error
                self.close()
        shard.master = params if not shard.separate_master else None  # only in the file
        shard.exp_avg = shard.exp_avg_sq = None
        return shard

    def build(self) -> None:
        """Allocates the fp32 state where ``placement`` says and gives every shard its views (or, on NVMe,
        writes every shard's initial state into the file)."""
        if self.nvme is not None:
            self._build_nvme()
        else:
            self._build_resident()
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if self.nvme is None:
            self._cache_slices()
        self._built = True

    def stages_through_host(self, device: torch.device) -> bool:
        """Whether a shard whose parameters live on ``device`` is updated through host staging buffers (state
        in memory on another device: offloaded from a GPU). ``build()`` and ``zerocore.estimate_memory`` ask."""
        return self.nvme is None and device != self.placement

    def keeps_separate_master(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a shard of ``dtype`` parameters on ``device`` gets its own fp32 master: in 16-bit training,
        and when the state lives on another device than the parameters."""
        return dtype != torch.float32 or device != self.placement

    def _empty(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32, device=self.placement, pin_memory=self.pin_memory)

    def _build_resident(self) -> None:
        total = sum(s.numel for s in self.shards)
        self.master = self._empty(sum(s.numel for s in self.shards if s.separate_master))
        self.exp_avg = self._empty(total)
        self.exp_avg_sq = self._empty(total)
        offset = master_offset = 0
        for shard in self.shards:
            shard.flat_offsets = {"exp_avg": offset, "exp_avg_sq": offset}
            offset += shard.numel
            if shard.separate_master:
                shard.flat_offsets["master"] = master_offset
                master_offset += shard.numel
        self._point_views()
        for shard in self.shards:
            values, shard.initial_master = shard.initial_master, None
            if shard.separate_master:
                with shard.params_loaded(write=False):
                    shard.master.copy_(values if values is not None else shard.params)

    def _point_views(self) -> None:
        for shard in self.shards:
            for key, offset in shard.flat_offsets.items():
                setattr(shard, key, getattr(self, key)[offset : offset + shard.numel])

    # ---- replacing the state wholesale (checkpoint loads) --------------------------------------------------
    def replaceable(self) -> bool:
        """Whether a checkpoint load may fill fresh flat tensors and :meth:`adopt` them instead of copying
        into the state: the state is in (unpinned) host memory, where the files' bytes can land directly."""
        return self._built and self.store is None and self.placement.type == "cpu" and not self.pin_memory

    def flat(self, key: str) -> torch.Tensor:
        """The flat tensor behind every shard's ``key`` (master, exp_avg or exp_avg_sq); a shard's part starts
        at ``shard.flat_offsets[key]`` (no entry: the shard has none, its master being its parameters)."""
        return getattr(self, key)

    def adopt(self, replacements: dict[str, torch.Tensor]) -> None:
        """Makes the given flat tensors (shaped like :meth:`flat`'s) the state, every shard's views following;
        the old ones are dropped. Only where :meth:`replaceable` says so."""
        if not self.replaceable():
            raise RuntimeError("OptimizerState.adopt() needs the state in unpinned host memory")
        for key, value in replacements.items():
            old = self.flat(key)
            if key not in _STATE_KEYS or value.shape != old.shape or value.dtype != old.dtype or value.device != old.device:
                raise ValueError(f"OptimizerState.adopt(): {key} must be {old.dtype} {list(old.shape)} on {old.device}")
        for key, value in replacements.items():
            setattr(self, key, value)
        self._point_views()
        self._cache_slices()

    def _cache_slices(self, plan: Any = None) -> None:
        """The views ``step()`` hands to C++, per (param group, step lag) and per shard, made once per ``plan``
        (``_plan``: None while every parameter takes every step). An offloaded parameter shard gets its address
        space meanwhile: a view of storage resized to nothing cannot be made."""
        with contextlib.ExitStack() as stack:
            for shard in self.shards:
                if shard.param_home is not None:
                    stack.enter_context(shard.param_home.addressable())
            self._slices_by_group = self._group_slices(self._resident_parts(self.shards), plan)
            self._slices_by_shard = [self._group_slices(self._resident_parts([shard]), plan) for shard in self.shards]
        self._plan_key = plan

    def _plan(self, without_grad: frozenset[str]) -> Any:
        """Which parameters this step leaves alone and how many steps each other one lags behind
        ``step_count`` (Note [Parameters without gradients]); None when none lags or is left alone."""
        for name in without_grad:
            self.idle_steps[name] = self.idle_steps.get(name, 0) + 1
        if not self.idle_steps:
            return None
        lags = frozenset((name, lag) for name, lag in self.idle_steps.items() if name not in without_grad)
        return without_grad, lags

    def _build_nvme(self) -> None:
        self.master = self.exp_avg = self.exp_avg_sq = torch.empty(0)
        if self.init_failure is not None:
            return
        if self.store is None:  # no trainable shard on this rank: an empty file
            self.store = _open_store(self.nvme)
        self.store.finish()

    @contextlib.contextmanager
    def resident(self, shard: Shard, write: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The shard's ``master``, ``exp_avg`` and ``exp_avg_sq`` as tensors: views of the state itself, or,
        on NVMe, read into RAM for the block and written back after it when ``write``."""
        with shard.params_loaded(write):  # the parameters are the master in fp32, or its rounding
            if self.store is None:
                yield {"master": shard.master, "exp_avg": shard.exp_avg, "exp_avg_sq": shard.exp_avg_sq}
                return
            values = self.store.read_shard(shard.index)
            values.setdefault("master", shard.params)  # fp32: the master is the parameter shard itself
            yield values
            if write:
                self.store.write_shard(shard.index,
                                       {k: v for k, v in values.items() if k != "master" or shard.separate_master})

    @contextlib.contextmanager
    def resident_range(self, shard: Shard, start: int, end: int, write: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`resident` for elements ``[start, end)`` of the shard only: on NVMe just the sub-groups that
        hold them are read (and, with ``write``, written back), so one parameter's state costs its own I/O."""
        if self.store is None:
            with self.resident(shard, write) as values:
                yield {key: value[start:end] for key, value in values.items()}
            return
        with shard.params_loaded(write):
            values = self.store.read_range(shard.index, start, end)
            values.setdefault("master", shard.params[start:end])  # fp32: the master is the parameter shard
            yield values
            if write:
                self.store.write_range(shard.index, start,
                                       {k: v for k, v in values.items() if k != "master" or shard.separate_master})

    def absorb_written(self, shard: Shard) -> None:
        """Some compute-dtype parameters of ``shard`` were written by the user: the master takes every
        element that no longer equals its own rounding (the others keep their fp32 bits)."""
        if shard.separate_master:
            with self.resident(shard, write=True) as state:
                _merge_written(state["master"], shard.params.to(state["master"].device))

    def absorb_untracked_writes(self, shard: Shard) -> None:
        """Writes through ``p.data`` (``p.data.copy_(ema)``) move no version counter (Note [Writes through
        .data] in _step.py): where the master lives beside the compute-dtype parameters, an element that no
        longer equals its master's rounding was written, and the master takes it. On the CPU a comparison
        first (one read of each, in blocks), so the master is rewritten only when something changed; on a GPU
        the merge itself (no host sync). With the state on NVMe or on the host beside a GPU's parameters,
        ``step()`` does it as each piece of state comes to hand (a read of the whole state here would double
        the step's I/O)."""
        if not shard.separate_master or self.store is not None or shard.params.device != shard.master.device:
            return
        if shard.params.device.type == "cpu" and _matches_rounding(shard.params, shard.master):
            return
        self.absorb_written(shard)

    def close(self) -> None:
        """Removes the NVMe state file (nothing to do in memory)."""
        if self.store is not None:
            self.store.close()
            self.store = None

    @property
    def grad_coefficient(self) -> float:
        """What the gradient shards' values are multiplied by to give the window's gradients (1.0 unless
        clipped by hand): every reader of the shards applies it, so a clip costs no pass over them and no
        16-bit rounding of the clipped values."""
        return 1.0 if self.hand_clip is None else self.hand_clip

    def clip_by_hand(self, coefficient: float) -> None:
        self.hand_clip = self.grad_coefficient * coefficient

    def apply_grad_coefficient(self) -> None:
        """Multiplies the coefficient into the gradient shards (before a write into them, which is taken as
        given), keeping the window marked as clipped by hand."""
        if self.grad_coefficient != 1.0:
            with torch.no_grad():
                for shard in self.shards:
                    shard.grads.mul_(self.grad_coefficient)
            self.hand_clip = 1.0

    def grad_sum_of_squares(self) -> torch.Tensor:
        """Sum of squares of every gradient as a float64 scalar on the shards' device (padding is zero and
        adds nothing; the shards' values times ``grad_coefficient``); inf or NaN when any gradient is. Each
        block of ``_NORM_BLOCK`` elements is reduced in fp32 and the blocks are summed in float64: one fp32
        reduction over a whole shard loses ~1e-3 relative at 16M elements, this stays within ~3e-7 at any
        size, at the same speed."""
        device = self.shards[0].grads.device if self.shards else self.placement
        total = torch.zeros((), dtype=torch.float64, device=device)
        for shard in self.shards:
            grads = shard.grads
            whole = grads.numel() // _NORM_BLOCK * _NORM_BLOCK
            if whole:
                # On the CPU, 16-bit gradients are widened to fp32 inside vector_norm: chunk by chunk, that
                # temporary stays in cache instead of being a fresh shard-sized allocation every step (~7x
                # slower for 14M bf16 elements); each block's norm is the same either way
                chunk = whole if grads.dtype == torch.float32 or grads.device.type != "cpu" else _NORM_CHUNK
                pieces = [grads[start:min(start + chunk, whole)].view(-1, _NORM_BLOCK) for start in range(0, whole, chunk)]
                blocks = torch.cat([torch.linalg.vector_norm(piece, dim=1, dtype=torch.float32) for piece in pieces])
                total += blocks.double().square().sum()
            if whole < grads.numel():
                total += torch.linalg.vector_norm(grads[whole:], dtype=torch.float32).double().square()
        return total if self.hand_clip is None else total * self.hand_clip ** 2

    def step(self, param_groups: Sequence[dict[str, Any]], grad_scale: float,
             after_shard: Callable[[int], None] | None = None, without_grad: frozenset[str] = frozenset()) -> None:
        """One Adam/AdamW update of every shard, ``grad_scale`` multiplying the gradients (loss-scale
        unscaling and clipping): one C++ call per param group; or, with ``after_shard``, shard by shard
        (one call per param group within it), calling ``after_shard(i)`` once shard ``i`` is updated, so the
        caller can start sending it while the next shard computes. On NVMe, sub-group by sub-group through
        the three-deep I/O pipeline (Note [NVMe optimizer state]). The parameters named in ``without_grad``
        got no gradient on any rank and are left alone (Note [Parameters without gradients])."""
        self.step_count += 1
        grad_scale *= self.grad_coefficient
        plan = self._plan(without_grad)
        if any(shard.param_home is not None for shard in self.shards):  # one offloaded shard in memory at a time
            # parameters a step leaves alone must be read to be written back (Note [Parameters without gradients])
            before_shard = functools.partial(self._load_params, writes_every_param=plan is None)
            after_shard = self._then_unload_params(after_shard)
        else:
            before_shard = None
        if self.store is not None:
            def update(group: Any, views: dict[str, torch.Tensor]) -> None:
                shard = self.shards[group.shard]
                window = slice(group.start, group.end)
                master = views.get("master", shard.params[window])
                params, grads = shard.params[window], shard.grads[window]
                on_host = params.device == self.placement
                if not on_host:  # parameters on a GPU: the gradients come over, the parameters go back
                    grads = grads.to(self.placement)
                out = None
                if shard.separate_master and params.dtype != torch.float32:
                    # the 16-bit values as they are now; the update rewrites them from the master, which first
                    # takes what was written through .data since the last step (Note [Writes through .data]).
                    # Offloaded stage-3 shards were loaded for the step, not as written: their writes were taken
                    # when their units were released.
                    out = params if on_host else params.to(self.placement)
                    if shard.param_home is None:
                        _take_untracked_writes(master, out)
                calls = self._group_slices([(shard, group.start, group.end, master, grads,
                                             views["exp_avg"], views["exp_avg_sq"], out)], plan)
                self._update(calls, param_groups, grad_scale)
                if not on_host:
                    params.copy_(out if out is not None else master)

            self.store.step(update, after_shard, before_shard)
            return
        if plan != self._plan_key:
            self._cache_slices(plan)
        if after_shard is None and not self._staged:
            self._update(self._slices_by_group, param_groups, grad_scale)
            return
        # Offloaded from a GPU: the gradients come over, the parameters go back, on copy streams of their own
        # (Note [Offload copies]); what the kernel leaves alone goes back as it was, and .data writes reach the
        # master (Note [Writes through .data]).
        copies = self._host_copies() if self._staged else None
        tickets: dict[int, Any] = {}

        def send_to_host(index: int) -> None:
            staging, shard = self._staged.get(index), self.shards[index]
            if staging is not None:
                tickets[index] = copies.to_host([(staging[0], shard.grads)] +
                                                ([] if staging[1] is None else [(staging[1], shard.params)]))

        if copies is not None and before_shard is None:
            for index in range(len(self.shards)):
                send_to_host(index)
        for index, calls in enumerate(self._slices_by_shard):
            shard = self.shards[index]
            if before_shard is not None:
                before_shard(index)
                if copies is not None:
                    send_to_host(index)
            staging = self._staged.get(index)
            if staging is not None:
                copies.wait_on_host(tickets.pop(index))
                if staging[1] is not None:
                    _take_untracked_writes(shard.master, staging[1])
            self._update(calls, param_groups, grad_scale)
            if staging is not None:
                copies.to_device(shard.params, staging[1] if staging[1] is not None else shard.master)
            if after_shard is not None:
                after_shard(index)

    def _host_copies(self) -> Any:
        """The copy streams of the staged shards' device, made at the first offloaded step."""
        if self._copies is None:
            device = next(self.shards[index].params.device for index in self._staged)
            self._copies = self.copies_type(device)
        return self._copies

    def _load_params(self, index: int, writes_every_param: bool) -> None:
        shard = self.shards[index]
        if shard.param_home is not None:  # 16-bit parameters are all written from the master: nothing to read
            overwritten = shard.separate_master and shard.params.dtype != torch.float32 and writes_every_param
            shard.param_home.load_shard(read=not overwritten, in_step=True)

    def _then_unload_params(self, after_shard: Callable[[int], None] | None) -> Callable[[int], None]:
        def unload(index: int) -> None:
            home = self.shards[index].param_home
            if home is not None:  # an NVMe state I/O failure skipped updates: the file keeps the old values
                home.unload_shard(written=self.store is None or self.store.failure is None, in_step=True)
            if after_shard is not None:
                after_shard(index)
        return unload

    def _update(self, calls: list[tuple[int, int, tuple[list[torch.Tensor], ...]]],
                param_groups: Sequence[dict[str, Any]], grad_scale: float) -> None:
        for group, lag, (masters, grads, exp_avgs, exp_avg_sqs, outs) in calls:
            hyper = param_groups[group]
            beta1, beta2 = hyper["betas"]
            ops.multi_tensor_adam_step(
                masters, grads, exp_avgs, exp_avg_sqs, step=self.step_count - lag, lr=hyper["lr"], beta1=beta1,
                beta2=beta2, eps=hyper["eps"], weight_decay=hyper["weight_decay"], adamw=hyper["adamw_mode"],
                grad_scale=grad_scale, bias_correction=hyper["bias_correction"], param_outs=outs)

    def _resident_parts(self, shards: Sequence[Shard]) -> list[tuple[Any, ...]]:
        """What the kernel updates for each resident shard: (shard, 0, numel, master, grads, moments, 16-bit
        output or None). Offloaded from a GPU, the gradients and the 16-bit output are host staging buffers
        (``_staged``) that ``step()`` fills and sends back."""
        parts = []
        for shard in shards:
            grads, out = shard.grads, None
            if shard.separate_master and shard.params.dtype != torch.float32:
                out = shard.params
            if self.stages_through_host(shard.params.device):
                # zeros: the kernel writes the parameters' elements only, and the padding goes back too
                staging = self._staged.setdefault(shard.index, (
                    torch.empty(shard.numel, dtype=shard.grads.dtype, pin_memory=self.pin_memory),
                    None if out is None else torch.zeros(shard.numel, dtype=out.dtype, pin_memory=self.pin_memory)))
                grads, out = staging
            parts.append((shard, 0, shard.numel, shard.master, grads, shard.exp_avg, shard.exp_avg_sq, out))
        return parts

    @staticmethod
    def _group_slices(parts: Sequence[tuple[Any, ...]], plan: Any = None) -> list[tuple[int, int, tuple[list[torch.Tensor], ...]]]:
        """Per (param group, step lag), the views handed to C++: masters, grads, moments, and 16-bit outputs
        (None in fp32). ``parts`` are (shard, lo, hi, master, grads, exp_avg, exp_avg_sq, out) whose tensors hold
        the shard's elements ``[lo, hi)``; ``plan`` is ``_plan``'s."""
        per_call: dict[tuple[int, int], list[tuple[torch.Tensor | None, ...]]] = {}
        for shard, lo, hi, master, grads, exp_avg, exp_avg_sq, out in parts:
            for seg_start, seg_end, group, lag in shard_segments(shard, plan):
                start, end = max(seg_start, lo) - lo, min(seg_end, hi) - lo
                if start >= end:
                    continue
                per_call.setdefault((group, lag), []).append((
                    master[start:end], grads[start:end], exp_avg[start:end], exp_avg_sq[start:end],
                    None if out is None else out[start:end]))
        result = []
        for (group, lag), slices in sorted(per_call.items()):
            masters, grads, exp_avgs, exp_avg_sqs, outs = (list(column) for column in zip(*slices))
            result.append((group, lag, (masters, grads, exp_avgs, exp_avg_sqs,
                                        None if all(o is None for o in outs) else outs)))
        return result

    def pieces(self) -> Iterator[tuple[Shard, ShardPiece]]:
        """Every (shard, piece): which parameter elements this rank's state holds, for checkpoints."""
        for shard in self.shards:
            for piece in shard.pieces:
                yield shard, piece

    def memory(self) -> dict[str, int]:
        """Bytes of optimizer state by where they live: ``master_params`` and ``optimizer_moments`` in
        memory (the device's, or the host's with CPU offload), ``offload_staging`` host buffers, and on NVMe
        the file (``nvme_bytes``) and the pipeline's buffers."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        out = {"master_params": nbytes(self.master),
               "optimizer_moments": nbytes(self.exp_avg) + nbytes(self.exp_avg_sq),
               "offload_staging": sum(nbytes(g) + nbytes(o) for g, o in self._staged.values()),
               "nvme_bytes": 0, "nvme_buffers": 0}
        if self.store is not None:
            out["nvme_bytes"] = self.store.size
            out["nvme_buffers"] = sum(nbytes(b) for b in self.store.buffers)
        return out


def _matches_rounding(params: torch.Tensor, master: torch.Tensor) -> bool:
    """Whether the 16-bit ``params`` are, bit for bit, the rounding of the fp32 ``master`` (how the update
    writes them: zerocore's kernels round exactly as torch does). Block by block into one small temporary,
    compared 8 bytes at a time where aligned: ~5 ms for 14M elements on one core, a third of torch.equal's."""
    numel = params.numel()
    scratch = torch.empty(min(numel, _WRITE_CHECK_BLOCK), dtype=params.dtype)
    for lo in range(0, numel, _WRITE_CHECK_BLOCK):
        hi = min(numel, lo + _WRITE_CHECK_BLOCK)
        rounded = scratch[: hi - lo]
        rounded.copy_(master[lo:hi])
        if not bitwise_equal(params[lo:hi], rounded):
            return False
    return True


def _merge_written(master: torch.Tensor, params: torch.Tensor) -> None:
    """The fp32 ``master`` takes every element of the 16-bit ``params`` (same device) that no longer equals its
    rounding; the others keep their fp32 bits. In blocks: temporaries of a block, not of the shard (several GB
    at a 7B model's shard)."""
    block = _WRITE_CHECK_BLOCK if master.device.type == "cpu" else 64 * _WRITE_CHECK_BLOCK
    for lo in range(0, master.numel(), block):
        m, p = master[lo : lo + block], params[lo : lo + block]
        m.copy_(torch.where(m.to(p.dtype) == p, m, p.to(torch.float32)))


def _take_untracked_writes(master: torch.Tensor, params: torch.Tensor) -> None:
    """On the host: a comparison first (one read of each, in blocks), a merge only where something changed."""
    if not _matches_rounding(params, master):
        _merge_written(master, params)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two 1-D tensors of one 16/32-bit dtype hold the same bits, compared 8 bytes at a time where
    both are aligned for it (3x faster than torch.equal on 16-bit values)."""
    per_word = 8 // a.element_size()
    if a.numel() % per_word == 0 and a.storage_offset() % per_word == 0 and b.storage_offset() % per_word == 0:
        word = torch.int64
    else:
        word = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(word), b.view(word))
