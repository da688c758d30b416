#!/usr/bin/env bash
# Set up (once) and run the test suite: bash scripts/test.sh [pytest args]
#   VASE_TEST_WORKERS=N  pytest-xdist workers (default 2; 0 runs in this process, as plain pytest)
#   VASE_LINT=0          skip the lint that runs first (CI runs it: a violation fails the run)
# Lint alone, after one bootstrap: .venv/bin/ruff check .   (rules: [tool.ruff] in pyproject.toml;
# `.venv/bin/ruff check --fix FILE` applies the safe fixes; the code is not run through ruff format)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if [ "${VASE_LINT:-1}" != 0 ]; then
  .venv/bin/ruff check . || { echo "[test] lint failed: .venv/bin/ruff check . (VASE_LINT=0 skips it)" >&2; exit 1; }
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two workers: about 1.5x faster than one process on a 2-core machine (docs/testing.md).
# --dist loadgroup keeps a module, and modules sharing a server, on one worker (tests/conftest.py).
WORKERS=${VASE_TEST_WORKERS:-2}
PARALLEL=()
[ "$WORKERS" != 0 ] && PARALLEL=(-n "$WORKERS" --dist loadgroup)
# --durations: every run reports its slowest tests, so CI time is measured, not guessed.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"
