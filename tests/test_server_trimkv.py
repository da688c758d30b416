"""trimkv served by a real SGLang server on CPU (tiny fp32 Qwen3, radix cache on, strict memory
checks on), against the transformers reference with the same gates.

One server (the shared paged server, conftest.py: snapkv with trimkv's gates loaded, so every
request here asks for trimkv) with deterministic gates whose β spread widely (so retention,
not age alone, decides), at --page-size 16: the server's budget 48 (a page
multiple) moves the newest window by whole pages, a request's budget 40 copies it into the
candidates' pages (vase_sglang/rows.py, patches/step.py), so both places where K/V move, and the side buffers
with them, are checked. The prompt's partial last page is private, as in tests/test_paged.py.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer

from servers import PAGE, PAGED, trimkv_gates
from vase_sglang import EvictionConfig
from vase_sglang.serving.hf_reference import ReferenceDecoder

BUDGET, WINDOW = PAGED["budget"], PAGED["window"]
assert BUDGET % PAGE == 0 and WINDOW % PAGE == 0
COPY = {"budget": 40}  # keep 24: the newest window is copied, not moved by pages
HYBRID = {"value_slots": 8}  # VaSE + learned retention (on the server's grid: window / 4)
TOL = 1e-4  # fp32 on both sides, as tests/test_server_eviction.py
N_FAITHFUL = 200
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gates_file(trimkv_gates_file):
    return trimkv_gates_file


@pytest.fixture(scope="module")
def trimkv_server(paged_server):
    return paged_server


def _served(server, prompt_ids, n, kv_evict):
    sampling = {"ignore_eos": True, "custom_params": {"kv_evict": kv_evict}}
    out = server.generate(input_ids=prompt_ids, max_new_tokens=n, return_logprob=True,
                          sampling_params=sampling)
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


TRIMKV = {"policy": "trimkv"}
REQUESTS = {
    "pages": TRIMKV,
    "copy": {**TRIMKV, **COPY},
    "hybrid-pages": {**TRIMKV, **HYBRID},
    "hybrid-copy": {**TRIMKV, **HYBRID, **COPY},
}


@pytest.fixture(scope="module")
def served(trimkv_server, tiny_model_fp32):
    """Every request in flight at once (decode batches mix them)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_fp32)
    prompt = tokenizer("KV cache eviction policy radix tree pages")["input_ids"]
    assert len(prompt) % PAGE, "the prompt's partial last page must be private"
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        futures = {name: pool.submit(_served, trimkv_server, prompt, N_FAITHFUL, kv)
                   for name, kv in REQUESTS.items()}
        out = {name: f.result() for name, f in futures.items()}
    trimkv_server.wait_idle_checked()
    return prompt, out


def _reference(model, prompt, forced, gates, **settings):
    cfg = EvictionConfig(budget=BUDGET, window=WINDOW).replace(**settings)
    return ReferenceDecoder(model, cfg, page_size=PAGE, gates=gates).run(prompt, forced_ids=forced)


def _max_diff(a, b):
    diffs = [abs(x - y) for x, y in zip(a, b)]
    first = next((i for i, d in enumerate(diffs) if d > TOL), None)
    print(f"max logprob diff {max(diffs):.3g}, first above {TOL} at token {first}")
    return max(diffs)


@pytest.mark.parametrize("name", list(REQUESTS))
def test_trimkv_faithful_to_transformers_reference(served, hf_model, gates_file, name):
    """Served logprobs against the transformers loop with the same gates and eviction,
    teacher-forced on the served tokens. Negative control: the reference with other gates
    (another seed) keeps other tokens and diverges."""
    prompt, out = served
    tokens, logprobs, meta = out[name]
    assert len(tokens) == N_FAITHFUL
    settings = REQUESTS[name]
    ref = _reference(hf_model, prompt, tokens, gates_file, **settings)
    assert ref["rounds"] >= 3 and meta["kv_evicted_tokens"] == ref["evicted"] > 0
    assert _max_diff(logprobs, ref["logprobs"]) < TOL
    other = _reference(hf_model, prompt, tokens, trimkv_gates(hf_model.config, seed=8), **settings)
    assert _max_diff(logprobs, other["logprobs"]) > 1e-2


def test_retention_not_age_decides(served, hf_model):
    """The gates matter on this server: the served trimkv differs from keeping the newest
    tokens (streaming in the reference), so the faithfulness above is not a streaming match."""
    prompt, out = served
    tokens, logprobs, _ = out["pages"]
    cfg = EvictionConfig(policy="streaming", budget=BUDGET, window=WINDOW)
    stream = ReferenceDecoder(hf_model, cfg, page_size=PAGE).run(prompt, forced_ids=tokens)
    assert _max_diff(logprobs, stream["logprobs"]) > 1e-2


def test_side_buffers_fit_their_reservation(trimkv_server):
    """The side buffers allocated next to the pool (one row per slot) fit the bytes the memory
    plan reserved before sizing the pool (--max-total-tokens 4096, pages of 16: 4112 slots x 2
    layers x 2 KV heads x 8 bytes)."""
    import re

    log = trimkv_server.output()
    reserved = re.search(r"VaSE retention side buffers: reserving [\d.]+ MiB \((\d+) bytes", log)
    allocated = re.search(r"side buffers [\d.]+ MiB = (\d+) bytes .*\[(\d+) slots, (\d+) KV heads\] "
                          r"x (\d+) layers", log)
    assert reserved and allocated, log[-3000:]
    nbytes, slots, heads, layers = map(int, allocated.groups())
    assert nbytes == slots * heads * layers * 8 and slots >= 4096
    assert nbytes <= int(reserved.group(1))
