#!/usr/bin/env bash
# Set everything up, then the main job on the embedded data (scikit-learn's digits): PeFLL (an embedding net
# and a hypernetwork on the server) against FedAvg on the same clients, each on NP=3 ranks; report both
# (seen and unseen clients' accuracy, exact bytes per client and direction, simulated time) and plot
# accuracy against rounds, bytes and simulated time for both in one figure. Run again, it starts both runs
# again and replaces their files and the figure (--overwrite).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
for algorithm in pefll fedavg; do
  NP=${NP:-3} jobs/run_local.sh configs/quickstart_pefll.yaml --set algorithm=$algorithm \
    --out results/quickstart_$algorithm.h5 --overwrite
done
source .venv/bin/activate
for algorithm in pefll fedavg; do
  python -m mpifl report results/quickstart_$algorithm.h5
done
python -m mpifl plot results/quickstart_pefll.h5 results/quickstart_fedavg.h5 -o results/quickstart.png --overwrite
