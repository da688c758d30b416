#!/usr/bin/env bash
# Set up (once) and run the test suite: bash scripts/test.sh [pytest args]
#   VASE_TEST_WORKERS=N  pytest-xdist workers (default 2; 0 runs in this process, as plain pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two workers: about 1.5x faster than one process on a 2-core machine (docs/testing.md).
# --dist loadgroup keeps a module, and modules sharing a server, on one worker (tests/conftest.py).
WORKERS=${VASE_TEST_WORKERS:-2}
PARALLEL=()
[ "$WORKERS" != 0 ] && PARALLEL=(-n "$WORKERS" --dist loadgroup)
# --durations: every run reports its slowest tests, so CI time is measured, not guessed.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"
