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

echo "[bootstrap] creating $VENV ($FLAVOR); a cold install takes about 3 minutes" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG=$(mktemp); trap 'rm -f "$LOG"' EXIT
pip_install() {
  # pip's output goes to a log. A failure prints all of it. On success only what the user
  # needs is shown: on CPU, sglang's CUDA-only dependencies are skipped on purpose, and pip's
  # resolver lists each of them as "sglang 0.5.23 requires X, which is not installed" under an
  # ERROR banner although nothing failed; those lines are summed up in one line instead.
  if ! "$VENV/bin/python" -m pip install --no-cache-dir --progress-bar off -q "$@" >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "[bootstrap] pip install $* failed" >&2
    exit 1
  fi
  local skipped conflicts
  skipped=$(grep -c "^sglang [0-9.]* requires .*, which is not installed" "$LOG" || true)
  conflicts=$(grep "^sglang [0-9.]* requires .*, but you have" "$LOG" | sed -E 's/^sglang [0-9.]* requires ([^,]*), but you have (.*) which is incompatible\./\2 (sglang pins \1)/' || true)
  # also dropped: setuptools' generic editable-install notice, and this machine's pip config
  # naming local mirror folders that do not exist
  awk '/BuildBackendWarning: Editable installation/ {skip = 1}
       !skip && !/^sglang [0-9.]* requires / && !/^ERROR: pip.s dependency resolver does not currently take into account/ &&
       !/^WARNING: Location .file:.* is ignored/
       /with strategy, WheelFile/ {skip = 0}' "$LOG" >&2
  [ "$skipped" -gt 0 ] && echo "[bootstrap] CPU install: $skipped CUDA-only or optional sglang dependencies skipped on purpose (flashinfer, sgl-kernel, ...)" >&2
  [ -n "$conflicts" ] && echo "[bootstrap] versions differing from sglang's pins, fine for the CPU path: $(echo "$conflicts" | paste -sd ';' | sed 's/;/; /g')" >&2
  return 0
}
pip_install --upgrade pip setuptools wheel
if [ "$FLAVOR" = cpu ]; then
  pip_install torch==2.14.1
  pip_install --no-deps sglang==0.5.23
  pip_install -r requirements-cpu.txt
  # pyproject pins sglang with full deps; on CPU those CUDA-only deps must not be pulled in.
  pip_install --no-deps -e .
else
  pip_install -e ".[test]"
  # real models and data, listed in requirements-cpu.txt for the CPU path
  pip_install gguf accelerate==1.15.0 reasoning-gym==0.1.25 champ-dataset==1.0.0 smg==1.13.0
fi
"$VENV/bin/python" -c "import sglang, torch, vase_sglang, vase_sglang_patches; print('[bootstrap] sglang', sglang.__version__, 'torch', torch.__version__)" >&2
echo "$KEY" > "$STAMP"
