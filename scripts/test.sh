#!/usr/bin/env bash
# Sets up .venv, then runs the test suite; with no arguments also the vLLM adapter tests in
# .venv-vllm-0.24.0 and .venv-vllm-0.33.0 (scripts/test-vllm.sh builds them on first use: a few
# minutes and ~7 GB each, reused afterwards). Arguments go to the main pytest run only, and
# then the vLLM runs are skipped (run scripts/test-vllm.sh yourself for those).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
cd "$root"
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
bash "$root/scripts/test-vllm.sh"
