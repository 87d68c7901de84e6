"""``zerocore.doctor`` / ``python -m zerocore.doctor`` (Note [Doctor] in doctor.py): each check on this machine,
with the failures a user meets before a long offloaded run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from zerocore.doctor import doctor

PROBE = 1 << 20
pytestmark = pytest.mark.timeout(300)


def nvme_config(path: str, **zero) -> dict:
    return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path},
                                  **zero}, "bf16": {"enabled": True}}


def by_name(result: dict) -> dict[str, dict]:
    return {check["name"]: check for check in result["checks"]}


def test_a_writable_directory_is_measured_through_the_engine_and_left_as_it_was(tmp_path):
    result = doctor(nvme_config(str(tmp_path)), params=10**6, world_size=2, local_world_size=2, probe_bytes=PROBE)
    disk = result["disks"][str(tmp_path)]
    assert disk["probe_bytes"] == PROBE and min(disk["write_gbps"], disk["read_gbps"], disk["read_write_gbps"]) > 0
    assert isinstance(disk["direct"], bool) and disk["free_bytes"] > 0 and disk["filesystem"] != "", disk
    assert os.listdir(tmp_path) == []  # the probe file had no name: nothing left behind
    checks = by_name(result)
    assert checks[f"nvme_path {tmp_path}"]["status"] in ("ok", "warn"), checks  # (warn: tmpfs, no O_DIRECT)
    assert "GB/s" in checks[f"nvme_path {tmp_path}"]["detail"]
    assert checks["host memory"]["status"] == "ok", checks
    prediction = result["prediction"]  # the state file read and written once per step by both ranks here
    assert prediction["state_io_seconds"] > 0 and prediction["adam_seconds"] > 0, prediction
    assert prediction["optimizer_phase_seconds"] == max(prediction["state_io_seconds"], prediction["adam_seconds"])
    assert prediction["param_io_seconds"] == 0, prediction
    assert result["ok"]


def test_a_model_on_the_meta_device_is_planned_as_itself(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    result = doctor(nvme_config(str(tmp_path)), params=model, world_size=2, probe_bytes=PROBE)
    assert not result["plan"]["approximate"] and result["plan"]["psi"] == 8 * (256 * 256 + 256), result["plan"]
    counted = doctor(nvme_config(str(tmp_path)), params=8 * (256 * 256 + 256), world_size=2, probe_bytes=PROBE)
    assert "one flat tensor" in by_name(counted)["host memory"]["detail"]
    assert "one flat tensor" not in by_name(result)["host memory"]["detail"]


@pytest.mark.parametrize("max_in_cpu", [10**9, 0])
def test_parameter_shards_on_nvme_are_predicted_and_a_max_in_cpu_that_keeps_them_all_is_named(tmp_path, max_in_cpu):
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                                                                  "max_in_cpu": max_in_cpu}}}
    result = doctor(config, params=10**6, world_size=1, probe_bytes=PROBE)
    check, prediction = by_name(result)["prediction"], result["prediction"]
    assert prediction["adam_seconds"] is None and prediction["state_io_seconds"] == 0, prediction
    if max_in_cpu:
        assert check["status"] == "warn" and "max_in_cpu (1,000,000,000 elements)" in check["detail"], check
        assert prediction["param_io_seconds"] == 0
    else:
        assert check["status"] == "ok" and prediction["param_io_seconds"] > 0, (check, prediction)


def test_cpu_offload_predicts_the_adam_kernel_alone():
    result = doctor({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, params=10**7,
                    world_size=1)
    assert result["prediction"]["state_io_seconds"] == 0 and result["prediction"]["bound_by"] == "cpu", result
    assert result["disks"] == {}


@pytest.mark.parametrize("make", ["missing", "a file"])
def test_an_unusable_nvme_path_fails_naming_it(tmp_path, make):
    path = tmp_path / "state"
    if make == "a file":
        path.write_text("not a directory")
    result = doctor(nvme_config(str(path)), probe_bytes=PROBE)
    check = by_name(result)[f"nvme_path {path}"]
    assert check["status"] == "fail" and str(path) in check["detail"], check
    assert "does not exist or is not a directory" in check["detail"] or "No such file" in check["detail"], check
    assert not result["ok"]


def test_a_plan_larger_than_the_machine_fails_and_names_the_sub_group_size(tmp_path):
    # every rank's shard is 3e10 elements: three sub-groups of 1e11 fp32 master and moments would be in flight
    result = doctor(nvme_config(str(tmp_path), sub_group_size=10**11), params=3 * 10**13, world_size=1000,
                    local_world_size=1, probe_bytes=PROBE)
    checks = by_name(result)
    assert checks["host memory"]["status"] == "fail", checks
    assert "nvme_buffers" in checks["host memory"]["detail"] and "sub_group_size" in checks["host memory"]["detail"]
    # and its 360 GB state file does not fit the disk either
    assert checks[f"nvme_path {tmp_path}"]["status"] == "fail", checks
    assert "the plan's files need" in checks[f"nvme_path {tmp_path}"]["detail"]
    assert not result["ok"]


def test_without_offload_a_plan_too_large_says_to_offload():
    result = doctor({"zero_optimization": {"stage": 1}}, params=10**12, world_size=1)
    check = by_name(result)["host memory"]
    assert check["status"] == "fail" and "offload the optimizer state to NVMe" in check["detail"], check
    assert result["prediction"] is None  # nothing offloaded: no optimizer phase of its own to predict


def test_a_bad_config_is_a_failed_check_and_bad_ranks_raise():
    result = doctor({"zero_optimization": {"stage": 3, "bogus_key": 1}})
    assert by_name(result)["config"]["status"] == "fail" and "bogus_key" in by_name(result)["config"]["detail"]
    with pytest.raises(ValueError, match="local_world_size"):
        doctor(None, world_size=2, local_world_size=3)


def test_a_hugging_face_trainer_config_is_planned_with_its_precision_and_hidden_size(tmp_path):
    """A Trainer's config ("auto" lr, clipping, batch sizes, precision, buckets): the plan needs only the
    precision and the hidden size, as the estimate's command line (tests/test_estimate.py); its plan is then the
    one of the config as the Trainer fills it in."""
    from test_estimate import HF_ZERO3, _filled_as_the_trainer_would

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_ZERO3))
    refused = by_name(doctor(str(path), params=10**6, world_size=8))["config"]
    assert refused["status"] == "fail" and "--bf16, --fp16 or --fp32" in refused["detail"]
    assert "--hidden-size" in refused["detail"] and "optimizer.params.lr" not in refused["detail"]
    planned = doctor(str(path), params=10**6, world_size=8, precision="fp16", hidden_size=64)
    assert "config" not in by_name(planned)
    filled = doctor(_filled_as_the_trainer_would(64, bf16=False, fp16=True), params=10**6, world_size=8)
    assert planned["plan"]["compute_dtype"] == "float16" and planned["plan"]["bytes"] == filled["plan"]["bytes"]
    before = json.dumps(HF_ZERO3)
    assert "config" not in by_name(doctor(HF_ZERO3, world_size=8, precision="bf16", hidden_size=64))
    assert json.dumps(HF_ZERO3) == before  # the caller's dict is left as it was
    with pytest.raises(ValueError, match="precision must be one of bf16, fp16, fp32"):
        doctor(HF_ZERO3, precision="int8")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerocore.doctor", *args], capture_output=True, text=True,
                          timeout=240)


def test_command_line_prints_the_checks_and_exits_1_on_a_failure(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(nvme_config(str(tmp_path / "missing"))))
    done = run_cli("--config", str(config), "--params", "1M", "--world", "2", "--probe-size", "64K")
    assert done.returncode == 1, done.stderr
    assert "[FAIL] nvme_path" in done.stdout and "] build: zerocore" in done.stdout, done.stdout
    good = run_cli("--nvme-path", str(tmp_path), "--probe-size", "64K", "--json")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["disks"][str(tmp_path)]["probe_bytes"] == 64 << 10
    bad = run_cli("--probe-size", "12")
    assert bad.returncode == 2 and "probe size" in bad.stderr, bad.stderr


@pytest.mark.parametrize("omp, expected", [("2", "that CPU Adam runs on 2 thread(s) while 4 cores per rank are there: "
                                                  "set OMP_NUM_THREADS=4 (or zerocore.ops.set_num_threads(4)"),
                                           ("8", "8 threads x 2 ranks oversubscribe the cores: set OMP_NUM_THREADS=4"),
                                           ("4", None),
                                           # torchrun's default: the kernels take the rank's share of the cores
                                           ("1", None)])
def test_threads_per_rank_are_checked_against_the_cores(monkeypatch, omp, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    result = doctor({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, params=10**6,
                    world_size=2)
    check = by_name(result)["cpu"]
    assert "8 cores for 2 rank(s)" in check["detail"], check
    adam = 4 if omp in ("1", "4") else int(omp)
    assert f"offloaded optimizer's CPU Adam on {adam}" in check["detail"], check
    assert result["cpu"]["adam_threads"] == min(adam, 4), result["cpu"]
    if expected is None:
        assert check["status"] == "ok", check
    else:
        assert check["status"] == "warn" and expected in check["detail"], check


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_copies_and_memory_are_measured():
    result = doctor(None, probe_bytes=64 << 20)
    assert len(result["gpus"]) == torch.cuda.device_count(), result["gpus"]
    for gpu in result["gpus"]:
        assert gpu["h2d_gbps"] > 0 and gpu["d2h_gbps"] > 0 and 0 < gpu["free_bytes"] <= gpu["total_bytes"], gpu
    assert by_name(result)["gpu 0"]["status"] == "ok"


def test_without_a_gpu_there_are_no_gpu_checks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = doctor(None)
    assert result["gpus"] == [] and not any(c["name"].startswith("gpu") for c in result["checks"])
