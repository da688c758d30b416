"""The frontend-language programs of examples/ (sglang.lang, RuntimeEndpoint) against a real
VaSE server: they run as users copy them (the CLI scripts), results have the promised shape,
the forked branches reuse the prompt from the radix cache, and every request really evicted."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servers import VASE_ATTNV

ROOT = Path(__file__).resolve().parents[1]
BUDGET, WINDOW = 24, 4


def _load_reasoning():
    spec = importlib.util.spec_from_file_location("reasoning", ROOT / "examples" / "reasoning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(vase_server):
    """The shared vase-attnv server (conftest.py). Seeded sampling (--random-seed 0):
    sglang.lang cannot send per-request seeds, and forked branches reach the scheduler in
    thread order, so this pins the server's generator, not every batch; the asserts below hold
    for any sample."""
    assert (VASE_ATTNV["budget"], VASE_ATTNV["window"]) == (BUDGET, WINDOW)
    return vase_server


def evicted_for(generated: int) -> int:
    """Tokens evicted per (layer, KV head) from a request that generated `generated` tokens
    after a prompt the radix tree owns (as tests/test_metrics.py counts rounds)."""
    rounds = 0 if generated <= BUDGET + WINDOW + 1 else 1 + (generated - BUDGET - WINDOW - 2) // WINDOW
    return rounds * WINDOW


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
    # The radix tree owns the prompt, so only generated tokens are private: the first eviction
    # runs before the step after budget + window of them, then one every window tokens.
    assert out["kv_evicted_tokens"] == evicted_for(n)
    assert "answer" in out and "answer_source" in out  # random weights: the value is arbitrary


def test_self_consistency_cli(server):
    k, n = 3, 60
    out = run_example("self_consistency.py", "--url", server.url, "-k", str(k), "--question",
                      "A farmer has 12 cows and buys 3 times as many sheep. How many animals?",
                      "--max-tokens", str(n), "--ignore-eos")
    branches = out["branches"]
    assert out["k"] == k and len(branches) == k
    for b in branches:
        # --ignore-eos: every branch runs to max_tokens, a sampled "<|im_end|>" included
        assert b["completion_tokens"] == n and b["finish_reason"]["type"] == "length", b
        # the fork committed the prompt first: each branch found (almost) all of it cached
        assert b["cached_tokens"] >= b["prompt_tokens"] - 8 > 0, b
        assert b["kv_evicted_tokens"] == evicted_for(n), b
    # temperature 0.6 sampling: branches are not copies of one another
    assert len({b["text"] for b in branches}) > 1
    # the vote counts every extracted answer, and the winner is the most frequent (the first
    # seen among ties), or None when no branch gave one (random weights: either can happen)
    answers = [b["answer"] for b in branches if b["answer"] is not None]
    assert out["votes"] == dict(collections.Counter(answers))
    top = max(out["votes"].values(), default=None)
    assert out["answer"] == next((a for a in answers if out["votes"][a] == top), None)
    server.wait_idle_checked()  # forked, evicted branches leave no leaked KV slots


def test_majority_vote():
    mod = _load_reasoning()
    assert mod.majority_vote(["3", None, "4", "4", "3"]) == ("3", {"3": 2, "4": 2})
    assert mod.majority_vote(["5", "6", "6"]) == ("6", {"5": 1, "6": 2})
    assert mod.majority_vote([None, None]) == (None, {})


def test_programs_send_the_sampling_they_are_given():
    """The cause of a flaky self-consistency run (a branch ended after 6 of 60 tokens despite
    --ignore-eos). Two faults, both seen in the requests: (1) SglFunction.run has its own
    temperature / top_p / ignore_eos keywords, so those arguments never reached the programs,
    whose gen() then sent their defaults (ignore_eos False, and solve --temperature decoded
    greedily); (2) sglang.lang adds the chat template's end-of-turn strings to every gen, and
    SGLang matches stop strings on the decoded text even with ignore_eos. sglang.lang's real
    interpreter runs the programs here against a backend that records the requests (the
    server is not what is tested)."""
    from sglang.lang.backend.base_backend import BaseBackend
    from sglang.lang.chat_template import get_chat_template

    mod = _load_reasoning()

    class Recorder(BaseBackend):
        def __init__(self):
            super().__init__()
            self.chat_template = get_chat_template("qwen")
            self.sent = []

        def generate(self, s, sampling_params):
            p = sampling_params
            self.sent.append((list(p.stop), p.ignore_eos, p.temperature, p.top_p, p.max_new_tokens))
            return "Final answer: 7", {"completion_tokens": 1}

    backend = Recorder()
    assert "<|im_end|>" in backend.chat_template.stop_str
    mod.run_solve(backend, "q", max_tokens=5, temperature=0.7, top_p=0.9, ignore_eos=True)
    assert backend.sent == [([], True, 0.7, 0.9, 5)]
    mod.run_self_consistency(backend, "q", k=3, max_tokens=6, temperature=0.5, top_p=0.8,
                             ignore_eos=True)
    assert backend.sent[1:] == [([], True, 0.5, 0.8, 6)] * 3
    # without ignore_eos the turn ends at the template's marker (the caller's backend kept its
    # template), and the programs' own defaults apply
    mod.run_solve(backend, "q", max_tokens=5)
    mod.run_self_consistency(backend, "q", k=2, max_tokens=5)
    assert backend.sent[4:] == [(["<|im_end|>"], False, 0.0, 1.0, 5)] + [(["<|im_end|>"], False, 0.6, 0.95, 5)] * 2
