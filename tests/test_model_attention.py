"""Window-attention scores are the model's own attention: its logit scaling (Granite's
attention_multiplier, Gemma-2's query_pre_attn_scalar) and its tanh soft-cap (Gemma-2), not
1/sqrt(D). Checked on tiny random transformers models against the attention weights the model
itself outputs (eager attention), through the transformers reference decoder."""

import pytest
import torch
import torch.nn.functional as F

import vase_sglang.serving.hf_reference as hf_reference
from vase_sglang import EvictionConfig
from vase_sglang.serving.hf_reference import ReferenceDecoder

torch.set_num_threads(1)
PROMPT, BUDGET, WINDOW, SINKS = 60, 24, 8, 2


def _tiny(arch: str):
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(0)
    if arch == "granite":  # scaling 0.6 instead of 1/sqrt(16) = 0.25
        return GraniteForCausalLM(GraniteConfig(attention_multiplier=0.6, **common)).eval()
    # Gemma-2: scaling 1/sqrt(4) instead of 1/sqrt(16), logits capped at 2 (larger ones bend).
    return Gemma2ForCausalLM(Gemma2Config(head_dim=16, query_pre_attn_scalar=4,
                                          attn_logit_softcapping=2.0, sliding_window=4096,
                                          **common)).eval()


def _expected_keep(model, ids, n):
    """Snapkv's choice from the model's own attention weights: the last WINDOW queries'
    probabilities restricted to the n candidates and renormalised (= softmax over candidates),
    mean over the GQA group and window, avg-pool 5, sinks forced, top-k."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    keep = []
    for attn in out.attentions:  # [1, H_q, T, T] per layer
        a = attn[0, :, -WINDOW:, :n].double()
        a = a / a.sum(dim=-1, keepdim=True)
        score = a.reshape(2, -1, n).mean(dim=1)  # KV head h <- q heads 2h, 2h + 1
        score = F.avg_pool1d(score[:, None], 5, stride=1, padding=2)[:, 0]
        score[:, :SINKS] = float("inf")
        keep.append(score.sort(dim=-1, descending=True, stable=True).indices[:, :BUDGET - WINDOW])
    return torch.stack(keep).sort(dim=-1).values


@pytest.mark.parametrize("arch", ["granite", "gemma2"])
def test_reference_selects_by_the_models_own_attention(arch, monkeypatch):
    model = _tiny(arch)
    cfg = EvictionConfig(policy="snapkv", budget=BUDGET, window=WINDOW, sinks=SINKS)
    selections = []

    def recording(*args, **kwargs):  # the real select_tokens, its result kept for the check
        keep = select_tokens(*args, **kwargs)
        selections.append(keep)
        return keep

    select_tokens = hf_reference.select_tokens
    monkeypatch.setattr(hf_reference, "select_tokens", recording)
    prompt = torch.randint(0, 128, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    # No protected prompt: the one eviction runs after the first decode step, over the
    # prompt and the first generated token, with the queries of the last WINDOW positions.
    out = ReferenceDecoder(model, cfg, protect_prompt=False).run(prompt, max_new_tokens=3)
    assert out["rounds"] == 1 and len(selections) == 1
    ids = prompt + out["tokens"][:1]
    expected = _expected_keep(model, ids, len(ids) - WINDOW)
    assert torch.equal(selections[0], expected)
    # The check can fail: 1/sqrt(D) scores choose other tokens on these models.
    default = select_tokens(cfg, *_candidates(model, ids))
    assert not torch.equal(default, expected)


def _candidates(model, ids):
    """Post-RoPE keys, values and window queries of the n candidates, recorded the way the
    reference decoder records them."""
    decoder = ReferenceDecoder(model, EvictionConfig(policy="full", budget=BUDGET, window=WINDOW))
    from transformers import DynamicCache

    cache = DynamicCache()
    with decoder._record_queries(), torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    n = len(ids) - WINDOW
    keys = torch.stack([lay.keys[0, :, :n] for lay in cache.layers])
    values = torch.stack([lay.values[0, :, :n] for lay in cache.layers])
    queries = torch.stack([q[0, :, -WINDOW:] for q in decoder._queries])
    return keys, values, queries


# ---------------------------------------------------------------- startup checks on SGLang layers
# Real RadixAttention modules (their constructor needs no distributed state). No model that
# SGLang 0.5.23 serves from a plain MHA pool has v_head_dim != head_dim (those that do use MLA or
# hybrid pools, refused before this check), so the check is tested on the function the startup
# hook (after_post_pool) calls.


def _layers(count=2, head_dim=32, scaling=None, **kwargs):
    from sglang.srt.layers.radix_attention import RadixAttention

    scaling = head_dim**-0.5 if scaling is None else scaling
    return [RadixAttention(4, head_dim, scaling, 2, layer_id=i, **kwargs) for i in range(count)]


def test_startup_check_reads_the_models_scaling_and_cap():
    from vase_sglang import AttentionParams
    from vase_sglang_patches.model_runner import check_attention_layers

    assert check_attention_layers(_layers(), 2, 32, 32) == AttentionParams()  # 1/sqrt(D)
    assert check_attention_layers(_layers(scaling=0.6), 2, 32, 32) == AttentionParams(0.6, 0.0)
    capped = check_attention_layers(_layers(scaling=0.0625, logit_cap=30.0), 2, 32, 32)
    assert capped == AttentionParams(0.0625, 30.0)


def test_startup_check_refuses_what_eviction_cannot_score():
    from vase_sglang_patches.model_runner import check_attention_layers

    with pytest.raises(ValueError, match="value head dim 16 differs from the key head dim 32"):
        check_attention_layers(_layers(v_head_dim=16), 2, 32, 16)
    mixed = _layers(scaling=0.1) + _layers(scaling=0.2)[1:]
    with pytest.raises(ValueError, match=r"differ in \(scaling, logit cap\)"):
        check_attention_layers(mixed, 2, 32, 32)
    with pytest.raises(ValueError, match="logit capping method"):
        check_attention_layers(_layers(logit_cap=5.0, logit_capping_method="other"), 2, 32, 32)
    with pytest.raises(ValueError, match="sliding-window"):
        check_attention_layers(_layers(sliding_window_size=64), 2, 32, 32)


def test_kv_head_offset_follows_sglangs_kv_head_sharding():
    from vase_sglang_patches.model_runner import kv_head_offset

    assert kv_head_offset(8, 8, 0, 1) == (0, 1)
    assert [kv_head_offset(8, 4, r, 2) for r in range(2)] == [(0, 1), (4, 1)]
    # tp 4 > 2 KV heads: QKVParallelLinear gives rank r head r // 2 (2 replicas per head).
    assert [kv_head_offset(2, 1, r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
