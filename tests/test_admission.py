"""Compression-aware admission on a real server: with eviction on, a request is charged
prompt + min(max_new_tokens, budget + window), so the same pool runs more requests at once."""

import re

from servers import Server

POOL, BUDGET, WINDOW, N, MAX_NEW = 1024, 64, 16, 8, 300


def _peak_running(log: str) -> int:
    return max(int(m) for m in re.findall(r"Decode batch.*?#running-req: (\d+)", log))


def _run(model, args):
    common = ["--dtype", "float32", "--decode-log-interval", "1", *args]
    with Server(model, common, max_total_tokens=POOL) as server:
        out = server.post("/generate", {
            "text": [f"Request number {i}: the quick brown fox" for i in range(N)],
            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})
        server.wait_idle_checked()
        return out, _peak_running(server.output())


def test_eviction_admits_more_requests_on_the_same_pool(tiny_model_fp32):
    stock_out, stock_peak = _run(tiny_model_fp32, [])
    vase_out, vase_peak = _run(tiny_model_fp32, ["--kv-evict-policy", "vase-attnv",
                                                 "--kv-evict-budget", str(BUDGET),
                                                 "--kv-evict-window", str(WINDOW)])
    assert all(len(o["output_ids"]) == MAX_NEW for o in stock_out + vase_out)
    # Stock reserves ~prompt + 300 per request: at most 3 fit in 1024 slots.
    assert stock_peak <= POOL // MAX_NEW
    # Capped at prompt + 80 each, all 8 run together.
    assert vase_peak == N, (stock_peak, vase_peak)
