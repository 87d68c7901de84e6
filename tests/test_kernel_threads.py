"""How many threads the CPU kernels (an offloaded optimizer's CPU Adam among them) run on when nobody pinned a
count: torch's, except under torchrun's one-thread-per-rank default, where a rank takes its share of the
cores (Note [Kernel threads under torchrun] in cpp/include/zerocore/kernel_threads.hpp)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerocore import ZeroConfig
from zerocore._construction import cpu_step_threads_line
from zerocore._native import _C

_env_values = st.one_of(st.none(), st.sampled_from(["1", "2", "0", "", " 1", "1 ", "01", "abc", "-3", "64"]),
                        st.integers(-2, 300).map(str))


@given(torch_threads=st.integers(0, 256), omp=_env_values, local_world=_env_values, cores=st.integers(0, 512))
def test_torch_is_followed_unless_torchrun_left_it_on_one_thread(torch_threads, omp, local_world, cores):
    threads = _C.default_kernel_threads(torch_threads, omp, local_world, cores)
    assert threads >= 1
    torchrun_default = (torch_threads <= 1 and omp == "1" and local_world is not None and local_world.isdigit()
                        and int(local_world) > 1)
    if not torchrun_default:
        assert threads == max(1, torch_threads)
        return
    ranks = int(local_world)
    assert threads == max(1, max(1, cores) // ranks)
    # the ranks' shares never oversubscribe the cores (one thread each where there are fewer cores than ranks)
    assert threads * ranks <= max(cores, ranks)


def test_a_rank_of_a_big_machine_gets_its_share():
    assert _C.default_kernel_threads(1, "1", "8", 96) == 12
    assert _C.default_kernel_threads(1, "1", "8", 100) == 12
    assert _C.default_kernel_threads(1, None, "8", 96) == 1  # torch on one thread for another reason
    assert _C.default_kernel_threads(1, "1", "1", 96) == 1  # a deliberate OMP_NUM_THREADS=1, one rank
    assert _C.default_kernel_threads(6, "1", "8", 96) == 6  # torch.set_num_threads(6) after torchrun's default


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_an_offloaded_run_names_its_cpu_threads_once_per_machine(device):
    section = {"device": device, **({"nvme_path": "/tmp"} if device == "nvme" else {})}
    config = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": section}})
    torchrun = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    line = cpu_step_threads_line(config, torchrun, rank=0)
    assert line is not None and f"offload_optimizer {device}" in line
    assert f"runs on {_C.get_num_threads()} CPU thread(s)" in line and "zerocore.ops.set_num_threads(n)" in line
    assert cpu_step_threads_line(config, {**torchrun, "LOCAL_RANK": "1"}, rank=1) is None
    assert cpu_step_threads_line(config, {}, rank=3) is None  # no LOCAL_RANK: the group's rank 0 speaks
    assert cpu_step_threads_line(ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2}}), torchrun, 0) is None


def test_torchruns_default_gives_the_offloaded_step_the_ranks_share(tmp_path):
    """A process as torchrun starts the first of two ranks on this machine: the kernels run on half the cores
    this process may use (at least one), the engine says so at initialize, and set_num_threads still pins."""
    script = textwrap.dedent("""
        import os, torch, zerocore
        from zerocore import ops
        model = torch.nn.Linear(8, 8)
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        engine = zerocore.initialize(model, config)
        engine.backward(engine(torch.ones(2, 8)).sum())
        engine.step()
        print(ops.get_num_threads(), len(os.sched_getaffinity(0)))
        ops.set_num_threads(1)
        print(ops.get_num_threads())
        engine.close()
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (threads, cores), (pinned,) = (line.split() for line in done.stdout.split("\n")[:2])
    assert int(threads) == max(1, int(cores) // 2) and int(pinned) == 1, done.stdout
    assert f"each rank's optimizer step runs on {threads} CPU thread(s)" in done.stderr, done.stderr
