#!/usr/bin/env bash
# One command for a GPU machine (docs/how-to/gpus.md, "Checking a GPU machine"): installs what mpifl needs into
# this interpreter from a wheelhouse if anything is missing, then runs the GPU tests, CUDA's sync debug mode,
# every algorithm and model kind on the GPU against the CPU, and the GPU benchmarks, into one report.
#   scripts/gpu_check.sh [--wheelhouse DIR] [--out DIR] [--only STAGE,...] [--device cuda|cpu] [--quick] ...
# --device cpu is the dry run (anywhere). All options: scripts/gpu_check.sh --help (benchmarks/gpu_check.py).
# PYTHON=...  the interpreter to check and install into (default python3: a GPU image's own).
set -euo pipefail
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check: error: no Python interpreter '$PY' (set PYTHON=...)" >&2; exit 2; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
# relative paths in the options stay relative to the caller's folder: no cd
exec "$PY" "$(dirname "$0")/../benchmarks/gpu_check.py" "$@"
