#!/usr/bin/env bash
# Sets up (see setup.sh) and runs the main job: the services and a demo workload, with a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m stack "$@"
