"""The demo trainer ``python -m zerocore.examples.train_gpt`` end to end, as a user runs it (a subprocess
that spawns 2 Gloo ranks on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

_SMALL = ["--nproc", "2", "--steps", "15", "--log-every", "5", "--device", "cpu", "--json"]


def _run(args: list[str], cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}  # not under torchrun
    return subprocess.run([sys.executable, "-m", "zerocore.examples.train_gpt", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("stage", [1, 2])
def test_demo_trains(stage, tmp_path):
    proc = _run([*_SMALL, "--stage", str(stage)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # with --json, stdout is the summary line
    assert summary["ok"] is True
    assert summary["stage"] == stage and summary["world_size"] == 2 and summary["steps"] == 15
    assert summary["final_loss"] < summary["first_loss"], summary
    assert summary["model_state_bytes"] < summary["ddp_bytes"]  # sharded optimizer state on 2 ranks
    assert summary["comm_bytes_per_step"] > 0
    assert "OK" in proc.stderr.splitlines()  # the human-readable lines go to stderr under --json
    assert "step   15/15" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--stage", "5"], "invalid choice: 5"),
    (["--meta-init", "--stage", "2"], "needs --stage 3"),
])
def test_demo_rejects_bad_input(args, message, tmp_path):
    proc = _run([*_SMALL, *args], tmp_path, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]
    assert not proc.stdout.strip()  # no summary
