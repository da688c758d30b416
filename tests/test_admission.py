"""Compression-aware admission on a real server. With eviction on, a request is charged its
prompt + min(max_new_tokens, budget + window / 2 + 2) (the middle of its cache's cycle), so the
same pool runs several times more requests at once; when the next decode step does not fit,
requests over budget are evicted early instead of retracted."""

import re

import pytest
from servers import Server

POOL, BUDGET, WINDOW, N, MAX_NEW = 1024, 64, 16, 16, 240
VASE = ["--kv-evict-policy", "vase-attnv", "--kv-evict-budget", str(BUDGET),
        "--kv-evict-window", str(WINDOW)]


def _peak_running(log: str) -> int:
    return max(int(m) for m in re.findall(r"Decode batch.*?#running-req: (\d+)", log))


def _run(model, args):
    common = ["--dtype", "float32", "--decode-log-interval", "1", *args]
    with Server(model, common, max_total_tokens=POOL) as server:
        out = server.post("/generate", {
            "text": [f"Request number {i}: the quick brown fox" for i in range(N)],
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
        server.wait_idle_checked()  # SGLang's idle leak check (strict memory checks run too)
        return out, server.output()


def _check_vase(out, log, radix=True):
    assert all(len(o["output_ids"]) == MAX_NEW for o in out)
    prompt = out[0]["meta_info"]["prompt_tokens"]
    admitted = min(N, POOL // (prompt + BUDGET + WINDOW // 2 + 2))
    peak = _peak_running(log)
    assert peak >= admitted, (peak, admitted)
    assert "Retract requests" not in log
    if radix:
        # In phase at their cycle's top (prompt + budget + window each) the admitted requests
        # do not fit, so the pool forces early evictions. Regular rounds drop exactly
        # `window` tokens; an early one drops fewer. (Without the radix cache the prompt is
        # private and evicted too, so the cycle's top is budget + window: no shortage.)
        assert admitted * (prompt + BUDGET + WINDOW) > POOL
        evicted = [o["meta_info"]["kv_evicted_tokens"] for o in out]
        assert any(e % WINDOW for e in evicted), evicted
    return peak


def test_eviction_admits_more_requests_on_the_same_pool(tiny_model_fp32):
    stock_out, stock_log = _run(tiny_model_fp32, [])
    vase_out, vase_log = _run(tiny_model_fp32, VASE)
    assert all(len(o["output_ids"]) == MAX_NEW for o in stock_out)
    stock_peak = _peak_running(stock_log)
    # Stock reserves ~prompt + 240 per request: at most 4 fit in 1024 slots.
    assert stock_peak <= POOL // MAX_NEW
    vase_peak = _check_vase(vase_out, vase_log)
    assert vase_peak >= 2.5 * stock_peak, (stock_peak, vase_peak)


def test_admission_without_radix_cache(tiny_model_fp32):
    # Radix off + ignore_eos is SGLang's separate add_one_req_ignore_eos admission path, and
    # the prompt is private (evicted too).
    out, log = _run(tiny_model_fp32, VASE + ["--disable-radix-cache"])
    _check_vase(out, log, radix=False)
