"""Independent oracle of every eviction policy: scores and selection, written from the formulas
(shared/design/algorithms.md, the official VaSE `EvictLayer.update`) and the policy table of
docs/usage.md, in plain Python floats (double precision) and loops, one (request, layer) at a time.

It deliberately imports nothing from `vase_sglang` and mirrors none of its code: readable and
slow, so that a wrong formula there cannot pass by being wrong the same way here.

Inputs of one batch element (torch tensors, any float dtype, read once into Python lists):
  keys, values  [H_kv][n][D]  the candidates (every private token but the newest window)
  queries       [H_q][W][D]   the last W post-RoPE queries
  noise         [H_kv][n]     the Gumbel noise of this eviction round (sampling policies, random)
  projection    [D][r]        the Gaussian projection G (vase-dkv, curdkv)
  log_beta, age [H_kv][n]     trimkv: the gate's log retention of each candidate and its age
                              (position now - position of the token)
The random draws themselves are the engine's (counter-based hash RNG): the tests take them from
the engine and pass them in as data; their distribution is tested separately.

Selection, common to all policies (docs/usage.md: "keeps, besides the sinks and the newest R tokens"):
  1. the first `sinks` candidates are kept;
  2. vase-attnv: then the `value_slots` largest Range(v) among the other candidates
     (N_v slots on top of the sinks; default budget // 4, shrunk to fit); trimkv the same when
     value_slots is given (default 0: TRIM-KV's plain top-k of beta^age);
  3. the remaining K - |forced| slots (K = budget - window) go to the highest ranking keys:
     the score, or for vase-attnv log(score) + Gumbel noise (Gumbel-top-k: sampling without
     replacement with probability proportional to the score);
  ties go to the older (smaller) index; the result is ascending.
"""

from __future__ import annotations

import itertools
import math

POLICIES = ("vase-attnv", "vase-dkv", "snapkv", "rkv", "curdkv", "random", "streaming",
            "evict-large-values", "trimkv")
VALUE_SLOT_POLICIES = ("vase-attnv", "trimkv")


def _rows(tensor):
    """A tensor as nested Python floats (exact: every float dtype widens to double)."""
    return tensor.double().tolist()


# ---------------------------------------------------------------- scores


def softmax(xs):
    top = max(xs)
    exps = [math.exp(x - top) for x in xs]
    total = sum(exps)
    return [e / total for e in exps]


def avg_pool(xs, kernel):
    """avg_pool1d(kernel, stride 1, padding kernel // 2): out-of-range neighbours count as
    zeros, so every output is a sum over `kernel` slots divided by `kernel`."""
    half = kernel // 2
    n = len(xs)
    out = []
    for i in range(n):
        total = 0.0
        for j in range(i - half, i + half + 1):
            if 0 <= j < n:
                total += xs[j]
        out.append(total / kernel)
    return out


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def window_attention(queries, keys, *, temperature=1.0, pool_kernel=5, scaling=None):
    """[H_kv][n]: for each q head, softmax over the candidates of q . k * scaling / tau
    (scaling = 1/sqrt(D) by default), mean over the W window queries, avg-pool along the keys;
    then the mean over the q heads of the KV head's GQA group. q head h reads KV head
    h // (H_q / H_kv) (repeat_kv: a group is a contiguous run of q heads)."""
    q_rows, k_rows = _rows(queries), _rows(keys)
    h_q, h_kv = len(q_rows), len(k_rows)
    d = len(k_rows[0][0])
    group = h_q // h_kv
    scale = (1.0 / math.sqrt(d) if scaling is None else scaling) / temperature
    per_q_head = []
    for h in range(h_q):
        cand = k_rows[h // group]
        mean = [0.0] * len(cand)
        for q in q_rows[h]:
            probs = softmax([dot(q, k) * scale for k in cand])
            for i, p in enumerate(probs):
                mean[i] += p / len(q_rows[h])
        per_q_head.append(avg_pool(mean, pool_kernel) if pool_kernel > 1 else mean)
    out = []
    for kv in range(h_kv):
        members = per_q_head[kv * group:(kv + 1) * group]
        out.append([sum(m[i] for m in members) / group for i in range(len(members[0]))])
    return out


def value_range(values):
    """[H][n]: Range(v) = max_d v[d] - min_d v[d]."""
    return [[max(v) - min(v) for v in head] for head in _rows(values)]


def redundancy(keys):
    """[H][n]: R-KV redundancy as in the official VaSE `cal_redundancy`: cosine similarity of
    each key to every key, self-similarity set to 0, mean over all n, softmax over tokens."""
    out = []
    for head in _rows(keys):
        units = []
        for k in head:
            norm = math.sqrt(dot(k, k))
            units.append([x / norm for x in k] if norm > 0 else [0.0] * len(k))
        n = len(units)
        mean_cos = []
        for i in range(n):
            total = sum(dot(units[i], units[j]) for j in range(n) if j != i)
            mean_cos.append(total / n)
        out.append(softmax(mean_cos))
    return out


def rkv_score(queries, keys, *, rkv_lambda=0.5, temperature=1.0, pool_kernel=5):
    """lambda * window attention - (1 - lambda) * redundancy (official VaSE `attn_rkv`)."""
    importance = window_attention(queries, keys, temperature=temperature, pool_kernel=pool_kernel)
    red = redundancy(keys)
    return [[rkv_lambda * a - (1.0 - rkv_lambda) * r for a, r in zip(ah, rh)]
            for ah, rh in zip(importance, red)]


def cur_leverage(keys, values, projection):
    """[H][n]: ||k G||^2 * ||v G||^2, normalised to sum 1 over the tokens of a head; G [D][r]
    is shared by the heads."""
    g = _rows(projection)
    rank = len(g[0])

    def projected_sq_norm(x):
        return sum(sum(x[d] * g[d][j] for d in range(len(x))) ** 2 for j in range(rank))

    out = []
    for k_head, v_head in zip(_rows(keys), _rows(values)):
        raw = [projected_sq_norm(k) * projected_sq_norm(v) for k, v in zip(k_head, v_head)]
        total = sum(raw)
        out.append([x / total if total > 0 else 0.0 for x in raw])
    return out


def retention_score(log_beta, age):
    """[H][n]: TRIM-KV's retention beta^age, as its logarithm age * log(beta) (the same order;
    beta^age underflows to 0 for old tokens in double already)."""
    return [[a * lb for lb, a in zip(lb_row, a_row)]
            for lb_row, a_row in zip(_rows(log_beta), _rows(age))]


def score(policy, keys, values, queries=None, *, noise=None, projection=None, temperature=1.0,
          pool_kernel=5, rkv_lambda=0.5, log_beta=None, age=None):
    """[H_kv][n] score of each candidate (higher = more worth keeping), before the forced
    tokens and, for vase-attnv, before the Gumbel noise."""
    h, n = keys.shape[0], keys.shape[1]
    if policy == "trimkv":
        return retention_score(log_beta, age)
    if policy in ("vase-attnv", "snapkv"):
        return window_attention(queries, keys, temperature=temperature, pool_kernel=pool_kernel)
    if policy == "rkv":
        return rkv_score(queries, keys, rkv_lambda=rkv_lambda, temperature=temperature,
                         pool_kernel=pool_kernel)
    if policy in ("vase-dkv", "curdkv"):
        return cur_leverage(keys, values, projection)
    if policy == "random":  # any i.i.d. continuous noise ranks a uniform random subset first
        return _rows(noise)
    if policy == "streaming":  # the newest candidates first
        return [[float(i) for i in range(n)] for _ in range(h)]
    if policy == "evict-large-values":  # the smallest ranges first
        return [[-r for r in head] for head in value_range(values)]
    raise ValueError(f"oracle: unknown policy {policy!r}")


# ---------------------------------------------------------------- selection


def default_value_slots(budget, window, sinks):
    """N_v = budget / 4 as in the official scripts, shrunk so that sinks + N_v <= K."""
    return max(0, min(budget // 4, budget - window - sinks))


def best_first(keys_to_rank, among):
    """The indices `among`, best (largest key) first; ties: the older index first."""
    return sorted(among, key=lambda i: (-keys_to_rank[i], i))


def select_head(policy, score_row, range_row, noise_row, *, keep, sinks, value_slots):
    """Ascending kept indices of one KV head, and the ranking key of each candidate
    (None for a forced one)."""
    n = len(score_row)
    forced = list(range(min(sinks, n)))
    if policy in VALUE_SLOT_POLICIES and value_slots:
        others = [i for i in range(n) if i not in forced]
        forced += best_first(range_row, others)[:value_slots]
    if policy == "vase-attnv":
        # Sampling without replacement, p ∝ score == top-k of log(score) + Gumbel noise;
        # a zero weight is drawn only after every positive one.
        rank_key = [math.log(s) + g if s > 0 else -math.inf for s, g in zip(score_row, noise_row)]
    else:
        rank_key = list(score_row)
    rest = [i for i in range(n) if i not in forced]
    chosen = forced + best_first(rank_key, rest)[:keep - len(forced)]
    for i in forced:
        rank_key[i] = None
    return sorted(chosen), rank_key


def select(policy, keys, values, queries=None, *, budget, window, sinks, value_slots=None,
           cfg_sinks=None, noise=None, projection=None, temperature=1.0, pool_kernel=5,
           rkv_lambda=0.5, log_beta=None, age=None):
    """Per KV head: (ascending kept indices, ranking key per candidate).

    sinks: the sinks of this call; cfg_sinks: the configured ones (N_v's default is computed
    from those, default: sinks)."""
    keep = budget - window
    if value_slots is None and policy == "trimkv":
        value_slots = 0
    elif value_slots is None:
        value_slots = default_value_slots(budget, window, sinks if cfg_sinks is None else cfg_sinks)
    scores = score(policy, keys, values, queries, noise=noise, projection=projection,
                   temperature=temperature, pool_kernel=pool_kernel, rkv_lambda=rkv_lambda,
                   log_beta=log_beta, age=age)
    ranges = value_range(values)
    noise_rows = _rows(noise) if noise is not None else [[0.0] * len(s) for s in scores]
    return [select_head(policy, s, r, g, keep=keep, sinks=sinks, value_slots=value_slots)
            for s, r, g in zip(scores, ranges, noise_rows)]


# ---------------------------------------------------------------- sampling distribution


def inclusion_probabilities(weights, m):
    """P(i in sample) for m sequential draws without replacement, each with probability
    proportional to the weight among the items not drawn yet (torch.multinomial's
    replacement=False), by enumerating every ordered outcome."""
    incl = [0.0] * len(weights)
    for outcome in itertools.permutations(range(len(weights)), m):
        p, rest = 1.0, sum(weights)
        for i in outcome:
            p *= weights[i] / rest
            rest -= weights[i]
        for i in outcome:
            incl[i] += p
    return incl


def normal_cdf(x, std=1.0):
    return 0.5 * (1.0 + math.erf(x / (std * math.sqrt(2.0))))


def gumbel_cdf(x):
    return math.exp(-math.exp(-x))


def ks_statistic(samples, cdf):
    """Kolmogorov-Smirnov distance between the empirical distribution of samples and cdf."""
    xs = sorted(samples)
    n = len(xs)
    worst = 0.0
    for i, x in enumerate(xs):
        f = cdf(x)
        worst = max(worst, abs(f - i / n), abs((i + 1) / n - f))
    return worst
