"""benchmarks/concurrency_scaling.py end to end (slow: three server starts; not in CI).

    pytest -m slow tests/test_benchmarks_concurrency.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_concurrency_scaling_small_run(tiny_model, tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "concurrency_scaling.py"),
           "--model-path", tiny_model, "--max-total-tokens", "1024", "--input-len", "32",
           "--output-len", "160", "--num-prompts", "8", "--budget", "64", "--window", "16",
           "--concurrency", "8", "--out", str(tmp_path), "--quiet-client"]
    subprocess.run(cmd, check=True, timeout=3000)
    result = json.loads((tmp_path / "concurrency_scaling.json").read_text())
    assert (tmp_path / "concurrency_scaling.png").stat().st_size > 0
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"full@N", "vase-attnv@N", "ceiling"}
    assert all(r["completed"] == 8 and r["total_output_tokens"] == 8 * 160 for r in rows.values())
    # Stock charges 32 + 160 per request on the 1024 pool; VaSE 32 + 64 + 8 + 2.
    assert rows["full@N"]["peak_running"] <= 1024 // 192
    assert rows["vase-attnv@N"]["peak_running"] >= 8
    assert rows["vase-attnv@N"]["eviction_seconds"] > 0
    assert rows["full@N"]["eviction_seconds"] == 0
    assert rows["vase-attnv@N"]["retractions"] == 0
