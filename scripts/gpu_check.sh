#!/usr/bin/env bash
# One short, prepared run for a lent GPU machine (see docs/gpu.md). Everything it measures lands in
# $OUT (or ./gpu-results): doctor's JSON, the sampler bench, the cold-start bench, bench compare.
# Usage on the device:  bash scripts/gpu_check.sh            (about 8 minutes on one H200)
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
python3 -m venv .venv-gpu >/dev/null 2>&1 || true
. .venv-gpu/bin/activate
pip install -q --upgrade pip >/dev/null
# Pick the JAX build the driver supports (what `preheat doctor` would tell you).
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1 | cut -d. -f1)
extra=cuda12; [ "${driver:-0}" -ge 580 ] && extra=cuda13
pip install -q -e ".[${extra},torch,bench,train]" 2>&1 | tail -2
export PREHEAT_HOME="$PWD/.preheat-home"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
preheat doctor --json > "$OUT/doctor.json"; echo "doctor exit $?" >> "$OUT/doctor.json.rc"
preheat bench sampler --repeats 5 --json-out "$OUT/sampler-builtin.json" > "$OUT/sampler-builtin.md" 2>&1
preheat bench sampler ddpm-cifar10-32 --steps 20 --repeats 5 --json-out "$OUT/sampler-cifar.json" > "$OUT/sampler-cifar.md" 2>&1
preheat bench coldstart --n 8 --repeats 3 --json-out "$OUT/coldstart-builtin.json" --png-out "$OUT/coldstart-builtin.png" > "$OUT/coldstart-builtin.md" 2>&1
preheat bench coldstart ddpm-cifar10-32 --n 8 --steps 20 --repeats 3 --json-out "$OUT/coldstart-cifar.json" --png-out "$OUT/coldstart-cifar.png" > "$OUT/coldstart-cifar.md" 2>&1
preheat bench compare --quick --json-out "$OUT/compare-quick.json" --png-out "$OUT/compare-quick.png" > "$OUT/compare-quick.md" 2>&1 || true
ls -la "$OUT"
