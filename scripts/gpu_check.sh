#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (docs/gpu.md): no network there, its own python3
# (jax 0.11 + CUDA 13 plugin, torch, flax, ...), 15 minutes of device time for everything.
#
#   1. preflight (seconds): the wheel folder, every requirement, supported versions, the GPU;
#      stops here, naming what is missing, before any device time goes to measuring
#   2. installs the carried wheels (preheat + diffusers) with --no-deps --no-index into a
#      private folder on PYTHONPATH: no registry is ever asked
#   3. scripts/gpu_measure.py: the rows of issue 29 in its order -- doctor; the executables compiled
#      on the CPU builder for the H200 (.gpu-targets, carried) loaded here, against an on-device
#      compile, and autotune-and-replace; SDXL, FLUX.1-dev and Kontext, JAX against torch.compile;
#      then the scaled-fp8 Linear layer against a bf16 GEMM (kernels after autotuning, time); last,
#      a whole fp8 UNet step (SD 1.5, then SDXL) with the 1x1 convs as GEMMs on the fp8 weight
#      against convolutions and against bf16 weights (ms/step, agreement, the decision); on request
#      (GPU_CHECK_ROWS=...,xlaser) whether an executable loaded from JAX's cache survives
#      serialisation here (preheat's guard off) -- each under a deadline from one budget; JSON
#      under $OUT, the table printed last
#
# On the GPU (through the device tool, .gpu-wheels and .gpu-targets carried):  bash scripts/gpu_check.sh
# The CPU dry run (same script, CPU devices, tiny sizes):     GPU_CHECK_DRY=1 bash scripts/gpu_check.sh
# Settings: OUT (default gpu-results), GPU_WHEELS_DIR (default .gpu-wheels), GPU_TARGETS_DIR (default
# .gpu-targets), PYTHON (default python3), GPU_CHECK_BUDGET_S (seconds for the whole run, install
# included; default 540 on the GPU, so that a call with timeout_s 590 ends inside the device's
# 10-minute limit; 900 dry, where it only guards against a hang), GPU_CHECK_ROWS (comma-separated:
# doctor, target, sdxl, flux, kontext, fp8, fp8unet, xlaser, models, compare, scaling; default on
# the GPU the first seven, dry all), GPU_CHECK_SKIP (rows to leave out: a targeted rerun).
# Exit status: 0 all steps ran; 1 a step failed or was skipped; 2 preflight or install failed.
set -uo pipefail
STARTED=$(date +%s.%N)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS_DIR:-.gpu-wheels}
OUT=${OUT:-gpu-results}
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  MODE=dry; BUDGET=${GPU_CHECK_BUDGET_S:-900}  # dry: only a guard against a hang
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
else
  MODE=gpu; BUDGET=${GPU_CHECK_BUDGET_S:-540}
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/preheat-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
# Never a registry: no index, no config files (they may name one), no find-links from the caller.
unset PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_CONSTRAINT PIP_REQUIREMENT
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
echo "gpu_check: mode $MODE, $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1), wheels $WHEELS, out $OUT"

# 1. preflight
"$PY" scripts/gpu_preflight.py --wheels "$WHEELS" --mode "$MODE" --src src/preheat \
  --json "$OUT/preflight.json" --install-list "$WORK/install.txt"
rc=$?
if [ $rc = 3 ]; then  # preheat's wheel does not match this tree: build it here, offline, and check again
  mkdir -p "$WORK/tree" "$WORK/wheel"
  cp pyproject.toml README.md "$WORK/tree/" && cp -r src "$WORK/tree/src"
  if ! "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$WORK/wheel" "$WORK/tree" \
      >"$WORK/build.log" 2>&1; then
    tail -5 "$WORK/build.log"
    echo "gpu_check: STOP: preheat's wheel is stale and cannot be rebuilt here; rerun scripts/gpu_wheels.sh"
    exit 2
  fi
  "$PY" scripts/gpu_preflight.py --wheels "$WHEELS" --mode "$MODE" --preheat-wheel "$WORK"/wheel/preheat-*.whl \
    --json "$OUT/preflight.json" --install-list "$WORK/install.txt"
  rc=$?
fi
if [ $rc != 0 ]; then
  echo "gpu_check: STOP after $(awk "BEGIN {print int($(date +%s.%N) - $STARTED)}") s: the preflight above names what is missing"
  exit 2
fi

# 2. the offline install, into a private folder (nothing of the machine's own environment changes)
SITE="$WORK/site"
mapfile -t INSTALL < "$WORK/install.txt"
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${INSTALL[@]}"; then
  echo "gpu_check: STOP: the offline install failed"
  exit 2
fi
export PYTHONPATH="$SITE"
if ! "$PY" -c "import preheat, sys; sys.exit(0 if preheat.__file__.startswith('$SITE') else 1)"; then
  echo "gpu_check: STOP: preheat is not imported from the carried wheel ($SITE)"
  exit 2
fi

# 3. the measurements (the table comes last)
"$PY" scripts/gpu_measure.py run --out "$OUT" --mode "$MODE" --budget "$BUDGET" --started-at "$STARTED"
