"""Model generality in a real SGLang server on CPU (strict memory checks on): a model whose
attention logits are not q . k / sqrt(D) is scored with its own scaling, and the query ring's
reservation matches the dtype it is allocated with when the KV cache dtype differs from the
model's."""

import re

import pytest
import torch
from transformers import AutoTokenizer

from servers import Server
from vase_sglang import AttentionParams, EvictionConfig
from vase_sglang.pool_ring import slots_per_request
from vase_sglang.serving.hf_reference import ReferenceDecoder
from vase_sglang.serving.tiny_model import build_tiny_qwen3

BUDGET, WINDOW, TOL = 32, 8, 1e-4  # TOL as test_server_eviction's faithfulness tests
torch.set_num_threads(1)


def _args(policy, *extra):
    return ["--kv-evict-policy", policy, "--kv-evict-budget", str(BUDGET),
            "--kv-evict-window", str(WINDOW), "--kv-evict-seed", "5", *extra]


@pytest.fixture(scope="module")
def tiny_granite(tmp_path_factory) -> str:
    """fp32 tiny Granite: attention logits q . k * 0.6 where Qwen3 would use 1/sqrt(32)."""
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-granite",
                                dtype="float32", init_std=0.1, attention_multiplier=0.6))


def _max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def test_model_scaling_served_faithfully_to_the_reference(tiny_granite):
    prompt = AutoTokenizer.from_pretrained(tiny_granite)("Hello world, the capital of France is")["input_ids"]
    with Server(tiny_granite, ["--dtype", "float32", *_args("snapkv")]) as server:
        out = server.generate(input_ids=prompt, max_new_tokens=160, return_logprob=True,
                              sampling_params={"ignore_eos": True, "sampling_seed": 77})
        server.wait_idle_checked()
        log = server.output()
    assert "AttentionParams(scaling=0.6, softcap=0.0)" in log
    tokens = out["output_ids"]
    logprobs = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    cfg = EvictionConfig(policy="snapkv", budget=BUDGET, window=WINDOW, seed=5)
    reference = ReferenceDecoder.from_pretrained(tiny_granite, cfg)
    ref = reference.run(prompt, forced_ids=tokens, request_key=77)
    assert ref["rounds"] >= 3 and out["meta_info"]["kv_evicted_tokens"] == ref["evicted"] > 0
    assert _max_diff(logprobs, ref["logprobs"]) < TOL
    # The check can fail: scored with 1/sqrt(D), as the server did before, the text diverges.
    reference.attention = AttentionParams()
    default = reference.run(prompt, forced_ids=tokens, request_key=77)
    assert _max_diff(logprobs, default["logprobs"]) > 1e-2


def test_query_ring_reserved_in_the_dtype_it_is_allocated_with(tiny_model):
    # fp32 weights, bf16 KV cache: the ring holds bf16 queries, so it reserves bf16 bytes.
    args = ["--dtype", "float32", "--kv-cache-dtype", "bfloat16", "--max-running-requests", "4",
            *_args("vase-attnv")]
    with Server(tiny_model, args) as server:
        out = server.generate(text="The quick brown fox", max_new_tokens=80,
                              sampling_params={"ignore_eos": True, "temperature": 0})
        server.wait_idle_checked()
        log = server.output()
    assert out["meta_info"]["kv_evicted_tokens"] > 0
    # Beside the --max-total-tokens pool (vase_sglang/pool_ring.py): the slots reserved are
    # the storage allocated, of bf16 queries over bf16 K/V (2 query heads a KV head: 2 cells a
    # window position).
    reserved = re.search(r"VaSE query ring beside the --max-total-tokens pool: reserving "
                         r"[\d.]+ MiB \((\d+) slots", log)
    allocated = re.search(r"query ring beside the pool: (\d+) slots a request of (\d+) in its "
                          r"own storage whose policy reads queries, ([\w.]+)", log)
    assert reserved and allocated, log[-3000:]
    assert allocated.group(3) == "torch.bfloat16"
    assert reserved.group(1) == allocated.group(2)
    assert int(allocated.group(1)) == slots_per_request(WINDOW, 4, 32, torch.bfloat16, 2, 2)
