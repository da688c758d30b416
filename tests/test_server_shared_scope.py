"""Shared budget scopes served (issue 52): trimkv with `budget_scope` "global" and "layer" on a
real SGLang server (the shared snapkv server: tiny fp32 Qwen3, pages of one token, radix cache
and strict memory checks on, trimkv's gates loaded), against the transformers reference's
masked rows (benchmarks/global_budget.py: every token stays, a per-(layer, head) mask hides
the evicted ones, so heads keep unequal counts where nothing moves).

Served, a request keeps K older slots whose cells hold tokens of any (layer, head): the same
tokens as the reference's row at every eviction, so the same logprobs, teacher-forced on the
served tokens. The per-head row is a different cache (checked: the comparison can fail), and
the slots are those of a per-head budget: the same KV length, nothing leaked."""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from servers import PAGE, PAGED, SNAPKV, masked_logprobs, stream_and_abort, trimkv_gates

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.global_budget import MaskedBudgetRun, Row  # noqa: E402

BUDGET, WINDOW, SINKS = 24, 8, 4  # on the server's grid (its window 8): K = 16
N_TOKENS = 120  # 12 evictions
TOL = 1e-4  # fp32 on both sides, as tests/test_server_trimkv.py
SCOPES = ("global", "layer", "head")
torch.set_num_threads(1)


def _request(scope):
    return {"policy": "trimkv", "budget": BUDGET, "window": WINDOW, "sinks": SINKS,
            "budget_scope": scope}


def _serve(server, prompt, scope, **kv_evict):
    out = server.generate(input_ids=prompt, max_new_tokens=N_TOKENS, return_logprob=True,
                          sampling_params={"ignore_eos": True, "custom_params": {
                              "kv_evict": {**_request(scope), **kv_evict}}})
    meta = out["meta_info"]
    return out["output_ids"], [x[0] for x in meta["output_token_logprobs"]], meta


@pytest.fixture(scope="module")
def served(snapkv_server, tokenizer):
    """Every scope in flight at once (decode batches mix cells and plain rows)."""
    prompt = tokenizer("Global budgets: the tokens of all layers and heads compete")["input_ids"]
    with ThreadPoolExecutor(len(SCOPES)) as pool:
        futures = {s: pool.submit(_serve, snapkv_server, prompt, s) for s in SCOPES}
        out = {s: f.result() for s, f in futures.items()}
    snapkv_server.wait_idle_checked()
    return prompt, out, snapkv_server.used_tokens()


@pytest.fixture(scope="module")
def reference(tiny_model_fp32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, torch_dtype=torch.float32)
    return MaskedBudgetRun(model, trimkv_gates(model.config), budget=BUDGET, window=WINDOW,
                           sinks=SINKS, seed=SNAPKV["seed"])


def _row_logprobs(reference, prompt, forced, scope):
    """The reference row's logprob of each forced token: step t predicts forced[t]."""
    name = {"head": "per-head"}.get(scope, scope)
    logprobs, _counts = reference.run(prompt, forced, [Row("trimkv", name)])
    return [float(logprobs[0, t, tok]) for t, tok in enumerate(forced)]


def _max_diff(a, b):
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    first = next((i for i, d in enumerate(diffs) if d > TOL), None)
    print(f"max logprob diff {max(diffs):.3g}, first above {TOL} at token {first}")
    return max(diffs)


@pytest.mark.parametrize("scope", SCOPES)
def test_served_scope_equals_the_reference_row(served, reference, scope):
    prompt, out, _used = served
    ids, logprobs, meta = out[scope]
    assert len(ids) == N_TOKENS
    assert meta["kv_evicted_tokens"] > 0
    assert _max_diff(logprobs, _row_logprobs(reference, prompt, ids, scope)) < TOL


def test_global_differs_from_per_head_so_the_comparison_can_fail(served, reference):
    """The served global request against the per-head row on its own tokens: another cache,
    another distribution (what the equality above rules out)."""
    prompt, out, _used = served
    ids, logprobs, _meta = out["global"]
    assert _max_diff(logprobs, _row_logprobs(reference, prompt, ids, "head")) > 100 * TOL


FLOOR = 4  # older tokens per (layer, KV head): binds on these gates (checked below)


def test_the_per_head_floor_is_the_reference_floor_row(snapkv_server, served, reference):
    """kv_evict.head_floor: under the global scope every (layer, KV head) first keeps its
    FLOOR best older tokens. Served, the request equals the reference's global row with that
    floor; the floor binds (the floor-0 row leaves some head under it) and changes the cache
    (the served logprobs differ from the floor-0 row's)."""
    prompt, out, _used = served
    ids, logprobs, meta = _serve(snapkv_server, prompt, "global", head_floor=FLOOR)
    snapkv_server.wait_idle_checked()
    assert meta["kv_evicted_tokens"] == out["global"][2]["kv_evicted_tokens"] > 0
    rows = [Row("trimkv", "global", FLOOR), Row("trimkv", "global")]
    ref, counts = reference.run(prompt, ids, rows)
    floored, free = ([float(ref[b, t, tok]) for t, tok in enumerate(ids)] for b in range(2))
    assert min(int(c[1].min()) for c in counts) < FLOOR <= min(int(c[0].min()) for c in counts)
    assert _max_diff(logprobs, floored) < TOL
    assert _max_diff(logprobs, free) > 100 * TOL


def test_without_the_radix_cache_the_prompt_is_a_candidate_too(radix_off_server, tokenizer,
                                                               reference, tiny_model_fp32):
    """--disable-radix-cache: the prompt is private, so its tokens compete for the global
    budget with the generated ones (sinks: the sequence's first tokens). Served, the request
    equals the reference's global row with the prompt unprotected, and not the row that
    protects it; every slot comes back."""
    prompt = tokenizer("Without the radix cache, the prompt's tokens compete for the "
                       "global budget")["input_ids"]
    ids, logprobs, meta = _serve(radix_off_server, prompt, "global")
    radix_off_server.wait_idle_checked()
    assert radix_off_server.used_tokens() == 0
    (unprotected,) = masked_logprobs(tiny_model_fp32, prompt, ids, ["global"], budget=BUDGET,
                                     window=WINDOW, sinks=SINKS, seed=SNAPKV["seed"],
                                     protect_prompt=False)
    assert meta["kv_evicted_tokens"] > 0
    assert _max_diff(logprobs, unprotected) < TOL
    assert _max_diff(logprobs, _row_logprobs(reference, prompt, ids, "global")) > 100 * TOL


def _held_during_decode(server, prompt, kv_evict):
    """Pool slots in use (SGLang's decode log: #token, every step on this server) at each
    decode step of one request served alone."""
    before = len(server.output())
    out = server.generate(input_ids=prompt, max_new_tokens=N_TOKENS,
                          sampling_params={"ignore_eos": True,
                                           "custom_params": {"kv_evict": kv_evict}})
    server.wait_idle_checked()
    log = server.output()[before:]
    # (a line at the request's first or last step can read 0: the overlap scheduler logs
    # a batch whose prefill, or whose release, is still being processed)
    held = [int(m) for m in re.findall(r"Decode batch.*?#running-req: 1, #token: (\d+)", log)
            if int(m)]
    assert len(held) > N_TOKENS // 2, log[-2000:]
    return held, out["meta_info"]["kv_evicted_tokens"]


def test_shared_scopes_hold_the_slots_of_a_per_head_budget(snapkv_server, served):
    """Served alone, a request holds the same pool slots at every decode step whatever its
    scope (the same K older slots, whoever's tokens their cells hold), and evicts the same
    number of tokens; a budget one window larger holds more (the reading can fail). Nothing
    is held once the requests are done (strict checks silent)."""
    prompt, out, used = served
    held = {s: _held_during_decode(snapkv_server, prompt, _request(s)) for s in SCOPES}
    assert held["global"] == held["layer"] == held["head"], held
    assert held["head"][1] == out["head"][2]["kv_evicted_tokens"] > 0
    larger, _ = _held_during_decode(snapkv_server, prompt,
                                    {**_request("head"), "budget": BUDGET + WINDOW})
    assert max(larger) == max(held["head"][0]) + WINDOW, (larger, held["head"][0])
    assert used == 0
    assert snapkv_server.used_tokens() == 0


@pytest.mark.parametrize("bad, message", [
    ({"policy": "snapkv", "budget_scope": "global"}, "needs a policy whose scores compare"),
    ({"policy": "trimkv", "budget_scope": "everything"}, "must be one of head, layer, global"),
    ({"policy": "trimkv", "budget_scope": "global", "value_slots": 4}, "without value slots"),
])
def test_a_scope_the_request_cannot_have_is_refused_with_400(snapkv_server, bad, message):
    status, body = snapkv_server.post_status("/generate", {
        "text": "hello", "sampling_params": {"max_new_tokens": 2,
                                             "custom_params": {"kv_evict": bad}}})
    body = str(body)
    assert status == 400 and "kv_evict.budget_scope" in body and message in body, body


@pytest.mark.parametrize("budget", [PAGED["budget"], PAGED["budget"] - 8])
def test_with_pages_whole_pages_are_freed_and_the_cells_are_the_reference_row(
        paged_server, tokenizer, tiny_model_fp32, budget):
    """Pages of 16 (the shared paged server, window 16): the candidates start at the prompt's
    last whole page (its partial page is private), the K older slots hold cells and the
    leaving pages go back whole. At a budget on the page grid the row is rewritten; off it
    (K = 24) the newest window's K/V and side values are copied behind the cells, as per head.
    Served, the request equals the reference's global row with the same pages within TOL, not
    its per-head row; every page comes back (strict checks, pool empty)."""
    prompt = tokenizer("Pages of sixteen tokens: the global budget frees whole pages")["input_ids"]
    assert len(prompt) % PAGE  # a partial last page: private
    window = PAGED["window"]
    ids, logprobs, meta = _serve(paged_server, prompt, "global", budget=budget, window=window)
    paged_server.wait_idle_checked()
    assert paged_server.used_tokens() == 0
    assert meta["kv_evicted_tokens"] > 0
    glob, head = masked_logprobs(tiny_model_fp32, prompt, ids, ["global", "per-head"],
                                 budget=budget, window=window, sinks=SINKS, seed=PAGED["seed"],
                                 page_size=PAGE)
    assert _max_diff(logprobs, glob) < TOL
    assert _max_diff(logprobs, head) > 100 * TOL


def test_abort_of_a_request_holding_cells_frees_its_slots_and_its_cells(snapkv_server, served):
    """A global request aborted after several evictions: every slot comes back, and the
    request-table row it held serves the next requests with their own caches (its cells are
    dropped with the row: a stale cell view would change their outputs)."""
    prompt, out, _used = served
    payload = {"input_ids": prompt, "stream": True, "rid": "abort-cells",
               "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True,
                                   "custom_params": {"kv_evict": _request("global")}}}
    seen = stream_and_abort(snapkv_server, payload, BUDGET + 4 * WINDOW, timeout=120)
    assert seen > BUDGET + 4 * WINDOW
    snapkv_server.wait_idle_checked()
    assert snapkv_server.used_tokens() == 0
    again = {s: _serve(snapkv_server, prompt, s)[0] for s in ("head", "global")}
    assert again == {s: out[s][0] for s in ("head", "global")}
    snapkv_server.wait_idle_checked()


# -- a server started with the scope ------------------------------------------------------------

def test_the_workspace_and_warmup_plan_per_head_steps_for_a_global_server():
    """A server whose own scope is global sizes its step workspace and warms its kernels for
    the per-head steps its requests may ask for (shared-scope steps run outside the
    workspace): the same sizes as a per-head server, where it crashed at startup before
    (a trimkv request-like config with value slots and the global scope)."""
    from vase_sglang import EvictionConfig
    from vase_sglang.chunk import KVShapes
    from vase_sglang.plan import workspace_bytes
    from vase_sglang.warmup import scratch_config

    shapes = KVShapes(kv_heads=2, q_heads=4, head_dim=32, kv_dtype=torch.float32,
                      q_dtype=torch.float32, ring_window=WINDOW)
    head = EvictionConfig(policy="trimkv", budget=BUDGET, window=WINDOW)
    glob = head.replace(budget_scope="global")
    assert workspace_bytes(glob, shapes, "cpu", max_candidates=4096) == \
        workspace_bytes(head, shapes, "cpu", max_candidates=4096)
    assert scratch_config(glob, "vase-attnv").budget_scope == "head"


def test_a_request_for_a_per_head_policy_on_a_global_server_gets_the_head_scope():
    from patches.request_control import effective_config
    from vase_sglang import EvictionConfig

    server = EvictionConfig(policy="trimkv", budget=BUDGET, window=WINDOW, budget_scope="global")
    assert effective_config({"kv_evict": {"policy": "vase-dkv"}}, server,
                            has_gates=True).budget_scope == "head"
    assert effective_config({"kv_evict": {"budget": 32}}, server,
                            has_gates=True).budget_scope == "global"
    with pytest.raises(ValueError, match="kv_evict.budget_scope: 'global' needs a policy"):
        effective_config({"kv_evict": {"policy": "vase-dkv", "budget_scope": "global"}}, server,
                         has_gates=True)


def test_a_server_started_with_the_global_scope_serves_it(tiny_model_fp32, trimkv_gates_file,
                                                         served):
    """--kv-evict-budget-scope global on the command line: its requests evict into cells as
    a per-request global one does on another server (the same tokens), and a request for a
    per-head policy is served per head."""
    from servers import Server

    prompt, out, _used = served
    flags = ["--dtype", "float32", "--kv-evict-policy", "trimkv", "--kv-evict-budget",
             str(BUDGET), "--kv-evict-window", str(WINDOW), "--kv-evict-sinks", str(SINKS),
             "--kv-evict-budget-scope", "global",
             "--kv-evict-retention-gates", str(trimkv_gates_file)]
    with Server(tiny_model_fp32, flags) as server:
        got = server.generate(input_ids=prompt, max_new_tokens=N_TOKENS,
                              sampling_params={"ignore_eos": True})
        other = server.generate(input_ids=prompt, max_new_tokens=40, sampling_params={
            "ignore_eos": True, "custom_params": {"kv_evict": {"policy": "vase-dkv"}}})
        server.wait_idle_checked()
        used = server.used_tokens()
    assert got["output_ids"] == out["global"][0]
    assert got["meta_info"]["kv_evicted_tokens"] == out["global"][2]["kv_evicted_tokens"]
    assert len(other["output_ids"]) == 40 and used == 0
