"""Ctrl-C (SIGINT, which torchrun forwards to every rank) and a user's SIGTERM handler during the engine's
work: the state a user saves in ``except KeyboardInterrupt:`` is whole, and training can go on
(Note [Interrupts deferred in an update] in _deferred_signals.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from torch import nn

import zerocore
import zerocore.checkpoint
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h


def _config(stage: int) -> dict:
    # small buckets and no persistent units: the update runs shard by shard, so a signal can land between two
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300,
                                  "stage3_param_persistence_threshold": 0}}


def _pair(stage: int) -> tuple[zerocore.Engine, zerocore.Engine]:
    torch.manual_seed(0)
    engine = zerocore.initialize(Net(), _config(stage))
    torch.manual_seed(0)
    return engine, zerocore.initialize(Net(), _config(stage))


def _train(engine: zerocore.Engine, step: int, rank: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    engine.backward(engine(x).square().mean())
    engine.step()


def _same(a: zerocore.Engine, b: zerocore.Engine) -> bool:
    mine, theirs = a.full_state_dict(rank0_only=False), b.full_state_dict(rank0_only=False)
    return all(torch.equal(mine[k], theirs[k]) for k in mine)


def _signal_after_shard(engine: zerocore.Engine, shard: int, times: int = 1) -> None:
    """The next update sends this process SIGINT ``times`` times once shard ``shard`` is updated, at a
    bytecode boundary between two shards, where Python runs the handler."""
    state = engine.optimizer_state
    real_step = state.step

    def step(groups, scale, after_shard=None, without_grad=frozenset()):
        state.step = real_step
        done = [0]

        def after(i: int) -> None:
            if after_shard is not None:
                after_shard(i)
            done[0] += 1
            if done[0] == shard:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)

        return real_step(groups, scale, after, without_grad)

    state.step = step


def step_worker(rank: int, world: int, stage: int, directory: str) -> list[bool]:
    engine, twin = _pair(stage)
    handler = signal.getsignal(signal.SIGINT)
    _train(engine, 0, rank)
    _train(twin, 0, rank)
    _signal_after_shard(engine, shard=2)
    with pytest.raises(KeyboardInterrupt):
        _train(engine, 1, rank)
    _train(twin, 1, rank)
    whole = _same(engine, twin)  # the interrupt came after the step, not between two of its shards
    engine.save_checkpoint(directory, tag="emergency")  # what a user's except KeyboardInterrupt: does
    torch.manual_seed(7)
    resumed = zerocore.initialize(Net(), _config(stage))
    resumed.load_checkpoint(directory, tag="emergency")
    for step in (2, 3):
        for each in (engine, twin, resumed):
            _train(each, step, rank)
    return [whole, _same(engine, twin), _same(resumed, twin), engine.global_steps == 4,
            signal.getsignal(signal.SIGINT) is handler]


@pytest.mark.parametrize("stage", [1, 3])
def test_an_interrupt_during_the_update_takes_effect_after_it(stage, tmp_path):
    """Before, the KeyboardInterrupt left the shards before it updated and the rest not, with Adam's step
    counted, and the emergency checkpoint held that torn state."""
    for flags in run_ranks(step_worker, 2, stage, str(tmp_path)):
        assert all(flags), flags


def insisting_worker(rank: int, world: int) -> list[bool]:
    engine, _ = _pair(1)
    handler = signal.getsignal(signal.SIGINT)
    _signal_after_shard(engine, shard=1, times=2)
    with pytest.raises(KeyboardInterrupt):
        _train(engine, 0, rank)
    return [engine.optimizer_state.step_count == 1, signal.getsignal(signal.SIGINT) is handler]


def test_a_second_interrupt_stops_the_update_at_once():
    """The way out of a step stuck in a collective: the second SIGINT is not held back."""
    for flags in run_ranks(insisting_worker, 1):
        assert all(flags), flags


def load_worker(rank: int, world: int, directory: str) -> list[bool]:
    engine, twin = _pair(3)
    for step in range(2):
        _train(engine, step, rank)
    engine.save_checkpoint(directory, tag="t")
    real = zerocore.checkpoint.load_untracked

    def interrupted(*args, **kwargs):  # between the shards' values and the buffers'
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    zerocore.checkpoint.load_untracked = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            twin.load_checkpoint(directory, tag="t")
    finally:
        zerocore.checkpoint.load_untracked = real
    loaded = _same(engine, twin) and twin.global_steps == 2
    _train(engine, 2, rank)
    _train(twin, 2, rank)
    return [loaded, _same(engine, twin)]


def test_an_interrupt_during_a_checkpoint_load_takes_effect_after_it(tmp_path):
    for flags in run_ranks(load_worker, 2, str(tmp_path)):
        assert all(flags), flags


class Interrupted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.interrupt:
            raise KeyboardInterrupt
        return self.net(x)


def forward_worker(rank: int, world: int, stage: int) -> list[bool]:
    torch.manual_seed(0)
    model = Interrupted()
    engine = zerocore.initialize(model, _config(stage))
    torch.manual_seed(0)
    twin = zerocore.initialize(Interrupted(), _config(stage))
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt) as caught:
        engine(torch.randn(4, 8))
    model.interrupt = False
    for step in range(2):  # the notebook cell run again
        _train(engine, step, rank)
        _train(twin, step, rank)
    return [_same(engine, twin), "dropped" in "".join(getattr(caught.value, "__notes__", []))]


@pytest.mark.parametrize("stage", [1, 3])
def test_one_process_goes_on_after_an_interrupted_forward(stage):
    """Before, the next backward raised that a forward had raised "inside no_sync()", dropping the next batch."""
    for flags in run_ranks(forward_worker, 1, stage):
        assert all(flags), flags


def ranks_forward_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Interrupted()
    engine = zerocore.initialize(model, _config(2))
    model.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        engine(torch.randn(4, 8))
    model.interrupt = False
    with pytest.raises(RuntimeError) as caught:
        _train(engine, 0, rank)
    _train(engine, 1, rank)  # ready again
    return str(caught.value)


def test_ranks_interrupted_in_forward_drop_the_next_window_naming_the_interrupt():
    """Several ranks may be interrupted at different points, so nothing is played out; the next backward
    drops its window on every rank, and says why without blaming no_sync()."""
    for message in run_ranks(ranks_forward_worker, 2):
        assert "rank(s) [0, 1]" in message and "KeyboardInterrupt" in message, message


def thread_worker(rank: int, world: int) -> list:
    results: list = []

    def train() -> None:
        try:
            engine, _ = _pair(1)
            _train(engine, 0, rank)
            results.append(engine.global_steps == 1)
        except BaseException as error:  # noqa: BLE001 - reported below
            results.append(repr(error))

    handler = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=train)
    thread.start()
    thread.join(120)
    return [*results, signal.getsignal(signal.SIGINT) is handler]


def test_off_the_main_thread_no_handler_is_touched():
    """signal.signal() works in the main thread only: an engine stepped from another thread leaves it."""
    assert run_ranks(thread_worker, 1) == [[True, True]]
