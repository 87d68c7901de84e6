#!/usr/bin/env bash
# One-shot GPU check for a lent device machine (see README "GPU check"): build with the CUDA kernels,
# run the CUDA tests, the GPU Adam benchmark, and the demo on NCCL (world size 1, bf16, stages 1 and 2).
# Prints a short table last. Logs go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/zerocore-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
step() { echo "=== $1"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"

step "build (pip install --no-build-isolation .)"
python3 -m pip install -q scikit-build-core cmake ninja >"$OUT/pip.log" 2>&1 || true
if ! ZEROCORE_CUDA=ON python3 -m pip install -v --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
python3 -c "import zerocore, json; print(json.dumps(zerocore.build_info()))"

step "CUDA tests"
python3 -m pip install -q pytest pytest-timeout hypothesis >>"$OUT/pip.log" 2>&1 || true
python3 -m pytest -q tests/test_kernels_cuda.py 2>&1 | tee "$OUT/tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "GPU Adam benchmark"
python3 bench/gpu_adam.py --params 1e9 --json-out "$OUT/gpu_adam.json" 2>&1 | tee "$OUT/gpu_adam.log" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "demo on NCCL, world size 1, bf16"
for stage in 1 2; do
  timeout 300 python3 -m zerocore.examples.train_gpt --device cuda --nproc 1 --bf16 --stage "$stage" --steps 40 --json \
    2>&1 | tee "$OUT/demo_stage$stage.log" | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

step "summary"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    r = json.loads((out / "gpu_adam.json").read_text())
    for row in r["rows"]:
        print(f"{row['name']:<34} {row['ms']:9.2f} ms  {row['gbps']:8.1f} GB/s  {row['fraction_of_copy']:.2f} of copy")
except Exception as e:  # noqa: BLE001
    print("no gpu_adam.json:", e)
for stage in (1, 2):
    log = out / f"demo_stage{stage}.log"
    last = log.read_text().strip().splitlines()[-1:] if log.exists() else ["missing"]
    print(f"demo stage {stage}: {last[0][:150]}")
PY
exit $status
