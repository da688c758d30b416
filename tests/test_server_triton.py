"""Eviction served by SGLang's `triton` attention backend: the Python + Triton decode and extend
kernels SGLang runs on GPUs, here on CPU under Triton's interpreter (TRITON_INTERPRET=1), with
the plugin's own Triton kernels (VASE_KERNELS=triton: scoring, compaction, the attention over
cells) instead of their torch references. Tiny fp32 Qwen3, radix cache, overlap scheduler and
SGLang's strict memory checks on.

Every request is compared token by token and in logprob with the same request on the shared
torch_native server (conftest.py: snapkv_server, the same server flags but the backend), and
with the transformers reference teacher-forced on the served tokens. Tolerance TOL = 1e-4 in
logprob: both sides compute in fp32 and differ only in summation order (SGLang's split-KV
decode against SDPA, the interpreted kernels against torch): observed up to 2.4e-6.

The interpreter is slow (about 0.13 s per request, layer and decode step here), so every
request is in flight at once, short (N tokens, a per-request budget of 16 and window of 4:
3 eviction rounds), and the server runs SGLang's decode with 2 KV splits instead of its
default 8 (`--triton-attention-num-kv-splits 2`: a third of the interpreted programs, and the
splits' log-sum-exp merge still runs).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from servers import (Server, max_logprob_diff, reference, serve_request, snapkv_flags,
                     stream_and_abort, trimkv_gates)
from vase_sglang import POLICY_NAMES

BUDGET, WINDOW = 16, 4  # per request: the first round at 20 private tokens, then every 4
N = 32
TOL = 1e-4
EVICTING = [p for p in POLICY_NAMES if p != "full"]
RANDOMISED = {"vase-attnv", "vase-dkv", "curdkv", "random"}
TRITON = ["--attention-backend", "triton", "--triton-attention-num-kv-splits", "2"]
torch.set_num_threads(1)


def _kv(policy, **extra):
    return {"policy": policy, "budget": BUDGET, "window": WINDOW, **extra}


# name -> custom_params.kv_evict of one request (False: eviction off for that request)
REQUESTS = {
    **{p: _kv(p) for p in EVICTING},
    "trimkv": _kv("trimkv"),
    "vase-attnv seed 1": _kv("vase-attnv", seed=1),
    "vase-attnv seed 2": _kv("vase-attnv", seed=2),
    "elastic": _kv("vase-attnv", mode="elastic"),
    "global": _kv("trimkv", budget_scope="global"),
    "off": False,
}


def triton_env(plugins="triton_graph_check") -> dict:
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    return {"TRITON_INTERPRET": "1", "VASE_KERNELS": "triton", "VASE_KV_EVICT_PLUGINS": plugins,
            "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def triton_server(tiny_model_fp32, trimkv_gates_file):
    """The snapkv server's flags on the triton backend, with tests/triton_graph_check.py
    loaded (SGLang's CUDA-graph metadata path called after every eager decode build)."""
    with Server(tiny_model_fp32, snapkv_flags(trimkv_gates_file) + TRITON,
                env=triton_env()) as server:
        yield server


def _serve_all(server, prompt):
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = {name: pool.submit(serve_request, server, prompt, N, kv_evict=kv)
                   for name, kv in REQUESTS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def served(triton_server, snapkv_server, tokenizer):
    """Every request on both servers, all in flight together on each."""
    prompt = tokenizer("Triton backend: KV cache eviction served")["input_ids"]
    out = {"triton": _serve_all(triton_server, prompt),
           "torch_native": _serve_all(snapkv_server, prompt)}
    triton_server.wait_idle_checked()
    snapkv_server.wait_idle_checked()
    return prompt, out


@pytest.mark.parametrize("name", list(REQUESTS))
def test_same_as_torch_native(served, name):
    """Token for token, logprobs within TOL, and the same number of tokens evicted."""
    _, out = served
    tokens, logprobs, meta = out["triton"][name]
    native_tokens, native_logprobs, native_meta = out["torch_native"][name]
    assert len(tokens) == N
    assert tokens == native_tokens
    assert max_logprob_diff(logprobs, native_logprobs, tol=TOL) < TOL
    assert meta["kv_evicted_tokens"] == native_meta["kv_evicted_tokens"]
    if name not in ("elastic", "off"):
        assert meta["kv_evicted_tokens"] > 0


@pytest.mark.parametrize("policy", EVICTING)
def test_faithful_to_transformers_reference(served, hf_model, policy):
    """The triton server's logprobs against the transformers decode loop with the same
    eviction, teacher-forced on the served tokens; negative control as in
    tests/test_server_eviction.py (another draw, or another budget, diverges)."""
    prompt, out = served
    tokens, logprobs, meta = out["triton"][policy]
    kw = dict(budget=BUDGET, window=WINDOW)
    ref = reference(hf_model, policy, prompt, tokens, **kw)
    assert ref["rounds"] >= 3 and meta["kv_evicted_tokens"] == ref["evicted"] > 0
    assert max_logprob_diff(logprobs, ref["logprobs"], tol=TOL) < TOL
    if policy in RANDOMISED:
        other = reference(hf_model, policy, prompt, tokens, request_key=78, **kw)
    else:
        other = reference(hf_model, policy, prompt, tokens, budget=BUDGET + 2 * WINDOW,
                          window=WINDOW)
    assert max_logprob_diff(logprobs, other["logprobs"]) > 1e-2


def test_trimkv_faithful_to_transformers_reference(served, hf_model):
    """trimkv with the server's gates (conftest.py: trimkv_gates, seed 7)."""
    prompt, out = served
    tokens, logprobs, _ = out["triton"]["trimkv"]
    gates = trimkv_gates(hf_model.config)
    ref = reference(hf_model, "trimkv", prompt, tokens, budget=BUDGET, window=WINDOW, gates=gates)
    assert max_logprob_diff(logprobs, ref["logprobs"], tol=TOL) < TOL
    other = reference(hf_model, "trimkv", prompt, tokens, budget=BUDGET, window=WINDOW,
                      gates=trimkv_gates(hf_model.config, seed=8))
    assert max_logprob_diff(logprobs, other["logprobs"]) > 1e-2


def test_vase_attnv_draws_differ_by_seed(served):
    """The three vase-attnv requests (seeds 5, 1, 2) keep different tokens: the draws, not
    only the value slots, decide what is kept (so the comparisons above test the draws)."""
    _, out = served
    runs = [out["triton"][name][1] for name in ("vase-attnv", "vase-attnv seed 1",
                                                "vase-attnv seed 2")]
    assert max_logprob_diff(runs[0], runs[1]) > 1e-2
    assert max_logprob_diff(runs[0], runs[2]) > 1e-2


def test_elastic_at_idle_answers_as_the_full_cache(served):
    _, out = served
    tokens, logprobs, meta = out["triton"]["elastic"]
    assert meta["kv_evicted_tokens"] == 0
    assert tokens == out["triton"]["off"][0]


def test_global_scope_is_not_the_per_head_cache(served):
    """The global request was served with its cells (equal to torch_native's served global
    scope above), not as a per-head trimkv request."""
    _, out = served
    assert max_logprob_diff(out["triton"]["global"][1], out["triton"]["trimkv"][1]) > 1e-2


def test_cuda_graph_metadata_reads_what_the_eager_path_reads(served, triton_server):
    """tests/triton_graph_check.py ran SGLang's CUDA-graph metadata build (kv_indptr, kv
    indices, split counts from req_to_token and seq_lens) after every eager decode build,
    compacted rows included: the same slots, each its row's, none freed."""
    lines = re.findall(r"vase-graph-check: decode=(\d+) shrunk=(\d+) mismatch=(.*?) control=(.*)",
                       triton_server.output())
    assert lines, "the graph check did not run"
    assert [m for _, _, m, _ in lines if m.strip() != "none"] == []
    shrunk = [(int(n), c.strip()) for _, n, _, c in lines if int(n) > 0]
    assert max(n for n, _ in shrunk) >= len(EVICTING)
    # the check can fail: given the unshrunk lengths, it finds what they would read
    assert all(c != "none" for _, c in shrunk)


def test_abort_mid_generation_frees_everything(served, triton_server, tokenizer):
    prompt = tokenizer("Triton backend: abort")["input_ids"]
    kv = _kv("vase-attnv")
    before = serve_request(triton_server, prompt, 30, kv_evict=kv)[0]
    payload = {"input_ids": prompt, "stream": True, "rid": "abort-triton",
               "sampling_params": {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True,
                                   "custom_params": {"kv_evict": kv}}}
    seen = stream_and_abort(triton_server, payload, BUDGET + 3 * WINDOW, timeout=300)
    assert seen > BUDGET + WINDOW
    triton_server.wait_idle_checked()
    assert triton_server.used_tokens() == 0
    assert serve_request(triton_server, prompt, 30, kv_evict=kv)[0] == before
