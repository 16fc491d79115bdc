#!/usr/bin/env bash
# Set everything up and run the whole test suite: lint, the single-process suite (which also
# launches real mpirun jobs), and the pytest-mpi suite on 3 and 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
MPIFL_EXTRAS=test scripts/setup.sh
source .venv/bin/activate
# Debian's Fashion-MNIST lets the IDX loader be tested on the real files, and Debian's Slurm lets the
# batch scripts be tested on a real local Slurm (each skipped with the reason if unavailable).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  wanted=()
  [ -d /usr/share/datasets/fashion-mnist ] || wanted+=(dataset-fashion-mnist)
  command -v slurmctld >/dev/null || wanted+=(slurmctld slurmd slurm-client munge libpmix-dev)
  if [ ${#wanted[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${wanted[@]}" >/dev/null) \
      || echo "note: could not install ${wanted[*]}; the tests that need them will be skipped"
  fi
fi
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
ruff check mpifl tests benchmarks
lint-imports  # the layers and the absence of import cycles (pyproject: [tool.importlinter])
mypy          # type-checks mpifl (pyproject: [tool.mypy])
echo "== pytest-mpi on 3 ranks"
timeout 900 mpirun -n 3 --oversubscribe python -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
echo "== pytest-mpi on 4 ranks (transport, engine, every algorithm on 1-4 ranks)"
timeout 600 mpirun -n 4 --oversubscribe python -m pytest -q -p no:cacheprovider --with-mpi \
  tests/mpi/test_transport_mpi.py tests/mpi/test_engine_mpi.py tests/mpi/test_rank_counts_mpi.py
echo "== single-process suite"
# "slow" marks duplicates of what the pytest-mpi suite above already checks (kept for local runs). Two
# pytest-xdist workers (the CI machine's two cores); tests/conftest.py groups the tests that share a fixture.
python -m pytest -q -p no:cacheprovider --durations=40 -n 2 --dist loadgroup -m "not slow and not alone"
echo "== the tests that measure wall time (shaped links), with nothing of the suite beside them"
python -m pytest -q -p no:cacheprovider -m "not slow and alone"
