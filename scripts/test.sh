#!/usr/bin/env bash
# Sets up (see setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
