"""One flat, padded, bucketed buffer of parameters and this rank's shard of it: the storage of every stage.

Note [Sharded buffer]
---------------------
Stages 1-2 have one buffer (the whole model is one unit); stage 3 one per unit (Note [Stage 3 units]).
A buffer lays its parameters out with the layout engine (Note [Flat-partition geometry] in layout.hpp):
``buckets`` of whole tensors, each padded so that every rank owns an equal, contiguous shard of it. What
the stage policy (Note [Stage policy]) changes is only where things live:

* parameters (compute dtype): ``full`` holds every bucket and each parameter's ``.data`` is a view of it.
  With ``params_sharded`` (stage 3) this rank's shard lives in ``shard`` and ``full``'s storage exists only
  while gathered (resized to zero at rest; parameters then hold NaN placeholders, Note [Sharded
  placeholders]); otherwise the shard is the rank's region of ``full`` itself.
* gradients (``grad_dtype``: the compute dtype, or fp32, Note [fp32 gradient accumulation]): with
  ``grads_sharded`` (stages 2-3) only this rank's reduced shard is kept (``grad_shard``) and ``.grad`` is freed
  once copied into a reduction bucket; otherwise (stage 1) ``grad_buffer`` holds every gradient, ``.grad`` is a
  view of it and accumulates in place (Note [Gradient slots start stale]) until the reducing backward hands it
  to the reduction (then ``.grad`` is None: once reduce-scattered, a rank holds the average of its own shard
  only).
* optimizer state: every bucket's shard is registered with the OptimizerState (Note [Optimizer state
  ownership]), with the param group of every element (``runs``) and global coordinates (``pieces``).

A buffer without ``optimizer_state`` holds a stage-3 unit's frozen parameters (Note [Frozen shards]): the
same sharding, gathers and placeholders, but no gradients and no optimizer state.

``gather(bucket)`` starts the all-gather that fills ``full``'s bucket from every rank's shard (before use in
stage 3); after a stages 1-2 step ``gather_in_background(bucket)`` does, and leaves it in flight until a
parameter of the bucket is read or the engine lands it (Note [Gathers land on first read]); ``release()``
frees ``full`` again (stage 3).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._gather_spares import GatherSpares
from ._optimizer_state import OptimizerState, Shard
from ._param_writes import ParamWrites
from ._shard_geometry import shard_geometry
from ._policy import StagePolicy
from ._sharded_param import mark_in_flight, mark_landed, mark_sharded, mark_whole
from .layout import Bucket, FlatLayout

ALIGNMENT = 64  # elements: 128 bytes of a 16-bit dtype (vector loads, cache lines, coalesced access)

# Note [fp32 gradient accumulation]
# ---------------------------------
# DeepSpeed's ``data_types.grad_accum_dtype: "fp32"`` with bf16 or fp16 compute (FSDP2's reduce_dtype=fp32 and
# Megatron's fp32 main_grad do the same): a window's gradients are summed in fp32, not rounded to 16 bits at
# every micro-step. The backward still computes each micro-step's gradients in the compute dtype (autograd gives
# ``.grad`` the parameter's dtype); what changes is where they are summed:
# * stages 2-3: the gradient shard is fp32. Each reducing backward's 16-bit gradients travel as before (16 bits
#   where the reduce-scatter sums at the receiver) and their fp32 sum is added into the fp32 shard.
# * stage 1: the gradient buffer is fp32. ``.grad`` cannot be a view of it (a parameter's gradient has its
#   dtype), so each backward's ``.grad`` is added into the parameter's fp32 slot and set to None, as DeepSpeed
#   moves it into ``param.grad_accum``; the boundary reduces the fp32 sums (in fp32).
# * inside ``no_sync()`` at stages 2-3 each parameter's gradients are summed into an fp32 tensor of its own
#   (``hold_grad``: full size, 4 bytes an element where ``.grad`` took 2), which the next reducing backward
#   hands to the reduction with its own gradient added; that backward's buckets travel in the reduce dtype (fp32
#   unless communication_data_type says otherwise), not a 16-bit wire that would round the sums
#   (GradReducer.begin_backward's full_width, the same on every rank since every rank ran the same backwards).
# So ``.grad`` is None after every backward, also at stage 1; safe_get_full_grad reads the sums.


class ShardedBuffer(ParamWrites):
    full: torch.Tensor  # 1-D compute dtype, layout.total_size (storage empty at rest when params are sharded)
    shard: torch.Tensor  # 1-D compute dtype, layout.shard_size when params are sharded; else empty
    grad_buffer: torch.Tensor | None  # stage 1: 1-D grad_dtype, layout.total_size
    grad_shard: torch.Tensor | None  # stages 2-3: 1-D grad_dtype, layout.shard_size

    def __init__(self, label: str, params: list[nn.Parameter], names: Sequence[str], groups: Sequence[int], *,
                 bucket_cap: int, world: int, rank: int, policy: StagePolicy, dtype: torch.dtype,
                 device: torch.device, optimizer_state: OptimizerState | None, param_file: Any = None,
                 grad_dtype: torch.dtype | None = None) -> None:
        self.label = label
        self.params = params
        self.names = list(names)
        self.shapes = [p.shape for p in params]  # as laid out: a parameter given another shape is refused
        self.groups = list(groups)  # param group of each parameter
        self.layout = FlatLayout([p.numel() for p in params], world, ALIGNMENT, bucket_cap)
        self.buckets: list[Bucket] = self.layout.buckets
        self.offsets: list[int] = self.layout.offsets().tolist()
        # per bucket: where its parameters begin and end in it, for a quantized gather's groups (Note
        # [Quantized collectives] in bindings/quantized_collectives.cpp)
        self._bucket_cuts: list[list[int]] = self.layout.bucket_cuts()
        self.rank = rank
        self.policy = policy
        self.dtype = dtype
        self.grad_dtype = dtype if grad_dtype is None else grad_dtype  # Note [fp32 gradient accumulation]
        self._held: dict[int, torch.Tensor] = {}  # by parameter index: no_sync()'s fp32 sums at stages 2-3
        self.device = device
        self._optimizer_state = optimizer_state
        self.optimizer_shards: list[Shard] = []
        self._versions: list[int] = []
        self.write_fingerprints: dict[str, int] = {}  # parameters the user wrote since the step (ParamWrites)
        # stage 3, gathered: the shard was written past ``full`` on purpose (a local master write, Note [Local
        # parameter state]), so ``full`` differing from it is no write through .data; until the next release
        self.shard_ahead_of_full = False
        self._own_values: list[torch.Tensor] | None = None  # see keep_own_values
        # Note [NVMe parameter shards]: the ParamShardFile, this shard's offset in it (None: kept in memory),
        # how many blocks hold the shard in memory now, and whether one of them wrote it
        self._param_file = param_file if policy.params_sharded else None
        self._param_offset: int | None = None
        self._resident_depth = 0
        self._shard_written = False
        # Note [Gathers land on first read]: (bucket, pending collective) in issue order, and their elements
        self._in_flight: collections.deque[tuple[int, Any]] = collections.deque()
        self._in_flight_elements = 0
        # stage 3: the runtime's spares once built (Note [Spare gather storage]); none kept before
        self.spares = GatherSpares(0)

    @property
    def numel(self) -> int:
        return self.layout.total_size

    @property
    def shard_size(self) -> int:
        return self.layout.shard_size

    # ---- construction -------------------------------------------------------------------------------
    def build_from(self, values: Sequence[torch.Tensor]) -> None:
        """Takes the parameters' full values (fp32 or not; read before anything is cast): allocates the
        storage, points the parameters at it, and registers every bucket's shard with the optimizer state."""
        self.full = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        if self.policy.params_sharded:  # filled bucket by bucket below
            self.shard = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
        else:
            self.shard = torch.empty(0, dtype=self.dtype, device=self.device)
            for value, offset in zip(values, self.offsets):
                self.full[offset : offset + value.numel()].copy_(value.detach().reshape(-1))
        self.views = [self.full[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]
        if self._optimizer_state is None:
            self._build_frozen(values)
            return
        grads_sharded = self.policy.grads_sharded
        grads = torch.zeros(self.shard_size if grads_sharded else self.numel, dtype=self.grad_dtype, device=self.device)
        self.grad_buffer = None if grads_sharded else grads
        self._grad_stale = [False] * len(self.params)  # Note [Gradient slots start stale]
        self.grad_shard = grads if grads_sharded else None
        self._grad_shard_stale = False  # Note [Gradient slots start stale]
        shapes = [tuple(p.shape) for p in self.params]
        for b in range(len(self.buckets)):
            # one bucket's fp32 values at a time (an NVMe state file takes them at once; in memory they
            # wait for the optimizer state's build)
            master = None
            if self.policy.params_sharded or self.dtype != torch.float32:
                master = self._shard_values(values, b)
                if self.policy.params_sharded:
                    self.param_shard(b).copy_(master)
            runs, pieces = shard_geometry(self.layout, self.rank, b, self.names, shapes, self.groups)
            self.optimizer_shards.append(self._optimizer_state.add_shard(
                f"{self.label} bucket {b}", self.param_shard(b), self.grad_slice(b), runs, pieces,
                master_values=None if self.dtype == torch.float32 else master))
            del master
        if self.policy.params_sharded:
            self._go_to_rest()
        else:
            self.attach_views()

    def _go_to_rest(self) -> None:
        """Parameters sharded, the shard built: the parameters hold placeholders (Note [Sharded
        placeholders]), ``full`` is freed, and the shard goes to the parameter file unless it is kept."""
        self.placeholders = [torch.full((), float("nan"), dtype=self.dtype, device=self.device).expand(p.shape)
                             for p in self.params]
        self.free()
        if self._param_file is not None:
            self._offload_shard()

    def _build_frozen(self, values: Sequence[torch.Tensor]) -> None:
        """Note [Frozen shards]
        ------------------
        At stage 3 a unit's frozen floating-point parameters (a LoRA model's base, a frozen tower) are sharded
        like its trainable ones, in a second buffer: this rank keeps its shard in the compute dtype, nothing
        else (no gradient, no fp32 master, no moments), as DeepSpeed's stage 3 shards them. The unit gathers
        both buffers together; a backward releases the unit only once its inputs' gradients are computed, since
        the frozen weights are read to compute them after the unit's last trainable gradient may have arrived
        (Note [Units with frozen parameters in backward] in _stage3.py). With ``offload_param: nvme`` a frozen
        shard goes to the parameter file like a trainable one (Note [NVMe parameter shards]), placed right after
        its unit's trainable shard."""
        assert self.policy.params_sharded, "frozen parameters are sharded only at stage 3"
        self.grad_buffer = self.grad_shard = None
        self._grad_stale = []
        self._grad_shard_stale = False
        self.set_shard_from_values(values)
        self._go_to_rest()

    def set_shard_from_values(self, values: Sequence[torch.Tensor]) -> None:
        """This rank's shard of a frozen buffer from the parameters' full values."""
        self.set_shard(torch.cat([self._shard_values(values, b, self.dtype) for b in range(len(self.buckets))]))

    def set_shard(self, shard: torch.Tensor) -> None:
        """This rank's shard of a frozen buffer, padding included (a load)."""
        assert self._optimizer_state is None
        self.load_shard(read=False)  # every element, padding included, is written
        try:
            for b, bucket in enumerate(self.buckets):
                self.param_shard(b).copy_(shard[bucket.shard_offset : bucket.shard_offset + bucket.shard_size])
        finally:
            self.unload_shard(written=True)

    # ---- parameter shards on NVMe (Note [NVMe parameter shards]) ------------------------------------------
    def _offload_shard(self) -> None:
        """Places the shard in the parameter file unless it is within ``max_in_cpu``; there it leaves memory."""
        assert len(self.buckets) == 1, "stage 3 lays every unit out as one bucket"
        self._param_offset = self._param_file.place(self.shard_size, self.dtype)
        if self._param_offset is not None:
            self._param_file.write(self._param_offset, self.shard)
            self.shard.untyped_storage().resize_(0)
            for shard in self.optimizer_shards:
                shard.param_home = self

    @property
    def shard_offloaded(self) -> bool:
        return self._param_offset is not None

    @contextlib.contextmanager
    def addressable(self) -> Iterator[None]:
        """Views of the shard can be made in the block (its memory is allocated, never touched or read)."""
        storage = self.shard.untyped_storage()
        if storage.nbytes() > 0:
            yield
            return
        storage.resize_(self.shard_size * self.shard.element_size())
        try:
            yield
        finally:
            storage.resize_(0)

    def read_ahead(self) -> None:
        """The next gather of this unit is coming: its offloaded shard starts coming off the disk."""
        if self.shard_offloaded and self._resident_depth == 0:
            self._param_file.read_ahead(self._param_offset, self.shard_size * self.shard.element_size())

    def load_shard(self, read: bool = True, in_step: bool = False) -> None:
        """The offloaded shard is read into memory for a block that uses it (blocks nest); ``read=False``: a
        block that overwrites every parameter element gets zeros (the padding's value) instead. ``in_step``:
        a failure is kept in the file's ``step_failure`` for the step's verdict instead of raised."""
        self._resident_depth += 1
        if self._resident_depth == 1 and self.shard_offloaded:
            self.shard.untyped_storage().resize_(self.shard_size * self.shard.element_size())
            if not read:
                self.shard.zero_()
            elif in_step:
                failure = self._param_file.try_read(self._param_offset, self.shard)
                self._param_file.step_failure = self._param_file.step_failure or failure
            else:
                self._param_file.read(self._param_offset, self.shard)

    def unload_shard(self, written: bool, in_step: bool = False) -> None:
        """A block that loaded the shard ends; the last one writes it back (when any wrote) and frees it."""
        self._shard_written |= written
        self._resident_depth -= 1
        if self._resident_depth == 0 and self.shard_offloaded:
            try:
                if self._shard_written:
                    self._param_file.write(self._param_offset, self.shard)
            except OSError as error:
                if not in_step:
                    raise
                self._param_file.step_failure = self._param_file.step_failure or str(error)
            finally:
                self._shard_written = False
                self.shard.untyped_storage().resize_(0)

    def _shard_values(self, values: Sequence[torch.Tensor], bucket: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's shard of ``bucket`` in ``dtype``, from the full values (padding is zero)."""
        b = self.buckets[bucket]
        out = torch.zeros(b.shard_size, dtype=dtype, device=self.device)
        for piece in self.layout.pieces(self.rank, bucket):
            source = values[piece.tensor].detach().reshape(-1)
            start = piece.shard_offset - b.shard_offset
            out[start : start + piece.length] = source[piece.tensor_offset : piece.tensor_offset + piece.length]
        return out

    # ---- per-bucket views -----------------------------------------------------------------------------
    def param_bucket(self, bucket: int) -> torch.Tensor:
        b = self.buckets[bucket]
        return self.full[b.flat_start : b.flat_start + b.padded_size]

    def _own_region(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """This rank's region of ``bucket`` in a full-size flat tensor (``full`` or ``grad_buffer``)."""
        b = self.buckets[bucket]
        start = b.flat_start + self.rank * b.shard_size
        return flat[start : start + b.shard_size]

    def param_shard(self, bucket: int) -> torch.Tensor:
        """This rank's parameters of ``bucket`` (where the all-gather reads them from)."""
        b = self.buckets[bucket]
        if self.policy.params_sharded:
            return self.shard[b.shard_offset : b.shard_offset + b.shard_size]
        return self._own_region(self.full, bucket)

    def grad_slice(self, bucket: int) -> torch.Tensor:
        """This rank's reduced gradient shard of ``bucket`` (valid after the reducing backward)."""
        b = self.buckets[bucket]
        if self.grad_shard is not None:
            return self.grad_shard[b.shard_offset : b.shard_offset + b.shard_size]
        assert self.grad_buffer is not None
        return self._own_region(self.grad_buffer, bucket)

    def bucket_params(self, bucket: int) -> list[nn.Parameter]:
        """The parameters whose values live in ``bucket``."""
        b = self.buckets[bucket]
        return self.params[b.first_tensor : b.end_tensor]

    def grad_view(self, index: int) -> torch.Tensor:
        """Stage 1: parameter ``index``'s gradient as a view of ``grad_buffer``."""
        assert self.grad_buffer is not None
        offset = self.offsets[index]
        return self.grad_buffer[offset : offset + self.params[index].numel()].view(self.params[index].shape)

    # ---- gather / release -----------------------------------------------------------------------------
    def gather(self, comm: Any, bucket: int, label: str, staged: bool = False) -> Any:
        """Starts filling ``bucket`` of ``full`` from every rank's shard; returns the pending collective.
        ``staged``: :meth:`stage_own` already put this rank's values in place."""
        self.land_gathers()  # two collectives never write one region at once
        if self.policy.params_sharded and not staged:
            failure = self.stage_own(bucket)
            if failure is not None:
                raise OSError(failure)
        return self._all_gather(comm, bucket, label)

    def _all_gather(self, comm: Any, bucket: int, label: str) -> Any:
        cuts = self._bucket_cuts[bucket] if comm.all_gather_algo == "quantized" else []
        return comm.all_gather(self.param_bucket(bucket), bucket, label, cuts)

    def gather_in_background(self, comm: Any, bucket: int, label: str, cap: int | None = None) -> None:
        """Parameters whole (stages 1-2), after this rank's shard of ``bucket`` was updated: starts its
        all-gather and leaves it in flight (Note [Gathers land on first read]); with ``cap``, the oldest
        gathers land first while more than ``cap`` elements would be in flight."""
        size = self.buckets[bucket].padded_size
        while cap is not None and self._in_flight and self._in_flight_elements + size > cap:
            self.land_gathers(through=self._in_flight[0][0])
        work = self._all_gather(comm, bucket, label)
        self._in_flight.append((bucket, work))
        self._in_flight_elements += size

        def land(bucket: int = bucket) -> None:
            self.land_gathers(through=bucket)

        for param in self.bucket_params(bucket):
            mark_in_flight(param, land)

    @property
    def gathers_in_flight(self) -> int:
        return len(self._in_flight)

    def land_gathers(self, through: int | None = None) -> None:
        """Waits for the gathers in flight in issue order: all of them, or with ``through`` those up to
        bucket ``through``'s (none when it has none in flight)."""
        if through is not None and all(bucket != through for bucket, _ in self._in_flight):
            return
        while self._in_flight:
            bucket, work = self._in_flight[0]
            work.wait()
            self._in_flight.popleft()
            self._in_flight_elements -= self.buckets[bucket].padded_size
            for param in self.bucket_params(bucket):
                mark_landed(param)
            if bucket == through:
                return

    def stage_own(self, bucket: int) -> str | None:
        """Parameters sharded: ``full`` gets its memory and this rank's region its shard, read straight from
        the parameter file when it is there (no shard in memory); a failed read is returned, not raised."""
        self._allocate_full()
        own = self._own_region(self.full, bucket)
        if self.shard_offloaded and self._resident_depth == 0:
            return self._param_file.try_read(self._param_offset, own)
        own.copy_(self.param_shard(bucket))
        return None

    def partition_slice(self, parts: int, index: int) -> torch.Tensor:
        """Slice ``index`` of ``full`` cut into ``parts`` equal slices (one bucket: hpZ's partitions)."""
        assert len(self.buckets) == 1 and self.param_bucket(0).numel() == self.full.numel()
        part = self.full.numel() // parts
        return self.full[index * part : (index + 1) * part]

    def gather_from_slice(self, comm: Any, values: torch.Tensor, parts: int, index: int, label: str) -> Any:
        """Parameters sharded: starts filling ``full`` from ``parts`` equal slices, this rank's (``values``,
        slice ``index``) in place, over ``comm``, a group of ``parts`` ranks (hpZ)."""
        assert self.policy.params_sharded
        self._allocate_full()
        self.partition_slice(parts, index).copy_(values)
        return self._all_gather(comm, 0, label)

    def _allocate_full(self) -> None:
        """Parameters sharded and at rest: ``full`` gets its memory back before a gather fills it."""
        if self.full.untyped_storage().nbytes() == 0:
            self.spares.fill(self.full, self.numel * self.full.element_size())

    def regather(self, comm: Any, label: str) -> None:
        """Every bucket of ``full`` again from every rank's shard, landed on return (a collective)."""
        for bucket in range(len(self.buckets)):
            self.gather(comm, bucket, label).wait()
        self.note_param_versions()

    def regather_in_background(self, comm: Any, label: str, cap: int | None = None) -> None:
        """Parameters whole (stages 1-2), after every shard was overwritten: every bucket's all-gather starts
        and is left in flight, as after a step (``gather_in_background``)."""
        self.land_gathers()
        for bucket in range(len(self.buckets)):
            self.gather_in_background(comm, bucket, label, cap)
        self.note_param_versions()

    def attach_views(self) -> None:
        dropped = []
        for i, (param, view) in enumerate(zip(self.params, self.views)):
            if self.policy.params_sharded:
                with torch._C.DisableTorchFunctionSubclass():  # a sharded parameter refuses data_ptr() itself
                    held = param.data_ptr()
                if held not in (self.placeholders[i].data_ptr(), view.data_ptr()):
                    dropped.append(self.names[i])  # the user gave it a tensor while it was sharded (p.data = t)
            param.data = view
            mark_whole(param)
        self.note_param_versions()
        if dropped:
            # Kept, the tensor would be taken into the shard at release, making a swap meant to be undone (an
            # EMA swap) permanent; replaced silently, the user's values would be lost without a word.
            raise RuntimeError(
                f"parameters {dropped} were given other tensors (p.data = ...) while stage 3 held them sharded; "
                "the gather replaced them with the model's values. Change sharded parameters inside `with "
                "zerocore.gathered(params, modifier_rank=0):` (values written there reach the shards), or swap "
                "values in and out inside `with zerocore.gathered(params):` (discarded on exit)")

    # ---- storage -------------------------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """The parameters hold their full values (always, unless parameters are sharded and at rest)."""
        return not self.policy.params_sharded or self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Parameters sharded: the full storage goes, the parameters hold placeholders (computing with them
        raises: Note [Sharded parameters refuse compute])."""
        for param, placeholder, name in zip(self.params, self.placeholders, self.names):
            param.data = placeholder
            mark_sharded(param, name)
        self.spares.release(self.full)
        self.shard_ahead_of_full = False

    # ---- gradients ------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Note [Gradient slots start stale]
        ----------------------------------
        Stage 1 does not zero its gradient buffer between steps, as DDP with ``gradient_as_bucket_view`` does
        not: ``.grad`` goes back to None (torch's ``set_to_none``) and each slot is marked stale. A parameter's
        first gradient after that arrives as a fresh tensor and is copied over its slot (``take_grad``), later
        ones accumulate into the view in place; a slot still stale when a reducing backward ends is zeroed then
        (``grad_or_zeros``). That saves a write pass over the whole buffer per step and the read of those zeros
        by the first accumulation.

        Stages 2-3 do the same with the gradient shard: after ``zero_grad`` it is stale, and the next reducing
        backward overwrites it instead of adding to zeros (``begin_reducing_backward``). That backward deposits
        every element: its end launches every bucket, a parameter without a gradient reducing as zeros, and a
        backward that raises part-way still completes them and then zeroes the gradients again. A reader
        outside a backward (the step) calls ``settle_grads`` first, which zeroes a shard still stale (a step with
        no backward since ``zero_grad``), so what it sees is what a zeroed shard would have given."""
        if self.grad_buffer is not None:
            self._grad_stale = [True] * len(self.params)
        else:
            self._grad_shard_stale = True
        self._held.clear()
        for param in self.params:
            param.grad = None

    def begin_reducing_backward(self) -> bool:
        """A backward that reduces gradients starts. Returns whether its reductions add to the gradient shard;
        False for a shard stale since ``zero_grad``, which they overwrite whole (Note [Gradient slots start
        stale]). Stage 1 reduces in its gradient buffer: never adds."""
        if self.grad_shard is None:
            return False
        adds = not self._grad_shard_stale
        self._grad_shard_stale = False
        return adds

    def settle_grads(self) -> None:
        """Before the gradient shard's values are read outside a backward: a shard stale since ``zero_grad``
        holds an old step's sums, so it becomes the zeros it stands for."""
        if self._grad_shard_stale:
            assert self.grad_shard is not None
            self.grad_shard.zero_()
            self._grad_shard_stale = False

    @property
    def grads_held_apart(self) -> bool:
        """Whether gradients accumulate in another dtype than ``.grad``'s (Note [fp32 gradient accumulation])."""
        return self.grad_dtype != self.dtype

    def take_grad(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Stage 1: parameter ``index``'s ``.grad`` as its slot of ``grad_buffer``; a fresh tensor (the first
        gradient since ``zero_grad``, or one the user set) is copied over the slot first. Held apart (fp32
        slots), the gradient is added into the slot (copied over a stale one), and the caller drops ``.grad``."""
        view = self.grad_view(index)
        if self.grads_held_apart and not self._grad_stale[index]:
            view.add_(grad.reshape(view.shape))
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        self._grad_stale[index] = False
        return view

    def hold_grad(self, index: int, grad: torch.Tensor) -> None:
        """Stages 2-3, held apart, a backward that does not reduce (``no_sync()``): parameter ``index``'s
        ``.grad`` is added into its fp32 sum; the caller drops ``.grad``."""
        held = self._held.get(index)
        if held is None:
            self._held[index] = grad.to(self.grad_dtype, copy=True)
        else:
            held.add_(grad)

    def take_held(self, index: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Stages 2-3: what parameter ``index`` accumulated in this window for the reduction: its fp32 sum from
        ``hold_grad`` with ``grad`` (this backward's, or None) added, else ``grad``; the sum is given up."""
        held = self._held.pop(index, None)
        if held is None:
            return grad
        if grad is not None:
            held.add_(grad.reshape(held.shape))
        return held

    def grad_or_zeros(self, index: int) -> torch.Tensor:
        """Stage 1: parameter ``index``'s accumulated gradient, zeroed first when nothing reached it since
        ``zero_grad`` (Note [Gradient slots start stale])."""
        view = self.grad_view(index)
        if self._grad_stale[index]:
            view.zero_()
            self._grad_stale[index] = False
        return view

    def memory(self) -> dict[str, int]:
        """Bytes held at rest (a stage-3 gather is counted by the runtime as gathered bytes)."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        params = self.shard.untyped_storage().nbytes() if self.policy.params_sharded else nbytes(self.full)
        return {"params": params, "grads": nbytes(self.grad_buffer) + nbytes(self.grad_shard)
                + sum(nbytes(t) for t in self._held.values())}
