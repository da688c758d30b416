"""Exactness against stock SGLang: real servers on CPU, greedy decoding.

- eviction configured but its budget never reached: token-identical to stock;
- a policy that keeps every token but shuffles them per (layer, KV head) at every step:
  token-identical to stock, which proves the per-head gather and the row bookkeeping.
"""

import os

import pytest

from servers import Server

PROMPTS = [
    "Hello world, the capital of France is",
    "KV cache eviction policy radix tree prefix sharing memory pool token " * 3,
    "0 1 2 3 4 5 6 7 8 9 10",
]
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _greedy(server, max_new_tokens):
    return [server.generate(p, max_new_tokens=max_new_tokens)["output_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def stock_outputs(tiny_model_fp32):
    with Server(tiny_model_fp32, ["--dtype", "float32"]) as server:
        out = {n: _greedy(server, n) for n in (60, 160)}
        server.wait_idle_checked()
    return out


def test_budget_never_reached_is_identical_to_stock(tiny_model_fp32, stock_outputs):
    args = ["--dtype", "float32", "--kv-evict-policy", "vase-attnv", "--kv-evict-budget", "256",
            "--kv-evict-window", "32"]
    with Server(tiny_model_fp32, args) as server:
        outputs = _greedy(server, 160)
        meta = server.generate(PROMPTS[0], max_new_tokens=160)["meta_info"]
        server.wait_idle_checked()
    assert outputs == stock_outputs[160]
    assert meta["kv_evicted_tokens"] == 0


def test_per_head_permutation_every_step_is_identical_to_stock(tiny_model_fp32, stock_outputs):
    # budget 16 + window 8: from the 24th private token on, every decode step shuffles the
    # cache of every (layer, head) again.
    args = ["--dtype", "float32", "--kv-evict-policy", "test-permute", "--kv-evict-budget", "16",
            "--kv-evict-window", "8", "--kv-evict-sinks", "0"]
    env = {"VASE_KV_EVICT_PLUGINS": "permute_policy", "PYTHONPATH": TESTS_DIR}
    with Server(tiny_model_fp32, args, env=env) as server:
        outputs = _greedy(server, 160)
        server.wait_idle_checked()
        log = server.output()
    assert "VaSE eviction on" in log
    assert outputs == stock_outputs[160]
