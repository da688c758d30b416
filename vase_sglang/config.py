"""EvictionConfig: every knob of a KV-eviction run, validated once, engine-free.

Vocabulary (kept identical in the SGLang flags `--kv-evict-*`):
  budget        T  tokens a request keeps per layer and KV head after an eviction, *including*
                   the newest `window` tokens (the paper's token budget).
  window        R  newest tokens always kept; eviction runs every R decode tokens once the cache
                   holds T + R tokens, so the footprint cycles between T and T + R. With
                   pages of ps tokens it cycles between ceil(T / ps) and ceil((T + R) / ps)
                   pages; R >= ps (check_page_size), and T, R multiples of ps move no K/V.
  value_slots   N_v  (policies that reserve value slots: vase-attnv, trimkv) slots always given
                   to the largest Range(v)=max(v)-min(v); None = the policy's default
                   (Policy.default_value_slots): T/4 for vase-attnv as in every official VaSE
                   script, 0 for trimkv (set, it makes the VaSE + learned-retention hybrid).
  sinks         first tokens of the sequence that are always kept.
  seed          base of every random draw; draws are keyed by (seed, request, layer, round).
  workspace_mb  memory an engine reserves for one eviction step (gathered K/V, score
                temporaries); None = sized for the configured step (docs/memory.md). A server
                setting: it changes how a step is chunked, never what it selects.
  mode          "fixed": the cache is cut back to T every R tokens (the paper's semantics);
                "elastic": T is a floor, the cache grows while memory is free and is cut
                (never below T) only under memory pressure (docs/elastic.md).
  ceiling       elastic: a cache that reaches ceiling + R is cut back to `ceiling` without
                pressure, as fixed mode does at T; None = no ceiling.
  budget_scope  "head": every (layer, KV head) keeps K = T - R older tokens (the paper's);
                "layer": a layer's KV heads share H·K; "global": all layers and heads share
                L·H·K (docs/global_budget.md). The same slots either way; shared scopes
                need a policy whose scores compare across heads (Policy.shares_budget).
  head_floor    shared scopes: older tokens each (layer, KV head) keeps whatever the others
                score (the reference's min_tokens_per_head), at most K = T - R; sinks count
                in it. Default 0: measured best on the real model (docs/global_budget.md,
                "The per-head floor"). Per head every head keeps K anyway: ignored there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .registry import POLICIES

# What a policy needs (queries, retention gates, value slots and their default) is stated on its
# class in the registry (registry.POLICIES, filled by policies.py and register_policy); nothing
# here names one, and nothing here imports policies.py (it imports this module).
MODES = ("fixed", "elastic")
BUDGET_SCOPES = ("head", "layer", "global")
# Explicit ranges of every integer setting, [low, high] inclusive, checked wherever a value enters
# (flags, variables, configure(), per-request custom_params): a value outside them is refused
# with a message naming the field, never carried into the step. Token counts stop at 2^24 (a
# cache of 16M tokens per layer and head, beyond any served context); the seed is any int64 >= 0,
# since draws hash it as one (vase_sglang/rng.py: the 63 bits below the sign).
MAX_TOKENS = 1 << 24
MAX_SEED = (1 << 63) - 1
INT_RANGES = {
    "budget": (2, MAX_TOKENS),
    "window": (1, MAX_TOKENS),
    "value_slots": (0, MAX_TOKENS),
    "sinks": (0, MAX_TOKENS),
    "head_floor": (0, MAX_TOKENS),
    "seed": (0, MAX_SEED),
    "ceiling": (2, MAX_TOKENS),
    "workspace_mb": (1, 1 << 24),  # 16 TiB
    "pool_kernel": (1, 1023),
    "projection_rank": (1, 4096),
}


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as a bounded integer setting (INT_RANGES[name] unless low/high are given);
    raises ValueError "name: ..." for a non-integer (bools included) or a value out of range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    lo, hi = INT_RANGES.get(name, (None, None))
    lo = lo if low is None else low
    hi = hi if high is None else high
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")
    return value


def _policy_class(name: str):
    """The registered Policy class of `name`; None for "full" (and names not registered)."""
    return POLICIES.get(name)


def _value_slot_owners() -> str:
    """'only the P policy reserves value slots (and Q<note>) ...' from the registry: the
    policies whose class sets reserves_value_slots, in registration order."""
    owners = [(n, p) for n, p in POLICIES.items() if p.reserves_value_slots]
    if not owners:
        return "no registered policy reserves value slots"
    (first, _), *others = owners
    return f"only the {first} policy reserves value slots" + "".join(
        f" (and {name}{policy.value_slots_note})" for name, policy in others)


@dataclass(frozen=True)
class EvictionConfig:
    policy: str = "vase-attnv"
    budget: int = 1024
    window: int = 64
    value_slots: int | None = None
    sinks: int = 4
    seed: int = 0
    # Scoring details; defaults are those of the official VaSE code.
    temperature: float = 1.0  # softmax temperature of the window attention
    pool_kernel: int = 5  # avg-pool width along the key axis (odd; 1 disables smoothing)
    projection_rank: int = 20  # r of the Gaussian projection of the CUR policies
    rkv_lambda: float = 0.5  # R-KV mix: lambda*importance - (1-lambda)*redundancy
    workspace_mb: int | None = None  # eviction step workspace (engines); None = default size
    mode: str = "fixed"  # "fixed" or "elastic" (T is a floor, cut under memory pressure only)
    ceiling: int | None = None  # elastic: cut back to it at ceiling + window without pressure
    budget_scope: str = "head"  # who shares the older tokens' budget: head, layer or global
    head_floor: int = 0  # shared scopes: older tokens every (layer, KV head) keeps, <= keep

    def __post_init__(self):
        known = ("full", *POLICIES)
        if self.policy not in known:
            raise ValueError(
                f"policy: unknown policy {self.policy!r}; choose one of {', '.join(known)}"
            )
        for name in ("budget", "window", "sinks", "seed", "head_floor", "pool_kernel",
                     "projection_rank"):
            check_int(name, getattr(self, name))
        if self.budget <= self.window:
            raise ValueError(
                f"budget: must be larger than window ({self.window}) since the budget includes "
                f"the window, got {self.budget}"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.ceiling is not None:
            check_int("ceiling", self.ceiling)
            if self.ceiling < self.budget:
                raise ValueError(f"ceiling: must be >= budget ({self.budget}), got {self.ceiling}")
        if self.budget_scope not in BUDGET_SCOPES:
            raise ValueError(f"budget_scope: must be one of {', '.join(BUDGET_SCOPES)}, got "
                             f"{self.budget_scope!r}")
        if self.shared_budget and self.policy != "full":
            policy = _policy_class(self.policy)
            if not policy.shares_budget:
                sharing = [n for n, p in POLICIES.items() if p.shares_budget]
                raise ValueError(
                    f"budget_scope: {self.budget_scope!r} needs a policy whose scores compare "
                    f"across heads ({', '.join(sharing) or 'none registered'}); {self.policy!r} "
                    "is served per head (docs/global_budget.md)")
            refusal = policy.shares_budget_refusal()  # register_policy refused it already
            if refusal:
                raise ValueError(f"budget_scope: policy {self.policy!r} sets shares_budget, "
                                 f"but {refusal}")
            if self.value_slots:
                raise ValueError(f"budget_scope: {self.budget_scope!r} is served without value "
                                 f"slots (got value_slots={self.value_slots})")
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel: must be a positive odd integer, got {self.pool_kernel}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature: must be a finite number > 0, got {self.temperature!r}")
        if not (isinstance(self.rkv_lambda, (int, float)) and 0.0 <= self.rkv_lambda <= 1.0):
            raise ValueError(f"rkv_lambda: must be in [0, 1], got {self.rkv_lambda!r}")
        if self.workspace_mb is not None:
            check_int("workspace_mb", self.workspace_mb)
        if self.value_slots is not None:
            check_int("value_slots", self.value_slots)
            policy = _policy_class(self.policy)
            if self.value_slots and not (policy and policy.reserves_value_slots):
                raise ValueError(
                    f"value_slots: {_value_slot_owners()} (policy is {self.policy!r}); leave it "
                    f"unset or 0"
                )
        if self.policy != "full" and self.sinks + self.n_value_slots > self.keep:
            raise ValueError(
                f"value_slots: value_slots ({self.n_value_slots}) + sinks ({self.sinks}) must fit in "
                f"budget - window ({self.keep})"
            )

    @property
    def keep(self) -> int:
        """Older tokens kept per (layer, KV head) at each eviction: K = budget - window."""
        return self.budget - self.window

    @property
    def n_value_slots(self) -> int:
        """N_v in effect: value_slots, or the policy's default where unset (vase-attnv: T/4,
        shrunk only if T/4 cannot fit; trimkv: 0); 0 for policies without value slots."""
        policy = _policy_class(self.policy)
        if policy is None or not policy.reserves_value_slots:
            return 0
        if self.value_slots is None:
            return policy.default_value_slots(self)
        return self.value_slots

    @property
    def floor(self) -> int:
        """The per-head floor in effect under a shared scope: head_floor, at most K (a floor
        of K is the per-head budget); 0 per head."""
        return min(self.head_floor, self.keep) if self.shared_budget else 0

    @property
    def shared_budget(self) -> bool:
        """Whether heads share the older tokens' budget (budget_scope layer or global)."""
        return self.budget_scope != "head"

    @property
    def evicts(self) -> bool:
        return self.policy != "full"

    @property
    def elastic(self) -> bool:
        return self.mode == "elastic"

    @property
    def scheduled_budget(self) -> int | None:
        """What a scheduled eviction (one without memory pressure) cuts the cache back to: the
        budget in fixed mode, the ceiling (None: never) in elastic mode."""
        return self.ceiling if self.elastic else self.budget

    @property
    def trigger_len(self) -> int | None:
        """Private cache length at which a scheduled eviction runs (then again every `window`
        tokens); None: only memory pressure evicts (elastic mode without a ceiling)."""
        top = self.scheduled_budget
        return None if top is None else top + self.window

    def replace(self, **changes) -> "EvictionConfig":
        return dataclasses.replace(self, **changes)


def check_page_size(cfg: EvictionConfig, page_size: int) -> None:
    """Refuse settings a KV pool of `page_size`-token pages cannot serve well. An eviction
    drops `window` tokens and the allocator takes back whole pages only: with a window below
    one page most evictions would free nothing. Raises ValueError naming the field."""
    if cfg.evicts and cfg.window < page_size:
        raise ValueError(
            f"window: must be >= the page size ({page_size}) so that each eviction frees at "
            f"least one page of {page_size} tokens, got {cfg.window}; multiples of the page "
            f"size for both budget and window move no K/V at eviction"
        )
