#!/usr/bin/env bash
# pfl-research 0.6 and the dependencies a GPU image with torch, numpy and scipy lacks, as wheels for that image's
# Python (default 3.12, the lent H200's), into DIR: carried to the GPU machine beside the tree, installed there with
#   python3 -m pip install --no-deps --target /tmp/pfl-site DIR/*.whl
# and given to benchmarks/gpu_side_by_side.py as --pfl-site /tmp/pfl-site (docs/how-to/gpus.md). pfl-research is
# no dependency of mpifl: only the side-by-side benchmark runs it.
#   scripts/pfl_wheels.sh DIR [PYTHON_VERSION]
set -euo pipefail
[ $# -ge 1 ] || { echo "pfl_wheels: usage: scripts/pfl_wheels.sh DIR [PYTHON_VERSION]" >&2; exit 2; }
dir=$1 version=${2:-3.12}
mkdir -p "$dir"
python3 -m pip download --quiet --only-binary=:all: --no-deps --python-version "$version" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$dir" \
  pfl==0.6.0 dp-accounting==0.5.1 multiprocess==0.70.19 prv-accountant==0.2.0 "dill>=0.4.1" absl-py \
  "attrs>=22,<24" "dm-tree~=0.1.8" "packaging>=24,<26" "wheel>=0.41.2,<0.46"
count=$(find "$dir" -maxdepth 1 -type f -name '*.whl' | wc -l)
echo "pfl_wheels: $count wheels in $dir ($(du -sh "$dir" | cut -f1))"
