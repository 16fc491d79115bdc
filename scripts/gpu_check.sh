#!/usr/bin/env bash
# The check of a GPU machine (docs/how-to/gpus.md, "What the check runs"): every algorithm and model kind on the
# GPU against the CPU, W2 and B1 on the GPU and on the same machine's CPU, the GPU tests, CUDA's sync debug mode,
# into one report. scripts/gpu_lease.sh runs it as the check step of a GPU lease, after installing the wheels.
#   scripts/gpu_check.sh [--profile lease|rest] [--out DIR] [--only STAGE,...] [--device cuda|cpu] [--quick] ...
# --device cpu is the dry run (anywhere). All options: scripts/gpu_check.sh --help (benchmarks/gpu_check.py).
# PYTHON=...  the interpreter to check (default python3: a GPU image's own).
set -euo pipefail
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check: error: no Python interpreter '$PY' (set PYTHON=...)" >&2; exit 2; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# relative paths in the options stay relative to the caller's folder: no cd
exec "$PY" "$(dirname "$0")/../benchmarks/gpu_check.py" "$@"
