#!/usr/bin/env bash
# Creates one virtual environment per supported vLLM release at the repository root
# (.venv-vllm-<version>): that vLLM from PyPI with its own pinned torch, then tierstore editable
# with --no-deps plus tierstore's own runtime dependencies and pytest.
#
# Lean install: pip resolves vLLM's full dependency set (--dry-run --report), and the pinned
# result is installed with --no-deps minus GPU_ONLY_PACKAGES, kernel libraries that only vLLM's
# GPU paths load and that the CPU adapter tests never import (2-3.5 GB of each venv). pip keeps
# no cache. A venv then takes a few minutes and about 6-7 GB; the script refuses to start one
# with less than VLLM_VENV_MIN_FREE_GB (default 10) free, saying how much is free.
# A venv whose vLLM version, Python and tierstore metadata already match (a stamp file) is
# reused without touching pip.
#
# Usage: scripts/setup-vllm-venvs.sh [VERSION ...]   (default: every version in VLLM_VERSIONS)
# Exits non-zero, naming the version and the failing step, when an install or import fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
default_versions="0.24.0 0.33.0"
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    read -r -a versions <<<"${VLLM_VERSIONS:-$default_versions}"
fi

# Left out of every vLLM venv (see the header); $VLLM_EXTRA_GPU_ONLY adds more.
GPU_ONLY_PACKAGES="flashinfer-python flashinfer-cubin flashinfer-jit-cache
nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core
nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13 tilelang tokenspeed-triton
tokenspeed-mla quack-kernels humming-kernels opencv-python-headless pynvvideocodec torchcodec
z3-solver ${VLLM_EXTRA_GPU_ONLY:-}"
min_free_gb="${VLLM_VENV_MIN_FREE_GB:-10}"
export PIP_NO_CACHE_DIR=1

fail() {
    echo "setup-vllm-venvs: vLLM $1: $2" >&2
    exit 1
}

# tierstore's runtime dependencies minus torch/triton (vLLM pins those), read from pyproject.toml.
tierstore_requirements() {
    "$python" - <<'EOF'
import re, tomllib
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    name = re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower()
    if name not in ("torch", "triton"):
        print(dep)
EOF
}

# Prints pip's resolve report ($1) as name==version lines, without GPU_ONLY_PACKAGES.
pinned_without_gpu_only() {
    GPU_ONLY_PACKAGES="$GPU_ONLY_PACKAGES" "$python" - "$1" <<'EOF'
import json, os, sys
skip = set(os.environ["GPU_ONLY_PACKAGES"].split())
with open(sys.argv[1]) as f:
    report = json.load(f)
for item in report["install"]:
    name = item["metadata"]["name"].lower().replace("_", "-")
    if name not in skip:
        print(f"{name}=={item['metadata']['version']}")
EOF
}

free_gb() {
    df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

setup_one() {
    local version="$1"
    local venv=".venv-vllm-${version}"
    local identity
    identity="$(
        {
            echo "$version"
            "$python" --version
            cat pyproject.toml setup.py
            echo "$GPU_ONLY_PACKAGES"
        } | sha256sum | cut -c1-16
    )"
    local stamp="$venv/.tierstore-vllm-${identity}"
    if [ -f "$stamp" ] && "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
        echo "setup-vllm-venvs: $venv is up to date"
        return
    fi
    # A venv from an older recipe is rebuilt from nothing, so no left-out package lingers.
    rm -rf "$venv"
    local free
    free="$(free_gb)"
    if [ "$free" -lt "$min_free_gb" ]; then
        fail "$version" "only ${free} GB free on $(df -P . | awk 'NR == 2 { print $6 }'); building $venv needs about ${min_free_gb} GB (VLLM_VENV_MIN_FREE_GB overrides)"
    fi
    echo "setup-vllm-venvs: building $venv (a few minutes, ~7 GB; ${free} GB free)"
    "$python" -m venv "$venv" || fail "$version" "cannot create $venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip || fail "$version" "pip upgrade failed"
    local report="$venv/.vllm-resolve.json"
    local requirements="$venv/.vllm-requirements.txt"
    "$venv/bin/python" -m pip install --quiet --dry-run --ignore-installed --report "$report" "vllm==${version}" ||
        fail "$version" "pip could not resolve vllm==${version}"
    pinned_without_gpu_only "$report" >"$requirements" || fail "$version" "cannot read pip's report $report"
    "$venv/bin/python" -m pip install --quiet --no-deps -r "$requirements" ||
        fail "$version" "installing vllm==${version} and its pinned dependencies ($requirements) failed"
    local constraints="$venv/.torch-constraint.txt"
    grep '^torch==' "$requirements" >"$constraints" || fail "$version" "vllm==${version} resolved without torch"
    # shellcheck disable=SC2046
    "$venv/bin/python" -m pip install --quiet -c "$constraints" $(tierstore_requirements) "pytest>=8" ||
        fail "$version" "installing tierstore's dependencies failed"
    "$venv/bin/python" -m pip install --quiet --no-deps -e . || fail "$version" "pip install -e . --no-deps failed"
    "$venv/bin/python" -c "import vllm, tierstore.vllm_adapter; print('vllm', vllm.__version__)" ||
        fail "$version" "import check failed (see the traceback above)"
    touch "$stamp"
    echo "setup-vllm-venvs: $venv ready ($(du -sh "$venv" | cut -f1))"
}

for version in "${versions[@]}"; do
    setup_one "$version"
done
