#!/usr/bin/env bash
# Executables for a TPU v5e VM, compiled on this CPU-only machine (issue 57): the built-in model and a
# tiny random SD 1.x folder, `preheat warm --target v5e`, into .tpu-aot/ (git-ignored, at most 64 MiB:
# what the device tool carries). Then on the TPU VM: python scripts/tpu_aot.py check --carried .tpu-aot
#
#   bash scripts/tpu_prepare.sh [OUT] [TARGET]        (default .tpu-aot v5e)
#
# The builder venv must hold the TPU machine's versions (the key names them; a VM with others misses):
# Python 3.11, jax and jaxlib 0.10.2, libtpu 0.0.42.1, and preheat's runtime dependencies. It is made
# here when missing (TPU_VENV, default .venv-tpu). The SD 1.x folder is written by diffusers from
# MODEL_PYTHON (default .venv/bin/python, the test venv).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.tpu-aot}
TARGET=${2:-v5e}
TPU_VENV=${TPU_VENV:-.venv-tpu}
MODEL_PYTHON=${MODEL_PYTHON:-.venv/bin/python}
if [ ! -x "$TPU_VENV/bin/python" ]; then
  python3.11 -m venv "$TPU_VENV" 2>/dev/null || python3 -m venv "$TPU_VENV"
  "$TPU_VENV/bin/python" -m pip install -q "jax==0.10.2" "jaxlib==0.10.2" "libtpu==0.0.42.1" \
    flax optax safetensors numpy pillow rich click tokenizers
fi
exec env JAX_PLATFORMS=cpu "$TPU_VENV/bin/python" scripts/tpu_aot.py prepare --out "$OUT" --target "$TARGET" \
  --model-python "$MODEL_PYTHON"
