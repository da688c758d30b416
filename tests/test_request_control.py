"""Per-request eviction control (`custom_params.kv_evict`) on real SGLang servers (tiny fp32
Qwen3, greedy): a request can turn eviction off or pick its own policy and settings, and gets
exactly what a server started with those settings gives; bad values are answered with HTTP 400
naming `kv_evict.<field>`, and the server keeps serving."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from servers import SNAPKV, VASE_ATTNV

PROMPT = "KV cache eviction policy radix tree prefix"
N = 120  # several evictions at budget 32 / window 8 and at budget 24 / window 4
SERVER = SNAPKV  # the shared evicting server (conftest.py): snapkv, budget 32, window 8
# Differs from the server in every field; window < the server's exercises the query ring read.
# The shared vase-attnv server (conftest.py) was started with these flags.
OWN = VASE_ATTNV


@pytest.fixture(scope="module")
def servers(snapkv_server, vase_server, stock_server):
    """The evicting server, the one started with OWN's flags and stock (shared, conftest.py)."""
    return {"evict": snapkv_server, "own": vase_server, "stock": stock_server}


def _gen(server, kv_evict=None, prompt=PROMPT, n=N):
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "sampling_seed": 77}
    if kv_evict is not None:
        params["custom_params"] = {"kv_evict": kv_evict}
    out = server.post("/generate", {"text": prompt, "sampling_params": params})
    # A server without eviction does not report the count.
    return out["output_ids"], out["meta_info"].get("kv_evicted_tokens", 0)


def test_kv_evict_false_equals_stock(servers):
    stock, evicted0 = _gen(servers["stock"])
    default, evicted = _gen(servers["evict"])
    off, evicted_off = _gen(servers["evict"], False)
    assert evicted0 == 0 and evicted > 0, "the server's own settings evict"
    assert default != stock  # so the comparison below can fail
    assert off == stock and evicted_off == 0
    # "policy": "full" is the other spelling of off; true means the server's settings.
    assert _gen(servers["evict"], {"policy": "full"}) == (stock, 0)
    assert _gen(servers["evict"], True) == (default, evicted)


def test_own_settings_equal_a_server_started_with_them(servers):
    ref = _gen(servers["own"])
    mine = _gen(servers["evict"], OWN)
    assert ref[1] > 0 and mine == ref
    # A budget-only override keeps the server's policy, window and seed.
    budget_only = _gen(servers["evict"], {"budget": 24})
    assert budget_only != _gen(servers["evict"]) and budget_only[1] > 0


def test_mixed_settings_in_one_batch(servers):
    """Requests with different settings run in the same decode batches (grouped per config)
    and each gets its solo output."""
    settings = [None, False, OWN, {"policy": "streaming", "budget": 40}, {"budget": 24}]
    alone = [_gen(servers["evict"], s) for s in settings]
    results = [None] * len(settings)

    def run(i):
        results[i] = _gen(servers["evict"], settings[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(settings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
    servers["evict"].wait_idle_checked()


def test_openai_routes_pass_custom_params_through(servers):
    ref_text = servers["own"].post("/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "sampling_seed": 77}})["text"]
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "seed": 77, "custom_params": {"kv_evict": OWN}}
    code, out = servers["evict"].post_status("/v1/completions", body)
    assert code == 200, out
    assert out["choices"][0]["text"] == ref_text
    code, out = servers["evict"].post_status("/v1/completions",
                             dict(body, custom_params={"kv_evict": {"budget": 2}}))
    assert code == 400 and "kv_evict.budget: must be larger than window" in json.dumps(out), out
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "custom_params": {"kv_evict": {"policy": "nope"}}}
    code, out = servers["evict"].post_status("/v1/chat/completions", chat)
    assert code == 400 and "kv_evict.policy: unknown policy 'nope'" in json.dumps(out), out


def test_eviction_request_on_a_server_without_eviction_is_refused(servers):
    code, out = servers["stock"].post_status("/generate", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 4,
                                            "custom_params": {"kv_evict": {"budget": 64}}}})
    assert code == 400
    assert "started without --kv-evict-policy" in json.dumps(out), out
    # Turning eviction off is fine anywhere.
    assert len(_gen(servers["stock"], False, n=4)[0]) == 4


def _beam(server, kv_evict=None, n=N):
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "beam_width": 2}
    if kv_evict is not None:
        params["custom_params"] = {"kv_evict": kv_evict}
    return server.post_status("/generate", {"text": PROMPT, "sampling_params": params})


def test_beam_search_is_refused_where_the_request_would_evict(servers):
    """Beam members decode from rows sharing the leader's slots, which compaction would free
    under them (on the old code this request was served and the scheduler then died on the
    idle leak check). Refused with 400 where it would evict; served with eviction off."""
    evict = servers["evict"]
    for kv_evict in (None, True, {"budget": 24}):
        code, body = _beam(evict, kv_evict)
        assert code == 400, (kv_evict, body)
        assert body["error"]["message"].startswith(
            "beam_width: beam search (beam_width=2) is not supported with KV eviction"), body
    # Eviction off for the request: the stock beam search result, several evictions' worth.
    code, stock = _beam(servers["stock"])
    assert code == 200, stock
    code, off = _beam(evict, False)
    assert code == 200, off
    assert off["output_ids"] == stock["output_ids"] and len(off["output_ids"]) == N
    assert off["meta_info"]["kv_evicted_tokens"] == 0
    # ...alongside an evicting request in the same batches: no slot leaked or freed twice.
    with ThreadPoolExecutor(2) as pool:
        beam = pool.submit(_beam, evict, False)
        plain = pool.submit(_gen, evict)
        code, again = beam.result()
        assert code == 200 and again["output_ids"] == off["output_ids"]
        assert plain.result()[1] > 0
    evict.wait_idle_checked()
    code, _ = servers["stock"].post_status("/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "beam_width": 2}})
    assert code == 200  # a server without eviction serves beam search as stock SGLang does
