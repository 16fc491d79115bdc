#!/usr/bin/env bash
# The test suite on a busy machine: scripts/test.sh with N CPU-bound processes beside it (default 2), as on a
# shared login node or a workstation running other jobs. The busy processes end with the suite, however it ends.
#   scripts/test_under_load.sh        # two busy processes
#   MPIFL_LOAD=4 scripts/test_under_load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
busy=()
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
for _ in $(seq "${MPIFL_LOAD:-2}"); do
  python3 -c 'while True: pass' &
  busy+=($!)
done
echo "== scripts/test.sh beside ${#busy[@]} CPU-bound processes"
start=$SECONDS
scripts/test.sh
echo "== passed beside ${#busy[@]} CPU-bound processes in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
