"""Build and import safety: build_info, the torch-version guard, and the missing-torch build message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import zerocore

REPO = Path(__file__).resolve().parents[1]


def test_build_info_lists_simd_paths_and_cuda():
    info = zerocore.build_info()
    json.dumps(info)  # serialisable
    assert info["version"] == zerocore.__version__
    assert "scalar" in info["simd_compiled"]
    assert info["simd_best"] in info["simd_compiled"]
    assert info["simd_active"] == info["simd_best"]
    assert isinstance(info["cuda_compiled"], bool)
    assert info["torch_version_built"] == info["torch_version_running"]
    assert info["compiler"]


def test_import_under_another_torch_names_both_versions():
    code = (
        "import torch; torch.__version__ = '0.0.1+other'\n"
        "try:\n    import zerocore\nexcept ImportError as e:\n    print(str(e))\nelse:\n    print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert "0.0.1+other" in out.stdout and zerocore.build_info()["torch_version_built"] in out.stdout, out


def _python_without_torch() -> str | None:
    for candidate in ("/usr/bin/python3", shutil.which("python3")):
        if candidate and Path(candidate).exists():
            probe = subprocess.run([candidate, "-c", "import torch"], capture_output=True)
            if probe.returncode != 0:
                return candidate
    return None


@pytest.mark.timeout(120)
def test_build_without_torch_says_to_install_torch(tmp_path):
    python = _python_without_torch()
    cmake = shutil.which("cmake")
    if python is None or cmake is None:
        pytest.skip("needs cmake and a Python without torch")
    out = subprocess.run(
        [cmake, "-S", str(REPO), "-B", str(tmp_path), f"-DPython_EXECUTABLE={python}", "-DZEROCORE_CUDA=OFF"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "install torch first" in (out.stdout + out.stderr).lower()
