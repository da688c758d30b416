"""Smoke test of benchmarks/kernels.py: the eviction-step benchmark runs and writes its outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernels.py"


def _env():
    env = dict(os.environ)
    # conftest.py turns the Triton interpreter on for the kernel tests; the benchmark must time
    # the real backends (it sets the interpreter itself for --check on CPU).
    env.pop("TRITON_INTERPRET", None)
    env.pop("VASE_KERNELS", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(*args, timeout=120):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_quick_run_writes_json_rows_and_plot(tmp_path):
    out = tmp_path / "k.json"
    proc = _run("--quick", "--out", str(out))
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows, "no rows"
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok, f"no configuration ran: {[(r['status'], r['reason']) for r in rows]}"
    for r in ok:
        assert set(r["ms"]) == {"gather", "select", "compact", "total"}
        assert all(v > 0 for v in r["ms"].values()), r["ms"]
        assert r["gb_per_s"] > 0 and r["bytes"]["total"] > 0
    assert report["machine"]["torch"] and report["machine"]["device_name"]
    assert "--quick" in report["command"]
    assert (tmp_path / "k.png").stat().st_size > 0
    assert "total ms" in proc.stdout  # the printed table


def test_check_mode_passes_on_a_tiny_configuration(tmp_path):
    out = tmp_path / "c.json"
    _run("--check-only", "--policies", "streaming,vase-dkv", "--requests", "1",
         "--budgets", "128", "--check-layers", "1", "--out", str(out))
    checks = json.loads(out.read_text())["check"]
    assert [c["policy"] for c in checks] == ["streaming", "vase-dkv"]
    assert all(c["ok"] and c["compacted_pool_bit_equal"] for c in checks), checks
