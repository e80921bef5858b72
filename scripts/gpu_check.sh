#!/usr/bin/env bash
# The prepared GPU check (prefixcache_bench/gpu_check; docs/gpu.md): on a CUDA machine with no
# network, installs the wheels of scripts/gpu_wheels.txt from .whl/ (carried with the call) into
# a private folder and runs
#     python3 -m prefixcache_bench.gpu_check OUTDIR [ARGS...]
# which writes its JSON under OUTDIR (default runs/gpu-check), prints one table, and exits 1 on
# a failed correctness check, 2 on a stage error, 0 otherwise (3: the wheels would not install).
#
#   scripts/gpu_check.sh --download       # here, with network: fetch the wheels into .whl/
#   scripts/gpu_check.sh "$OUT/gpu"       # there: the check (add --dry-run to try it on CPU)
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/gpu-check-site}

if [[ "${1:-}" == "--download" ]]; then
    mkdir -p "$WHEELS"
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$WHEELS" -r scripts/gpu_wheels.txt
fi

OUTDIR=${1:-runs/gpu-check}
shift || true
mkdir -p "$OUTDIR"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # --target: a private folder first on the path, so the image's own packages stay untouched
    # and ours (grpcio/protobuf new enough for prefixcache/v1's generated code) win.
    if ! "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --no-compile \
            --no-cache-dir --upgrade --target "$SITE" -r scripts/gpu_wheels.txt; then
        echo "gpu_check.sh: the wheels in $WHEELS would not install (scripts/gpu_wheels.txt)" >&2
        exit 3
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_check.sh: no $WHEELS/*.whl: using the installed packages" \
         "(scripts/gpu_check.sh --download fetches them; carry $WHEELS with the call)" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader 2>&1 | head -2
"$PY" -m prefixcache_bench.gpu_check "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/run.log"
exit "${PIPESTATUS[0]}"
