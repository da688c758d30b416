#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install everything the server and the tests need.
#   CPU machine (no nvidia-smi): torch 2.14.1, sglang 0.5.23 --no-deps, requirements-cpu.txt
#   CUDA machine:                pip install sglang==0.5.23 with its full dependencies
# Idempotent: a stamp file records what was installed; rerunning costs a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VASE_VENV:-.venv}
PY=${VASE_PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOR=cuda; else FLAVOR=cpu; fi
KEY="$FLAVOR $(cat requirements-cpu.txt pyproject.toml | sha256sum | cut -c1-16)"
STAMP="$VENV/.vase-installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then exit 0; fi

echo "[bootstrap] creating $VENV ($FLAVOR); a cold install takes about 2 minutes" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --no-cache-dir --progress-bar off -q)
"${PIP[@]}" --upgrade pip setuptools wheel
if [ "$FLAVOR" = cpu ]; then
  "${PIP[@]}" torch==2.14.1
  "${PIP[@]}" --no-deps sglang==0.5.23
  "${PIP[@]}" -r requirements-cpu.txt
  # pyproject pins sglang with full deps; on CPU those CUDA-only deps must not be pulled in.
  "${PIP[@]}" --no-deps -e .
else
  "${PIP[@]}" -e ".[test]"
  # real models and data, listed in requirements-cpu.txt for the CPU path
  "${PIP[@]}" gguf accelerate==1.15.0 reasoning-gym==0.1.25
fi
"$VENV/bin/python" -c "import sglang, torch, vase_sglang, vase_sglang_patches; print('[bootstrap] sglang', sglang.__version__, 'torch', torch.__version__)" >&2
echo "$KEY" > "$STAMP"
