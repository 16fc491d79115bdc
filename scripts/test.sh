#!/usr/bin/env bash
# Set everything up and run the whole test suite: lint, the single-process suite (which also
# launches real mpirun jobs), and the pytest-mpi suite on 3 and 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source .venv/bin/activate
# Debian's Fashion-MNIST lets the IDX loader be tested on the real files (skipped if unavailable).
if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
    || echo "note: dataset-fashion-mnist not installable; its test will be skipped"
fi
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
ruff check mpifl tests benchmarks
for ranks in 3 4; do
  echo "== pytest-mpi on $ranks ranks"
  timeout 900 mpirun -n "$ranks" --oversubscribe python -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
done
echo "== single-process suite"
python -m pytest -q -p no:cacheprovider
