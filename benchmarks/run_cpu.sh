#!/usr/bin/env bash
# The CPU benchmarks recorded in docs/benchmarks.md (JSON/PNG land in docs/bench/).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
B=.venv/bin/preheat
D=docs/bench
mkdir -p "$D"
$B bench sampler --n 1 --n 8 --n 32 --steps 20 --repeats 3 --report $D/sampler-builtin.json | tee $D/sampler-builtin.md
$B bench sampler ddpm-cifar10-32 --n 1 --n 8 --n 32 --steps 4 --repeats 2 --report $D/sampler-cifar.json | tee $D/sampler-cifar.md
$B bench coldstart --n 8 --repeats 3 --report $D/coldstart-builtin.json --png-out $D/coldstart-builtin.png | tee $D/coldstart-builtin.md
$B bench coldstart ddpm-cifar10-32 --n 1 --steps 10 --repeats 3 --report $D/coldstart-cifar.json --png-out $D/coldstart-cifar.png | tee $D/coldstart-cifar.md
$B bench coldstart --n 8 --repeats 3 --cache-url "$(mktemp -d)/fleet" --report $D/coldstart-remote.json | tee $D/coldstart-remote.md
$B bench serve --requests 256 --concurrency 32 --json $D/serve-builtin.json | tee $D/serve-builtin.md

# Text-to-image (issue 12): the full-size SD 1.5 architecture with random weights, 256x256, fp32 on
# the CPU, a few steps. The folder (about 4 GB) is written once by preheat.bench.random_models.
SD15=${SD15:-.bench-models/sd15-random}
[ -f "$SD15/model_index.json" ] || .venv/bin/python -c "import sys; from pathlib import Path; \
from preheat.bench.random_models import save_random_sd15; save_random_sd15(Path(sys.argv[1]))" "$SD15"
T2I=(--prompt "a watercolor fox" --width 256 --height 256)
$B bench coldstart "$SD15" --n 1 --steps 2 --repeats 1 "${T2I[@]}" --report $D/coldstart-sd15.json --png-out $D/coldstart-sd15.png | tee $D/coldstart-sd15.md
$B bench sampler "$SD15" --n 1 --steps 2 --repeats 2 --width 256 --height 256 --report $D/sampler-sd15.json | tee $D/sampler-sd15.md
$B bench compare "$SD15" --quick --paths jax,torch-eager,torch-inductor --steps 2 --n 1 --batch-sizes 1 --sampler ddim \
  "${T2I[@]}" --report $D/compare-sd15.json --png-out $D/compare-sd15.png | tee $D/compare-sd15.md

# Flux (issue 13): FLUX.1-dev's published widths with fewer layers (1 double + 1 single transformer
# block, T5-XXL widths with 2 layers, CLIP-L with 2 layers, the full 16-channel VAE), random float32
# weights (about 4.7 GB, written once by preheat.bench.random_models), 256x256, 2 steps.
FLUX=${FLUX:-.bench-models/flux-random}
[ -f "$FLUX/model_index.json" ] || .venv/bin/python -c "import sys; from pathlib import Path; \
from preheat.bench.random_models import save_random_flux; save_random_flux(Path(sys.argv[1]))" "$FLUX"
$B bench coldstart "$FLUX" --n 1 --steps 2 --repeats 2 "${T2I[@]}" --cache-url "$(mktemp -d)/fleet" \
  --report $D/coldstart-flux.json --png-out $D/coldstart-flux.png | tee $D/coldstart-flux.md
$B bench compare "$FLUX" --quick --paths jax,torch-eager,torch-inductor --steps 2 --n 1 --batch-sizes 1 \
  --steady-repeats 1 --sampler flow_euler "${T2I[@]}" --report $D/compare-flux.json --png-out $D/compare-flux.png \
  | tee $D/compare-flux.md

# Resolutions on the torch side (issue 14): per-resolution entries vs dynamic=True, tiny Flux and SD 1.x.
.venv/bin/python -m benchmarks.shapes --resolutions 32,48,64 --repeats 5 --threads 1 --report $D/torch-shapes.json | tee $D/torch-shapes.md

# Steady state on the CPU (issue 21): where a denoiser call's time goes, and the model-code switches
# side by side in one process (round-robin), then JAX vs torch.compile at batch 8.
.venv/bin/python -m benchmarks.op_profile --report $D/profile-builtin.json | tee $D/profile-builtin.md
.venv/bin/python -m benchmarks.op_profile ddpm-cifar10-32 --report $D/profile-cifar.json | tee $D/profile-cifar.md
.venv/bin/python benchmarks/denoiser_ab.py --report $D/denoiser-ab-builtin.json | tee $D/denoiser-ab-builtin.txt
.venv/bin/python benchmarks/denoiser_ab.py ddpm-cifar10-32 --rounds 7 --variant two_pass=groupnorm=two_pass \
  --variant one_pass=groupnorm=one_pass --report $D/denoiser-ab-cifar.json | tee $D/denoiser-ab-cifar.txt
$B bench compare --quick --xla-flags noynn=--xla_cpu_experimental_ynn_fusion_type= \
  --report $D/compare-builtin-issue21.json | tee $D/compare-builtin-issue21.md
$B bench compare ddpm-cifar10-32 --quick --paths jax,torch-inductor --batch-sizes 8 \
  --report $D/compare-cifar-b8-issue21.json | tee $D/compare-cifar-b8-issue21.md
