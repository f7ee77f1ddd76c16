#!/usr/bin/env bash
# The CPU benchmarks recorded in docs/benchmarks.md (JSON/PNG land in docs/bench/).
set -euo pipefail
cd "$(dirname "$0")/.."
B=.venv/bin/preheat
D=docs/bench
mkdir -p "$D"
$B bench sampler --batch 1 --batch 8 --batch 32 --steps 20 --repeats 3 --json-out $D/sampler-builtin.json | tee $D/sampler-builtin.md
$B bench sampler ddpm-cifar10-32 --batch 1 --batch 8 --batch 32 --steps 4 --repeats 2 --json-out $D/sampler-cifar.json | tee $D/sampler-cifar.md
$B bench coldstart --n 8 --repeats 3 --json-out $D/coldstart-builtin.json --png-out $D/coldstart-builtin.png | tee $D/coldstart-builtin.md
$B bench coldstart ddpm-cifar10-32 --n 1 --steps 10 --repeats 3 --json-out $D/coldstart-cifar.json --png-out $D/coldstart-cifar.png | tee $D/coldstart-cifar.md
$B bench coldstart --n 8 --repeats 3 --cache-url "$(mktemp -d)/fleet" --json-out $D/coldstart-remote.json | tee $D/coldstart-remote.md
$B bench serve --requests 256 --concurrency 32 --json $D/serve-builtin.json | tee $D/serve-builtin.md
