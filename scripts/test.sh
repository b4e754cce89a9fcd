#!/usr/bin/env bash
# Sets up .venv, then runs the test suite. Extra arguments are passed to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-venv.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
