#!/usr/bin/env bash
# Run a config on this machine: 1 server rank + NP-1 worker ranks.
#   jobs/run_local.sh configs/quickstart.yaml [--set key=value ...]     (NP=3 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: jobs/run_local.sh CONFIG [mpifl run options]}
shift
source .venv/bin/activate
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
exec mpirun -n "${NP:-3}" --oversubscribe python -m mpifl run "$config" "$@"
