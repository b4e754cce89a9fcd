#!/usr/bin/env bash
# The main job on a built-in default: sets up .venv, then runs `tierstore inspect` on a tiny
# checkpoint that it builds on first use. Extra arguments are passed to `tierstore inspect`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
exec "$root/.venv/bin/tierstore" inspect --demo "$@"
