#!/usr/bin/env bash
# Create the venv holding the peer tools that bench/convert_rtn.py and bench/quality.py compare quantkit
# against: llm-compressor, and auto-round (one of llm-compressor's own dependencies, pinned here too).
# llm-compressor is NOT a quantkit dependency: it lives in its own venv, never in the project's.
#
#   bench/setup_peers.sh [VENV_DIR]        (default: bench/.cache/peer-venv, gitignored)
#
# torch is pinned to 2.13.0 first (the CPU wheel; any other version may pull a multi-GB CUDA build),
# then llmcompressor, pinned to a release checked to accept torch 2.13 (`pip install --dry-run
# torch==2.13.0 llmcompressor==X`). Override with LLMCOMPRESSOR_VERSION=... (empty: newest).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/.cache/peer-venv}"
python="${PYTHON:-python3}"
llmc_version="${LLMCOMPRESSOR_VERSION-0.14.0.1}"
llmc_spec="llmcompressor${llmc_version:+==$llmc_version}"
autoround_version="${AUTOROUND_VERSION-0.15.1}"
autoround_spec="auto-round${autoround_version:+==$autoround_version}"

if [[ ! -x "$venv/bin/python" ]]; then
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==2.13.0"
# keep torch where it is: a resolver that wanted another torch would fail here rather than swap it
"$venv/bin/python" -m pip install -q "torch==2.13.0" "$llmc_spec" "$autoround_spec"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
from llmcompressor.entrypoints.model_free import model_free_ptq  # noqa: F401  (the API the bench calls)
from auto_round import AutoRound  # noqa: F401
print(f"peer venv ready: llmcompressor {md.version('llmcompressor')}, auto-round {md.version('auto-round')}, "
      f"compressed-tensors {md.version('compressed-tensors')}, torch {torch.__version__}")
EOF
echo "$venv"
