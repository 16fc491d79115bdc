#!/usr/bin/env bash
# The runs behind docs/fedals_feddeper.md: FedALS α sweep and the FedDeper comparison, 3 ranks each.
# Usage: scripts/fedals_feddeper_evidence.sh [OUTDIR]   (results OUTDIR/*.h5; default results/evidence)
set -euo pipefail
out=${1:-results/evidence}
mkdir -p "$out"
run() { local name=$1 config=$2; shift 2
  mpirun -n 3 --oversubscribe python -m mpifl run "configs/$config.yaml" --quiet --out "$out/$name.h5" "$@"; }

for data in digits fmnist; do
  for alpha in 1 5 10; do run "fedals_${data}_a$alpha" "fedals_$data" --set fedals.alpha=$alpha; done
  run "fedavg_${data}_tau5" "fedals_$data" --set algorithm=fedavg --set client.steps=5
done
for data in digits fmnist; do
  for clients in 10 100; do
    per_round=$(( clients == 10 ? 5 : 10 ))
    common=(--set data.num_clients=$clients --set clients_per_round=$per_round)
    run "fedavg_${data}_n$clients" "feddeper_$data" "${common[@]}" --set algorithm=fedavg
    run "fedprox_${data}_n$clients" "feddeper_$data" "${common[@]}" --set algorithm=fedprox --set fedprox.mu=1
    run "scaffold_${data}_n$clients" "feddeper_$data" "${common[@]}" --set algorithm=scaffold
    run "feddeper_${data}_n$clients" "feddeper_$data" "${common[@]}"
    run "feddeperstar_${data}_n$clients" "feddeper_$data" "${common[@]}" --set client.steps=5
  done
done
