"""Test-only policy, loaded into servers through VASE_KV_EVICT_PLUGINS=permute_policy.

`test-permute` keeps every candidate but shuffles them differently in each (layer, KV head):
attention over post-RoPE keys does not depend on their order, so greedy output must equal
stock SGLang. It exercises the per-head gather and the row bookkeeping of the engine."""

from vase_sglang import Policy, register_policy


class PermutePolicy(Policy):
    ascending = False

    def select(self, keys, values, queries, draws, sinks, check=True):
        noise = draws.gumbel(keys.shape[-3:-1])  # [..., H, n], new every round
        return noise.argsort(dim=-1)


register_policy("test-permute", PermutePolicy)
