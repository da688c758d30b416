#!/usr/bin/env bash
# Set up (once) and run the test suite: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# --durations: every run reports its slowest tests, so CI time is measured, not guessed.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
