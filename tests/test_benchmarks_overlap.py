"""benchmarks/overlap.py, small: eviction under the overlap scheduler (SGLang's default) gives the
same greedy outputs as with --disable-overlap-schedule, with strict memory checks on. The
throughput figures are only printed (noisy on a shared 2-core machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overlap_on_and_off_give_identical_outputs(tmp_path, tiny_model_fp32):
    out = tmp_path / "overlap.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overlap.py"), "--model-path", tiny_model_fp32,
         "--requests", "16", "--max-new-tokens", "64", "--concurrency", "8", "--strict",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    report = json.loads(out.read_text())
    assert report["identical_outputs"] and not report["mismatched_requests"]
    modes = report["modes"]
    assert set(modes) == {"overlap", "no-overlap"}
    # Both runs evicted (budget 32 + window 8 < 64 output tokens), and the same amount.
    assert modes["overlap"]["kv_evicted_tokens"] == modes["no-overlap"]["kv_evicted_tokens"] > 0
    assert all(m["output_tokens"] == 16 * 64 and m["tokens_per_s"] > 0 for m in modes.values())
