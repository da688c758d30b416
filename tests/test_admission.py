"""Compression-aware admission on a real server. With eviction on, a request is charged its
prompt + min(max_new_tokens, budget + window / 2 + 2) (the middle of its cache's cycle), so the
same pool runs several times more requests at once; when the next decode step does not fit,
requests over budget are evicted early instead of retracted. Requests with eviction turned
off (custom_params.kv_evict = false) keep SGLang's stock charge, on the same server and pool."""

import re

import pytest
import torch

from servers import RADIX_OFF, RADIX_OFF_POOL, Server
from vase_sglang.pool_ring import slots_per_request

POOL, BUDGET, WINDOW, N, MAX_NEW = 1024, 64, 16, 16, 240
# Stock admits POOL // (prompt + MAX_NEW) = 4 requests at once: 6 queued show the cap.
N_STOCK = 6
VASE = ["--kv-evict-policy", "vase-attnv", "--kv-evict-budget", str(BUDGET),
        "--kv-evict-window", str(WINDOW)]


# This module's server holds the query rings in the pool (--kv-evict-ring pool): each request
# is charged its ring's slots too (the tiny model's 4 query heads over 2 KV heads, fp32: 2 cells
# a window position). The shared radix-off server holds them beside its pool (auto).
RING = slots_per_request(WINDOW, 4, 32, torch.float32, 2, 4)
# ...on a pool a little smaller, so that the requests it admits with their rings are still
# short of slots at their cycles' top, as below.
RING_POOL = POOL - 40


def _peak_running(log: str) -> int:
    return max(int(m) for m in re.findall(r"Decode batch.*?#running-req: (\d+)", log))


@pytest.fixture(scope="module")
def server(tiny_model_fp32):
    flags = ["--dtype", "float32", "--decode-log-interval", "1", *VASE, "--kv-evict-ring", "pool"]
    with Server(tiny_model_fp32, flags, max_total_tokens=RING_POOL) as server:
        yield server


def _run(server, n=N, kv_evict=None):
    """n requests at once; their outputs and the log lines they produced."""
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    if kv_evict is not None:
        sampling["custom_params"] = {"kv_evict": kv_evict}
    before = len(server.output())
    out = server.post("/generate", {
        "text": [f"Request number {i}: the quick brown fox" for i in range(n)],
        "sampling_params": sampling})
    server.wait_idle_checked()  # SGLang's idle leak check (strict memory checks run too)
    return out, server.output()[before:]


def _check_vase(out, log, radix=True, ring=0, pool=POOL):
    assert all(len(o["output_ids"]) == MAX_NEW for o in out)
    prompt = out[0]["meta_info"]["prompt_tokens"]
    admitted = min(N, pool // (prompt + BUDGET + WINDOW // 2 + 2 + ring))
    peak = _peak_running(log)
    assert peak >= admitted, (peak, admitted)
    assert "Retract requests" not in log
    if radix:
        # In phase at their cycle's top (prompt + budget + window each) the admitted requests
        # do not fit, so the pool forces early evictions. Regular rounds drop exactly
        # `window` tokens; an early one drops fewer. (Without the radix cache the prompt is
        # private and evicted too, so the cycle's top is budget + window: no shortage.)
        assert admitted * (prompt + BUDGET + WINDOW + ring) > pool
        evicted = [o["meta_info"]["kv_evicted_tokens"] for o in out]
        assert any(e % WINDOW for e in evicted), evicted
    return peak


def test_eviction_admits_more_requests_on_the_same_pool(server):
    vase_out, vase_log = _run(server)
    stock_out, stock_log = _run(server, N_STOCK, kv_evict=False)
    assert all(len(o["output_ids"]) == MAX_NEW for o in stock_out)
    assert all(o["meta_info"]["kv_evicted_tokens"] == 0 for o in stock_out)
    stock_peak = _peak_running(stock_log)
    # Stock reserves ~prompt + 240 per request: at most 4 fit in 1024 slots.
    assert stock_peak <= RING_POOL // MAX_NEW < N_STOCK
    vase_peak = _check_vase(vase_out, vase_log, ring=RING, pool=RING_POOL)
    assert RING == WINDOW and "query ring: 16 pool slots per request" in server.output()
    assert vase_peak >= 2.5 * stock_peak, (stock_peak, vase_peak)


def test_admission_without_radix_cache(radix_off_server):
    # Radix off + ignore_eos is SGLang's separate add_one_req_ignore_eos admission path, and
    # the prompt is private (evicted too). The shared radix-off server (conftest.py) has this
    # module's settings.
    assert (RADIX_OFF_POOL, RADIX_OFF) == (POOL, {"policy": "vase-attnv", "budget": BUDGET,
                                                  "window": WINDOW})
    out, log = _run(radix_off_server)
    _check_vase(out, log, radix=False)


# Issue 58's reproduction: 48 clients at once asking for a budget of 8 and a window of 4 on the
# shared radix-off server (vase-attnv, budget 64, window 16, a 1024-token pool, the query rings
# beside it: 19 rings of 16 slots, sized at the server's own charge). Admission charges each by
# its own budget, so more of them fit the pool than there are rings; those wait for a ring.
CLIENTS, SMALL = 48, {"budget": 8, "window": 4}


def _ring_count(log: str) -> int:
    m = re.search(r"VaSE query ring beside the --max-total-tokens pool: reserving [0-9.]+ MiB "
                  r"\((\d+) slots", log)
    return int(m.group(1)) // RING


def test_requests_below_the_servers_budget_wait_for_a_ring(radix_off_server):
    from concurrent.futures import ThreadPoolExecutor

    server = radix_off_server
    rings = _ring_count(server.output())
    assert rings == 19

    def client(i):
        return server.post_status("/generate", {
            "text": f"Client {i} asks: the quick brown fox jumps over the dog",
            "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True,
                                "custom_params": {"kv_evict": SMALL}}}, timeout=600)

    before = len(server.output())
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(client, range(CLIENTS)))
    server.wait_idle_checked()
    log = server.output()[before:]
    assert [status for status, _ in answers] == [200] * CLIENTS, [
        body for status, body in answers if status != 200][:1]
    assert all(len(body["output_ids"]) == 300 and body["meta_info"]["kv_evicted_tokens"] > 0
               for _, body in answers)
    # Every ring in use at once, no more (the pool alone would admit 21).
    assert _peak_running(log) == rings, _peak_running(log)
    assert "query ring" not in log and "query-ring" not in log


def _peak_tokens(log: str) -> int:
    return max(int(m) for m in re.findall(r"Decode batch.*?#token: (\d+)", log))


def test_a_request_that_cannot_reach_its_budget_holds_no_ring(server, tokenizer):
    """With the radix cache on the tree owns the prompt: a long prompt with fewer new tokens
    than the budget never reaches it (nothing is evicted), so it holds no ring and is charged
    none: the pool holds its prompt and outputs only. A request with more new tokens than the
    budget does hold one (RING slots beside its tokens)."""
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]
    assert len(prompt) > 2 * BUDGET

    def alone(max_new):
        before = len(server.output())
        out = server.generate(input_ids=prompt, max_new_tokens=max_new,
                              sampling_params={"ignore_eos": True})
        server.wait_idle_checked()
        return out, _peak_tokens(server.output()[before:])

    short, short_peak = alone(BUDGET - 8)
    assert short["meta_info"]["kv_evicted_tokens"] == 0
    assert short_peak <= len(prompt) + BUDGET - 8, (short_peak, len(prompt))
    long, long_peak = alone(3 * BUDGET)
    assert long["meta_info"]["kv_evicted_tokens"] > 0
    assert long_peak >= len(prompt) + BUDGET + RING, (long_peak, len(prompt))


@pytest.mark.parametrize("fixture", ["server", "radix_off_server"])
def test_the_rings_slot_table_is_counted_before_the_pool_is_sized(request, fixture):
    """The table of every request row's ring slots (int64, on the device) is reserved with the
    other buffers beside the pool, for at least as many rows as the request table gets: in
    the pool (pages of the pool) and beside it (the storage's free list too)."""
    log = request.getfixturevalue(fixture).output()
    reserved = re.search(r"VaSE query-ring slot table: reserving [0-9.]+ MiB \(at most (\d+) "
                         r"request rows x (\d+) slots, int64", log)
    built = re.search(r"slot table \[(\d+), (\d+)\]", log)
    assert reserved and built, log[-3000:]
    assert int(reserved.group(1)) >= int(built.group(1)) > 1
    assert int(reserved.group(2)) == int(built.group(2)) == RING
