#!/usr/bin/env bash
# The GPU check: one call of at most 8 minutes on one CUDA GPU whose image has torch and Triton
# (no SGLang, no network). Writes one JSON; see vase_sglang/serving/gpu_check.py and docs/gpu.md.
#   bash scripts/gpu_check.sh [OUT.json] [more gpu_check arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu_check.json}
[ $# -gt 0 ] && shift
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET VASE_KERNELS
# The script keeps to --budget-s (450 s); timeout is the backstop. The JSON is rewritten after
# every section, so a run stopped here still leaves what it measured.
exec timeout --kill-after=10 480 "$PY" -m vase_sglang.gpu_check --out "$out" "$@"
