#!/usr/bin/env bash
# Set up (once) and run the test suite: bash scripts/test.sh [pytest args]
#   VASE_TEST_WORKERS=N  pytest-xdist workers (default 2; 0 runs in this process, as plain pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two workers: most of a server test's time is one process importing SGLang or waiting on
# another, so a 2-core machine runs two such tests side by side. --dist loadgroup keeps a module,
# and modules sharing a server, on one worker (tests/conftest.py).
WORKERS=${VASE_TEST_WORKERS:-2}
PARALLEL=()
[ "$WORKERS" != 0 ] && PARALLEL=(-n "$WORKERS" --dist loadgroup)
# --durations: every run reports its slowest tests, so CI time is measured, not guessed.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"
