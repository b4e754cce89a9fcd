#!/usr/bin/env bash
# Runs the vLLM adapter tests (marker `vllm`, plus the adapter's knob tests) in every vLLM venv,
# one version after the other: sets its venv up (scripts/setup-vllm-venvs.sh reuses one whose
# versions match), runs pytest in it, then goes on to the next. When the next version's venv
# still has to be built and the disk has less than VLLM_VENV_MIN_FREE_GB (default 10) free, the
# venv just tested is removed first (it says so), so a small disk needs room for one venv only.
# Fails if any version fails to install, to import, or to pass; extra arguments go to pytest.
#
# Usage: scripts/test-vllm.sh [PYTEST_ARGS ...]     (versions: $VLLM_VERSIONS, default 0.24.0 0.33.0)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
read -r -a versions <<<"${VLLM_VERSIONS:-0.24.0 0.33.0}"
min_free_gb="${VLLM_VENV_MIN_FREE_GB:-10}"

free_gb() {
    df -Pk . | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

failed=()
for i in "${!versions[@]}"; do
    version="${versions[$i]}"
    bash scripts/setup-vllm-venvs.sh "$version"
    echo "== vLLM ${version}"
    if ! ".venv-vllm-${version}/bin/python" -m pytest -p no:cacheprovider tests/vllm_plugin tests/test_vllm_settings.py "$@"; then
        failed+=("$version")
    fi
    next=$((i + 1))
    if [ "$next" -lt "${#versions[@]}" ] && [ ! -d ".venv-vllm-${versions[$next]}" ] &&
        [ "$(free_gb)" -lt "$min_free_gb" ]; then
        echo "test-vllm: $(free_gb) GB free, under ${min_free_gb} GB: removing .venv-vllm-${version} to make room for vLLM ${versions[$next]}"
        rm -rf ".venv-vllm-${version}"
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "test-vllm: tests failed under vLLM ${failed[*]}" >&2
    exit 1
fi
echo "test-vllm: all passed under vLLM ${versions[*]}"
