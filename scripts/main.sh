#!/usr/bin/env bash
# The main job: sets up .venv, then runs `tierstore generate` on the default model: it packs the
# routed experts to 2-bit (first use only), generates with a GPU expert pool holding 25% of the
# experts (a CPU stand-in with the same logic where there is no GPU), prints the text and the
# KPIs, and checks every step's logits bit for bit against an all-resident run.
#
# The default model is the quality lab's trained checkpoint (benchmarks/quality/checkpoint: a
# Qwen3-MoE trained on CPython standard-library sources, NVFP4 experts) when it is there, else
# the built-in tiny random-init demo. Extra arguments are passed to `tierstore generate`.
# TIERSTORE_MAIN_DRY_RUN=1 prints the command (one argument per NUL-terminated field) and exits
# without installing or running anything.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
checkpoint="$root/benchmarks/quality/checkpoint"
if [ -f "$checkpoint/config.json" ]; then
    model=("$checkpoint" --prompt $'def read_config(path):\n' --max-new-tokens 48)
else
    model=(--demo --prompt "The quick brown fox" --max-new-tokens 32)
fi
command=("$root/.venv/bin/tierstore" generate "${model[@]}" --gpu-pool-frac 0.25 --verify-resident "$@")
if [ -n "${TIERSTORE_MAIN_DRY_RUN:-}" ]; then
    printf '%s\0' "${command[@]}"
    exit 0
fi
bash "$root/scripts/setup-venv.sh"
exec "${command[@]}"
