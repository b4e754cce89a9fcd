#!/usr/bin/env bash
# Creates .venv at the repository root (if missing) and installs tierstore editable with the
# extras named in $TIERSTORE_EXTRAS (default: dev). On a machine without CUDA it installs the
# CPU torch wheel first. Re-running is cheap: a stamp skips pip when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
extras="${TIERSTORE_EXTRAS:-dev}"
export PIP_NO_CACHE_DIR=1  # a CI disk can be small: keep no second copy of the wheels
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
stamp=".venv/.tierstore-install-$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
            .venv/bin/python -m pip install --quiet torch
        else
            .venv/bin/python -m pip install --quiet torch==2.13.0
        fi
    fi
    .venv/bin/python -m pip install --quiet -e ".[${extras}]"
    rm -f .venv/.tierstore-install-*
    touch "$stamp"
fi
