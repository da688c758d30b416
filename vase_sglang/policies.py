"""The eviction decision: which older tokens each (request, layer, KV head) keeps.

Every policy is a small frozen dataclass (a `Policy` subclass) with `score()` (higher = keep)
and, through the base class, `select()`. Selection is the same for all of them:
  1. forced tokens: the sinks (first tokens of the sequence), plus for policies that reserve
     value slots (vase-attnv; trimkv when set) the `value_slots` candidates with the largest
     Range(v);
  2. the remaining slots go to the best scores (top-k), or for sampling policies are drawn
     without replacement with probability proportional to the score. Gumbel-top-k
     (top-k of log w + Gumbel noise) has exactly that distribution and runs batched.
Indices come back ascending per head, so "older slot = older token" stays true across rounds.

What a policy needs (window queries, retention gates, value slots and their default count) is
stated on its class (`Policy.needs_queries`, `needs_retention`, `reserves_value_slots`,
`default_value_slots`, ...); config validation, the server, its memory plan, warm-up and the
benchmarks read those attributes and the registry `POLICIES`, never a policy's name. Adding a
policy is one class and one `register_policy` call: docs/add_policy.md.

Where the n candidates of a (request, layer) are too many to score at once (a long private
cache), `score_streamed()` computes the same score from candidate chunks, keeping only
[..., H, n] arrays (vase_sglang/stream_select.py), and `select_streamed()` then selects as
`select()` does; `select_tokens(..., chunk=c)` takes that path.

Nothing here knows about SGLang: inputs are plain tensors with any leading batch dims
(typically [requests, layers]).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import ops, rng
from .config import EvictionConfig
from .registry import POLICIES
from .stream_select import (TensorCandidates, cur_leverage_streamed, mean_cosine_streamed,
                            mean_cosine_to_others, value_range_streamed,
                            window_attention_streamed)


def top_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim; ties go to the older token.

    Exact ties are common (in the first layer, V depends on the token id alone, so repeated
    tokens have equal value ranges) and topk breaks them in an unspecified order that can
    change with batch shape; a stable sort makes the choice reproducible everywhere."""
    return score.sort(dim=-1, descending=True, stable=True).indices[..., :k]


@dataclass(frozen=True)
class AttentionParams:
    """How the model turns q . k into attention logits, for the window-attention scores.

    Facts of the model (SGLang: RadixAttention.scaling / logit_cap; transformers: the attention
    module's scaling / attn_logit_softcapping), not user settings, so not in EvictionConfig.
    """

    scaling: float | None = None  # logit = q . k * scaling; None: 1/sqrt(head_dim)
    softcap: float = 0.0  # > 0: logit = softcap * tanh(logit / softcap) (Gemma-2); 0: none

    @classmethod
    def of_layer(cls, scaling, softcap, head_dim: int) -> "AttentionParams":
        """From an attention layer's own values (softcap None or 0: none). The standard
        1/sqrt(head_dim), however the model spells it, becomes None: the default arithmetic,
        so standard models score bit-identically to a call without AttentionParams."""
        scaling = float(scaling)
        if math.isclose(scaling, 1.0 / math.sqrt(head_dim), rel_tol=1e-9):
            scaling = None
        return cls(scaling=scaling, softcap=float(softcap or 0.0))


@dataclass(frozen=True)
class Draws:
    """Random streams of one batched eviction step: one 32-bit key per batch element.

    `per_round` changes every eviction round; `per_generation` is fixed for a request's whole
    generation (curdkv's projection is drawn once, vase-dkv's at every round).
    `head_offset` is the global index of local KV head 0: per-head noise is indexed by the
    global head, so a tensor-parallel rank holding heads [o, o + h) draws what one process
    holding all heads draws for them (offset 0 reproduces the draws of one process).
    """

    per_round: torch.Tensor
    per_generation: torch.Tensor
    head_offset: int = 0

    @classmethod
    def make(cls, seed, batch_shape, device, request=None, layer=None, round=0,
             head_offset: int = 0) -> "Draws":
        """seed: an int, or a tensor broadcasting to the batch shape (one seed per element)."""
        if request is None and layer is None:
            # No identities given: each batch element is its own stream.
            count = 1
            for size in batch_shape:
                count *= size
            request = torch.arange(count, device=device).reshape(batch_shape)
        request = torch.as_tensor(0 if request is None else request, device=device)
        layer = torch.as_tensor(0 if layer is None else layer, device=device)
        round = torch.as_tensor(round, device=device)
        seed_shape = seed.shape if isinstance(seed, torch.Tensor) else ()
        try:
            shape = torch.broadcast_shapes(tuple(batch_shape), request.shape, layer.shape,
                                           round.shape, seed_shape)
        except RuntimeError:
            shape = None
        if shape != tuple(batch_shape):
            raise ValueError(
                f"request/layer/round{'/seed' if seed_shape else ''}: shapes "
                f"{tuple(request.shape)}, {tuple(layer.shape)}, {tuple(round.shape)}"
                f"{', ' + str(tuple(seed_shape)) if seed_shape else ''} do not broadcast to the "
                f"batch shape {tuple(batch_shape)}"
            )
        gen = rng.stream_key(seed, request, layer, device=device).expand(shape)
        per_round = rng.stream_key(seed, request, layer, round + 1, device=device).expand(shape)
        return cls(per_round=per_round, per_generation=gen, head_offset=head_offset)

    @staticmethod
    def _index(key: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
        count = 1
        for size in shape:
            count *= size
        index = torch.arange(count, device=key.device, dtype=torch.int64).reshape(shape)
        return key.reshape(*key.shape, *([1] * len(shape))), index

    def gumbel(self, shape) -> torch.Tensor:
        """Gumbel noise [*batch, heads, n] for shape (heads, n), new every round. Element
        (h, j) is stream index (head_offset + h) * n + j: the global KV head's own noise."""
        heads, n = shape
        key, index = self._index(self.per_round, (heads, n))
        return rng.gumbel(key, index + self.head_offset * n)

    def projection(self, head_dim: int, rank: int, per_round: bool) -> torch.Tensor:
        """G [*batch, D, r] with entries N(0, 1/r), shared by the KV heads of a layer."""
        key = self.per_round if per_round else self.per_generation
        key = rng.mix32(key ^ 0x5BD1E995)  # a sub-stream distinct from the Gumbel noise
        return rng.normal(*self._index(key, (head_dim, rank))) / rank**0.5


@dataclass(frozen=True, eq=False)
class Retention:
    """Learned retention of the candidates (trimkv): log β [..., H_kv, n] (<= 0, from the
    gates when the token was created) and age [..., H_kv, n] (true position now minus the
    token's position; "now" is the position of the next token to be processed). Both
    broadcast to the candidates' [..., H_kv, n]."""

    log_beta: torch.Tensor
    age: torch.Tensor


@dataclass(frozen=True)
class Policy:
    """An eviction policy: which `cfg.keep` of n candidates each (batch element, KV head) keeps.

    A subclass overrides `score()` (and, to be servable on long caches, `score_streamed()`);
    `select()` ranks by the score (or samples from it), forces the sinks and value slots and
    takes the top `cfg.keep`. An instance is built for one selection by `select_tokens`.
    Register a subclass under a `--kv-evict-policy` name with `register_policy`
    (docs/add_policy.md has a worked example).

    What the policy needs is stated here, as class attributes, and read by everything else
    (config validation, the server's hooks and memory plan, warm-up, benchmarks):
        needs_queries: score() reads the window queries: the server records the last
            `window` queries of every request (a query ring) and passes them.
        needs_retention: score() reads a `Retention` (per-token log β and age from a gates
            file; trimkv); served only by servers started with --kv-evict-retention-gates.
        reads_kv: False when the score ignores K/V contents (engines then skip the gather
            and pass shape-only stand-ins for keys and values).
        samples: the kept tokens are drawn without replacement with probability ∝ score
            (Gumbel-top-k) instead of taken top-k; score() must then be >= 0.
        ascending: select() returns ascending indices per head (in-place compaction); a
            policy overriding select() with unsorted indices sets False.
        reserves_value_slots: cfg.value_slots may force the largest Range(v) candidates
            (forced()); EvictionConfig refuses value_slots > 0 for other policies.
        value_slots_note: how error messages name its value slots after the first owner's.
    and `default_value_slots(cfg)`: how many value slots an unset cfg.value_slots gives.

    Args:
        cfg: the eviction settings (budget, window, sinks, value slots, scoring knobs).
        attention: the model's attention logit scaling and soft-cap (window attention).
        retention: per-candidate log β and age, for needs_retention policies; else None.
    """

    cfg: EvictionConfig
    attention: AttentionParams = AttentionParams()
    retention: Retention | None = None  # per-candidate inputs of needs_retention policies
    needs_queries: ClassVar[bool] = False
    needs_retention: ClassVar[bool] = False  # scores from a Retention (gates file), not K/V
    reads_kv: ClassVar[bool] = True  # False: the score ignores K/V contents (engines skip the read)
    samples: ClassVar[bool] = False  # weighted sampling without replacement instead of top-k
    ascending: ClassVar[bool] = True  # select() returns ascending indices (in-place compaction)
    reserves_value_slots: ClassVar[bool] = False  # cfg.value_slots may force large Range(v)
    value_slots_note: ClassVar[str] = ""  # e.g. ", as the VaSE + retention hybrid"
    # Its scores rank candidates of different (layer, KV head) against each other, so one
    # ranking can serve a budget shared by heads (cfg.budget_scope "layer"/"global": issue 52)
    shares_budget: ClassVar[bool] = False

    @classmethod
    def default_value_slots(cls, cfg: EvictionConfig) -> int:
        """N_v of a config whose value_slots is unset (None), for reserves_value_slots
        policies: 0 here (value slots only when asked for).

        Args:
            cfg: the config being resolved (its budget, window, sinks).

        Returns:
            The number of value slots, 0 <= N_v <= cfg.keep - cfg.sinks.
        """
        return 0

    @classmethod
    def shares_budget_refusal(policy) -> str | None:
        """Why `policy` (which sets shares_budget) cannot be served under a shared budget scope,
        or None. The shared-scope step (patches/shared_scope.py, docs/add_policy.md) ranks every
        candidate of a request's layers and heads at once from retention alone: it calls
        score_streamed(candidates, None, None) with `candidates` of shape [L, n, H_kv] and
        `retention` the log β and age of each, and takes the top of the raw scores. So it needs
        needs_retention, a score_streamed of its own, no queries, no sampling and the base class's
        select() and forced()."""
        if not policy.shares_budget:
            return None
        owner = {name: next(k for k in policy.__mro__ if name in vars(k))
                 for name in ("score_streamed", "select", "forced")}
        needs = []
        if not policy.needs_retention:
            needs.append("needs_retention (the shared-scope step scores from retention gates' log "
                         "β and age only, never K/V)")
        if policy.needs_queries:
            needs.append("no needs_queries (it passes no queries)")
        if policy.samples:
            needs.append("no samples (it takes the top of the raw scores, draws nothing)")
        if owner["score_streamed"] is Policy:
            needs.append("a score_streamed (what it calls)")
        if owner["select"] is not Policy or owner["forced"] is not Policy:
            needs.append("the base select() and forced() (it ranks the scores itself)")
        if not needs:
            return None
        return "a shared budget scope needs " + "; ".join(needs) + " (docs/add_policy.md)"

    def score(self, keys, values, queries, draws: Draws) -> torch.Tensor:
        """How much each candidate is worth keeping: higher = keep.

        Args:
            keys: [*batch, H_kv, n, D] the candidates' keys, post-RoPE, in the cache's dtype
                (bf16, fp16, fp32 or an fp8 view); shape-only stand-ins where `reads_kv` is
                False.
            values: [*batch, H_kv, n, D] the candidates' values (likewise).
            queries: [*batch, H_q, W, D] the last W queries, H_q a multiple of H_kv (query
                head h belongs to KV head h // (H_q / H_kv)), or None unless `needs_queries`.
            draws: the selection's random streams (`Draws.gumbel`, `Draws.projection`),
                keyed by (seed, request, layer, global KV head, round).

        Returns:
            [*batch, H_kv, n] scores (any float dtype; ranked in float32), higher = keep;
            weights >= 0 for `samples` policies. NaN is refused by select (check=True).
        """
        raise NotImplementedError

    def forced(self, keys, values, sinks: int) -> torch.Tensor:
        """Bool [..., H, n]: candidates kept whatever their score: the sinks, then the
        value_slots largest Range(v) among the others (only policies that allow value slots
        have cfg.n_value_slots > 0).

        Args:
            keys, values: [..., H, n, D] the candidates (values read only for value slots).
            sinks: how many of the first candidates are sinks.

        Returns:
            [..., H, n] bool, True = kept whatever the score.
        """
        return self._forced_mask(keys.shape[:-1], keys.device, sinks,
                                 lambda: ops.value_range(values))

    def _forced_mask(self, shape, device, sinks: int, value_range) -> torch.Tensor:
        """forced() from the candidates' Range(v), computed by value_range() if needed."""
        mask = torch.zeros(shape, dtype=torch.bool, device=device)
        mask[..., :sinks] = True
        n_value = self.cfg.n_value_slots
        if n_value:
            spread = value_range().masked_fill(mask, float("-inf"))
            mask.scatter_(-1, top_indices(spread, n_value), True)
        return mask

    def select(self, keys, values, queries, draws: Draws, sinks: int, check: bool = True):
        """The candidates to keep: forced tokens, then the best ranked (top-k of the score, or
        Gumbel-top-k of log score for `samples` policies).

        Args:
            keys, values, queries, draws: as for score().
            sinks: how many of the first candidates are kept as sinks (<= cfg.sinks).
            check: raise ValueError on NaN scores (a device sync).

        Returns:
            LongTensor [*batch, H_kv, cfg.keep] of distinct candidate indices, ascending per
            head (a subclass that overrides select may return them unsorted if it sets
            `ascending = False`).
        """
        score = self._ranking(self.score(keys, values, queries, draws), draws, check)
        return self._top(score, self.forced(keys, values, sinks))

    def _ranking(self, score: torch.Tensor, draws: Draws, check: bool) -> torch.Tensor:
        """The key each candidate is ranked by: the score, or for sampling policies
        log(score) + Gumbel noise."""
        score = score.float()
        if check and torch.isnan(score).any():
            raise ValueError(
                f"scores: policy {self.cfg.policy!r} produced NaN scores; keys, values or "
                f"queries contain NaN or Inf"
            )
        if self.samples:
            # Gumbel-top-k == sequential sampling without replacement with p ∝ score.
            # Clamping keeps zero-weight tokens drawable (uniformly, after all positive ones).
            score = score.clamp_min(1e-30).log() + draws.gumbel(score.shape[-2:])
        return score

    def _top(self, score: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
        score = score.masked_fill(forced, float("inf"))
        return top_indices(score, self.cfg.keep).sort(dim=-1).values

    # Streamed over candidate chunks (vase_sglang/stream_select.py): for units whose n
    # candidates do not fit in memory at once. Only O(n H) per-candidate arrays are held.

    def score_streamed(self, candidates, queries, draws: Draws) -> torch.Tensor:
        """score() from `candidates` read chunk by chunk: the same values up to float
        summation order, holding only [*batch, H_kv, n] arrays, never all n candidates'
        K/V or an [H_q, W, n] temporary. Policies without it cannot be streamed: a server
        skips (does not evict) their requests in a step too big for its workspace at once.

        Args:
            candidates: a stream_select.Candidates of shape (*batch, H_kv, n) and head_dim D;
                `candidates.chunks(keys=True, values=True)` yields (start, stop, keys, values)
                with keys / values [*batch, H_kv, stop - start, D], valid until the next
                chunk (each call is one more pass over the candidates).
            queries: [*batch, H_q, W, D] or None, as for score().
            draws: as for score().

        Returns:
            [*batch, H_kv, n] scores, equal to score()'s up to float summation order.
        """
        raise NotImplementedError

    @classmethod
    def streams(cls) -> bool:
        """Whether select_streamed() selects what select() does: score_streamed() is defined
        by the class that defines score(), or below it, and select() and forced() are the
        base class's (a custom policy overriding either cannot be streamed)."""
        def owner(name):
            return next(k for k in cls.__mro__ if name in vars(k))

        streamed = owner("score_streamed")
        return streamed is not Policy and all(
            issubclass(streamed, owner(name)) for name in ("score", "select", "forced"))

    def select_streamed(self, candidates, queries, draws: Draws, sinks: int,
                        check: bool = True) -> torch.Tensor:
        """select() over candidate chunks: the streamed score, then the same ranking, forced
        tokens and top-k on the full-length [..., H, n] arrays."""
        score = self._ranking(self.score_streamed(candidates, queries, draws), draws, check)
        forced = self._forced_mask(candidates.shape, candidates.device, sinks,
                                   lambda: value_range_streamed(candidates))
        return self._top(score, forced)


@dataclass(frozen=True)
class StreamingPolicy(Policy):
    """Sinks + the most recent candidates (StreamingLLM)."""

    reads_kv: ClassVar[bool] = False

    def score(self, keys, values, queries, draws):
        n = keys.shape[-2]
        return torch.arange(n, device=keys.device, dtype=torch.float32).expand(keys.shape[:-1])

    def score_streamed(self, candidates, queries, draws):
        n, device = candidates.n, candidates.device
        return torch.arange(n, device=device, dtype=torch.float32).expand(candidates.shape)


@dataclass(frozen=True)
class RandomPolicy(Policy):
    """Uniform per-head subset (Random Attention); reads no KV."""

    reads_kv: ClassVar[bool] = False

    def score(self, keys, values, queries, draws):
        return draws.gumbel(keys.shape[-3:-1])

    def score_streamed(self, candidates, queries, draws):
        return draws.gumbel(candidates.shape[-2:])


@dataclass(frozen=True)
class SnapKVPolicy(Policy):
    """Deterministic top-k of the window-attention score."""

    needs_queries: ClassVar[bool] = True

    def score(self, keys, values, queries, draws):
        return ops.window_attention(
            queries, keys, temperature=self.cfg.temperature, pool_kernel=self.cfg.pool_kernel,
            scaling=self.attention.scaling, softcap=self.attention.softcap,
        )

    def score_streamed(self, candidates, queries, draws):
        return window_attention_streamed(
            queries, candidates, temperature=self.cfg.temperature,
            pool_kernel=self.cfg.pool_kernel, scaling=self.attention.scaling,
            softcap=self.attention.softcap,
        )


@dataclass(frozen=True)
class RKVPolicy(SnapKVPolicy):
    """lambda * importance - (1 - lambda) * redundancy, as the R-KV baseline of the VaSE code:
    redundancy = softmax over tokens of the mean cosine similarity to the other keys."""

    def score(self, keys, values, queries, draws):
        importance = super().score(keys, values, queries, draws)
        redundancy = torch.softmax(mean_cosine_to_others(keys), dim=-1)
        lam = self.cfg.rkv_lambda
        return lam * importance - (1.0 - lam) * redundancy

    def score_streamed(self, candidates, queries, draws):
        importance = super().score_streamed(candidates, queries, draws)
        redundancy = torch.softmax(mean_cosine_streamed(candidates), dim=-1)
        lam = self.cfg.rkv_lambda
        return lam * importance - (1.0 - lam) * redundancy


@dataclass(frozen=True)
class VaseAttnVPolicy(SnapKVPolicy):
    """VaSE-AttnV: the value_slots largest Range(v) are kept (Policy.forced), the rest
    sampled ∝ attention."""

    samples: ClassVar[bool] = True
    reserves_value_slots: ClassVar[bool] = True

    @classmethod
    def default_value_slots(cls, cfg: EvictionConfig) -> int:
        """T/4, as every official VaSE script, shrunk only where T/4 and the sinks cannot
        fit in budget - window."""
        return max(0, min(cfg.budget // 4, cfg.keep - cfg.sinks))


@dataclass(frozen=True)
class CurDKVPolicy(Policy):
    """CUR leverage ||kG||^2 ||vG||^2, top-k; G drawn once per generation."""

    redraw_each_round: ClassVar[bool] = False

    def score(self, keys, values, queries, draws):
        g = draws.projection(keys.shape[-1], self.cfg.projection_rank, self.redraw_each_round)
        return ops.cur_leverage(keys, values, g.to(keys.device))

    def score_streamed(self, candidates, queries, draws):
        g = draws.projection(candidates.head_dim, self.cfg.projection_rank, self.redraw_each_round)
        return cur_leverage_streamed(candidates, g.to(candidates.device))


@dataclass(frozen=True)
class VaseDKVPolicy(CurDKVPolicy):
    """VaSE-DKV: CUR leverage with the projection redrawn at every eviction."""

    redraw_each_round: ClassVar[bool] = True


@dataclass(frozen=True)
class EvictLargeValuesPolicy(Policy):
    """Ablation: keeps the smallest-range tokens, i.e. evicts exactly what VaSE protects."""

    def score(self, keys, values, queries, draws):
        return -ops.value_range(values)

    def score_streamed(self, candidates, queries, draws):
        return -value_range_streamed(candidates)


@dataclass(frozen=True)
class TrimKVPolicy(Policy):
    """TRIM-KV (arXiv 2512.03324): score = log β · age = log(β^(now - i)), top-k. β comes from
    a learned gate when the token is created (vase_sglang.retention); the older a token and
    the smaller its β, the lower its score. With value_slots (default 0) the largest Range(v)
    are forced first: the VaSE + learned-retention hybrid."""

    needs_retention: ClassVar[bool] = True
    reserves_value_slots: ClassVar[bool] = True  # default 0: plain TRIM-KV
    # log β · age is the log of the probability the gate gives the token of surviving: one
    # scale for every head and layer (the global capacity loss trains for it)
    shares_budget: ClassVar[bool] = True
    value_slots_note: ClassVar[str] = ", as the VaSE + retention hybrid"

    def score(self, keys, values, queries, draws):
        return self._retention_score(keys.shape[:-1])

    def score_streamed(self, candidates, queries, draws):
        # log β and age are O(n H) already (the side buffers' rows): nothing to stream.
        return self._retention_score(candidates.shape)

    def _retention_score(self, shape) -> torch.Tensor:
        r = self.retention
        if r is None:
            raise ValueError("retention: policy 'trimkv' needs the log β and age of every candidate")
        return (r.log_beta.float() * r.age.float()).expand(shape)


POLICIES.update({  # the registry (registry.py): the built-ins, then register_policy()
    "vase-attnv": VaseAttnVPolicy,
    "vase-dkv": VaseDKVPolicy,
    "snapkv": SnapKVPolicy,
    "rkv": RKVPolicy,
    "curdkv": CurDKVPolicy,
    "random": RandomPolicy,
    "streaming": StreamingPolicy,
    "evict-large-values": EvictLargeValuesPolicy,
    "trimkv": TrimKVPolicy,
})


def policy_names(*, retention: bool = True) -> tuple[str, ...]:
    """The registered policy names, in registration order (the built-ins, then those added by
    register_policy, e.g. in a VASE_KV_EVICT_PLUGINS module imported by now).

    Args:
        retention: False leaves out the policies that need retention gates (needs_retention),
            which only servers started with --kv-evict-retention-gates serve.

    Returns:
        The names, without "full" (no eviction, not a policy class).
    """
    return tuple(name for name, policy in POLICIES.items()
                 if retention or not policy.needs_retention)


def needs_gates(name: str) -> bool:
    """Whether the registered policy `name` scores from retention gates (a gates file must be
    loaded to serve it); False for "full" and for names not registered."""
    policy = POLICIES.get(name)
    return policy is not None and policy.needs_retention


def register_policy(name: str, policy: type[Policy]) -> None:
    """Add a policy under a --kv-evict-policy name (docs/add_policy.md).

    From then on EvictionConfig accepts the name, select_tokens runs it, and a server that
    imported the registering module (VASE_KV_EVICT_PLUGINS=module) serves it, per server or
    per request. Its select() may return any distinct candidate indices, at most n per head
    (set `ascending = False` if they are not sorted).

    Args:
        name: the --kv-evict-policy / custom_params.kv_evict.policy name; not "full", not a
            name already registered to another class (registering the same class again is a
            no-op).
        policy: a Policy subclass.

    Raises:
        ValueError: "policy: ..." for a non-Policy or a taken name.
    """
    if not (isinstance(policy, type) and issubclass(policy, Policy)):
        raise ValueError(f"policy: {policy!r} is not a Policy subclass")
    if name == "full" or (name in POLICIES and POLICIES[name] is not policy):
        raise ValueError(f"policy: the name {name!r} is taken")
    refusal = policy.shares_budget_refusal()
    if refusal:
        raise ValueError(f"policy: {name!r} sets shares_budget, but {refusal}")
    POLICIES[name] = policy


# The user-facing values of --kv-evict-policy of a server without retention gates: "full" and
# every built-in policy that does not need them (trimkv, which scores from a gates file, is
# served only by servers started with --kv-evict-retention-gates, docs/retention.md). A
# snapshot of the built-ins; policy_names() lists what is registered now, plugins included.
POLICY_NAMES = ("full", *policy_names(retention=False))


def _check_shapes(cfg: EvictionConfig, keys, values, queries, needs_queries: bool) -> None:
    if keys.dim() < 3:
        raise ValueError(f"keys: expected [..., H_kv, n, D], got shape {tuple(keys.shape)}")
    if values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(
            f"values: shape {tuple(values.shape)} does not match keys {tuple(keys.shape)} "
            f"in [..., H_kv, n]"
        )
    if keys.shape[-2] < cfg.keep:
        raise ValueError(
            f"keys: {keys.shape[-2]} candidate tokens cannot fill budget - window = {cfg.keep}"
        )
    if needs_queries:
        if queries is None:
            raise ValueError(f"queries: policy {cfg.policy!r} needs the window queries")
        if queries.dim() != keys.dim() or queries.shape[:-3] != keys.shape[:-3]:
            raise ValueError(
                f"queries: expected [..., H_q, W, D] with the batch dims of keys "
                f"{tuple(keys.shape[:-3])}, got {tuple(queries.shape)}"
            )
        if queries.shape[-1] != keys.shape[-1]:
            raise ValueError(
                f"queries: head dim {queries.shape[-1]} differs from keys' {keys.shape[-1]}"
            )
        if queries.shape[-3] % keys.shape[-3] != 0:
            raise ValueError(
                f"queries: {queries.shape[-3]} query heads are not a multiple of "
                f"{keys.shape[-3]} KV heads"
            )


def _checked_retention(cfg: EvictionConfig, keys, retention) -> Retention | None:
    needs = POLICIES[cfg.policy].needs_retention
    if retention is None:
        if needs:
            raise ValueError(f"retention: policy {cfg.policy!r} needs the log β and age of every "
                             f"candidate (a Retention; gates from vase_sglang.retention)")
        return None
    if not needs:
        raise ValueError(f"retention: policy {cfg.policy!r} does not use retention; pass None")
    if not isinstance(retention, Retention):
        raise ValueError(f"retention: expected a Retention, got {type(retention).__name__}")
    for name in ("log_beta", "age"):
        t = getattr(retention, name)
        try:
            ok = torch.broadcast_shapes(t.shape, keys.shape[:-1]) == keys.shape[:-1]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"retention: {name} of shape {tuple(t.shape)} does not broadcast to "
                             f"the candidates [..., H_kv, n] = {tuple(keys.shape[:-1])}")
    return retention


@dataclass(frozen=True, eq=False)
class SelectParams:
    """Who a selection is for and how to run it: the keyword arguments that `select_tokens`
    and `select_candidates` share, as one object (like SGLang's MatchPrefixParams). Build one
    and pass `params=`, or pass the fields as keywords (they override `params`' own).

    Args:
        request: id of the request(s), an int or an integer tensor broadcasting to the batch
            dims (an engine's request keys); keys the draws.
        layer: layer id(s), likewise (e.g. [1, L] beside request [b, 1]). With neither request
            nor layer, each batch element is its own stream.
        round: eviction round(s) (0 the first), likewise: the noise is new every round.
        seed: the draws' seed, an int or a tensor broadcasting to the batch dims (an engine's
            requests with their own seeds in one batch); None: cfg.seed. Element-wise it draws
            exactly what cfg.replace(seed=that value) draws.
        head_offset: global index of the first KV head in `keys` (a tensor-parallel rank's
            first head), so per-head draws do not depend on the sharding; >= 0.
        sinks: how many of the first candidates are sinks, in [0, cfg.sinks]; None: cfg.sinks
            (an engine whose protected prompt already holds the sinks passes fewer).
        attention: the model's logit scaling and soft-cap; None: 1/sqrt(D), none.
        retention: log β and age of every candidate, for needs_retention policies (trimkv)
            only; see `Retention`.
        check: raise ValueError on NaN scores (costs a device sync).
    """

    request: object = None
    layer: object = None
    round: object = 0
    seed: object = None
    head_offset: int = 0
    sinks: int | None = None
    attention: AttentionParams | None = None
    retention: Retention | None = None
    check: bool = True

    def draws(self, cfg: EvictionConfig, batch_shape, device) -> Draws:
        """The random streams of a selection over batch dims `batch_shape` with these ids."""
        return Draws.make(cfg.seed if self.seed is None else self.seed, batch_shape, device,
                          self.request, self.layer, self.round, head_offset=self.head_offset)


def _params(params: SelectParams | None, fields: dict) -> SelectParams:
    if params is not None and not isinstance(params, SelectParams):
        raise ValueError(f"params: expected a SelectParams, got {type(params).__name__}")
    params = params if params is not None else SelectParams()
    return dataclasses.replace(params, **fields) if fields else params


def select_tokens(
    cfg: EvictionConfig,
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None = None,
    *,
    params: SelectParams | None = None,
    chunk: int | None = None,
    **fields,
) -> torch.Tensor:
    """Which candidates each (batch element, KV head) keeps: the policy `cfg.policy` run on
    plain tensors (what a server's eviction step runs on its gathers).

    Args:
        cfg: the eviction settings; a non-evicting one ("full") keeps every candidate.
        keys: [*batch, H_kv, n, D] the candidates (every token but the newest `window`),
            post-RoPE; n >= cfg.keep.
        values: [*batch, H_kv, n, D].
        queries: [*batch, H_q, W, D] the last W queries (needs_queries policies only; H_q a
            multiple of H_kv, same D).
        params: who the selection is for and how to run it (`SelectParams`: request, layer,
            round, seed, head_offset, sinks, attention, retention, check).
        chunk: score the candidates `chunk` tokens at a time (the streamed path, for
            candidates whose score temporaries do not fit in memory: stream_select.py); the
            same selection up to float summation order. Policies that cannot stream raise
            ValueError.
        **fields: SelectParams fields as keywords (request=..., round=..., ...), overriding
            those of `params`.

    Returns:
        LongTensor [*batch, H_kv, cfg.keep] (budget - window) of candidate indices, ascending
        per head (unless a registered policy sets ascending = False); "full": all n.

    Raises:
        ValueError: naming the argument at fault (shapes, ids, a policy's missing inputs).
    """
    if not isinstance(cfg, EvictionConfig):
        raise ValueError(f"cfg: expected an EvictionConfig, got {type(cfg).__name__}")
    params = _params(params, fields)
    n = keys.shape[-2] if keys.dim() >= 2 else 0
    if not cfg.evicts:
        return torch.arange(n, device=keys.device).expand(*keys.shape[:-2], n)
    candidates = None
    if chunk is not None:
        candidates = TensorCandidates(keys, values, chunk)
    policy, draws, sinks = _prepare(cfg, keys, values, queries, keys.device, params,
                                    streamed=candidates is not None)
    if candidates is not None:
        return policy.select_streamed(candidates, queries, draws, sinks, check=params.check)
    return policy.select(keys, values, queries, draws, sinks, check=params.check)


def select_candidates(cfg: EvictionConfig, candidates, queries: torch.Tensor | None = None, *,
                      params: SelectParams | None = None, **fields) -> torch.Tensor:
    """select_tokens over candidates read chunk by chunk (a stream_select.Candidates, e.g. an
    engine's gathers from its KV pool into a bounded workspace).

    Args:
        cfg: an evicting config whose policy streams (Policy.streams).
        candidates: a stream_select.Candidates of shape (*batch, H_kv, n).
        queries, params, **fields: as for select_tokens.

    Returns:
        As select_tokens.
    """
    if not isinstance(cfg, EvictionConfig) or not cfg.evicts:
        raise ValueError(f"cfg: expected an EvictionConfig of an evicting policy, got {cfg!r}")
    params = _params(params, fields)
    # shapes only: a broadcast scalar (on meta, so memory planning counts nothing either)
    like = torch.empty((), device="meta").expand(*candidates.shape, candidates.head_dim)
    policy, draws, sinks = _prepare(cfg, like, like, queries, candidates.device, params,
                                    streamed=True)
    return policy.select_streamed(candidates, queries, draws, sinks, check=params.check)


def _prepare(cfg, keys, values, queries, device, params: SelectParams, *, streamed):
    """select_tokens' checks, then (policy, draws, sinks). keys / values give the shapes."""
    attention = params.attention
    if attention is None:
        attention = AttentionParams()
    if not isinstance(attention, AttentionParams):
        raise ValueError(f"attention: expected an AttentionParams, got {type(attention).__name__}")
    head_offset = params.head_offset
    if isinstance(head_offset, bool) or not isinstance(head_offset, int) or head_offset < 0:
        raise ValueError(f"head_offset: must be an integer >= 0, got {head_offset!r}")
    policy = POLICIES[cfg.policy](cfg, attention, _checked_retention(cfg, keys, params.retention))
    _check_shapes(cfg, keys, values, queries, policy.needs_queries)
    sinks = cfg.sinks if params.sinks is None else params.sinks
    if not 0 <= sinks <= cfg.sinks:
        raise ValueError(f"sinks: must be in [0, {cfg.sinks}], got {sinks}")
    if streamed and not policy.streams():
        raise ValueError(f"chunk: policy {cfg.policy!r} cannot score candidates chunk by chunk "
                         f"(it defines no score_streamed, or overrides select or forced)")
    draws = params.draws(cfg, keys.shape[:-3], device)
    return policy, draws, sinks
