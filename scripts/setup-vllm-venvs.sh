#!/usr/bin/env bash
# Creates one virtual environment per supported vLLM release at the repository root
# (.venv-vllm-<version>), installs that vLLM from PyPI (it brings its own pinned torch), then
# tierstore editable with --no-deps plus tierstore's own runtime dependencies and pytest.
# A venv whose vLLM version, Python and tierstore metadata already match (a stamp file) is
# reused without touching pip. Each fresh install takes a few minutes and about 9-10 GB.
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

setup_one() {
    local version="$1"
    local venv=".venv-vllm-${version}"
    local identity
    identity="$(
        {
            echo "$version"
            "$python" --version
            cat pyproject.toml setup.py
        } | sha256sum | cut -c1-16
    )"
    local stamp="$venv/.tierstore-vllm-${identity}"
    if [ -f "$stamp" ] && "$venv/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
        echo "setup-vllm-venvs: $venv is up to date"
        return
    fi
    echo "setup-vllm-venvs: building $venv (several minutes, ~10 GB)"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" || fail "$version" "cannot create $venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip || fail "$version" "pip upgrade failed"
    "$venv/bin/python" -m pip install --quiet "vllm==${version}" || fail "$version" "pip install vllm==${version} failed"
    local torch_version
    torch_version="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')" ||
        fail "$version" "torch is not installed after installing vllm"
    local constraints="$venv/.torch-constraint.txt"
    echo "torch==${torch_version}" >"$constraints"
    # shellcheck disable=SC2046
    "$venv/bin/python" -m pip install --quiet -c "$constraints" $(tierstore_requirements) "pytest>=8" ||
        fail "$version" "installing tierstore's dependencies failed"
    "$venv/bin/python" -m pip install --quiet --no-deps -e . || fail "$version" "pip install -e . --no-deps failed"
    "$venv/bin/python" -c "import vllm, tierstore.vllm_adapter; print('vllm', vllm.__version__)" ||
        fail "$version" "import check failed (see the traceback above)"
    rm -f "$venv"/.tierstore-vllm-*
    touch "$stamp"
    echo "setup-vllm-venvs: $venv ready"
}

for version in "${versions[@]}"; do
    setup_one "$version"
done
