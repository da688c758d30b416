"""Statistics of the accuracy harness: Wilson intervals, exact McNemar, paired bootstrap,
first divergence, and KL between next-token distributions known only on their top-k."""

from __future__ import annotations

import math
import random


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (good at small n and near 0 or 1)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b, c = discordant pairs (only A right, only B right);
    under H0 each discordant pair goes either way with probability 1/2."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_bootstrap(a: list[float], b: list[float], iters: int = 10000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Mean of a - b over the pairs, and a percentile bootstrap CI resampling pairs."""
    assert len(a) == len(b)
    n = len(a)
    if n == 0:
        return (float("nan"),) * 3
    d = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    lo = means[int((1 - level) / 2 * iters)]
    hi = means[min(iters - 1, int((1 + level) / 2 * iters))]
    return (sum(d) / n, lo, hi)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where two token sequences differ (the shorter one's length if one is a
    prefix of the other); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def coarse_kl(ref_lp: list[float], pol_lp: list[float]) -> float:
    """KL(P_ref || Q_pol) on the partition {the reference's top-k ids} + {all other ids}.

    ref_lp / pol_lp: logprobs of the same k ids (the reference's top-k) under each model. This is
    the exact KL of the coarsened distributions, hence a lower bound of the full-vocabulary KL
    (data processing inequality); with k = 20 the tail mass is usually tiny."""
    kl = 0.0
    ps = qs = 0.0
    for lp, lq in zip(ref_lp, pol_lp):
        p = math.exp(lp)
        ps += p
        qs += math.exp(lq)
        kl += p * (lp - lq)
    rp, rq = max(0.0, 1 - ps), max(1e-12, 1 - qs)
    if rp > 1e-12:
        kl += rp * math.log(rp / rq)
    return max(0.0, kl)


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def cluster_bootstrap(sums: list[float], counts: list[int], iters: int = 10000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """Pooled mean sum(sums) / sum(counts) of a per-token metric, and a percentile bootstrap CI
    that resamples problems (clusters), not tokens: tokens of one generation are correlated, so
    a token-level bootstrap would give intervals far too narrow."""
    m, lo, hi, _ = paired_cluster_bootstrap(sums, [0.0] * len(sums), counts, iters, seed, level)
    return m, lo, hi


def paired_cluster_bootstrap(sums_a: list[float], sums_b: list[float], counts: list[int],
                             iters: int = 10000, seed: int = 0,
                             level: float = 0.95) -> tuple[float, float, float, float]:
    """Difference of two pooled per-token means measured on the same tokens of the same
    problems (A − B), its percentile bootstrap CI resampling problems, and the two-sided
    bootstrap p-value (twice the smaller share of resampled differences on either side of 0)."""
    import numpy as np

    a, b = np.asarray(sums_a, dtype=float), np.asarray(sums_b, dtype=float)
    c = np.asarray(counts, dtype=float)
    if len(a) == 0 or c.sum() == 0:
        return (float("nan"),) * 4
    idx = np.random.default_rng(seed).integers(0, len(a), size=(iters, len(a)))
    den = c[idx].sum(1)
    ok = den > 0
    diffs = np.sort((a[idx].sum(1) - b[idx].sum(1))[ok] / den[ok])
    k = len(diffs)
    p = min(1.0, 2 * min((diffs <= 0).mean(), (diffs >= 0).mean()))
    return (float((a.sum() - b.sum()) / c.sum()), float(diffs[int((1 - level) / 2 * k)]),
            float(diffs[min(k - 1, int((1 + level) / 2 * k))]), float(p))


def paired_accuracy(a_ok: list[float], b_ok: list[float], iters: int = 10000) -> dict:
    """Two arms' correctness (1.0 / 0.0) on the same problems, in the same order: the accuracy
    difference a − b with its paired bootstrap interval, the discordant counts and McNemar's
    exact p."""
    only_a = sum(int(x > y) for x, y in zip(a_ok, b_ok, strict=True))
    only_b = sum(int(y > x) for x, y in zip(a_ok, b_ok, strict=True))
    d, lo, hi = paired_bootstrap(a_ok, b_ok, iters=iters)
    return {"n_paired": len(a_ok), "acc_diff": d, "acc_diff_boot95": [lo, hi],
            "only_a_right": only_a, "only_b_right": only_b,
            "mcnemar_p": mcnemar_exact(only_a, only_b)}
