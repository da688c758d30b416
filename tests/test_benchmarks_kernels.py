"""benchmarks/kernels.py: it times the server's own eviction step (and refuses to run without
it), writes its outputs, and --check compares every Triton op and the step with torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    proc = _run("--quick", "--layers", "4", "--out", str(out))  # 4 of 36 layers: a smoke run
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert rows, "no rows"
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok, f"no configuration ran: {[(r['status'], r['reason']) for r in rows]}"
    for r in ok:
        assert set(r["ms"]) == {"total"} and r["ms"]["total"] > 0, r["ms"]
        assert r["step"] == "vase_sglang_patches.step.evict"
        assert len(r["samples_ms"]["total"]) == 2
        assert r["gb_per_s"] > 0 and r["bytes"]["total"] > 0
    assert report["machine"]["torch"] and report["machine"]["device_name"]
    assert "--quick" in report["command"]
    assert (tmp_path / "k.png").stat().st_size > 0
    assert "step ms" in proc.stdout  # the printed table


def test_check_mode_passes_on_a_tiny_configuration(tmp_path):
    out = tmp_path / "c.json"
    _run("--check-only", "--policies", "streaming,vase-dkv", "--requests", "1",
         "--budgets", "128", "--check-layers", "1", "--out", str(out))
    report = json.loads(out.read_text())
    checks = report["check"]
    assert [c["policy"] for c in checks] == ["streaming", "vase-dkv"]
    assert all(c["ok"] and c["compacted_pool_bit_equal"] for c in checks), checks
    # every op, the window-attention kernel included although neither policy scores with it
    kernels = report["check_kernels"]
    assert kernels["ok"], kernels
    assert set(kernels["max_abs_diff"]) == {"window_attention", "value_range", "cur_leverage"}


def test_the_timed_step_is_the_servers(tmp_path, monkeypatch):
    """Every timed call goes through evict of patches/step.py, and each one evicts (a step
    that frees nothing is an error, not a fast time)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module = kernels.load_runtime_module("step")
    assert Path(module.__file__).resolve() == (ROOT / "patches" / "step.py").resolve()
    real, freed = module.evict, []

    def counted(rt, batch, *args, **kwargs):
        freed.append(real(rt, batch, *args, **kwargs))
        return freed[-1]

    monkeypatch.setattr(module, "evict", counted)
    assert kernels.main(["--policies", "snapkv,streaming", "--budgets", "64", "--requests", "2",
                         "--window", "16", "--layers", "2", "--warmup", "1", "--repeats", "3",
                         "--no-plot", "--no-progress", "--out", str(tmp_path / "k.json")]) == 0
    assert freed == [2 * 16] * (2 * (1 + 3))  # B * R slots per step, 2 policies x 4 steps
    # a no-op step must not be timed
    monkeypatch.setattr(module, "evict", lambda rt, batch, *a, **k: 0)
    with pytest.raises(RuntimeError, match="freed 0 slots"):
        kernels.main(["--policies", "snapkv", "--budgets", "64", "--requests", "1", "--layers", "1",
                      "--window", "16", "--no-plot", "--no-progress", "--out", str(tmp_path / "x.json")])


def test_no_fallback_when_the_step_cannot_be_imported(tmp_path):
    code = ("import sys, runpy; sys.modules['vase_sglang_patches'] = None; "
            f"sys.argv = ['kernels.py', '--quick', '--out', {str(tmp_path / 'k.json')!r}]; "
            "runpy.run_path('benchmarks/kernels.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "vase_sglang_patches.runtime" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "k.json").exists()


def test_real_model_preset_and_a_window_that_follows_the_budget(tmp_path):
    """--model qwen2.5-0.5b sizes the pool as the served real model (24 layers, 14 / 2 heads,
    head_dim 64) and --window T/4 gives each budget its own window (R = T/4, kept T - R)."""
    out = tmp_path / "r.json"
    _run("--model", "qwen2.5-0.5b", "--window", "T/4", "--budgets", "64,128", "--requests", "1",
         "--layers", "2", "--dtype", "float32", "--warmup", "0", "--repeats", "1",
         "--no-plot", "--no-progress", "--out", str(out))
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert (settings["q_heads"], settings["kv_heads"], settings["head_dim"]) == (14, 2, 64)
    assert settings["window"] == "T/4"
    rows = {r["budget"]: r for r in report["rows"]}
    assert {t: (r["window"], r["kept"]) for t, r in rows.items()} == {64: (16, 48), 128: (32, 96)}
    for t, r in rows.items():
        assert r["status"] == "ok", r
        # compaction moves K and V of the kept tokens, read and written, in fp32
        assert r["bytes"]["compaction_read_write"] == 2 * 2 * 2 * 2 * (t - t // 4) * 64 * 4


def test_window_spec_is_checked():
    sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed
    from benchmarks import kernels as module

    assert module.window_for("T/4", 192) == 48 and module.window_for("16", 192) == 16
    assert module.window_for("T/8", 4) == 1
    for bad in ("0", "T/0", "T/x", "quarter", "-3"):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--window", bad, "--check-only"],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--window" in proc.stderr, (bad, proc.stderr)
