#!/usr/bin/env bash
# The quick tier: the single-process tests that start no process, share no module-wide fixture and run no whole
# job (the "launches" and "runs" marks, set by tests/conftest.py), on both cores. Arguments go to pytest, e.g. the
# test files of the module you change:   scripts/test_quick.sh tests/comm/test_codecs.py
# It is a subset of scripts/test.sh's single-process suite (tests/test_tiers.py checks that).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi
exec python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "not slow and not launches and not runs" "$@"
