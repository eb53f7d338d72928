#!/usr/bin/env bash
# GPU check of the runtime kernels and of calibration on CUDA, for a machine with a CUDA GPU and torch +
# triton preinstalled (no network needed): installs quantkit without dependencies, runs tests/runtime on
# CUDA (compiled kernels, not the interpreter), times the kernels, then runs GPTQ of a small bench MoE with
# --device cuda against the same conversion on the CPU (python -m bench calib_cuda: wall times, peak device memory
# against the plan's estimate, SQNR / KL / KV-scale agreement within stated tolerances). About 4-6 minutes
# on an H100/H200.
#
#   bench/gpu_check.sh            # logs and JSON under $OUT (default /tmp/quantkit-gpu-check; results in the bench schema)
#
# Exit status: 0 when the tests, the benchmark and the calibration check all succeeded.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/quantkit-gpu-check}"
mkdir -p "$out"
unset TRITON_INTERPRET  # compiled kernels on the GPU

python - <<'PY' || { echo "gpu_check: needs torch with CUDA and triton" >&2; exit 1; }
import torch, triton
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
PY

# --no-build-isolation: build with the preinstalled setuptools (no network for an isolated build env)
if ! pip install --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1; then
  echo "gpu_check: 'pip install -e .' failed (see $out/pip.log); running from the source tree instead" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

start=$(date +%s)
timeout 420 python -m pytest tests/runtime -q -rs -p no:cacheprovider --junitxml "$out/pytest.xml" 2>&1 | tee "$out/pytest.txt"
rc_tests=${PIPESTATUS[0]}
echo "gpu_check: tests rc=$rc_tests in $(( $(date +%s) - start )) s"

start=$(date +%s)
timeout 300 python -m bench kernel_timings --json "$out/kernels.json" --out "$out" 2>&1 | tee "$out/bench.txt"
rc_bench=${PIPESTATUS[0]}
echo "gpu_check: bench rc=$rc_bench in $(( $(date +%s) - start )) s; results in $out"

# calibration on CUDA: GPTQ of a 4-layer bench MoE (hidden 1024, 32 experts) on cuda and on the CPU
start=$(date +%s)
timeout 420 python -m bench calib_cuda --device cuda --workdir "$out/calib_cuda" --json "$out/calib_cuda.json" --out "$out" \
  2>&1 | tee "$out/calib_cuda.txt"
rc_calib=${PIPESTATUS[0]}
echo "gpu_check: calibration rc=$rc_calib in $(( $(date +%s) - start )) s; results in $out/calib_cuda.json"
rm -rf "$out/calib_cuda"  # the model and the two outputs (~1 GB); the JSON keeps every figure

[[ $rc_tests -eq 0 && $rc_bench -eq 0 && $rc_calib -eq 0 ]]
