#!/usr/bin/env bash
# The main job on a built-in default: sets up .venv, builds a tiny Qwen3-MoE checkpoint (first use
# only), packs it, generates with a GPU expert pool holding 25% of the experts (a CPU stand-in
# with the same logic where there is no GPU), prints the KPIs and checks every step's logits
# bit for bit against an all-resident run. Extra arguments are passed to `tierstore generate`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
exec "$root/.venv/bin/tierstore" generate --demo --prompt "The quick brown fox" --max-new-tokens 32 \
    --gpu-pool-frac 0.25 --verify-resident "$@"
