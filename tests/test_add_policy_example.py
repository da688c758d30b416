"""docs/add_policy.md's worked example, examples/my_policy.py (`vatp`), run as a user would run
it: imported and registered, its selection against a naive reference (plain and streamed),
validated by EvictionConfig, and served by a real server that loaded it through
VASE_KV_EVICT_PLUGINS (the shared snapkv server, conftest.py) token for token as the
plain-transformers reference decodes with the same eviction."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from servers import SNAPKV, max_logprob_diff, reference, serve_request
from vase_sglang import POLICIES, EvictionConfig, SelectParams, policy_names, select_tokens
from vase_sglang.policies import register_policy

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module", autouse=True)
def my_policy():
    """examples/my_policy.py imported as a server imports a VASE_KV_EVICT_PLUGINS module (its
    import registers `vatp`); unregistered afterwards, so other modules' tests see the
    built-in registry."""
    sys.path.insert(0, str(EXAMPLES))
    sys.modules.pop("my_policy", None)
    try:
        yield importlib.import_module("my_policy")
    finally:
        POLICIES.pop("vatp", None)
        sys.modules.pop("my_policy", None)
        sys.path.remove(str(EXAMPLES))


def naive_vatp(keys, values, queries, keep: int, sinks: int, pool: int = 5) -> torch.Tensor:
    """What `vatp` keeps, one (batch element, KV head) row at a time in plain Python: the
    attention of the head's W x G queries over the n candidates (softmax of q.k / sqrt(D)),
    averaged, avg-pooled over `pool` neighbours (zeros past the ends), times sum |v|; the
    sinks, then the largest scores (ties to the older token), ascending."""
    *batch, heads, n, d = keys.shape
    group = queries.shape[-3] // heads
    k = keys.float().reshape(-1, heads, n, d)
    v = values.float().reshape(-1, heads, n, d)
    q = queries.float().reshape(k.shape[0], heads * group, -1, d)
    rows = []
    for e in range(k.shape[0]):
        for h in range(heads):
            att = [0.0] * n
            own = [q[e, h * group + g, w] for g in range(group) for w in range(q.shape[2])]
            for row in own:
                p = torch.softmax(k[e, h] @ row / d**0.5, dim=0).tolist()
                att = [a + x / len(own) for a, x in zip(att, p)]
            pooled = [sum(att[j] for j in range(i - pool // 2, i + pool // 2 + 1) if 0 <= j < n)
                      / pool for i in range(n)]
            score = [pooled[i] * float(v[e, h, i].abs().sum()) for i in range(n)]
            rest = sorted(range(sinks, n), key=lambda i: (-score[i], i))
            rows.append(sorted(list(range(sinks)) + rest[: keep - sinks]))
    return torch.tensor(rows).reshape(*batch, heads, keep)


def test_the_module_registers_its_policy_once(my_policy):
    assert POLICIES["vatp"] is my_policy.VatpPolicy
    assert "vatp" in policy_names() and "vatp" in policy_names(retention=False)
    register_policy("vatp", my_policy.VatpPolicy)  # the same class again: nothing changes
    with pytest.raises(ValueError, match="policy: the name 'vatp' is taken"):
        register_policy("vatp", POLICIES["snapkv"])
    cls = my_policy.VatpPolicy
    assert cls.needs_queries and cls.streams()
    assert not (cls.needs_retention or cls.samples or cls.reserves_value_slots)


def test_a_config_names_it_and_gives_it_no_value_slots():
    cfg = EvictionConfig(policy="vatp", budget=32, window=8)
    assert cfg.evicts and cfg.keep == 24 and cfg.n_value_slots == 0
    with pytest.raises(ValueError, match="value_slots: only the vase-attnv policy reserves"):
        EvictionConfig(policy="vatp", budget=32, window=8, value_slots=4)
    with pytest.raises(ValueError, match="policy: unknown policy 'vatp2'; choose one of full, "
                                         "vase-attnv, .*vatp"):
        EvictionConfig(policy="vatp2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_matches_the_naive_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 2, 20, 8, generator=gen).to(dtype)  # [requests, layers, H, n, D]
    values = torch.randn(2, 3, 2, 20, 8, generator=gen).to(dtype)
    queries = torch.randn(2, 3, 4, 4, 8, generator=gen).to(dtype)  # H_q = 4 (2 per KV head), W = 4
    cfg = EvictionConfig(policy="vatp", budget=16, window=4, sinks=2)
    keep = select_tokens(cfg, keys, values, queries, request=torch.arange(2)[:, None],
                         layer=torch.arange(3)[None, :])
    assert keep.shape == (2, 3, 2, cfg.keep)
    assert torch.equal(keep, naive_vatp(keys, values, queries, cfg.keep, sinks=2))
    # fewer sinks (an engine whose shared prompt holds them), as a parameter object
    fewer = select_tokens(cfg, keys, values, queries, params=SelectParams(sinks=0))
    assert torch.equal(fewer, naive_vatp(keys, values, queries, cfg.keep, sinks=0))
    # streamed over candidate chunks (what a server runs for a cache too long to gather at once)
    for chunk in (1, 7, 20):
        assert torch.equal(select_tokens(cfg, keys, values, queries, chunk=chunk), keep)
    with pytest.raises(ValueError, match="queries: policy 'vatp' needs the window queries"):
        select_tokens(cfg, keys, values)


@pytest.fixture(scope="module")
def snapkv_server(snapkv_server):
    """The shared snapkv server (conftest.py), which loads examples/my_policy.py through
    VASE_KV_EVICT_PLUGINS."""
    assert SNAPKV == {"policy": "snapkv", "budget": 32, "window": 8, "seed": 5}
    return snapkv_server


def test_served_through_the_plugin_variable_as_the_reference_decodes(snapkv_server, tokenizer,
                                                                   hf_model):
    """One request asks for `vatp` (custom_params.kv_evict) on a server started with snapkv,
    which records the window queries: its logprobs equal the plain-transformers decode loop's
    with the same eviction, which evicts as much; a reference at another budget does not match
    (the check can fail)."""
    prompt = tokenizer("KV cache eviction policy radix tree")["input_ids"]
    tokens, logprobs, meta = serve_request(snapkv_server, prompt, 64, kv_evict={"policy": "vatp"})
    snapkv_server.wait_idle_checked()
    ref = reference(hf_model, "vatp", prompt, tokens, budget=32, window=8)
    assert ref["rounds"] >= 3 and meta["kv_evicted_tokens"] == ref["evicted"] > 0
    assert max_logprob_diff(logprobs, ref["logprobs"], tol=1e-4) < 1e-4
    other = reference(hf_model, "vatp", prompt, tokens, budget=40, window=8)
    assert max_logprob_diff(logprobs, other["logprobs"]) > 1e-2
