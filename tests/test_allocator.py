"""The CUDA caching allocator watch (Note [Allocator pressure] in _allocator.py), with the allocator's counters
faked: read after each step, one warning the first time a step flushed the cache, the counts in
memory_report()["allocator"]. On a GPU tests/test_engine_cuda.py reads the real ones."""

from __future__ import annotations

import warnings

import pytest
import torch

from zerocore._allocator import AllocatorWatch

GIB = 2**30


class FakeAllocator:
    def __init__(self) -> None:
        self.counters = {"num_alloc_retries": 3, "num_ooms": 0, "reserved_bytes.all.current": 8 * GIB,
                         "allocated_bytes.all.current": 6 * GIB, "allocated_bytes.all.peak": 7 * GIB,
                         "inactive_split_bytes.all.current": GIB // 2}

    def __call__(self, device: torch.device) -> dict:
        assert device.type == "cuda"
        return dict(self.counters)


def test_the_first_step_that_flushes_the_cache_warns_once_and_every_flush_is_counted():
    fake = FakeAllocator()
    watch = AllocatorWatch(torch.device("cuda", 0), stats=fake)  # 3 retries before the engine: not its steps'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.after_step(1)  # nothing new
    fake.counters["num_alloc_retries"] = 5
    with pytest.warns(RuntimeWarning, match=r"step 2: the CUDA caching allocator .* 2 time\(s\) .*8\.00 GiB "
                                            r"reserved, 6\.00 GiB allocated, 0\.50 GiB in fragments.*expandable_segments"):
        watch.after_step(2)
    fake.counters["num_alloc_retries"] = 9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.after_step(3)  # counted, not warned again
        watch.after_step(4)
    report = watch.report()
    assert report["num_alloc_retries"] == 9 and report["retries_in_steps"] == 6 and report["steps_with_retries"] == 2
    assert report["reserved_bytes"] == 8 * GIB and report["allocated_bytes"] == 6 * GIB
    assert report["peak_allocated_bytes"] == 7 * GIB and report["inactive_split_bytes"] == GIB // 2
    assert report["cached_free_fraction"] == pytest.approx(0.25)


def test_the_cpu_has_no_allocator_section():
    watch = AllocatorWatch(torch.device("cpu"), stats=lambda device: pytest.fail("read on the CPU"))
    watch.after_step(1)
    assert watch.report() is None


def cpu_engine_worker(rank: int, world: int):
    import zerocore
    engine = zerocore.initialize(torch.nn.Linear(4, 4), {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                         "zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    return engine.memory_report()["allocator"]


def test_an_engine_on_the_cpu_reports_no_allocator():
    from _dist import run_ranks

    assert run_ranks(cpu_engine_worker, 1) == [None]
