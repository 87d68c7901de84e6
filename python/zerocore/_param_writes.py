"""The user's writes to a ShardedBuffer's parameters (Note [Writes to parameters] and Note [Writes through
.data] in _step.py): which were written, in place, through ``.data`` or by new storage, and how the shard and
its fp32 master take them or give them back. Mixed into :class:`~zerocore._sharded_buffer.ShardedBuffer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._native import _C
from ._optimizer_state import OptimizerState, Shard, bitwise_equal
from ._sharded_param import mark_whole

if TYPE_CHECKING:
    from ._policy import StagePolicy
    from .layout import Bucket


class ParamWrites:
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    names: list[str]
    full: torch.Tensor
    policy: StagePolicy
    buckets: list[Bucket]
    optimizer_shards: list[Shard]
    _optimizer_state: OptimizerState
    _versions: list[int]
    write_fingerprints: dict[str, int]
    _own_values: list[torch.Tensor] | None
    gathered: bool
    shard_offloaded: bool
    shard_ahead_of_full: bool

    def note_param_versions(self) -> None:
        """Remembers the parameters' autograd version counters: the engine's own writes go through ``full``
        and its views (other counters), so a parameter whose counter moved was written by the user."""
        self._versions = [param._version for param in self.params]

    def renote_param_version(self, index: int) -> None:
        """The engine wrote parameter ``index`` itself: its counter's move is not the user's write (the others'
        moves still are). Nothing to do before the versions were first noted (a stage-3 unit never gathered)."""
        if index < len(self._versions):
            self._versions[index] = self.params[index]._version

    def mark_rewritten(self) -> None:
        """The engine gave the parameters new values behind autograd's back (an update, a load, a modifier
        rank's broadcast): their version counters move, as a torch optimizer's in-place update moves them, so a
        backward through a graph recorded before raises autograd's "modified by an inplace operation" instead
        of combining the new weights with the old activations (a forward, ``load_checkpoint``, then its
        backward). Noted again at once: the move is not the user's write."""
        torch.autograd.graph.increment_version(self.params)
        self.note_param_versions()

    def params_written(self) -> bool:
        return self.gathered and (any(param._version != seen for param, seen in zip(self.params, self._versions))
                                  or bool(self.rebound_params()))

    def rebound_params(self) -> list[int]:
        """Parameters the user pointed at other storage (``p.data = t``, ``vector_to_parameters``): left so,
        they would be cut off from the engine's buffer, their value frozen while training goes on."""
        return [i for i, (param, view) in enumerate(zip(self.params, self.views))
                if param.data_ptr() != view.data_ptr() and view.numel() > 0]

    def check_rebound_shapes(self) -> None:
        """Raises naming the first parameter given a tensor of another shape (``p.data = t``): its values have
        no place in the engine's buffer."""
        for i in self.rebound_params():
            param, view = self.params[i], self.views[i]
            if param.shape != view.shape:
                raise RuntimeError(f"parameter {self.names[i]!r} was given a tensor of shape {tuple(param.shape)} "
                                   "(p.data = ...), but it was laid out at zerocore.initialize with shape "
                                   f"{tuple(view.shape)}: a parameter's shape cannot change")

    def reattach_rebound(self, keep_values: bool = True) -> None:
        """Every rebound parameter is the engine's view again, holding the value the user gave it
        (``keep_values``) or the engine's (a write being discarded)."""
        if keep_values:
            self.check_rebound_shapes()
        for i in self.rebound_params():
            param, view = self.params[i], self.views[i]
            if keep_values:
                view.copy_(param.detach())
            param.data = view
            mark_whole(param)

    def absorb_param_writes(self, fingerprint: bool = True) -> None:
        """The user wrote to parameters in place (``load_state_dict``, ``nn.init``, ``fill_``) or gave them
        other storage (``p.data = t``): this rank's shard and its fp32 master take the written values, so the
        next step updates them instead of reverting them. Elements whose value still equals the master's
        rounding keep the master's bits. ``fingerprint``: a write every rank sees (its version counters moved),
        compared across ranks at the step; not one found by comparing this rank's region alone."""
        self.reattach_rebound()
        if fingerprint:
            self._fingerprint_written()
        self._shard_from_full()
        for shard in self.optimizer_shards:
            self._optimizer_state.absorb_written(shard)
        self.note_param_versions()

    def _fingerprint_written(self) -> None:
        """Every rank takes only its own shard of a write, so ranks that wrote different values (an
        ``nn.Embedding(max_norm=)`` renormalizing the rows each rank's batch looked up) would keep a mix of
        them, which one depending on the sharding, silently. The CRC-32C of each parameter's written values is
        kept until the step compares them across ranks (Note [Writes to parameters] in _step.py). The last
        write before the step counts, as it is the one the shards hold."""
        for name, view in zip(self.names, self.views):
            if view.numel():
                self.write_fingerprints[name] = _C.crc32c(view.detach().cpu().contiguous())

    def absorb_untracked_writes(self, exact_gather: bool = True) -> None:
        """Writes through ``p.data``, which the version counters miss, reach the master (Note [Writes through
        .data] in _step.py): stages 1-2 with 16-bit parameters, by the master's rounding; a stage-3 unit kept
        whole, by its shard, when its gathered values are exactly the shards (not qwZ's) and the shard is in
        memory, and not written past it on purpose (``shard_ahead_of_full``)."""
        if not self.policy.params_sharded:
            for shard in self.optimizer_shards:
                self._optimizer_state.absorb_untracked_writes(shard)
        elif exact_gather and self.gathered and not self.shard_offloaded and not self.shard_ahead_of_full:
            # on an accelerator the merge itself, unconditionally: a comparison read on the host would sync
            if self.full.device.type != "cpu" or not all(
                    bitwise_equal(self._own_region(self.full, b), self.param_shard(b)) for b in range(len(self.buckets))):
                self.absorb_param_writes(fingerprint=False)  # another rank's region may hold the write

    def _shard_from_full(self) -> None:
        """Parameters sharded: this rank's shard takes its region of ``full`` (otherwise it is that region)."""
        if self.policy.params_sharded:
            self.load_shard(read=False)  # every element, padding included, comes from ``full``
            try:
                for b in range(len(self.buckets)):
                    self.param_shard(b).copy_(self._own_region(self.full, b))
            finally:
                self.unload_shard(written=True)

    def take_shard_from_full(self) -> None:
        """``full`` was overwritten (``zerocore.gathered`` with a modifier rank): this rank's shard and the
        fp32 master follow it, where the values changed: an element still equal to its master's rounding keeps
        the master's fp32 bits (copied whole, a 16-bit model's masters would all be cut to 16 bits by a block
        that changed one parameter, or none)."""
        self.reattach_rebound(keep_values=False)  # the modifier's values came in ``full``
        self._shard_from_full()
        for shard in self.optimizer_shards:
            self._optimizer_state.absorb_written(shard)
        self.note_param_versions()

    def keep_own_values(self) -> None:
        """Entering ``zerocore.gathered``: where this rank's region of ``full`` is the only copy of its values
        (stages 1-2 in fp32: the region is the master itself), a copy is kept so writes can be discarded."""
        sole_copy = not self.policy.params_sharded and not any(s.separate_master for s in self.optimizer_shards)
        self._own_values = [self.param_shard(b).clone() for b in range(len(self.buckets))] if sole_copy else None

    def forget_own_values(self) -> None:
        self._own_values = None

    def discard_param_writes(self, comm: Any) -> None:
        """The parameters' full values come back from every rank's shard (a collective), undoing writes.
        Parameters sharded: ``gather`` copies each shard into ``full``; otherwise this rank's region first
        gets back its values (the copy kept on entry, or the 16-bit rounding of the master)."""
        if not self.policy.params_sharded:
            for b, shard in enumerate(self.optimizer_shards):
                own = self._own_region(self.full, b)
                if self._own_values is not None:
                    own.copy_(self._own_values[b])
                else:
                    with self._optimizer_state.resident(shard) as state:
                        own.copy_(state["master"])
        self.reattach_rebound(keep_values=False)
        self.regather(comm, "all_gather_user")
