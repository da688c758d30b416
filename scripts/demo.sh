#!/usr/bin/env bash
# Set up (once), then serve a model with VaSE eviction and answer one request:
#   bash scripts/demo.sh [--tiny | --model-path DIR] [--kv-evict-policy P] [--kv-evict-budget T] ...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python scripts/demo.py "$@"
