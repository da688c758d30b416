"""Exactness against stock SGLang: real servers on CPU, greedy decoding.

- eviction configured but a request's budget never reached: token-identical to stock;
- a policy that keeps every token but shuffles them per (layer, KV head) at every step:
  token-identical to stock, which proves the per-head gather and the row bookkeeping.
"""

import re
import urllib.request

import pytest

PROMPTS = [
    "Hello world, the capital of France is",
    "KV cache eviction policy radix tree prefix sharing memory pool token " * 3,
    "0 1 2 3 4 5 6 7 8 9 10",
]
N = 160  # past every eviction trigger below, short of the budget-256 request's


def _greedy(server, kv_evict=None):
    """The three prompts in one batch, greedy: (output ids, tokens evicted) per prompt."""
    params = {"max_new_tokens": N, "temperature": 0}
    if kv_evict is not None:
        params["custom_params"] = {"kv_evict": kv_evict}
    out = server.post("/generate", {"text": PROMPTS, "sampling_params": params})
    return [o["output_ids"] for o in out], [o["meta_info"].get("kv_evicted_tokens") for o in out]


@pytest.fixture(scope="module")
def stock_outputs(stock_server):
    """From the shared stock server (conftest.py)."""
    outputs, _ = _greedy(stock_server)
    stock_server.wait_idle_checked()
    return outputs


def test_budget_never_reached_is_identical_to_stock(snapkv_server, stock_outputs):
    """On the shared evicting server (conftest.py), requests asking for vase-attnv at budget
    256: the eviction machinery runs for the server (query capture, capped admission, the
    eviction step), but these requests never reach their budget."""
    outputs, evicted = _greedy(snapkv_server, {"policy": "vase-attnv", "budget": 256})
    snapkv_server.wait_idle_checked()
    assert outputs == stock_outputs
    assert evicted == [0, 0, 0]


def _eviction_rounds(server) -> float:
    """vase:evictions_total (request-rounds, dropped tokens or not) from /metrics."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(r"^vase:evictions_total(?:\{[^}]*\})? (\S+)$", text,
                                              re.MULTILINE))


def test_per_head_permutation_every_step_is_identical_to_stock(snapkv_server, stock_outputs):
    """Requests asking for `test-permute` (loaded into the shared snapkv server, conftest.py)
    at budget 16 + window 8, sinks 0: from the 24th private token on, every decode step
    shuffles the cache of every (layer, head) again."""
    before = _eviction_rounds(snapkv_server)
    outputs, evicted = _greedy(snapkv_server, {"policy": "test-permute", "budget": 16,
                                               "window": 8, "sinks": 0})
    snapkv_server.wait_idle_checked()
    assert outputs == stock_outputs
    assert evicted == [0, 0, 0]  # every token kept: shuffled, never dropped
    # The policy ran at every step from the one after 16 + 8 private (generated) tokens.
    rounds = _eviction_rounds(snapkv_server) - before
    assert rounds == len(PROMPTS) * (N - (16 + 8) - 1), rounds
