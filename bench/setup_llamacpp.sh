#!/usr/bin/env bash
# llama.cpp for `verify OUT.gguf --engine llama.cpp --run` and its tests: llama-cpp-python, built from source once per
# machine into a wheel cache outside the clone, then installed into the active Python.
#
#   bench/setup_llamacpp.sh                 # the active venv (.ci/run calls it)
#   PYTHON=/path/venv/bin/python bench/setup_llamacpp.sh
#
# GGML_NATIVE=OFF: one build runs on every x86-64 CPU (AVX2-only EPYCs and AMX Xeons alike; the CPU backend picks its
# kernels at run time). ~13 min on 2 cores. QUANTKIT_WHEEL_CACHE overrides the cache (default ~/.cache/quantkit/wheels).
set -euo pipefail
PY="${PYTHON:-python}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
CACHE="${QUANTKIT_WHEEL_CACHE:-$HOME/.cache/quantkit/wheels}"
mkdir -p "$CACHE"
find_wheel() { ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true; }
build() {
  echo "setup_llamacpp: building llama-cpp-python $VERSION from source into $CACHE (~10-15 min on 2 cores)" >&2
  local tmp
  tmp=$(mktemp -d)
  CMAKE_ARGS="-DGGML_NATIVE=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$PY" -m pip wheel -q --no-deps "llama-cpp-python==$VERSION" -w "$tmp" >&2
  mv "$tmp"/llama_cpp_python-*.whl "$CACHE"/
  rm -rf "$tmp"
}
whl=$(find_wheel)
[ -n "$whl" ] || { build; whl=$(find_wheel); }
if ! { "$PY" -m pip install -q "$whl" && "$PY" -c "import llama_cpp" ; } >&2; then
  echo "setup_llamacpp: the cached wheel $whl does not install or import; rebuilding" >&2
  rm -f "$whl"
  build
  whl=$(find_wheel)
  "$PY" -m pip install -q "$whl"
  "$PY" -c "import llama_cpp"
fi
echo "setup_llamacpp: llama-cpp-python $VERSION installed from $whl" >&2
