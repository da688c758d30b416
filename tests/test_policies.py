"""Eviction core: selection contract, VaSE guarantees, sampling distribution, RNG keying, errors."""

import itertools
import math

import pytest
import torch

from vase_sglang import POLICIES, POLICY_NAMES, AttentionParams, Draws, EvictionConfig, select_tokens
import oracle  # expected values come from the independent oracle, not from vase_sglang.ops

torch.set_num_threads(1)
EVICTING = [p for p in POLICY_NAMES if p != "full"]


def _kvq(batch=(2, 3), h_kv=2, group=2, n=80, w=16, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(*batch, h_kv, n, d, generator=g)
    v = torch.randn(*batch, h_kv, n, d, generator=g)
    q = torch.randn(*batch, h_kv * group, w, d, generator=g)
    return k, v, q


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize("n", [48, 80, 131])
def test_keeps_exactly_budget_minus_window_ascending_unique(policy, n):
    cfg = EvictionConfig(policy=policy, budget=64, window=16, sinks=4)
    k, v, q = _kvq(n=n)
    keep = select_tokens(cfg, k, v, q)
    assert keep.dtype == torch.int64
    assert keep.shape == (2, 3, 2, cfg.keep)
    assert (keep[..., 1:] > keep[..., :-1]).all(), "indices must be strictly ascending"
    assert keep.min() >= 0 and keep.max() < n
    assert (keep[..., :4] == torch.arange(4)).all(), "sinks always kept"


def test_full_keeps_everything():
    k, v, q = _kvq(n=50)
    keep = select_tokens(EvictionConfig(policy="full", budget=64, window=16), k, v, q)
    assert keep.shape == (2, 3, 2, 50) and (keep == torch.arange(50)).all()


def test_vase_attnv_keeps_planted_large_values_and_sinks():
    n, d, n_value = 96, 32, 16
    cfg = EvictionConfig(policy="vase-attnv", budget=64, window=16, value_slots=n_value, sinks=4)
    for seed in range(5):
        k, v, q = _kvq(batch=(3,), n=n, d=d, seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        planted = torch.stack([torch.randperm(n - 4, generator=g)[:n_value] + 4 for _ in range(6)])
        planted = planted.view(3, 2, n_value)
        # Outliers with a large range but small norm and keys that attract no attention:
        # only the value reservation can save them.
        v.scatter_(-2, planted.unsqueeze(-1).expand(-1, -1, -1, d), 0.0)
        v_big = v.clone()
        idx = planted.unsqueeze(-1).expand(-1, -1, -1, d)
        spike = torch.zeros(3, 2, n_value, d)
        spike[..., 0], spike[..., 1] = 50.0, -50.0
        v_big.scatter_(-2, idx, spike)
        k.scatter_(-2, idx, -100.0 * q.view(3, 2, 2, -1, d).mean(dim=(2, 3)).unsqueeze(-2).expand(-1, -1, n_value, -1))
        keep = select_tokens(cfg, k, v_big, q, round=seed)
        for b, h in itertools.product(range(3), range(2)):
            kept = set(keep[b, h].tolist())
            assert set(planted[b, h].tolist()) <= kept
            assert {0, 1, 2, 3} <= kept
        # Without the reservation the same outliers are dropped: the test can fail.
        keep0 = select_tokens(cfg.replace(value_slots=0), k, v_big, q, round=seed)
        assert not all(set(planted[b, h].tolist()) <= set(keep0[b, h].tolist())
                       for b in range(3) for h in range(2))


def test_value_slots_are_the_largest_ranges_among_non_sinks():
    cfg = EvictionConfig(policy="vase-attnv", budget=64, window=16, value_slots=20, sinks=4)
    k, v, q = _kvq(n=100)
    keep = select_tokens(cfg, k, v, q)
    for r, l in itertools.product(range(2), range(3)):
        for h, spread in enumerate(oracle.value_range(v[r, l])):
            top = oracle.best_first(spread, range(4, 100))[:20]
            assert set(top) <= set(keep[r, l, h].tolist())


def test_weighted_sampling_matches_sampling_without_replacement():
    # One KV head, one query, no pooling: the attention weights are softmax(a) with a chosen a.
    weights = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
    n, m, trials = len(weights), 3, 4000
    cfg = EvictionConfig(policy="vase-attnv", budget=m + 1, window=1, value_slots=0, sinks=0,
                         pool_kernel=1, seed=1234)
    d = n
    keys = torch.diag(torch.log(torch.tensor(weights))).view(1, 1, n, d).expand(trials, 1, n, d)
    queries = torch.full((trials, 1, 1, d), math.sqrt(d))
    values = torch.zeros(trials, 1, n, d)
    probs = oracle.window_attention(queries[0], keys[0], pool_kernel=1)[0]
    assert max(abs(p - w) for p, w in zip(probs, weights)) < 1e-6

    keep = select_tokens(cfg, keys, values, queries)  # each batch element is its own stream
    freq = torch.zeros(n)
    freq.scatter_add_(0, keep.flatten(), torch.ones(keep.numel()))
    freq /= trials
    exact = torch.tensor(oracle.inclusion_probabilities(weights, m))
    # 4000 trials: std of a frequency <= 0.0079; tolerance ~3.8 sigma, fixed seed.
    assert (freq - exact).abs().max() < 0.03, (freq, exact)
    # The tolerance separates it from plain top-k and from proportional inclusion m*w.
    proportional = (torch.tensor(weights) * m).clamp(max=1)
    assert (proportional - exact).abs().max() > 0.06
    assert (freq[:3] < 0.99).all()


def test_random_policy_is_uniform():
    trials, n, k_keep = 3000, 10, 4
    cfg = EvictionConfig(policy="random", budget=k_keep + 1, window=1, sinks=0, seed=7)
    k = torch.zeros(trials, 1, n, 4)
    keep = select_tokens(cfg, k, k)
    freq = torch.bincount(keep.flatten(), minlength=n).float() / trials
    assert (freq - k_keep / n).abs().max() < 0.04


@pytest.mark.parametrize("policy", ["vase-attnv", "vase-dkv", "random"])
def test_same_seed_same_result_other_round_or_seed_differs(policy):
    cfg = EvictionConfig(policy=policy, budget=64, window=16, seed=3)
    k, v, q = _kvq(n=200)
    a = select_tokens(cfg, k, v, q, request=torch.tensor([[5], [6]]), layer=torch.arange(3), round=2)
    b = select_tokens(cfg, k, v, q, request=torch.tensor([[5], [6]]), layer=torch.arange(3), round=2)
    assert torch.equal(a, b)
    other_round = select_tokens(cfg, k, v, q, request=torch.tensor([[5], [6]]), layer=torch.arange(3), round=3)
    other_seed = select_tokens(cfg.replace(seed=4), k, v, q, request=torch.tensor([[5], [6]]),
                               layer=torch.arange(3), round=2)
    other_request = select_tokens(cfg, k, v, q, request=torch.tensor([[7], [6]]),
                                  layer=torch.arange(3), round=2)
    assert not torch.equal(a, other_round)
    assert not torch.equal(a, other_seed)
    assert not torch.equal(a[0], other_request[0]) and torch.equal(a[1], other_request[1])


def test_draws_do_not_depend_on_batch_neighbours():
    cfg = EvictionConfig(policy="vase-attnv", budget=64, window=16)
    k, v, q = _kvq(batch=(3,), n=120)
    together = select_tokens(cfg, k, v, q, request=torch.tensor([10, 11, 12]), layer=1, round=4)
    alone = select_tokens(cfg, k[1:2], v[1:2], q[1:2], request=torch.tensor([11]), layer=1, round=4)
    assert torch.equal(together[1:2], alone)


@pytest.mark.parametrize("policy", EVICTING)
def test_tensor_parallel_head_shards_select_what_one_process_selects(policy):
    # A tp=2 rank holds KV heads [o, o + 2) and their query heads; with head_offset = o its
    # selection must be the one-process selection of those heads (issue 12: tp=2 == tp=1).
    cfg = EvictionConfig(policy=policy, budget=64, window=16, seed=3)
    k, v, q = _kvq(h_kv=4, group=2, n=150)
    ids = dict(request=torch.tensor([[5], [9]]), layer=torch.arange(3), round=torch.tensor([[1], [4]]))
    whole = select_tokens(cfg, k, v, q, **ids)

    def shard(first, offset):
        heads, q_heads = slice(first, first + 2), slice(2 * first, 2 * first + 4)
        return select_tokens(cfg, k[..., heads, :, :], v[..., heads, :, :],
                             q[..., q_heads, :, :], head_offset=offset, **ids)

    assert torch.equal(torch.cat([shard(0, 0), shard(2, 2)], dim=-2), whole)
    if policy in ("vase-attnv", "random"):
        # The check can fail: keyed by the local head (offset 0 on every rank), rank 1 reuses
        # rank 0's noise and selects other tokens.
        assert not torch.equal(shard(2, 0), whole[..., 2:, :])


def test_head_offset_keys_the_gumbel_noise_by_global_head():
    draws = Draws.make(7, (2,), "cpu", request=torch.tensor([1, 2]), layer=3, round=1)
    shifted = Draws.make(7, (2,), "cpu", request=torch.tensor([1, 2]), layer=3, round=1,
                         head_offset=3)
    assert torch.equal(draws.gumbel((5, 40))[:, 3:], shifted.gumbel((2, 40)))
    with pytest.raises(ValueError, match="head_offset"):
        select_tokens(EvictionConfig(policy="random", budget=64, window=16), *_kvq()[:2],
                      head_offset=-1)


@pytest.mark.parametrize("policy", ["snapkv", "rkv", "vase-attnv"])
def test_attention_scores_use_the_models_scaling_and_softcap(policy):
    # A model whose logit scale is not 1/sqrt(D) (Granite's attention_multiplier, Gemma-2's
    # query_pre_attn_scalar) or that soft-caps its logits: the selection must follow its
    # attention, i.e. equal the default selection on queries rescaled to the same logits.
    cfg = EvictionConfig(policy=policy, budget=64, window=16, seed=1)
    k, v, q = _kvq(n=150, d=32)
    ids = dict(request=torch.tensor([[5], [9]]), layer=torch.arange(3), round=2)
    scaled = select_tokens(cfg, k, v, q, attention=AttentionParams(scaling=0.6), **ids)
    assert torch.equal(scaled, select_tokens(cfg, k, v, q * (0.6 * 32**0.5), **ids))
    assert not torch.equal(scaled, select_tokens(cfg, k, v, q, **ids))
    capped = select_tokens(cfg, k, v, q, attention=AttentionParams(scaling=0.6, softcap=1.0), **ids)
    assert not torch.equal(capped, scaled)


def test_vase_dkv_redraws_projection_each_round_curdkv_does_not():
    draws = [Draws.make(0, (2,), "cpu", request=torch.tensor([1, 2]), layer=0, round=r) for r in range(2)]
    assert not torch.equal(draws[0].projection(32, 20, True), draws[1].projection(32, 20, True))
    assert torch.equal(draws[0].projection(32, 20, False), draws[1].projection(32, 20, False))
    g = draws[0].projection(128, 20, True)
    assert g.shape == (2, 128, 20)
    assert abs(g.std().item() - 1 / math.sqrt(20)) < 0.02 and abs(g.mean().item()) < 0.01
    k, v, q = _kvq(n=300)
    cfg = EvictionConfig(policy="vase-dkv", budget=64, window=16)
    r0, r1 = (select_tokens(cfg, k, v, q, round=r) for r in range(2))
    assert not torch.equal(r0, r1)
    cfg = cfg.replace(policy="curdkv")
    c0, c1 = (select_tokens(cfg, k, v, q, round=r) for r in range(2))
    assert torch.equal(c0, c1)


def test_streaming_keeps_the_sinks_and_the_newest():
    k, v, q = _kvq(n=90)
    cfg = EvictionConfig(policy="streaming", budget=64, window=16, sinks=4)
    keep = select_tokens(cfg, k, v, q)
    assert (keep == torch.cat([torch.arange(4), torch.arange(90 - 44, 90)])).all()
    # The other policies against their definitions: tests/test_oracle.py.


def test_sinks_override_for_protected_prompts():
    cfg = EvictionConfig(policy="streaming", budget=64, window=16, sinks=4)
    k, v, q = _kvq(n=90)
    keep = select_tokens(cfg, k, v, q, sinks=0)
    assert (keep == torch.arange(90 - 48, 90)).all()
    with pytest.raises(ValueError, match="sinks"):
        select_tokens(cfg, k, v, q, sinks=5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(budget=64, window=64), "budget"),
        (dict(budget=32, window=64), "budget"),
        (dict(budget=-5), "budget"),
        (dict(window=0), "window"),
        (dict(window=-1), "window"),
        (dict(sinks=-1), "sinks"),
        (dict(seed=-3), "seed"),
        (dict(value_slots=-1), "value_slots"),
        (dict(budget=128, window=64, value_slots=62, sinks=4), "value_slots"),
        (dict(policy="snapkv", value_slots=10), "value_slots"),
        (dict(policy="nope"), "policy"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(pool_kernel=4), "pool_kernel"),
        (dict(projection_rank=0), "projection_rank"),
        (dict(rkv_lambda=1.5), "rkv_lambda"),
        (dict(budget=100.5), "budget"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        EvictionConfig(**kwargs)


def test_default_value_slots_is_a_quarter_of_the_budget():
    assert EvictionConfig(budget=1024).n_value_slots == 256
    assert EvictionConfig(budget=2048).n_value_slots == 512
    assert EvictionConfig(policy="snapkv", budget=1024).n_value_slots == 0
    assert EvictionConfig(budget=1024).trigger_len == 1088 and EvictionConfig(budget=1024).keep == 960


def test_what_a_policy_needs_is_read_from_its_class():
    """Value slots, gates and the policy lists come from the registered classes: a policy
    registered with its own value-slot default is validated and resolved with no edit to the
    config, and the lists of names follow the registry."""
    from vase_sglang.policies import VaseAttnVPolicy, needs_gates, policy_names, register_policy

    # the built-ins, snapshot at import; register_policy's come after them
    assert ("full", *policy_names(retention=False))[:len(POLICY_NAMES)] == POLICY_NAMES
    assert "trimkv" in policy_names() and "trimkv" not in policy_names(retention=False)
    assert needs_gates("trimkv") and not needs_gates("full") and not needs_gates("snapkv")
    owners = [n for n, p in POLICIES.items() if p.reserves_value_slots]
    assert owners[:2] == ["vase-attnv", "trimkv"]
    assert EvictionConfig(policy="trimkv", budget=64, window=16).n_value_slots == 0

    class Eighth(VaseAttnVPolicy):
        @classmethod
        def default_value_slots(cls, cfg):
            return cfg.budget // 8

    register_policy("test-eighth", Eighth)
    try:
        assert EvictionConfig(policy="test-eighth", budget=64, window=16).n_value_slots == 8
        assert EvictionConfig(policy="test-eighth", budget=64, window=16,
                              value_slots=3).n_value_slots == 3
        with pytest.raises(ValueError, match=r"value_slots: only the vase-attnv policy reserves "
                           r"value slots \(and trimkv, as the VaSE \+ retention hybrid\) ") as err:
            EvictionConfig(policy="snapkv", value_slots=4)
        assert str(err.value).endswith(" (and test-eighth) (policy is 'snapkv'); leave it unset "
                                       "or 0")
        assert "test-eighth" in policy_names() and not needs_gates("test-eighth")
    finally:
        del POLICIES["test-eighth"]


def test_bad_inputs_name_the_argument():
    cfg = EvictionConfig(policy="vase-attnv", budget=64, window=16)
    k, v, q = _kvq(n=80)
    with pytest.raises(ValueError, match="^values:"):
        select_tokens(cfg, k, v[..., :70, :], q)
    with pytest.raises(ValueError, match="^queries:"):
        select_tokens(cfg, k, v, None)
    with pytest.raises(ValueError, match="^queries:"):
        select_tokens(cfg, k, v, q[..., :3, :, :])
    with pytest.raises(ValueError, match="^queries:"):
        select_tokens(cfg, k, v, q[..., :16])
    with pytest.raises(ValueError, match="^keys:"):
        select_tokens(cfg, k[..., :40, :], v[..., :40, :], q)
    with pytest.raises(ValueError, match="^request/layer/round:"):
        select_tokens(cfg, k, v, q, request=torch.arange(5))
    bad = q.clone()
    bad[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="^scores:"):
        select_tokens(cfg, k, v, bad)
    bad_v = v.clone()
    bad_v[0, 0, 0, 5, 0] = float("nan")
    with pytest.raises(ValueError, match="^scores:"):
        select_tokens(cfg.replace(policy="vase-dkv", value_slots=None), k, bad_v, q)


@pytest.mark.parametrize("policy", ["vase-attnv", "evict-large-values"])
def test_exact_ties_go_to_the_older_token_whatever_the_batch_shape(policy):
    # Repeated tokens give identical V in the first layer: exact ties in Range(v).
    # K = 36 and N_v = 5 are not multiples of the 8 copies: the cut falls inside a tie.
    cfg = EvictionConfig(policy=policy, budget=44, window=8, value_slots=None if policy != "vase-attnv" else 5,
                         sinks=0)
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 6, 16, generator=g)
    values = base[:, torch.arange(48) % 6]  # every vector repeated 8 times: ranges tie
    keys = torch.randn(2, 48, 16, generator=g)
    queries = torch.randn(4, 8, 16, generator=g)
    alone = select_tokens(cfg, keys, values, queries, request=3, layer=0, round=1)
    batched = select_tokens(cfg, torch.stack([keys] * 5), torch.stack([values] * 5),
                            torch.stack([queries] * 5), request=3, layer=torch.zeros(5, dtype=torch.long),
                            round=1)
    assert all(torch.equal(alone, b) for b in batched)
    for h, spread in enumerate(oracle.value_range(values)):
        if policy == "evict-large-values":
            # The 36 smallest ranges: 4 vectors x 8 copies, then the 4 oldest copies of the 5th.
            smallest = sorted(range(48), key=lambda i: (spread[i], i))[:36]
            assert alone[h].tolist() == sorted(smallest)
        else:  # the value slots: the 5 oldest of the 8 copies of the largest-range vector
            largest = sorted(range(48), key=lambda i: (-spread[i], i))[:5]
            forced = POLICIES[policy](cfg).forced(keys, values, 0)[h]
            assert forced.nonzero().flatten().tolist() == sorted(largest)
            assert set(largest) <= set(alone[h].tolist())


def test_no_code_outside_the_policy_classes_branches_on_a_policy_name():
    """What a policy needs lives on its class (needs_queries, needs_retention, value slots):
    code that compares a policy to a built-in name would leave a policy added with
    register_policy unserved or mis-benchmarked. "full" (no eviction) is not a policy."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    names = "|".join(re.escape(n) for n in POLICIES)
    pattern = re.compile(rf"""[=!]=\s*["']({names})["']|["']({names})["']\s*[=!]=""")
    offenders = []
    for folder in ("vase_sglang", "patches", "benchmarks", "scripts", "examples"):
        for path in sorted((repo / folder).rglob("*.py")):
            if path == repo / "vase_sglang" / "policies.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(repo)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
