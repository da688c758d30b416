"""The frontend-language programs of examples/ (sglang.lang, RuntimeEndpoint) against a real
VaSE server: they run as users copy them (the CLI scripts), results have the promised shape,
the forked branches reuse the prompt from the radix cache, and every request really evicted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servers import Server

ROOT = Path(__file__).resolve().parents[1]
BUDGET, WINDOW = 32, 8


@pytest.fixture(scope="module")
def server(tiny_model):
    args = ["--kv-evict-policy", "vase-attnv", "--kv-evict-budget", str(BUDGET),
            "--kv-evict-window", str(WINDOW)]
    with Server(tiny_model, args=args, timeout=400) as s:  # slack for a busy machine
        yield s


def run_example(script: str, *args: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args, "--json"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_solve_cli(server):
    n = 80
    out = run_example("solve.py", "--url", server.url, "--question", "What is 17 + 25?",
                      "--max-tokens", str(n), "--ignore-eos")
    assert out["completion_tokens"] == n and out["text"]
    assert out["finish_reason"]["type"] == "length"
    # The private cache passed budget + window, so each (layer, KV head) lost tokens, yet the
    # request kept at least the budget: evicted < everything it ever held.
    assert 0 < out["kv_evicted_tokens"] <= out["prompt_tokens"] + n - BUDGET
    assert "answer" in out and "answer_source" in out  # random weights: the value is arbitrary


def test_self_consistency_cli(server):
    k, n = 3, 60
    out = run_example("self_consistency.py", "--url", server.url, "-k", str(k), "--question",
                      "A farmer has 12 cows and buys 3 times as many sheep. How many animals?",
                      "--max-tokens", str(n), "--ignore-eos")
    branches = out["branches"]
    assert out["k"] == k and len(branches) == k
    for b in branches:
        assert b["completion_tokens"] == n
        # the fork committed the prompt first: each branch found (almost) all of it cached
        assert b["cached_tokens"] >= b["prompt_tokens"] - 8 > 0, b
        assert b["kv_evicted_tokens"] > 0, b
    # temperature 0.6 sampling: branches are not copies of one another
    assert len({b["text"] for b in branches}) > 1
    answers = [b["answer"] for b in branches if b["answer"] is not None]
    assert sum(out["votes"].values()) == len(answers)
    if answers:
        assert out["votes"][out["answer"]] == max(out["votes"].values())
    server.wait_idle_checked()  # forked, evicted branches leave no leaked KV slots


def test_majority_vote():
    spec = importlib.util.spec_from_file_location("reasoning", ROOT / "examples" / "reasoning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.majority_vote(["3", None, "4", "4", "3"]) == ("3", {"3": 2, "4": 2})
    assert mod.majority_vote(["5", "6", "6"]) == ("6", {"5": 1, "6": 2})
    assert mod.majority_vote([None, None]) == (None, {})
