#!/usr/bin/env bash
# Fill the ignored folder .gpu-wheels/ with what scripts/gpu_check.sh installs on the lent GPU
# machine, which has no network and its own Python 3.12 with jax, torch, flax, transformers, ...
# but not these (see docs/gpu.md):
#
#   preheat    built from this checkout (pip wheel --no-deps --no-build-isolation: offline)
#   diffusers  the torch comparison backend (preheat[torch]); pure Python, the version the test
#              suite passes with (constraints-cpu.txt). Its other requirements are on the machine,
#              except importlib_metadata, which diffusers imports only on Python < 3.8.
#
# Run it on a machine with registry access, in the repository root the device tool sends:
#     bash scripts/gpu_wheels.sh
# GPU_WHEELS_FROM_ENV=1 takes diffusers from this Python's environment instead (repacked by
# scripts/gpu_repack.py; no registry): what the CPU dry run in CI uses.
# GPU_WHEELS_DIR=DIR writes elsewhere; PYTHON=... picks the interpreter (default: .venv's, else python3).
# Then, unless GPU_TARGETS=0, the GPU check's row 2 (docs/gpu.md): `python scripts/gpu_measure.py
# prepare` compiles the built-in model's serving programs for the H200 here, on the CPU (`preheat warm
# --target h200`, a few minutes, with the pod's cuDNN: GPU_POD_CUDNN), into the ignored folder .gpu-targets/
# (GPU_TARGETS_DIR), carried too.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.gpu-wheels}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
CARRIED=(diffusers)
version_of() {  # the version pinned in constraints-cpu.txt
  grep -i "^$1==" constraints-cpu.txt | head -1 | cut -d= -f3
}

rm -rf "$DEST"
mkdir -p "$DEST"
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/preheat-wheel.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT

# preheat, from a copy of the tree (so no build/ or egg-info lands in the checkout)
mkdir -p "$BUILD/tree"
cp pyproject.toml README.md "$BUILD/tree/"
cp -r src "$BUILD/tree/src"
find "$BUILD/tree" -name __pycache__ -prune -exec rm -rf {} +
if ! PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation --no-index \
    -w "$DEST" "$BUILD/tree" >"$BUILD/log" 2>&1; then  # (setuptools' deprecation notices only on failure)
  cat "$BUILD/log" >&2
  echo "gpu_wheels: building preheat's wheel failed (it needs setuptools >= 77 in $PYTHON's environment)" >&2
  exit 2
fi

if [ "${GPU_WHEELS_FROM_ENV:-0}" = 1 ]; then
  "$PYTHON" scripts/gpu_repack.py "$DEST" "${CARRIED[@]}" >/dev/null
else
  specs=()
  for name in "${CARRIED[@]}"; do
    v=$(version_of "$name")
    [ -n "$v" ] || { echo "gpu_wheels: no $name pin in constraints-cpu.txt" >&2; exit 2; }
    specs+=("$name==$v")
  done
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${specs[@]}"
fi

ls -l "$DEST" | awk 'NR > 1 {printf "  %-50s %6.2f MiB\n", $9, $5 / 1048576}'
du -sb "$DEST" | awk '{printf "gpu_wheels: %s holds %.2f MiB\n", $2, $1 / 1048576}'

if [ "${GPU_TARGETS:-1}" != 0 ]; then
  # The key holds cuDNN's version (a pod's cuDNN must run the graphs the builder's compiled), so the
  # builder compiles with the pod's: the lent H200 machine had 9.19.0.56 (docs/gpu.md, first run),
  # torch's pin here is another. A private folder ahead on PYTHONPATH for the prepare only.
  POD_CUDNN=${GPU_POD_CUDNN:-9.19.0.56}
  have=$("$PYTHON" -c 'from importlib import metadata as m; print(m.version("nvidia-cudnn-cu13"))' 2>/dev/null || true)
  if [ "$have" != "$POD_CUDNN" ]; then
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d "$BUILD/cudnn-wheel" \
      "nvidia-cudnn-cu13==$POD_CUDNN"
    "$PYTHON" -m pip install -q --no-deps --no-index --target "$BUILD/cudnn" "$BUILD"/cudnn-wheel/*.whl
    export PYTHONPATH="$BUILD/cudnn${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_wheels: compiling with the pod's cuDNN $POD_CUDNN (this environment has ${have:-none})"
  fi
  "$PYTHON" scripts/gpu_measure.py prepare --mode gpu --out "${GPU_TARGETS_DIR:-.gpu-targets}"
  du -sb "${GPU_TARGETS_DIR:-.gpu-targets}" "$DEST" | awk '{t += $1} END {printf "gpu_wheels: the carried folders hold %.2f MiB\n", t / 1048576}'
fi
