"""zerocore-bench (bench/cpp, torch-free): options the commands narrow to int are range-checked when parsed,
so a huge --threads or --repeat is a usage error (exit 2) instead of a wrapped, negative or zero count.

The harness is built once into a temporary directory (a few minutes on two cores); set ZEROCORE_BENCH to
an already built zerocore-bench to skip that."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.environ.get("ZEROCORE_BENCH"):
        return os.environ["ZEROCORE_BENCH"]
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("needs cmake")
    build = tmp_path_factory.mktemp("bench")
    subprocess.run([cmake, "-S", str(REPO), "-B", str(build), "-DZEROCORE_BUILD_PYTHON=OFF",
                    "-DZEROCORE_BUILD_BENCH=ON", "-DZEROCORE_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True, timeout=300)
    subprocess.run([cmake, "--build", str(build), "--target", "zerocore-bench", "-j", "2"], check=True,
                   capture_output=True, timeout=800)
    return str(build / "zerocore-bench")


@pytest.mark.parametrize("args,message", [
    (["stream", "--size-mb", "1", "--threads", "4294967297"], "--threads values must be at most 1024"),
    (["stream", "--size-mb", "1", "--repeat", "4294967297"], "--repeat must be at most 2147483647"),
    (["adam", "--elements", "16", "--threads", "2,99999999999"], "--threads values must be at most 1024"),
    (["adam", "--elements", "16", "--repeat", "2147483648"], "--repeat must be at most 2147483647"),
    (["quantize", "--elements", "16", "--threads", "2147483648"], "--threads values must be at most 1024"),
    (["aio", "--threads", "5000"], "--threads must be at most 1024"),
])
def test_an_option_too_large_for_an_int_is_a_usage_error(bench, args, message):
    """Finding: --threads 4294967297 became a pool of 1 thread (static_cast<int>), --repeat 4294967297 one
    pass; larger values became negative counts."""
    run = subprocess.run([bench, *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, (run.returncode, run.stdout[-500:], run.stderr[-500:])
    assert message in run.stderr


def test_options_in_range_still_run(bench):
    run = subprocess.run([bench, "stream", "--size-mb", "1", "--threads", "1", "--repeat", "1", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
