"""Eviction with paged KV (--page-size 16) in real SGLang servers on CPU (tiny fp32 Qwen3,
radix cache on, overlap scheduler on, strict memory checks on: conservation every busy step,
page ownership, the idle leak check). Most tests use the shared paged server (conftest.py).

Settings: budget 48 and window 16 are multiples of the page, so the server's own evictions
move whole pages of the newest window by rewriting the row; a request's own budget 40 (keep
24: not a page multiple) takes the other path, a copy of the newest window into the
candidates' pages (vase_sglang/rows.py, patches/step.py). Prompts are not page multiples unless said: their
partial last page is private and evicted like generated tokens.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from servers import (PAGE, PAGED, SNAPKV, Server, max_logprob_diff, reference, serve_request,
                     stream_and_abort)
from vase_sglang import EvictionConfig

BUDGET, WINDOW = PAGED["budget"], PAGED["window"]
COPY = {"budget": 40}  # keep 24: the newest window is copied, not moved by pages
TOL = 1e-4  # fp32 on both sides; the page-1 test's tolerance
torch.set_num_threads(1)


def _round_up(x, page=PAGE):
    return -(-x // page) * page


def _served_together(server, prompt, requests: dict, n):
    """Every (name -> kv_evict) request in flight at once: decode batches mix them."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(serve_request, server, prompt, n, kv_evict=kv)
                   for name, kv in requests.items()}
        return {name: f.result() for name, f in futures.items()}


def _reference(model, policy, prompt_ids, forced, request_key=77, budget=BUDGET, page=PAGE):
    return reference(model, policy, prompt_ids, forced, budget=budget, window=WINDOW,
                     request_key=request_key, page_size=page)


FAITHFUL = ["snapkv", "vase-attnv", "vase-dkv", "streaming"]
RANDOMISED = {"vase-attnv", "vase-dkv"}
N_FAITHFUL = 160


@pytest.fixture(scope="module")
def served_per_policy(paged_server, tokenizer):
    prompt = tokenizer("KV cache eviction policy radix tree pages")["input_ids"]
    assert len(prompt) % PAGE, "the prompt's partial last page must be private"
    requests = {}
    for policy in FAITHFUL:
        requests[(policy, "pages")] = {"policy": policy}
        requests[(policy, "copy")] = {"policy": policy, **COPY}
    served = _served_together(paged_server, prompt, requests, N_FAITHFUL)
    paged_server.wait_idle_checked()
    return prompt, served


@pytest.mark.parametrize("path", ["pages", "copy"])
@pytest.mark.parametrize("policy", FAITHFUL)
def test_paged_faithful_to_transformers_reference(served_per_policy, hf_model, policy, path):
    """Served logprobs at page size 16 against the transformers loop with the same eviction
    (the tree owns the prompt's whole pages only), teacher-forced on the served tokens."""
    prompt, served = served_per_policy
    tokens, logprobs, meta = served[(policy, path)]
    budget = COPY["budget"] if path == "copy" else BUDGET
    assert len(tokens) == N_FAITHFUL
    ref = _reference(hf_model, policy, prompt, tokens, budget=budget)
    assert ref["rounds"] >= 3 and meta["kv_evicted_tokens"] == ref["evicted"] > 0
    assert max_logprob_diff(logprobs, ref["logprobs"]) < TOL
    # Negative controls: another random stream, or the page-1 schedule (the whole prompt
    # protected), which keeps other tokens.
    if policy in RANDOMISED:
        other = _reference(hf_model, policy, prompt, tokens, request_key=78, budget=budget)
        assert max_logprob_diff(logprobs, other["logprobs"]) > 1e-2
    other = _reference(hf_model, policy, prompt, tokens, budget=budget, page=1)
    assert max_logprob_diff(logprobs, other["logprobs"]) > 1e-2


def _token_usage(log):
    import re

    return [int(m) for m in re.findall(r"Decode batch.*?#token: (\d+)", log)]


def test_paged_footprint_is_whole_pages_within_the_page_rounded_bound(paged_server, tokenizer):
    """One request: the tree's whole prompt pages plus at most ceil((T + R) / page) private
    pages at every decode step, so the pages evictions empty go back to the pool (the request
    writes far more tokens than that bound holds). Whether a step's log line falls between an
    eviction's free and the next page's allocation depends on timing (overlap mode frees after
    the batch in flight), so the bound, not a visible dip, is what is checked."""
    prompt = tokenizer("0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20")["input_ids"]
    before = len(_token_usage(paged_server.output()))
    tokens, _, meta = serve_request(paged_server, prompt, 300)
    usage = _token_usage(paged_server.output())[before:]
    assert len(tokens) == 300 and meta["kv_evicted_tokens"] > 200
    assert len(usage) > 200, "a decode log line every step (--decode-log-interval 1)"
    assert all(u % PAGE == 0 for u in usage), usage
    tree = len(prompt) // PAGE * PAGE
    bound = tree + _round_up(BUDGET + WINDOW)
    assert len(prompt) + len(tokens) > 3 * bound  # without freed pages the bound is broken
    assert max(usage) <= bound, usage
    paged_server.wait_idle_checked()


def test_paged_shared_prefix_over_several_pages_stays_cached(paged_server, tokenizer):
    common = "KV cache eviction policy radix tree prefix sharing memory pool token " * 5
    suffixes = [" The quick brown fox", " Hello world!", " 0 1 2 3", " Paris is the capital"]
    prompts = [tokenizer(common + s)["input_ids"] for s in suffixes]
    shared_pages = len(tokenizer(common)["input_ids"]) // PAGE
    assert shared_pages >= 3
    alone = [serve_request(paged_server, p, 120)[0] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # all in flight together
        results = list(pool.map(lambda p: serve_request(paged_server, p, 120), prompts))
    for i, (tokens, _, meta) in enumerate(results):
        assert tokens == alone[i], f"request {i} differs when run with the others"
        assert meta["kv_evicted_tokens"] > 0
        assert meta["cached_tokens"] >= shared_pages * PAGE
    # The shared pages were not rewritten by the evictions: cached once more, every prompt
    # still gives its original output.
    for i, p in enumerate(prompts):
        tokens, _, meta = serve_request(paged_server, p, 120)
        # SGLang matches at most len - 1 tokens (one must be computed), in whole pages.
        assert meta["cached_tokens"] == (len(p) - 1) // PAGE * PAGE
        assert tokens == alone[i]
    paged_server.wait_idle_checked()


def test_paged_abort_mid_generation_frees_every_page(paged_server, tokenizer):
    prompt = tokenizer("KV cache eviction")["input_ids"]
    before = serve_request(paged_server, prompt, 60)[0]
    payload = {"input_ids": prompt, "stream": True, "rid": "abort-paged",
               "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True,
                                   "custom_params": {"kv_evict": COPY}}}
    seen = stream_and_abort(paged_server, payload, BUDGET + 4 * WINDOW, timeout=120)
    assert seen > BUDGET + WINDOW
    paged_server.wait_idle_checked()
    used = paged_server.used_tokens()
    assert used == 0
    assert serve_request(paged_server, prompt, 60)[0] == before


def test_window_below_the_page_is_refused_per_request(paged_server, tokenizer):
    status, body = paged_server.post_status("/generate", {
        "input_ids": tokenizer("Hello")["input_ids"],
        "sampling_params": {"max_new_tokens": 4, "custom_params": {"kv_evict": {"window": 8}}}})
    assert status == 400 and "kv_evict.window" in json.dumps(body), body
    assert "page size (16)" in json.dumps(body)


# -- page 16 against page 1 and against stock ------------------------------------------------

# The policies that read no window queries: the shared page-1 snapkv server (window 8) can
# serve them per request at this window (16); the query policies are compared with the
# reference above, and at page 1 in tests/test_server_eviction.py.
EQUAL = ["vase-dkv", "streaming", "evict-large-values"]
N_EQUAL = 120
assert PAGED["seed"] == SNAPKV["seed"]  # the same random draws on both servers


def _equal_requests():
    requests = {}
    for policy in EQUAL:
        requests[(policy, "pages")] = {"policy": policy, "budget": BUDGET, "window": WINDOW}
        requests[(policy, "copy")] = {"policy": policy, "window": WINDOW, **COPY}
    return requests


@pytest.fixture(scope="module")
def page_multiple_prompts(tokenizer):
    """One prompt of two whole pages per request, seen by no other test: each is prefilled
    in full on both servers (a prefix cached by another request would have been computed in
    another batch shape, with other float roundings)."""
    prompts = {}
    for i, key in enumerate(_equal_requests()):
        text = f"Paged equality request {i}: " + "the quick brown fox jumps over the lazy dog " * 4
        prompts[key] = tokenizer(text)["input_ids"][:2 * PAGE]
        assert len(prompts[key]) == 2 * PAGE
    return prompts


def test_page_16_equals_page_1_where_the_schedules_coincide(snapkv_server, paged_server,
                                                            page_multiple_prompts):
    """With a prompt of whole pages the tree owns the same prefix at both page sizes, so the
    evictions run at the same steps over the same candidates: the same tokens and logprobs
    (fp32), through both the page-moving and the copying path. One request at a time on both
    servers: in a shared batch the projections' float sums depend on which requests run
    together, and a sampled policy's near-tie may then flip one way on one server only."""
    paged = {key: serve_request(paged_server, page_multiple_prompts[key], N_EQUAL, kv_evict=kv)
             for key, kv in _equal_requests().items()}
    paged_server.wait_idle_checked(1)
    flat = {key: serve_request(snapkv_server, page_multiple_prompts[key], N_EQUAL, kv_evict=kv)
            for key, kv in _equal_requests().items()}
    snapkv_server.wait_idle_checked(1)
    for key in paged:
        tokens, logprobs, meta = paged[key]
        assert meta["kv_evicted_tokens"] > 2 * WINDOW, key
        assert tokens == flat[key][0], key
        assert meta["kv_evicted_tokens"] == flat[key][2]["kv_evicted_tokens"], key
        assert max_logprob_diff(logprobs, flat[key][1]) < TOL, key


def test_paged_budget_never_reached_is_identical_to_stock(tiny_model_fp32, paged_server,
                                                          tokenizer):
    prompts = [tokenizer(t)["input_ids"] for t in
               ("Hello world, the capital of France is", "0 1 2 3 4 5 6 7 8 9 10",
                "KV cache eviction policy radix tree prefix sharing memory pool token " * 3)]

    def greedy(server):
        # The private cache (the prompt's partial page + the output) stays below T + R.
        outs = [server.generate(input_ids=p, max_new_tokens=BUDGET + WINDOW - 2 - len(p) % PAGE)
                for p in prompts]
        return [o["output_ids"] for o in outs], [o["meta_info"].get("kv_evicted_tokens") for o in outs]

    evicting, evicted = greedy(paged_server)
    assert evicted == [0] * len(prompts)
    with Server(tiny_model_fp32, ["--dtype", "float32", "--page-size", str(PAGE)]) as stock:
        assert greedy(stock)[0] == evicting
        stock.wait_idle_checked(1)


# -- admission, early eviction and retraction on a small paged pool ---------------------------

POOL, N_CAPPED, N_FULL, MAX_NEW = 1024, 12, 4, 240


def test_paged_admission_early_eviction_and_retraction(tiny_model_fp32, tokenizer):
    """Admission charges whole pages: on a 1024-token pool, requests with a private cycle of
    4..5 pages run several times more at once than stock would admit. Four requests with
    eviction off and no ignore_eos come first; with --schedule-conservativeness 0.05 SGLang
    reserves little of their growth (it expects early stops), they do not stop, and the pool
    runs short: requests over budget are evicted early (only where that frees a page), then
    SGLang retracts. Every request completes; the strict checks and the idle leak check pass.

    The capped prompts differ in length mod the page size, so the requests reach their
    budget at different steps: whenever the pool runs short, some are over budget by a page.
    (In phase, they would all sit exactly at the budget, page full, on the step after their
    eviction, which is the step most likely to run short: early eviction could free nothing.)"""
    import re

    from vase_sglang_patches.footprint import charge_len

    budget, window = 64, 16
    args = ["--dtype", "float32", "--page-size", str(PAGE), "--kv-evict-policy", "vase-attnv",
            "--kv-evict-budget", str(budget), "--kv-evict-window", str(window),
            "--decode-log-interval", "1", "--schedule-conservativeness", "0.05"]
    capped = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    base = tokenizer("Request number: the quick brown fox")["input_ids"]
    full = {"max_new_tokens": MAX_NEW, "temperature": 0, "custom_params": {"kv_evict": False}}
    with Server(tiny_model_fp32, args, max_total_tokens=POOL) as server:
        out = server.post("/generate", {
            "input_ids": [base + list(range(100, 100 + i)) for i in range(N_FULL + N_CAPPED)],
            "sampling_params": [full] * N_FULL + [capped] * N_CAPPED})
        server.wait_idle_checked()
        used = server.used_tokens()
        log = server.output()

    full_out, capped_out = out[:N_FULL], out[N_FULL:]
    assert [len(o["output_ids"]) for o in capped_out] == [MAX_NEW] * N_CAPPED
    assert all(o["meta_info"]["kv_evicted_tokens"] == 0 for o in full_out)
    assert all(o["meta_info"]["kv_evicted_tokens"] > 0 for o in capped_out)
    assert used == 0
    charge = charge_len(EvictionConfig(policy="vase-attnv", budget=budget, window=window), PAGE)
    assert charge % PAGE == 0 and _round_up(budget) <= charge <= _round_up(budget + window)
    prompt = min(o["meta_info"]["prompt_tokens"] for o in capped_out)  # stock's best case
    peak = max(int(m) for m in re.findall(r"Decode batch.*?#running-req: (\d+)", log))
    stock = POOL // (prompt + MAX_NEW + PAGE)  # what stock reserves for a capped request
    assert peak >= 2 * stock, (peak, stock)
    early = [int(m) for m in re.findall(r"early eviction freed (\d+) slots", log)]
    assert early and all(f >= PAGE and f % PAGE == 0 for f in early), early
    assert sum(o["meta_info"]["num_retractions"] for o in out) > 0


def test_freed_slots_are_whole_pages_past_the_new_length():
    from vase_sglang.rows import freed_slots

    # Page multiples: the newest window's pages move, the dropped candidates are whole pages.
    assert freed_slots(n=64, k=48, window=16, page_size=16) == 16
    # Otherwise the pages wholly past the new length k + window go back.
    assert freed_slots(n=40, k=24, window=16, page_size=16) == 16  # 56 -> 40 tokens: 4 -> 3 pages
    assert freed_slots(n=37, k=32, window=16, page_size=16) == 16  # 53 -> 48 tokens: 4 -> 3
    assert freed_slots(n=37, k=33, window=16, page_size=16) == 0  # 53 -> 49: still 4 pages
    assert freed_slots(n=40, k=40, window=16, page_size=16) == 0
    assert freed_slots(n=37, k=32, window=8, page_size=1) == 5
