"""No request can take the server down (docs/reliability.md): on the shared snapkv server
(conftest.py; strict memory checks on), a failure inside the eviction step costs the requests
it hit and nobody else, and the seed's range ends where the draws' does.

- Fault injection (tests/fault_policy.py): `test-fault-<stage>` raises at one stage of the real
  step (plan, stage, select, compact, rewrite). Its requests finish with HTTP 500 naming the
  stage; the requests decoding beside them give the same tokens as when served alone; the
  leak check stays silent and the server keeps serving.
- The seed: [0, 2^63). 2^63 (which overflowed in the step and stopped the scheduler) is an HTTP
  400 naming kv_evict.seed; 2^63 - 1 is served and draws exactly what the reference draws."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from servers import SNAPKV, max_logprob_diff, reference, serve_request

torch.set_num_threads(1)
# tests/fault_policy.py's names. Not imported: importing it registers its policies and wraps
# the step in this process too, where other tests read the registry.
PREFIX, STAGES = "test-fault-", ("plan", "stage", "select", "compact", "rewrite")
SHARED, SHARED_STAGES = PREFIX + "shared-", ("select", "pack", "compact")
N = 90  # tokens per request: 7 eviction rounds at budget 32, window 8
MAX_SEED = 2**63 - 1


@pytest.fixture(scope="module")
def snapkv_server(snapkv_server):
    assert SNAPKV["budget"] == 32 and SNAPKV["window"] == 8
    return snapkv_server


def _greedy(server, prompt, kv_evict=None):
    sampling = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
    if kv_evict is not None:
        sampling["custom_params"] = {"kv_evict": kv_evict}
    return server.post_status("/generate", {"input_ids": prompt, "sampling_params": sampling})


def test_a_failing_step_finishes_its_requests_and_no_other(snapkv_server, tokenizer):
    prompts = [tokenizer(f"Number {i}: 0 1 2 3")["input_ids"] for i in range(3)]
    alone = []
    for p in prompts:
        status, out = _greedy(snapkv_server, p)
        assert status == 200
        alone.append(out["output_ids"])
    # Every stage fails in the same decode steps as the healthy requests run (two requests
    # for select: a group of several fails whole).
    faults = [PREFIX + stage for stage in STAGES] + [PREFIX + "select"]
    with ThreadPoolExecutor(len(prompts) + len(faults)) as pool:
        healthy = [pool.submit(_greedy, snapkv_server, p) for p in prompts]
        failing = [pool.submit(_greedy, snapkv_server, prompts[i % 3], {"policy": policy})
                   for i, policy in enumerate(faults)]
        healthy = [f.result() for f in healthy]
        failing = [f.result() for f in failing]
    for (status, out), want in zip(healthy, alone):
        assert status == 200 and out["output_ids"] == want
    for policy, (status, body) in zip(faults, failing):
        stage = policy[len(PREFIX):]
        assert status == 500, (policy, status, body)
        assert f"KV eviction failed at stage '{stage}'" in str(body), body
        assert f"injected fault at stage '{stage}'" in str(body), body
    snapkv_server.wait_idle_checked()
    assert "Scheduler hit an exception" not in snapkv_server.output()
    # ...and it goes on serving: the same tokens as before the failures.
    for p, want in zip(prompts, alone):
        assert _greedy(snapkv_server, p)[1]["output_ids"] == want
    snapkv_server.wait_idle_checked()


def test_a_failing_shared_scope_step_finishes_its_requests_and_no_other(snapkv_server, tokenizer):
    """The same under a global budget scope (patches/shared_scope.evict_one, one request at a
    time): a fault in the policy's scoring, in packing the kept tokens into cells, or in the
    K/V copies finishes that request with an HTTP 500 naming the stage; global and per-head
    requests decoding beside it give the tokens they give alone."""
    trimkv = {"policy": "trimkv", "budget": 24, "window": 8, "budget_scope": "global"}
    healthy_settings = [trimkv, {**trimkv, "budget_scope": "head"}, None]
    prompts = [tokenizer(f"Global number {i}: 0 1 2 3")["input_ids"] for i in range(3)]
    alone = []
    for p, kv in zip(prompts, healthy_settings):
        status, out = _greedy(snapkv_server, p, kv)
        assert status == 200 and out["meta_info"]["kv_evicted_tokens"] > 0
        alone.append(out["output_ids"])
    with ThreadPoolExecutor(len(prompts) + len(SHARED_STAGES)) as pool:
        healthy = [pool.submit(_greedy, snapkv_server, p, kv)
                   for p, kv in zip(prompts, healthy_settings)]
        failing = [pool.submit(_greedy, snapkv_server, prompts[i], {**trimkv,
                                                                   "policy": SHARED + stage})
                   for i, stage in enumerate(SHARED_STAGES)]
        healthy = [f.result() for f in healthy]
        failing = [f.result() for f in failing]
    for (status, out), want in zip(healthy, alone):
        assert status == 200 and out["output_ids"] == want
    for stage, (status, body) in zip(SHARED_STAGES, failing):
        assert status == 500, (stage, status, body)
        assert f"KV eviction failed at stage '{stage}'" in str(body), body
        assert f"injected fault at stage '{stage}'" in str(body), body
    snapkv_server.wait_idle_checked()
    assert snapkv_server.used_tokens() == 0
    assert "Scheduler hit an exception" not in snapkv_server.output()


def test_a_seed_outside_its_range_is_a_bad_request(snapkv_server, tokenizer):
    prompt = tokenizer("KV cache eviction")["input_ids"]
    for seed in (2**63, 2**64, -1, 10**30):
        status, body = _greedy(snapkv_server, prompt, {"seed": seed})
        assert status == 400 and "kv_evict.seed" in str(body), (seed, status, body)
    status, _ = _greedy(snapkv_server, prompt, {"seed": MAX_SEED})
    assert status == 200
    snapkv_server.wait_idle_checked()


def test_the_largest_seed_draws_what_the_reference_draws(snapkv_server, tokenizer, hf_model):
    """Served at seed 2^63 - 1, vase-attnv (a drawing policy) matches the reference's decode
    loop at that seed, and not at its neighbour: the whole range is served, none of it
    folded."""
    prompt = tokenizer("KV cache eviction policy radix tree")["input_ids"]
    tokens, logprobs, meta = serve_request(snapkv_server, prompt, N,
                                           kv_evict={"policy": "vase-attnv", "seed": MAX_SEED})
    ref = reference(hf_model, "vase-attnv", prompt, tokens, budget=32, window=8, seed=MAX_SEED)
    assert ref["rounds"] >= 3 and meta["kv_evicted_tokens"] == ref["evicted"]
    assert max_logprob_diff(logprobs, ref["logprobs"], tol=1e-4) < 1e-4
    other = reference(hf_model, "vase-attnv", prompt, tokens, budget=32, window=8,
                      seed=MAX_SEED - 1)
    assert max_logprob_diff(logprobs, other["logprobs"], tol=1e-4) > 1e-2
    snapkv_server.wait_idle_checked()
