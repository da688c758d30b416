"""A KV-eviction policy of your own, in your own module: the worked example of docs/add_policy.md.

`vatp` weighs SnapKV's window-attention score by the L1 norm of each token's value:
score = attention x ||v||_1. This is VATP's value-aware token importance (Guo et al., "Attention
Score is not All You Need for Token Importance Indicator in KV Cache Reduction: Value Also
Matters", EMNLP 2024, arXiv 2406.12335). A token that draws attention but whose value is
near zero adds little to the attention output. The policy keeps the top-k per (layer, KV head),
reads the window queries (needs_queries) and draws nothing.

Use it in-process:

    import my_policy  # registers "vatp"
    from vase_sglang import EvictionConfig, select_tokens
    keep = select_tokens(EvictionConfig(policy="vatp", budget=64, window=16),
                         keys, values, queries)

or serve it. Every SGLang process imports the module first, so every one knows the name:

    PYTHONPATH=examples VASE_KV_EVICT_PLUGINS=my_policy \\
        python -m sglang.launch_server --model-path M --kv-evict-policy vatp ...

tests/test_add_policy_example.py checks it against a naive reference and serves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vase_sglang import Policy, ops, register_policy
from vase_sglang.stream_select import window_attention_streamed


@dataclass(frozen=True)
class VatpPolicy(Policy):
    """Top-k of window attention x ||v||_1; deterministic."""

    # What it needs, read by the config, the server and the benchmarks: the last `window`
    # queries of each request (the server records them); no retention gates, no value slots
    # (Policy's defaults); top-k rather than sampling.
    needs_queries = True

    def score(self, keys, values, queries, draws):
        """keys, values [*batch, H_kv, n, D], queries [*batch, H_q, W, D] ->
        [*batch, H_kv, n] float32, higher = keep."""
        attention = ops.window_attention(
            queries, keys, temperature=self.cfg.temperature, pool_kernel=self.cfg.pool_kernel,
            scaling=self.attention.scaling, softcap=self.attention.softcap)
        return attention * values.float().abs().sum(dim=-1)

    def score_streamed(self, candidates, queries, draws):
        """The same score over candidate chunks, for caches too long to gather at once: the
        built-in streamed window attention (two passes over the keys), then the value norms
        chunk by chunk (local to each candidate)."""
        attention = window_attention_streamed(
            queries, candidates, temperature=self.cfg.temperature,
            pool_kernel=self.cfg.pool_kernel, scaling=self.attention.scaling,
            softcap=self.attention.softcap)
        for start, stop, _, values in candidates.chunks(values=True):
            attention[..., start:stop] *= values.float().abs().sum(dim=-1)
        return attention


register_policy("vatp", VatpPolicy)
