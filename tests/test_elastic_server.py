"""Elastic budgets on real servers (issue 21), asked per request (custom_params.kv_evict.mode)
on the shared servers: with memory free a request is served exactly as without eviction; under
pressure the caches above their floors are cut instead of retracting anyone, SGLang's strict
memory checks stay silent, and a waiting request is made room for instead of waiting for a
running one to finish."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

from servers import PAGED, RADIX_OFF, RADIX_OFF_POOL, SNAPKV

ELASTIC = {"kv_evict": {"mode": "elastic"}}


def _generate(server, texts, max_new, custom=None, **sampling):
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **sampling}
    if custom is not None:
        params["custom_params"] = custom
    return server.post("/generate", {"text": texts, "sampling_params": params})


def _scrape(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r'^(vase:[a-z_]+)(?:\{[^}]*?(?:cause="([a-z_]+)")?[^}]*\})? ([0-9.e+-]+)$',
                     line)
        if m:
            key = m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")
            values[key] = values.get(key, 0.0) + float(m.group(3))
    return values


def test_with_memory_free_elastic_is_the_full_cache(snapkv_server):
    """A pool that never fills: elastic requests are never cut, and their greedy output is
    token for token the output with eviction off (on the same server, the same batch)."""
    texts = [f"Elastic request {i}: count the apples" for i in range(3)]
    n = 4 * (SNAPKV["budget"] + SNAPKV["window"])  # far past where fixed mode evicts
    elastic = _generate(snapkv_server, texts, n, ELASTIC)
    full = _generate(snapkv_server, texts, n, {"kv_evict": False})
    fixed = _generate(snapkv_server, texts, n)
    assert [o["output_ids"] for o in elastic] == [o["output_ids"] for o in full]
    assert all(o["meta_info"]["kv_evicted_tokens"] == 0 for o in elastic)
    assert all(o["meta_info"]["kv_min_budget"] is None for o in elastic)
    assert all(o["meta_info"]["kv_min_budget"] == SNAPKV["budget"] for o in fixed)
    snapkv_server.wait_idle_checked()


def _pressure(server, n_requests, max_new, floor, custom=ELASTIC):
    before = len(server.output())
    out = _generate(server, [f"Request number {i}: the quick brown fox" for i in range(n_requests)],
                    max_new, custom)
    server.wait_idle_checked()  # SGLang's idle leak check (strict memory checks run too)
    log = server.output()[before:]
    assert all(len(o["output_ids"]) == max_new for o in out)
    assert "Retract requests" not in log  # over-floor tokens were taken back instead
    assert "early eviction freed" in log  # the pool did run short
    evicted = [o["meta_info"]["kv_evicted_tokens"] for o in out]
    levels = [o["meta_info"]["kv_min_budget"] for o in out]
    assert any(evicted), evicted
    assert all(level is None or level >= floor for level in levels), levels
    return out, log


def test_decode_pressure_cuts_caches_above_their_floors(snapkv_server):
    """24 requests of 256 tokens on a 4096-token pool: they are admitted as in fixed mode
    (charged the floor's cycle) and grow until the next decode step does not fit; then the
    largest caches are cut to a common level >= the floor, never anyone retracted."""
    before = _scrape(snapkv_server)
    out, _ = _pressure(snapkv_server, 24, 256, SNAPKV["budget"])
    after = _scrape(snapkv_server)
    rounds = after.get("vase:evictions_by_cause_total[decode_pressure]", 0) - before.get(
        "vase:evictions_by_cause_total[decode_pressure]", 0)
    assert rounds > 0
    assert after.get("vase:evictions_by_cause_total[scheduled]", 0) == before.get(
        "vase:evictions_by_cause_total[scheduled]", 0)  # no budget is reached on schedule
    assert after["vase:elastic_level"] >= SNAPKV["budget"]
    # Every level a request was cut to is on the water line or its floor.
    assert min(o["meta_info"]["kv_min_budget"] or 10**9 for o in out) >= SNAPKV["budget"]


GLOBAL_ELASTIC = {"kv_evict": {"mode": "elastic", "policy": "trimkv", "budget_scope": "global"}}


def test_elastic_global_budget_at_idle_is_the_full_cache(snapkv_server):
    """trimkv under one budget for all layers and heads, elastic: with memory free nothing is
    cut, so the output is the full cache's, token for token (fixed mode would evict)."""
    texts = [f"Elastic global request {i}: count the apples" for i in range(2)]
    n = 4 * (SNAPKV["budget"] + SNAPKV["window"])
    elastic = _generate(snapkv_server, texts, n, GLOBAL_ELASTIC)
    full = _generate(snapkv_server, texts, n, {"kv_evict": False})
    fixed = _generate(snapkv_server, texts, n, {"kv_evict": {**GLOBAL_ELASTIC["kv_evict"],
                                                             "mode": "fixed"}})
    assert [o["output_ids"] for o in elastic] == [o["output_ids"] for o in full]
    assert all(o["meta_info"]["kv_evicted_tokens"] == 0 for o in elastic)
    assert all(o["meta_info"]["kv_evicted_tokens"] > 0 for o in fixed)
    snapkv_server.wait_idle_checked()


def test_decode_pressure_cuts_global_budgets_to_levels_of_their_own(snapkv_server):
    """Elastic requests under the global budget on the 4096-token pool: each is cut at the
    water line of its pressure round, a level of its own (above or below the cells it holds:
    cells past the new level leave with the plain slots, vase_sglang/cells.pack), never
    below the floor, nobody retracted; SGLang's strict checks stay silent and the pool is
    empty afterwards."""
    before = _scrape(snapkv_server)
    out, _ = _pressure(snapkv_server, 20, 256, SNAPKV["budget"], custom=GLOBAL_ELASTIC)
    after = _scrape(snapkv_server)
    assert after.get("vase:evictions_by_cause_total[decode_pressure]", 0) > before.get(
        "vase:evictions_by_cause_total[decode_pressure]", 0)
    assert sum(1 for o in out if o["meta_info"]["kv_evicted_tokens"]) > 1
    assert snapkv_server.used_tokens() == 0


def test_decode_pressure_with_pages(paged_server):
    """Pages of 16: cuts free whole pages (the strict checks would catch a partial one)."""
    _pressure(paged_server, 16, 300, PAGED["budget"])


def test_decode_pressure_without_radix_cache(radix_off_server):
    """Radix cache off: the private cache holds the prompt too, so it is cut with the rest
    (the floor counts prompt tokens), and ignore_eos requests take the general admission path."""
    assert (RADIX_OFF_POOL, RADIX_OFF["budget"]) == (1024, 64)
    _pressure(radix_off_server, 16, 240, RADIX_OFF["budget"])


def _long_wave_until_the_pool_is_short(server, texts, max_new, custom):
    """Send `texts` (elastic, long) from a thread and wait until they have grown into decode
    pressure ("early eviction freed" in the log). Returns the thread, a dict that gets the
    outputs ("out") and the time they came back ("at"), and the log offset before them."""
    done = {}

    def send():
        done["out"] = _generate(server, texts, max_new, custom)
        done["at"] = time.monotonic()

    before = len(server.output())
    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 300
    while "early eviction freed" not in server.output()[before:]:
        assert thread.is_alive() and time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.2)
    return thread, done, before


def test_a_waiting_request_is_made_room_for(radix_off_server):
    """Two long elastic requests (900 tokens; the model's context is 1024) fill the 1024-token
    pool (each grows far past its floor). A short request sent then is admitted within a few
    steps, by cutting them, instead of waiting for one of them to finish (without admission
    pressure, decode pressure alone keeps only R tokens per running request free: the request
    would wait)."""
    thread, done, before = _long_wave_until_the_pool_is_short(
        radix_off_server, ["The first long story", "The second long story"], 900, ELASTIC)
    # Its reservation (a ~250-token prompt + 64 tokens) is more than a decode-pressure cut
    # leaves free (R = 16 tokens for each of the two running requests, up to one grid step
    # more), so it cannot just slip in.
    short = _generate(radix_off_server, ["Count the apples: " + "apple " * 50], 64, ELASTIC)
    short_at = time.monotonic()
    thread.join(timeout=600)
    assert not thread.is_alive()
    assert short_at < done["at"]  # admitted while both long requests were running
    log = radix_off_server.output()[before:]
    lines = [l for l in log.splitlines() if "Decode" not in l or "queue-req: 1" in l]
    assert "a waiting request does not fit the KV cache pool: elastic eviction freed" in log, \
        "\n".join(lines[-60:])
    assert "Retract requests" not in log
    assert len(short[0]["output_ids"]) == 64
    assert [len(o["output_ids"]) for o in done["out"]] == [900, 900]
    radix_off_server.wait_idle_checked()


def test_aborts_in_the_middle_of_pressure(radix_off_server):
    """Half the requests are aborted while the pool is short and their caches are being cut:
    every slot comes back (the strict idle check), and the others finish."""
    rids = [f"elastic-abort-{i}" for i in range(8)]
    done = {}

    def run():
        done["out"] = radix_off_server.post("/generate", {
            "text": [f"Abort test {i}: the quick brown fox" for i in range(8)], "rid": rids,
            "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True,
                                "custom_params": ELASTIC}})

    before = len(radix_off_server.output())
    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 300
    while radix_off_server.output()[before:].count("early eviction freed") < 2:
        assert thread.is_alive() and time.monotonic() < deadline, "the pool never ran short"
        time.sleep(0.1)
    for rid in rids[:4]:
        radix_off_server.post("/abort_request", {"rid": rid})
    thread.join(timeout=600)
    assert not thread.is_alive()
    reasons = [o["meta_info"]["finish_reason"]["type"] for o in done["out"]]
    assert reasons[4:] == ["length"] * 4 and "abort" in reasons[:4], reasons
    radix_off_server.wait_idle_checked()
    used = radix_off_server.used_tokens()
    assert used == 0



def test_global_budgets_are_cut_below_and_above_the_cells_they_hold(radix_off_server):
    """Elastic requests under the global budget on the 1024-token pool, of unequal lengths and
    arriving in two waves: two long ones grow until the pool is short and are cut at a high
    water line; the second wave then cuts them lower (admission and decode pressure: cells past
    the new level leave with the plain slots), and as the short ones finish the line rises
    again (cuts above the cells held). Everyone finishes, nobody is retracted, levels stay
    at or above the floor, every slot comes back (strict checks)."""
    thread, done, before = _long_wave_until_the_pool_is_short(
        radix_off_server, ["The first long global story", "The second long global story"], 700,
        GLOBAL_ELASTIC)
    params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True,
               "custom_params": GLOBAL_ELASTIC} for m in (150, 250, 350)]
    short = radix_off_server.post("/generate", {
        "text": [f"Short global request {i}: count the apples" for i in range(3)],
        "sampling_params": params})
    thread.join(timeout=600)
    assert not thread.is_alive()
    radix_off_server.wait_idle_checked()
    log = radix_off_server.output()[before:]
    assert "Retract requests" not in log
    out = done["out"] + short
    assert [len(o["output_ids"]) for o in out] == [700, 700, 150, 250, 350]
    assert all(o["meta_info"]["kv_evicted_tokens"] > 0 for o in done["out"])
    assert all((o["meta_info"]["kv_min_budget"] or 10**9) >= RADIX_OFF["budget"] for o in out)
    assert radix_off_server.used_tokens() == 0
