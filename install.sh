#!/usr/bin/env bash
# Installs psd-engine with its test dependencies into the current Python environment.
# On a machine without an NVIDIA GPU, torch is installed as a CPU build first, so that the plain
# `torch` requirement never pulls the multi-GB CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet torch
  else
    # a local CPU wheel where the machine provides one, else the CPU index
    "$PY" -m pip install --quiet "torch==2.13.0" 2>/dev/null \
      || "$PY" -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -m pip install --quiet -e ".[test]"
"$PY" -c "import torch, triton; print(f'psd-engine installed: torch {torch.__version__}, triton {triton.__version__}, cuda={torch.cuda.is_available()}')"
