#!/usr/bin/env bash
# Set everything up and run the main job on the embedded default dataset (digits), then summarize and plot.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
NP=${NP:-3} jobs/run_local.sh configs/quickstart.yaml --out results/quickstart.h5
source .venv/bin/activate
python -m mpifl report results/quickstart.h5
python -m mpifl plot results/quickstart.h5 -o results/quickstart.png
