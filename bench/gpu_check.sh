#!/usr/bin/env bash
# One-shot GPU check for a lent device machine (see README "GPU check"): build with the CUDA kernels,
# run the CUDA tests (kernels, and the engine on NCCL against the fp32/float64 reference), the GPU Adam
# benchmark, the offload copies benchmark, and the demo on NCCL (world size 1, bf16, stages 1-3).
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
python3 -c "import sys, torch
print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
# The device machine has no network: nothing may be pip-downloaded. Its image holds scikit-build-core, cmake,
# ninja, pytest, pytest-timeout and hypothesis; anything missing can be carried as wheels in .whl/ (see the
# device README), installed here without an index.
missing=$(python3 -c "
import importlib.util as u
mods = {'scikit_build_core': 'scikit-build-core', 'pytest': 'pytest', 'pytest_timeout': 'pytest-timeout',
        'hypothesis': 'hypothesis'}
print(' '.join(name for mod, name in mods.items() if u.find_spec(mod) is None))")
if [ -n "$missing" ]; then
  echo "missing Python packages: $missing"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl || echo "installing .whl/ failed"
  fi
fi
# nvcc may be installed without being on PATH; CMake's CUDA detection needs it (or CUDACXX).
if ! command -v nvcc >/dev/null 2>&1; then
  for dir in /usr/local/cuda/bin /usr/local/cuda-13*/bin /opt/cuda/bin; do
    if [ -x "$dir/nvcc" ]; then export PATH="$dir:$PATH"; break; fi
  done
fi
if command -v nvcc >/dev/null 2>&1; then
  export CUDACXX="${CUDACXX:-$(command -v nvcc)}"
  nvcc --version | tail -2
else
  echo "no nvcc found: the CUDA build (ZEROCORE_CUDA=ON) will fail"
fi
echo "cmake: $(cmake --version 2>/dev/null | head -1) | ninja: $(ninja --version 2>/dev/null)"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# Single-node NCCL: keep its bootstrap on loopback and skip InfiniBand probing.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}" NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}"

step "build (pip install --no-index --no-build-isolation .)"
start=$SECONDS
if ! ZEROCORE_CUDA=ON python3 -m pip install -v --no-index --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
  grep -nE "error|Error|FAILED" "$OUT/build.log" | head -30; tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $((SECONDS - start)) s"
python3 -c "import zerocore, json; print(json.dumps(zerocore.build_info()))" || status=1

step "CUDA tests"
start=$SECONDS
python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_cuda.py tests/test_engine_cuda.py tests/test_doctor.py 2>&1 | tee "$OUT/tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "tests took $((SECONDS - start)) s"

step "GPU Adam benchmark"
python3 bench/gpu_adam.py --params 1e9 --json-out "$OUT/gpu_adam.json" 2>&1 | tee "$OUT/gpu_adam.log" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "offload copies benchmark (offload_optimizer: cpu, Note [Offload copies], issue 11)"
timeout 300 python3 bench/offload_copies.py --params 1e8 --json-out "$OUT/offload_copies.json" 2>&1 \
  | tee "$OUT/offload_copies.log" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "GPU quantize benchmark (ZeRO++ kernels, issue 12)"
python3 - "$OUT/gpu_quantize.json" <<'PY' 2>&1 | tee "$OUT/gpu_quantize.log" | tail -10
import json, sys, torch
from zerocore import _C
n, gs, dev = 1 << 28, 2048, "cuda"
def best_ms(fn, reps=10):
    fn(); times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); times.append(a.elapsed_time(b))
    return min(times)
src, dst = torch.empty(n, device=dev), torch.empty(n, device=dev)
copy_gbps = 8 * n / best_ms(lambda: dst.copy_(src)) / 1e6
rows = []
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(n, device=dev).to(dtype)
    for bits in (8, 4):
        q = torch.empty(_C.quantized_bytes(n, bits), dtype=torch.int8 if bits == 8 else torch.uint8, device=dev)
        s = torch.empty(_C.quantize_num_groups(n, gs), device=dev)
        nbytes = n * x.element_size() + q.numel() + 4 * s.numel()
        for name, fn in (("quantize", lambda: _C.quantize(x, bits, gs, q, s)),
                         ("dequantize", lambda: _C.dequantize(q, s, n, bits, gs, x))):
            gbps = nbytes / best_ms(fn) / 1e6
            rows.append({"direction": name, "bits": bits, "dtype": str(dtype), "gbps": gbps, "fraction": gbps / copy_gbps})
            print(f"{name:<10} int{bits} {str(dtype):<15} {gbps:8.1f} GB/s  {gbps / copy_gbps:.2f} of copy ({copy_gbps:.0f} GB/s)")
json.dump({"elements": n, "group_size": gs, "copy_gbps": copy_gbps, "rows": rows}, open(sys.argv[1], "w"))
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "doctor (this machine for an offloaded config)"
python3 -m zerocore.doctor --nvme-path /tmp --probe-size 256M 2>&1 | tee "$OUT/doctor.log" | tail -12
[ "${PIPESTATUS[0]}" -le 1 ] || status=1  # (1: a check failed on this machine, which is the doctor's answer)

step "demo on NCCL, world size 1, bf16"
for stage in 1 2 3; do
  timeout 150 python3 -m zerocore.examples.train_gpt --device cuda --nproc 1 --bf16 --stage "$stage" --steps 40 --json \
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
try:
    r = json.loads((out / "offload_copies.json").read_text())
    print(f"offload copies: step {r['summary']['streams']['step_s'] * 1e3:.1f} ms on streams, "
          f"{r['summary']['current stream']['step_s'] * 1e3:.1f} ms on the current stream ({r['step_ratio']:.3f})")
except Exception as e:  # noqa: BLE001
    print("no offload_copies.json:", e)
for stage in (1, 2, 3):
    log = out / f"demo_stage{stage}.log"
    last = log.read_text().strip().splitlines()[-1:] if log.exists() else ["missing"]
    print(f"demo stage {stage}: {last[0][:150]}")
PY
exit $status
