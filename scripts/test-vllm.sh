#!/usr/bin/env bash
# Runs the vLLM adapter tests (marker `vllm`, plus the adapter's knob tests) in every vLLM venv:
# sets them up first (scripts/setup-vllm-venvs.sh reuses a venv whose versions match), then runs
# pytest in each. Fails if any version fails to install, to import, or to pass; extra arguments
# go to pytest.
#
# Usage: scripts/test-vllm.sh [PYTEST_ARGS ...]     (versions: $VLLM_VERSIONS, default 0.24.0 0.33.0)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
read -r -a versions <<<"${VLLM_VERSIONS:-0.24.0 0.33.0}"

bash scripts/setup-vllm-venvs.sh "${versions[@]}"
failed=()
for version in "${versions[@]}"; do
    echo "== vLLM ${version}"
    if ! ".venv-vllm-${version}/bin/python" -m pytest -p no:cacheprovider tests/vllm_plugin tests/test_vllm_settings.py "$@"; then
        failed+=("$version")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "test-vllm: tests failed under vLLM ${failed[*]}" >&2
    exit 1
fi
echo "test-vllm: all passed under vLLM ${versions[*]}"
