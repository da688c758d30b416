"""Per-request eviction control through `sampling_params.custom_params.kv_evict`.

    "custom_params": {"kv_evict": false}                       eviction off for this request
    "custom_params": {"kv_evict": {"policy": "snapkv", "budget": 256}}   own settings

The dict's keys are EvictionConfig fields (policy, budget, window, value_slots, sinks, seed),
merged over the server's --kv-evict-* settings; `true` or `{}` means the server's settings,
`"policy": "full"` means off. `custom_params` is a stock SGLang sampling parameter, so it
reaches the scheduler through /generate, /v1/completions and /v1/chat/completions (top-level
`custom_params` there) and sgl.Engine alike.

Validation runs in the tokenizer manager process, in SamplingParams.verify: SGLang's HTTP
handlers turn the ValueError it raises into HTTP 400 (the OpenAI routes into an error response
with status 400), and the server keeps serving. Messages start with `kv_evict.<field>`.
The scheduler re-derives the config from the same dict (`effective_config`) once per request.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict

from vase_sglang import EvictionConfig
from vase_sglang.config import check_page_size
from vase_sglang.policies import POLICIES

from .settings import (GRID, MAX_BUDGET, MAX_SETTINGS, MIN_WINDOW, SETTINGS_IDLE_SECONDS,
                       RequestLimits, current, flag_name, published_page_size,
                       published_shared_scope_refusal)

KEY = "kv_evict"
FIELDS = ("policy", "budget", "window", "value_slots", "sinks", "seed", "mode", "budget_scope",
          "head_floor")
TARGET_VERIFY = "sglang.srt.sampling.sampling_params.SamplingParams.verify"


def _fail(field: str | None, message: str):
    raise ValueError(f"{KEY}.{field}: {message}" if field else f"{KEY}: {message}")


def effective_config(custom_params, server_cfg: EvictionConfig | None,
                     page_size: int = 1, has_gates: bool = False,
                     limits: RequestLimits | None = None) -> EvictionConfig | None:
    """The settings for one request: None = no eviction. Raises ValueError naming
    `kv_evict.<field>` for values the server cannot apply (`page_size`: its KV pages, as
    resolved; `has_gates`: whether it loaded --kv-evict-retention-gates, which trimkv needs)
    or does not allow (`limits`: the server's bounds; default RequestLimits.defaults)."""
    value = custom_params.get(KEY) if isinstance(custom_params, dict) else None
    server = server_cfg if server_cfg is not None and server_cfg.evicts else None
    if value is None:
        return server
    if value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        _fail(None, f"expected false, true or an object with keys {', '.join(FIELDS)}; "
                    f"got {value!r}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        _fail(unknown[0], f"unknown setting; use {', '.join(FIELDS)}")
    if value.get("policy") == "full":
        return None
    if server is None:
        # The eviction machinery (query capture, positions, the step) is only installed in
        # servers started with a policy.
        _fail(None, "this server was started without --kv-evict-policy, so it cannot evict; "
                    "start it with --kv-evict-policy (requests can still turn eviction off)")
    for field in ("budget", "window", "value_slots", "sinks", "seed", "head_floor"):
        v = value.get(field)
        if field in value and (isinstance(v, bool) or not isinstance(v, int)):
            _fail(field, f"must be an integer, got {v!r}")
    if "policy" in value and not isinstance(value["policy"], str):
        _fail("policy", f"must be a policy name, got {value['policy']!r}")
    if server.ceiling is not None and value.get("budget") is not None and (
            isinstance(value["budget"], int) and value["budget"] > server.ceiling):
        _fail("budget", f"must be <= the server's --kv-evict-ceiling ({server.ceiling}); "
                        f"got {value['budget']}")

    changes = {k: v for k, v in value.items() if v is not None}
    if "value_slots" not in changes and (
        changes.get("policy", server.policy) != server.policy
        or changes.get("budget", server.budget) != server.budget
    ):
        # The server's explicit N_v belongs to its own policy and budget; a request that
        # changes either gets the default (budget/4 for vase-attnv).
        changes["value_slots"] = None
    policy = POLICIES.get(changes.get("policy", server.policy))
    if "budget_scope" not in changes and policy is not None and not policy.shares_budget:
        # So does a shared budget scope: a request for a policy served per head gets "head".
        changes["budget_scope"] = "head"
    try:
        cfg = server.replace(**changes)
        check_page_size(cfg, page_size)
    except ValueError as err:
        raise ValueError(f"{KEY}.{err}") from None  # EvictionConfig names the field first

    check_limits(changes, cfg, server, limits or RequestLimits.defaults(server))
    if cfg.shared_budget and (problem := published_shared_scope_refusal()):
        _fail("budget_scope", f"{cfg.budget_scope!r} cannot be served here: {problem}")
    policy = POLICIES[cfg.policy]
    if policy.needs_retention and not has_gates:
        _fail("policy", f"{cfg.policy!r} needs retention gates, which this server did not "
                        f"load; start it with --kv-evict-retention-gates PATH")
    if policy.needs_queries:
        # The query ring is sized (and only allocated) for the server's policy and window.
        if not POLICIES[server.policy].needs_queries:
            _fail("policy", f"{cfg.policy!r} scores with attention queries, which this server "
                            f"does not record (its --kv-evict-policy {server.policy} does not "
                            "use them); start the server with a query-scoring policy such as "
                            "snapkv or vase-attnv to allow every policy per request")
        if cfg.window > server.window:
            _fail("window", f"must be <= the server's --kv-evict-window ({server.window}) for "
                            f"policy {cfg.policy!r}: the server keeps the last {server.window} "
                            f"queries per request; got {cfg.window}")
    return cfg


def check_limits(changes: dict, cfg: EvictionConfig, server: EvictionConfig,
                 limits: RequestLimits) -> None:
    """Refuse what one request may not choose on this server (settings.RequestLimits): one
    client must not be able to hold an unbounded cache, force a round on every decode step,
    or split every step into many small settings groups."""
    if cfg.budget > limits.max_budget:
        _fail("budget", f"must be <= {limits.max_budget}, this server's limit "
                        f"({flag_name(MAX_BUDGET)}); got {cfg.budget}")
    if cfg.window < limits.min_window:
        _fail("window", f"must be >= {limits.min_window}, this server's limit "
                        f"({flag_name(MIN_WINDOW)}); got {cfg.window}")
    for field in ("budget", "window", "value_slots"):
        value = changes.get(field)
        own = getattr(server, field)
        if value is not None and value != own and value % limits.grid:
            _fail(field, f"must be a multiple of {limits.grid} ({flag_name(GRID)})"
                         + ("" if own is None else f" or the server's value {own}")
                         + f"; got {value}")
    most_sinks = max(server.sinks, limits.grid)
    if cfg.sinks > most_sinks:
        _fail("sinks", f"must be <= {most_sinks} (the server's sinks or {flag_name(GRID)}, "
                       f"the larger); got {cfg.sinks}")


class RecentSettings:
    """The distinct per-request settings a server serves, at most `limit` besides its own: one
    more is admitted only in place of one that no queued or running request uses (`in_use`)
    and that nobody asked for in `idle_seconds`. So a step is never split into more than
    limit + 1 settings groups, however long its requests run, and step costs are traced for at
    most `limit` new settings per `idle_seconds` (vase_sglang/plan.py caches them)."""

    def __init__(self, idle_seconds: float = SETTINGS_IDLE_SECONDS, clock=time.monotonic):
        self.idle_seconds, self.clock = idle_seconds, clock
        self.last_used: OrderedDict = OrderedDict()  # settings -> when last asked for

    def admit(self, settings, limit: int, in_use=frozenset) -> bool:
        """Whether `settings` may be served; in_use() -> the settings of the requests queued
        or running now (read only when a place must be freed)."""
        now = self.clock()
        if settings in self.last_used:
            self.last_used.move_to_end(settings)
        elif len(self.last_used) >= limit:
            live = in_use()
            free = next((old for old, used in self.last_used.items()
                         if now - used >= self.idle_seconds and old not in live), None)
            if free is None:
                return False
            del self.last_used[free]
        self.last_used[settings] = now
        return True


RECENT = RecentSettings()  # of this process (the tokenizer manager, or one of its workers)
# This process's TokenizerManager (a weak reference, set by after_validate_one_request): its
# rid_to_state holds every request it has queued or running.
_MANAGER = None
_UNSET = object()


def live_settings(manager, server, limits) -> set:
    """The settings (seed aside) of every request `manager` has queued or running, the
    server's own included; each request's parsed once (kept on its state)."""
    out = set()
    for st in list(getattr(manager, "rid_to_state", {}).values()):
        settings = getattr(st, "_vase_settings", _UNSET)
        if settings is _UNSET:
            settings = _settings_of(getattr(st, "obj", None), server, limits)
            try:
                st._vase_settings = settings
            except AttributeError:
                pass
        if settings is not None:
            out.add(settings)
    return out


def _settings_of(obj, server, limits):
    sampling = getattr(obj, "sampling_params", None)
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    try:
        cfg = effective_config(custom, server.config, published_page_size(),
                               server.gates_path is not None, limits)
    except ValueError:
        return None
    return None if cfg is None else cfg.replace(seed=0)


def check_distinct(cfg: EvictionConfig | None, server: EvictionConfig, limits: RequestLimits,
                   recent: RecentSettings = RECENT, in_use=frozenset) -> None:
    """Refuse a request whose settings would be one more than limits.max_settings distinct
    ones in use (queued or running, in_use()) or asked for lately (the seed is free:
    requests differing only there share a group)."""
    if cfg is None:
        return
    settings = cfg.replace(seed=0)
    if settings == server.replace(seed=0) or recent.admit(settings, limits.max_settings, in_use):
        return
    _fail(None, f"this server serves at most {limits.max_settings} distinct eviction settings "
                f"besides its own at a time ({flag_name(MAX_SETTINGS)}), and each is used by a "
                f"queued or running request or was asked for in the last "
                f"{recent.idle_seconds:g} s; use the server's settings or one of those, or "
                "retry later")


def after_verify(result, self, *args, **kwargs):
    """AFTER SamplingParams.verify (tokenizer manager): reject bad kv_evict values, beam
    search where the request would evict, and settings beyond the server's distinct-settings
    bound, with a ValueError, which SGLang answers with HTTP 400."""
    check_sampling_bounds(self)
    custom = self.custom_params
    beam = (self.beam_width or 1) > 1
    if beam or (isinstance(custom, dict) and custom.get(KEY) is not None):
        server = current()
        cfg = effective_config(custom, server.config, published_page_size(),
                               server.gates_path is not None, server.limits)
        if beam and cfg is not None:
            refuse_beam_search(self.beam_width)
        if server.evicts:
            manager = _MANAGER() if _MANAGER is not None else None
            check_distinct(cfg, server.config, server.limits,
                           in_use=lambda: live_settings(manager, server, server.limits))
    return result


INT32_MAX = 2**31 - 1
MAX_PARALLEL_SAMPLES = 128  # n: what the OpenAI API allows


def check_sampling_bounds(params) -> None:
    """Sampling values SGLang 0.5.23 lets through and then fails on inside the scheduler,
    taking the server down: a top_k past int32 (its sampling batch is an int32 tensor)."""
    top_k = params.top_k
    if isinstance(top_k, int) and top_k > INT32_MAX:
        raise ValueError(f"top_k: must be -1 (off) or in [1, {INT32_MAX}], got {top_k}")


TARGET_PARALLEL_SAMPLING = (
    "sglang.srt.managers.io_struct.GenerateReqInput._handle_parallel_sampling")


def around_parallel_sampling(original, self, *args, **kwargs):
    """AROUND GenerateReqInput._handle_parallel_sampling: `n` must be an integer in
    [1, MAX_PARALLEL_SAMPLES] (SGLang compares it with 1 unchecked: `null` was an HTTP 500,
    and a huge n fans one request out into that many)."""
    params = self.sampling_params
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict) and "n" in p:
            n = p["n"]
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PARALLEL_SAMPLES:
                raise ValueError(f"n: must be an integer in [1, {MAX_PARALLEL_SAMPLES}], "
                                 f"got {n!r}")
    return original(self, *args, **kwargs)


def refuse_beam_search(beam_width: int):
    """Beam search is not supported with eviction. SGLang's beam members decode from rows
    that share the leader's KV slots (beam_search/beam_group.py), so compacting the leader's
    row frees slots the members still read (SGLang's idle leak check then stops the
    scheduler). A request may still run beam search with eviction turned off."""
    raise ValueError(
        f"beam_width: beam search (beam_width={beam_width}) is not supported with KV eviction; "
        f'send "custom_params": {{"{KEY}": false}} to run it without eviction'
    )


TARGET_VALIDATE_REQUEST = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
)


def after_validate_one_request(result, self, obj, input_ids, *args, **kwargs):
    """AFTER TokenizerManager._validate_one_request: a token id outside the vocabulary would
    crash the scheduler in the embedding lookup and take the whole server down (SGLang 0.5.23
    does not check `input_ids`); refuse it as a bad request (HTTP 400) instead. Also keeps a
    weak reference to the manager, whose queued and running requests check_distinct counts."""
    global _MANAGER
    _MANAGER = weakref.ref(self)
    embeds = getattr(obj, "input_embeds", None)
    if input_ids is not None and len(input_ids) == 0 and embeds is None:
        # SGLang 0.5.23 runs a prompt of no tokens (text "" with a tokenizer that adds none)
        # and its logits processor indexes past the empty batch: the scheduler dies.
        raise ValueError("text: the prompt has no tokens; send at least one")
    vocab = self.model_config.vocab_size
    if input_ids and (min(input_ids) < 0 or max(input_ids) >= vocab):
        bad = next(t for t in input_ids if t < 0 or t >= vocab)
        raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab})")
    return result


HOOKS = [
    (TARGET_VERIFY, "AFTER", after_verify),
    (TARGET_VALIDATE_REQUEST, "AFTER", after_validate_one_request),
    (TARGET_PARALLEL_SAMPLING, "AROUND", around_parallel_sampling),
]
