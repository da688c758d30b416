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
