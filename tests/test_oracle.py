"""Every policy against the independent oracle (tests/oracle.py, which shares no code with
vase_sglang): scores and selected indices on small random inputs, for GQA ratios 1, 2, 4 and 7,
odd candidate counts, several (request, layer) batch elements, sinks 0 and > 0 (and the
protected-prompt override), fp32 and bf16 inputs, both kernel backends; then the distribution
of the random draws the oracle takes as data (Gumbel noise, projections, the resulting
sampling without replacement).

The random draws come from the engine's counter-based RNG (`Draws`), which the oracle cannot
reproduce without sharing its code; the tests pass them to the oracle as data and check their
distribution separately, with stated false-failure rates (all seeds fixed, so each check is
deterministic anyway)."""

import math

import pytest
import torch

import oracle
from vase_sglang import EvictionConfig, select_tokens
from vase_sglang.policies import POLICIES, Draws, Retention

torch.set_num_threads(1)

BUDGET, WINDOW = 24, 6  # K = 18 kept of n candidates
H_KV, W, D = 2, 5, 16
REQUESTS, LAYERS, ROUND = (5, 9), (0, 1), 3  # batch elements: 2 requests x 2 layers
GROUPS = [1, 2, 4, 7]
DTYPES = [torch.float32, torch.bfloat16]
# (configured sinks, sinks passed to select_tokens: None = the configured ones). (4, 1) is the
# engine's protected-prompt case: 3 of the 4 sinks already lie in the protected prompt.
SINKS = [(0, None), (3, None), (4, 1)]
# Non-default scoring settings, one per GQA ratio, so that each is exercised somewhere (rkv's
# default lambda 0.5 could not tell lambda from 1 - lambda).
SETTINGS = {1: {}, 2: dict(temperature=0.8), 4: dict(rkv_lambda=0.3), 7: dict(pool_kernel=3)}


def test_oracle_covers_every_policy():
    assert set(POLICIES) == set(oracle.POLICIES)


def _inputs(group, dtype, n, seed, scale=1.5):
    gen = torch.Generator().manual_seed(seed)
    batch = (len(REQUESTS), len(LAYERS))
    k = (torch.randn(*batch, H_KV, n, D, generator=gen) * scale).to(dtype)
    v = torch.randn(*batch, H_KV, n, D, generator=gen).to(dtype)
    q = (torch.randn(*batch, H_KV * group, W, D, generator=gen) * scale).to(dtype)
    return k, v, q


def _n(group):
    return 31 + 2 * group  # odd, and different per case: 33, 35, 39, 45


def _ids():
    request = torch.tensor(REQUESTS)[:, None]
    layer = torch.tensor(LAYERS)[None, :]
    return request, layer


def _draws(cfg, k):
    request, layer = _ids()
    return Draws.make(cfg.seed, k.shape[:-3], k.device, request, layer, ROUND)


def _random_data(policy, cfg, draws, k):
    """The engine's draws for this round, as the oracle's inputs: Gumbel noise [.., H, n] for
    the sampling policies, the projection G [.., D, r] for the CUR ones (vase-dkv redraws it
    every round, curdkv once per generation)."""
    noise = projection = None
    if policy in ("vase-attnv", "random"):
        noise = draws.gumbel(k.shape[-3:-1])
    if policy in ("vase-dkv", "curdkv"):
        projection = draws.projection(k.shape[-1], cfg.projection_rank,
                                      per_round=(policy == "vase-dkv"))
    return noise, projection


def _retention(policy, k, seed):
    """trimkv's inputs: log β = logsigmoid of a spread of gate outputs (from ~0 to ~-9), and
    ages of positions that differ per head (an earlier eviction kept different tokens in each
    head); None for the other policies."""
    if policy != "trimkv":
        return None
    gen = torch.Generator().manual_seed(1000 + seed)
    n = k.shape[-2]
    log_beta = torch.nn.functional.logsigmoid(torch.randn(k.shape[:-1], generator=gen) * 4 + 2)
    positions = torch.rand(*k.shape[:-2], 3 * n, generator=gen).argsort(-1)[..., :n].sort(-1).values
    age = (3 * n + 5) - positions
    return Retention(log_beta.to(k.dtype), age)


def _retention_of(ret, idx):
    if ret is None:
        return {}
    return dict(log_beta=ret.log_beta[idx], age=ret.age[idx])


def _element(x, idx):
    return None if x is None else x[idx]


def _elements(k):
    return [(r, l) for r in range(k.shape[0]) for l in range(k.shape[1])]


def _oracle_options(cfg):
    return dict(temperature=cfg.temperature, pool_kernel=cfg.pool_kernel, rkv_lambda=cfg.rkv_lambda)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_scores_match_oracle(policy, group, dtype):
    cfg = EvictionConfig(policy=policy, budget=BUDGET, window=WINDOW, seed=11, **SETTINGS[group])
    n = _n(group)
    k, v, q = _inputs(group, dtype, n, seed=group)
    draws = _draws(cfg, k)
    ret = _retention(policy, k, group)
    got = POLICIES[policy](cfg, retention=ret).score(k, v, q, draws).double()
    noise, projection = _random_data(policy, cfg, draws, k)
    for idx in _elements(k):
        expected = torch.tensor(oracle.score(
            policy, k[idx], v[idx], q[idx], noise=_element(noise, idx),
            projection=_element(projection, idx), **_retention_of(ret, idx),
            **_oracle_options(cfg)), dtype=torch.float64)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got[idx], expected, rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m: f"{policy}, element {idx}: {m}")


def _assert_same_selection(got, expected, what, strict=False):
    """got: [H, K] indices; expected: oracle.select output. Equal sets, or (unless strict) a
    difference only among candidates whose ranking keys tie with the boundary up to float
    rounding (the oracle computes in double, the engine in fp32)."""
    for h, (kept, rank_key) in enumerate(expected):
        mine = got[h].tolist()
        assert mine == sorted(mine), f"{what}, head {h}: not ascending: {mine}"
        if mine == kept:
            continue
        assert not strict, f"{what}, head {h}: kept {mine}, oracle {kept}"
        finite = [x for x in rank_key if x is not None and math.isfinite(x)]
        tol = 1e-5 * max(abs(x) for x in finite)
        boundary = min(rank_key[i] for i in kept if rank_key[i] is not None)
        for i in set(mine) ^ set(kept):
            assert rank_key[i] is not None and abs(rank_key[i] - boundary) <= tol, (
                f"{what}, head {h}: kept {mine}, oracle {kept}; candidate {i} is not a near tie "
                f"(key {rank_key[i]}, boundary {boundary})")


@pytest.mark.parametrize("cfg_sinks, call_sinks", SINKS, ids=["sinks0", "sinks3", "sinks4-override1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_selection_matches_oracle(policy, group, dtype, cfg_sinks, call_sinks):
    cfg = EvictionConfig(policy=policy, budget=BUDGET, window=WINDOW, sinks=cfg_sinks, seed=11,
                         **SETTINGS[group])
    n = _n(group)
    k, v, q = _inputs(group, dtype, n, seed=100 + group)
    request, layer = _ids()
    ret = _retention(policy, k, 100 + group)
    keep = select_tokens(cfg, k, v, q, request=request, layer=layer, round=ROUND, sinks=call_sinks,
                         retention=ret)
    assert keep.shape == (len(REQUESTS), len(LAYERS), H_KV, BUDGET - WINDOW)
    noise, projection = _random_data(policy, cfg, _draws(cfg, k), k)
    sinks = cfg_sinks if call_sinks is None else call_sinks
    for idx in _elements(k):
        expected = oracle.select(
            policy, k[idx], v[idx], q[idx], budget=BUDGET, window=WINDOW, sinks=sinks,
            cfg_sinks=cfg_sinks, noise=_element(noise, idx), projection=_element(projection, idx),
            **_retention_of(ret, idx), **_oracle_options(cfg))
        _assert_same_selection(keep[idx], expected, f"{policy}, element {idx}")


@pytest.mark.parametrize("policy", ["vase-attnv", "evict-large-values"])
def test_exact_value_range_ties_match_oracle_strictly(policy):
    # Integer-valued V: ranges are small integers with many exact ties in every precision, so
    # the older-token tie rule is compared with no tolerance.
    cfg = EvictionConfig(policy=policy, budget=BUDGET, window=WINDOW, sinks=2, seed=4,
                         value_slots=8 if policy == "vase-attnv" else None)
    k, _, q = _inputs(2, torch.float32, 41, seed=7)
    gen = torch.Generator().manual_seed(8)
    v = torch.randint(-3, 4, k.shape, generator=gen).float()
    request, layer = _ids()
    keep = select_tokens(cfg, k, v, q, request=request, layer=layer, round=ROUND)
    noise, _ = _random_data(policy, cfg, _draws(cfg, k), k)
    for idx in _elements(k):
        expected = oracle.select(policy, k[idx], v[idx], q[idx], budget=BUDGET, window=WINDOW,
                                 sinks=2, value_slots=cfg.value_slots, noise=_element(noise, idx))
        if policy == "evict-large-values":
            _assert_same_selection(keep[idx], expected, f"{policy}, element {idx}", strict=True)
        else:  # the value slots are decided by the ranges alone: compare them strictly
            ranges = oracle.value_range(v[idx])
            for h in range(H_KV):
                slots = oracle.best_first(ranges[h], range(2, 41))[:8]
                assert set(slots) <= set(keep[idx][h].tolist()), (idx, h, slots)
            _assert_same_selection(keep[idx], expected, f"{policy}, element {idx}")


@pytest.mark.parametrize("value_slots", [0, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_trimkv_exact_ties_and_value_slots_match_oracle_strictly(dtype, value_slots):
    """trimkv alone and as the VaSE hybrid (value_slots > 0), compared with no tolerance:
    log β in {-1/4, -1/2, -1, -2} and integer ages make exact products in fp32 and bf16, with
    many exact ties (-1 * 4 == -2 * 2), so the older-token tie rule is checked too; integer V
    makes exact value-range ties for the value slots."""
    cfg = EvictionConfig(policy="trimkv", budget=BUDGET, window=WINDOW, sinks=2,
                         value_slots=value_slots)
    k, _, q = _inputs(2, dtype, 41, seed=9)
    gen = torch.Generator().manual_seed(10)
    v = torch.randint(-3, 4, k.shape, generator=gen).to(dtype)
    choices = torch.tensor([-0.25, -0.5, -1.0, -2.0])
    log_beta = choices[torch.randint(0, 4, k.shape[:-1], generator=gen)].to(dtype)
    age = torch.randint(1, 12, k.shape[:-1], generator=gen)
    ret = Retention(log_beta, age)
    request, layer = _ids()
    keep = select_tokens(cfg, k, v, q, request=request, layer=layer, round=ROUND, retention=ret)
    for idx in _elements(k):
        expected = oracle.select("trimkv", k[idx], v[idx], q[idx], budget=BUDGET, window=WINDOW,
                                 sinks=2, value_slots=value_slots, **_retention_of(ret, idx))
        _assert_same_selection(keep[idx], expected, f"trimkv, element {idx}", strict=True)


def test_trimkv_keeps_the_highest_retention_not_the_newest():
    """By the definition, on a case checkable by hand: one head, 6 candidates, keep 3 besides
    no sinks. Scores log β * age: [-0.5*6, -0.01*5, -1*4, -0.5*3, -2*2, -0.1*1] =
    [-3, -0.05, -4, -1.5, -4, -0.1]: kept 1, 3, 5 (the old token 1 outlives newer 2 and 4)."""
    cfg = EvictionConfig(policy="trimkv", budget=4, window=1, sinks=0)
    keys = torch.zeros(1, 6, 4)
    ret = Retention(torch.tensor([[-0.5, -0.01, -1.0, -0.5, -2.0, -0.1]]),
                    torch.tensor([[6, 5, 4, 3, 2, 1]]))
    assert select_tokens(cfg, keys, keys, retention=ret).tolist() == [[1, 3, 5]]
    with pytest.raises(ValueError, match="retention: policy 'trimkv' needs"):
        select_tokens(cfg, keys, keys)
    with pytest.raises(ValueError, match="does not broadcast"):
        select_tokens(cfg, keys, keys, retention=Retention(ret.log_beta[:, :5], ret.age))
    with pytest.raises(ValueError, match="does not use retention"):
        select_tokens(cfg.replace(policy="streaming"), keys, keys, retention=ret)


@pytest.mark.parametrize("policy", ["snapkv", "rkv", "vase-dkv", "evict-large-values"])
def test_triton_kernels_match_oracle(policy, monkeypatch):
    """The same scores through the Triton kernels (CPU interpreter), so that a formula wrong
    in both the kernel and its torch reference cannot pass test_kernels.py."""
    monkeypatch.setenv("VASE_KERNELS", "triton")
    cfg = EvictionConfig(policy=policy, budget=BUDGET, window=WINDOW, seed=11)
    k, v, q = _inputs(2, torch.bfloat16, 37, seed=3)
    draws = _draws(cfg, k)
    got = POLICIES[policy](cfg).score(k, v, q, draws).double()
    _, projection = _random_data(policy, cfg, draws, k)
    for idx in _elements(k):
        expected = torch.tensor(oracle.score(policy, k[idx], v[idx], q[idx],
                                             projection=_element(projection, idx)),
                                dtype=torch.float64)
        scale = expected.abs().max().item()
        torch.testing.assert_close(got[idx], expected, rtol=1e-4, atol=1e-6 * scale)


def test_rkv_penalises_redundant_keys():
    """rkv by its definition, on a case checkable by hand: with lambda = 0 only redundancy
    counts, and the copies of one key (cosine 1 with each other) are dropped first."""
    cfg = EvictionConfig(policy="rkv", budget=6, window=1, sinks=0, rkv_lambda=0.0)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 8, 4, generator=gen)
    keys[0, 1] = keys[0, 4] = keys[0, 6] = keys[0, 2] * 3.0  # four parallel keys
    queries = torch.randn(2, 3, 4, generator=gen)
    keep = select_tokens(cfg, keys, keys, queries)
    # 5 of 8 kept: the 4 others and one of the 4 parallel keys.
    assert set(keep[0].tolist()) >= {0, 3, 5, 7}
    assert len(set(keep[0].tolist()) & {1, 2, 4, 6}) == 1
    expected = oracle.select("rkv", keys, keys, queries, budget=6, window=1, sinks=0, rkv_lambda=0.0)
    _assert_same_selection(keep, expected, "rkv lambda=0")


# ---------------------------------------------------------------- distributions of the draws


def _exact_inclusion_with_forced(weights, forced, m):
    """Inclusion probability of every candidate when `forced` are kept and m more are drawn
    without replacement ∝ weight from the others."""
    others = [i for i in range(len(weights)) if i not in forced]
    probs = oracle.inclusion_probabilities([weights[i] for i in others], m)
    incl = [1.0 if i in forced else 0.0 for i in range(len(weights))]
    for i, p in zip(others, probs):
        incl[i] = p
    return incl


@pytest.mark.parametrize("policy", ["vase-attnv", "random"])
def test_sampling_inclusion_frequencies_match_exact_probabilities(policy):
    """The whole sampling path (GQA-pooled attention weights from the oracle, forced sink and
    value slot, Gumbel-top-k on the engine's hash RNG) against the exact inclusion
    probabilities of sequential sampling without replacement (torch.multinomial semantics).

    Trials: 20000 independent streams (one request key each). A frequency has standard
    deviation <= 0.5 / sqrt(20000) = 0.0035; the tolerance 0.02 is 5.6 sigma, so the chance
    that any of the 9 frequencies fails by chance is < 9 * 2e-8 (normal approximation)."""
    trials, n, group = 20000, 9, 2
    cfg = EvictionConfig(policy=policy, budget=6, window=1, sinks=1, seed=21,
                         value_slots=1 if policy == "vase-attnv" else None)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(1, 1, n, 4, generator=gen) * 2.0
    v = torch.randn(1, 1, n, 4, generator=gen)
    q = torch.randn(1, group, 3, 4, generator=gen) * 2.0
    keep = select_tokens(cfg, k.expand(trials, -1, -1, -1), v.expand(trials, -1, -1, -1),
                         q.expand(trials, -1, -1, -1), request=torch.arange(trials), layer=0)
    freq = torch.bincount(keep[:, 0].flatten(), minlength=n).double() / trials

    if policy == "vase-attnv":
        weights = oracle.window_attention(q[0], k[0])[0]
        ranges = oracle.value_range(v[0])[0]
        forced = [0] + oracle.best_first(ranges, range(1, n))[:1]
    else:
        weights, forced = [1.0] * n, [0]
    m = cfg.keep - len(forced)
    exact = torch.tensor(_exact_inclusion_with_forced(weights, forced, m), dtype=torch.float64)
    assert (freq - exact).abs().max() < 0.02, (freq, exact)
    if policy == "vase-attnv":
        # The tolerance can tell sampling without replacement from its look-alikes: uniform
        # sampling, and inclusion proportional to the weight.
        others = [i for i in range(n) if i not in forced]
        total = sum(weights[i] for i in others)
        uniform = [m / len(others) for _ in others]
        proportional = [min(1.0, m * weights[i] / total) for i in others]
        for alternative in (uniform, proportional):
            assert max(abs(a - exact[i].item()) for a, i in zip(alternative, others)) > 0.06


# Kolmogorov-Smirnov: P(sqrt(N) * D_N > c) <= 2 exp(-2 c^2) (DKW); c = 2.6 gives a
# false-failure rate below 2e-6 per check.
KS_C = 2.6


def test_gumbel_noise_is_standard_gumbel():
    cfg = EvictionConfig(policy="vase-attnv", budget=24, window=6, seed=2)
    draws = Draws.make(cfg.seed, (4, 3), "cpu", torch.arange(4)[:, None], torch.arange(3)[None, :], 1)
    noise = draws.gumbel((2, 2000)).flatten().tolist()  # 48000 draws across 12 streams
    assert oracle.ks_statistic(noise, oracle.gumbel_cdf) < KS_C / math.sqrt(len(noise))


@pytest.mark.parametrize("per_round", [True, False])
def test_projection_entries_are_normal_with_variance_one_over_rank(per_round):
    draws = Draws.make(3, (6,), "cpu", torch.arange(6), 0, 2)
    rank = 20
    g = draws.projection(128, rank, per_round).flatten().tolist()  # 15360 entries
    std = 1.0 / math.sqrt(rank)
    assert oracle.ks_statistic(g, lambda x: oracle.normal_cdf(x, std)) < KS_C / math.sqrt(len(g))
    # The check can fail: the same entries against N(0, 1) (unscaled G).
    assert oracle.ks_statistic(g, oracle.normal_cdf) > KS_C / math.sqrt(len(g))
