"""benchmarks/routing.py end to end: two VaSE workers behind SGLang's gateway (smg), cache-aware
vs round-robin routing (slow: four server starts and two gateways; not in CI).

    pytest -m slow tests/test_benchmarks_routing.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_routing_small_run(tiny_model, tmp_path):
    requests = 16
    cmd = [sys.executable, str(REPO / "benchmarks" / "routing.py"), "--model-path", tiny_model,
           "--requests", str(requests), "--concurrency", "4", "--output-len", "64",
           "--budget", "32", "--window", "8", "--system-prompts", "4", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, timeout=3000)
    result = json.loads((tmp_path / "routing.json").read_text())
    assert (tmp_path / "routing.png").stat().st_size > 0
    arms = {a["routing"]: a for a in result["arms"]}
    assert set(arms) == {"cache_aware", "round_robin"}
    for arm in arms.values():
        assert arm["requests"] == requests
        assert arm["evicted_tokens"] > 0  # every request outgrew budget + window
        assert sum(w["requests"] for w in arm["workers"]) == requests
    # Four system prompts over two workers: round robin spreads each prompt over both
    # workers (each pays its prefill once per worker), cache-aware keeps each on one.
    assert arms["cache_aware"]["prefix_hit_rate"] > arms["round_robin"]["prefix_hit_rate"]
