"""Prometheus metrics of the eviction step on a real server started with --enable-metrics (the
shared snapkv server, conftest.py): scraped from /metrics after evicting requests, they match
the per-response counts."""

import re
import urllib.request

import pytest

from servers import SNAPKV

BUDGET, WINDOW = 32, 8
N = 100  # private tokens reach budget + window at output 41, then every 8: 8 rounds of 8 tokens
ROUNDS = 1 + (N - BUDGET - WINDOW - 2) // WINDOW


def _scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}  # "name" or "name[le]" -> value summed over the other labels
    for line in text.splitlines():
        m = re.match(r"^(vase:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            le = re.search(r'le="([^"]+)"', m.group(2) or "")
            key = m.group(1) + (f"[{le.group(1)}]" if le else "")
            values[key] = values.get(key, 0.0) + float(m.group(3))
    return values


@pytest.fixture(scope="module")
def server(snapkv_server):
    assert (SNAPKV["budget"], SNAPKV["window"]) == (BUDGET, WINDOW)
    return snapkv_server


def test_metrics_count_what_responses_report(server):
    before = _scrape(server)
    out = server.post("/generate", {
        "text": [f"Request {i}: the quick brown fox" for i in range(3)],
        "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}})
    # One request with eviction turned off adds nothing.
    off = server.generate("no eviction here", max_new_tokens=N,
                          sampling_params={"ignore_eos": True, "custom_params": {"kv_evict": False}})
    after = _scrape(server)
    evicted = [o["meta_info"]["kv_evicted_tokens"] for o in out]
    assert evicted == [ROUNDS * WINDOW] * 3 and off["meta_info"]["kv_evicted_tokens"] == 0

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vase:evictions_total") == 3 * ROUNDS
    assert delta("vase:evicted_tokens_total") == sum(evicted)
    # Page size 1: one slot per evicted token (the slot holds every layer and head).
    assert delta("vase:freed_slots_total") == sum(evicted)
    # The three requests run in one batch, so they are evicted in the same steps; the
    # histogram counts steps, each with a positive duration.
    steps = delta("vase:eviction_seconds_count")
    assert ROUNDS <= steps <= 3 * ROUNDS
    assert delta("vase:eviction_seconds_sum") > 0
    assert delta("vase:eviction_seconds_bucket[+Inf]") == steps
    # Device time per step: on CPU the ops are synchronous, so every step is read at once.
    assert delta("vase:eviction_device_seconds_count") == steps
    assert 0 < delta("vase:eviction_device_seconds_sum") <= delta("vase:eviction_seconds_sum")
    # SGLang's own scheduler metrics are still exported next to ours.
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert b"sglang:num_running_reqs" in r.read()
