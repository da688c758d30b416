"""The server's eviction settings: one `ServerSettings` object per process, resolved once.

What a user chooses travels as environment variables, the one channel that reaches every
process SGLang spawns (`sgl.Engine(**kwargs)` only accepts real ServerArgs fields, and
ServerArgs cannot carry extra fields to the spawned processes):

    VASE_KV_EVICT_POLICY, VASE_KV_EVICT_BUDGET, VASE_KV_EVICT_WINDOW,
    VASE_KV_EVICT_VALUE_SLOTS, VASE_KV_EVICT_SINKS, VASE_KV_EVICT_SEED, VASE_KV_EVICT_MODE,
    VASE_KV_EVICT_CEILING, VASE_KV_EVICT_BUDGET_SCOPE, VASE_KV_EVICT_WORKSPACE_MB,
    VASE_KV_EVICT_RETENTION_GATES, VASE_KV_EVICT_MAX_BUDGET,
    VASE_KV_EVICT_MIN_WINDOW, VASE_KV_EVICT_GRID, VASE_KV_EVICT_EXPECTED_PROMPT_LEN

`launch_server --kv-evict-*` flags are sugar that write these variables; Engine users set them
(or call `configure(...)`) before creating the Engine. VASE_KV_EVICT_PLUGINS (comma-separated
modules) is imported first in every process, so policies registered there with
`vase_sglang.register_policy` can be named.

`current()` parses and validates them once per process into a `ServerSettings`, which every
hook reads. What SGLang decides for the launch (the KV page size its resolution chose) is not
copied anywhere: each SGLang process publishes its resolved arguments, and
`published_page_size()` reads them there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vase_sglang import POLICIES, POLICY_NAMES, EvictionConfig, policy_names
from vase_sglang.config import MAX_TOKENS, check_int

# The policies that score from retention gates, as the registry states them (needs_retention):
# listed in --kv-evict-policy's help with the flag they need.
_GATED = [f"{name} (needs --kv-evict-retention-gates)"
          for name in policy_names() if POLICIES[name].needs_retention]

# flag suffix -> (EvictionConfig field, type, help)
FLAGS = {
    "policy": ("policy", str, "KV eviction policy during decode: "
               + ", ".join([*POLICY_NAMES, *_GATED])
               + ". Unset or 'full' keeps the whole cache (stock SGLang)."),
    "budget": ("budget", int, "Tokens kept per layer and KV head after an eviction, including "
               "the recent window (VaSE's T), counted in the request's private cache: the "
               "generated tokens with the radix cache on (the prompt is shared and never "
               "evicted, but its partial last page is private), prompt and generated tokens "
               "with --disable-radix-cache. Default 1024. With --page-size P a request's "
               "private cache cycles between ceil(T/P) and ceil((T+R)/P) pages; multiples of "
               "P move no K/V at eviction."),
    "window": ("window", int, "Newest tokens always kept; eviction runs every `window` decode "
               "tokens once the private cache holds budget + window. Default 64. Must be at "
               "least --page-size (each eviction frees whole pages)."),
    "value-slots": ("value_slots", int, "vase-attnv: slots reserved for the largest value "
                    "ranges. Default budget/4."),
    "sinks": ("sinks", int, "First tokens of the sequence always kept. Default 4."),
    "seed": ("seed", int, "Seed of the stochastic policies; draws are keyed by (seed, the "
             "request's tokens, layer, KV head, round), so the same request gives the same "
             "output on every run and replica. Default 0."),
    "mode": ("mode", str, "fixed (default): the cache is cut back to --kv-evict-budget every "
             "--kv-evict-window tokens. elastic: the budget is a floor; a request's cache grows "
             "while the KV pool has room and is cut (never below the budget) only when memory "
             "is needed: the next decode step or a waiting request does not fit "
             "(docs/elastic.md). Also per request: custom_params.kv_evict.mode."),
    "ceiling": ("ceiling", int, "Elastic mode: a cache that reaches ceiling + window is cut back "
                "to the ceiling even without memory pressure. Default: none."),
    "budget-scope": ("budget_scope", str, "Who shares the older tokens' budget: head (default: "
                     "every layer and KV head keeps budget - window), layer (a layer's KV heads "
                     "share their total) or global (all layers and heads share one total; the "
                     "same slots, heads keep unequal counts; docs/global_budget.md). Shared "
                     "scopes need a policy whose scores compare across heads (trimkv) and are "
                     "served on CPU by the torch_native and triton backends, with pages, "
                     "elastic mode, fp8 K/V (torch_native), tp and dp (with tp, each rank's "
                     "heads share its part). Also per request: "
                     "custom_params.kv_evict.budget_scope."),
    "head-floor": ("head_floor", int, "Shared budget scopes: older tokens every layer and KV "
                   "head keeps whatever the others score (sinks count in it; at most budget - "
                   "window, which is the per-head budget). Default 0, measured best "
                   "(docs/global_budget.md). Ignored per head. Also per request: "
                   "custom_params.kv_evict.head_floor."),
    "workspace-mb": ("workspace_mb", int, "MiB reserved at startup for one eviction step "
                     "(gathered K/V and score temporaries; the step is chunked over layers and "
                     "requests to stay inside it). Default: sized for 64 requests of one layer "
                     "at the configured budget; the size is logged at startup."),
}


def env_name(suffix: str) -> str:
    return "VASE_KV_EVICT_" + suffix.upper().replace("-", "_")


def flag_name(suffix: str) -> str:
    return "--kv-evict-" + suffix


# Server-only settings: not EvictionConfig fields, because a request cannot choose them (the
# gates are one file per model, loaded once per scheduler process and run for every token; the
# limits bound what a request may choose; the prompt length is an assumption about the traffic).
GATES = "retention-gates"
MAX_BUDGET, MIN_WINDOW, GRID = "max-budget", "min-window", "grid"
MAX_SETTINGS, DEFAULT_MAX_SETTINGS, SETTINGS_IDLE_SECONDS = "max-settings", 16, 60
MAX_BUDGET_FACTOR = 8
PROMPT_LEN = "expected-prompt-len"
DEFAULT_PROMPT_LEN = 256
SERVER_FLAGS = {
    GATES: "Retention gates file (safetensors, `python -m vase_sglang.retention train`) of "
           "this model: the gate runs for every token and any request may ask for "
           "policy trimkv. Required by --kv-evict-policy trimkv.",
    MAX_BUDGET: "Largest budget a request may ask for (custom_params.kv_evict.budget). Default "
                f"{MAX_BUDGET_FACTOR} x --kv-evict-budget: what the default step workspace "
                "(sized for 64 requests at --kv-evict-budget) "
                "holds at once for one request; a larger value grows the workspace to hold "
                "one request at it.",
    MIN_WINDOW: "Smallest window a request may ask for (eviction runs every `window` decode "
                "tokens, so a small window costs a round on most steps). Default: a quarter of "
                "--kv-evict-window, at least 1 (and never below --page-size, see the window).",
    GRID: "A per-request budget, window and value_slots must equal the server's or be a "
          "multiple of this, so that few distinct settings groups share a decode batch (each "
          "group is one batched selection). Default: the minimum window.",
    MAX_SETTINGS: "Distinct per-request eviction settings (policy, budget, window, value_slots, "
                  "sinks, mode; the seed is free) a server serves besides its own at a time: a "
                  "request bringing one more, while each of these is used by a queued or "
                  f"running request or was asked for in the last {SETTINGS_IDLE_SECONDS} s, "
                  "gets HTTP 400. Bounds how many groups a step is "
                  "split into and how many step costs are traced. Default "
                  f"{DEFAULT_MAX_SETTINGS} (per tokenizer worker).",
    PROMPT_LEN: "No longer used: the query ring is held in the pool's own slots by the "
                "requests that read queries, so no prompt length is assumed and nothing caps "
                "the running requests (docs/memory.md). Accepted, and ignored, for old "
                "command lines.",
}
RING, RING_PLACES = "ring", ("auto", "pool", "beside")
SERVER_FLAGS[RING] = ("Where the query ring (the last window's queries of each request whose "
                      "policy reads them) is held: pool = in the KV pool's own slots, charged "
                      "to the request (memory is shared between K/V and rings); beside = in "
                      "its own storage next to a --max-total-tokens pool, sized for every "
                      "request that pool can run; auto (default) = beside with "
                      "--max-total-tokens, else pool (docs/memory.md).")
INT_SERVER_FLAGS = (MAX_BUDGET, MIN_WINDOW, GRID, MAX_SETTINGS, PROMPT_LEN)


def ring_from_values(values: dict[str, object], source=flag_name) -> str:
    raw = values.get(RING)
    if raw in (None, ""):
        return "auto"
    if raw not in RING_PLACES:
        raise ValueError(f"{source(RING)}: must be one of {', '.join(RING_PLACES)}, got {raw!r}")
    return raw


@dataclass(frozen=True)
class RequestLimits:
    """What a request may choose in custom_params.kv_evict on this server (request_control):
    budget <= max_budget; window >= min_window; budget, window and value_slots equal to the
    server's or multiples of `grid`; sinks <= max(the server's sinks, grid); at most
    `max_settings` distinct settings besides the server's in recent use. They bound one
    request's cache and step (the workspace holds one request at max_budget at once), its
    eviction frequency, and the number of distinct settings groups in a step. The default
    max_budget, 8 budgets, is what the default workspace (64 requests at the budget, a unit's
    memory grows linearly with its candidates) already holds at once: it costs no memory."""

    max_budget: int
    min_window: int
    grid: int
    max_settings: int = DEFAULT_MAX_SETTINGS

    @classmethod
    def defaults(cls, cfg: EvictionConfig) -> "RequestLimits":
        min_window = max(1, cfg.window // 4)
        return cls(max_budget=MAX_BUDGET_FACTOR * cfg.budget, min_window=min_window,
                   grid=min_window)


def limits_from_values(values: dict[str, object], cfg: EvictionConfig | None,
                       source=flag_name) -> RequestLimits | None:
    """The server's RequestLimits (None where eviction is off). Raises ValueError naming the
    flag (or variable) at fault."""
    if cfg is None or not cfg.evicts:
        return None
    chosen = {}
    for suffix in (MAX_BUDGET, MIN_WINDOW, GRID, MAX_SETTINGS):
        raw = values.get(suffix)
        if raw not in (None, ""):
            chosen[suffix] = _int_flag(raw, suffix, source, minimum=1)
    limits = RequestLimits.defaults(cfg)
    min_window = chosen.get(MIN_WINDOW, limits.min_window)
    limits = RequestLimits(max_budget=chosen.get(MAX_BUDGET, limits.max_budget),
                           min_window=min_window, grid=chosen.get(GRID, min_window),
                           max_settings=chosen.get(MAX_SETTINGS, limits.max_settings))
    if limits.max_budget < cfg.budget:
        raise ValueError(f"{source(MAX_BUDGET)}: must be >= {source('budget')} ({cfg.budget}), "
                         f"got {limits.max_budget}")
    if limits.min_window > cfg.window:
        raise ValueError(f"{source(MIN_WINDOW)}: must be <= {source('window')} ({cfg.window}), "
                         f"got {limits.min_window}")
    return limits


def prompt_len_from_values(values: dict[str, object], source=flag_name) -> int:
    raw = values.get(PROMPT_LEN)
    if raw in (None, ""):
        return DEFAULT_PROMPT_LEN
    return _int_flag(raw, PROMPT_LEN, source, minimum=0)


def _int_flag(raw, suffix: str, source, minimum: int) -> int:
    try:
        value = _as_int(raw)
    except ValueError:
        raise ValueError(f"{source(suffix)}: expected an integer, got {raw!r}") from None
    return check_int(source(suffix), value, low=minimum, high=MAX_TOKENS)


def config_from_values(values: dict[str, object], source=flag_name) -> EvictionConfig | None:
    """values: flag suffix -> raw value (str from env/CLI or already typed). None = not set.

    Raises ValueError whose message starts with the flag (or variable) at fault.
    """
    kwargs = {}
    for suffix, (field, kind, _help) in FLAGS.items():
        raw = values.get(suffix)
        if raw is None or raw == "":
            continue
        try:
            kwargs[field] = kind(raw) if kind is str else _as_int(raw)
        except ValueError:
            raise ValueError(f"{source(suffix)}: expected an integer, got {raw!r}") from None
    if "policy" not in kwargs:
        if kwargs or any(values.get(s) not in (None, "") for s in SERVER_FLAGS):
            first = next(s for s in (*FLAGS, *SERVER_FLAGS) if values.get(s) not in (None, ""))
            raise ValueError(f"{source(first)}: set {source('policy')} too, or drop this option")
        return None
    try:
        cfg = EvictionConfig(**kwargs)
    except ValueError as err:
        field, _, message = str(err).partition(": ")
        suffix = next((s for s, (f, _, _) in FLAGS.items() if f == field), None)
        name = source(suffix) if suffix else field
        raise ValueError(f"{name}: {message}") from None
    if cfg.evicts and POLICIES[cfg.policy].needs_retention and not values.get(GATES):
        raise ValueError(f"{source('policy')}: {cfg.policy} needs retention gates: set "
                         f"{source(GATES)} PATH (train them with `python -m "
                         f"vase_sglang.retention train --model ...`)")
    limits_from_values(values, cfg, source)  # the server-only settings, checked with the rest
    prompt_len_from_values(values, source)
    ring_from_values(values, source)
    return cfg


def _as_int(raw) -> int:
    if isinstance(raw, bool):
        raise ValueError
    if isinstance(raw, int):
        return raw
    text = str(raw).strip()
    return int(text)


def import_policy_modules(environ=os.environ) -> None:
    import importlib

    for name in filter(None, (m.strip() for m in environ.get("VASE_KV_EVICT_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"VASE_KV_EVICT_PLUGINS: cannot import {name!r}: {err}") from None
        except ValueError as err:  # register_policy refused one of its policies
            raise ValueError(f"VASE_KV_EVICT_PLUGINS: module {name!r}: {err}") from None


def _env_values(environ) -> dict[str, object]:
    return {suffix: environ.get(env_name(suffix)) for suffix in (*FLAGS, *SERVER_FLAGS)}


@dataclass(frozen=True)
class ServerSettings:
    """What a server decided about eviction: the eviction config (None: off), what requests
    may choose, the retention gates file, and the prompt length the query ring is sized for."""

    config: EvictionConfig | None = None
    limits: RequestLimits | None = None
    gates_path: str | None = None
    expected_prompt_len: int = DEFAULT_PROMPT_LEN  # no longer used (PROMPT_LEN's help)
    ring: str = "auto"  # where the query ring is held (RING's help)

    @property
    def evicts(self) -> bool:
        return self.config is not None and self.config.evicts

    @classmethod
    def from_values(cls, values: dict[str, object], source=flag_name) -> "ServerSettings":
        """values: flag suffix -> raw value (str from the environment or the command line, or
        already typed); None = not set. Raises ValueError naming the flag (or variable)."""
        config = config_from_values(values, source)
        return cls(config=config, limits=limits_from_values(values, config, source),
                   gates_path=str(values.get(GATES)) if values.get(GATES) else None,
                   expected_prompt_len=prompt_len_from_values(values, source),
                   ring=ring_from_values(values, source))

    @classmethod
    def from_env(cls, environ=os.environ) -> "ServerSettings":
        import_policy_modules(environ)
        return cls.from_values(_env_values(environ), source=env_name)


_CURRENT: tuple[tuple, ServerSettings] | None = None  # (the variables it was parsed from, it)


def current() -> ServerSettings:
    """This process's settings, parsed from the environment once (again only if the variables
    change: the flags are written into the environment after SGLang loaded its plugins, and
    one process may create Engines one after another). Raises ValueError naming the variable
    at fault (a launch validates the flags before any process reads them)."""
    global _CURRENT
    names = [env_name(s) for s in (*FLAGS, *SERVER_FLAGS)] + ["VASE_KV_EVICT_PLUGINS"]
    key = tuple(os.environ.get(name) for name in names)
    if _CURRENT is None or _CURRENT[0] != key:
        _CURRENT = (key, ServerSettings.from_env())
    return _CURRENT[1]


def published_page_size() -> int:
    """The KV page size SGLang resolved for this launch (e.g. trtllm_mha, the sm_100 default,
    turns page size 1 into 64), from the arguments this process published (the tokenizer
    manager and every scheduler publish theirs); 1 in a process that published none."""
    from sglang.srt.runtime_context import get_schedule

    try:
        return get_schedule().page_size or 1
    except ValueError:  # "config namespace 'schedule' not published"
        return 1


def published_shared_scope_refusal() -> str | None:
    """Why this launch cannot serve a shared budget scope (supported.shared_scope_refusal),
    from the arguments this process published; None where it can or nothing was published."""
    from sglang.srt.runtime_context import get_server_args

    from .supported import shared_scope_refusal

    try:
        server_args = get_server_args()
    except ValueError:
        return None
    return shared_scope_refusal(server_args)


def load_server_gates(path, hf_config, source=flag_name):
    """The gates in `path` for the served model (vase_sglang.gates.load_gates); a bad file
    raises ValueError naming the flag (or variable) and the reason."""
    from vase_sglang.gates import GatesError, load_gates

    try:
        return load_gates(path, hf_config)
    except GatesError as err:
        raise ValueError(f"{source(GATES)}: {err}") from None
    except OSError as err:  # a name the file system refuses (too long, say)
        raise ValueError(f"{source(GATES)}: cannot read {str(path)[:80]!r}: "
                         f"{err.strerror or err}") from None


def export_to_env(values: dict[str, object], environ=os.environ) -> None:
    """Write `values` (flag suffix -> value) as the VASE_KV_EVICT_* variables, replacing any
    left in the environment."""
    for suffix in (*FLAGS, *SERVER_FLAGS):
        environ.pop(env_name(suffix), None)
        value = values.get(suffix)
        if value is not None:
            environ[env_name(suffix)] = str(value)


def configure(**kwargs) -> EvictionConfig | None:
    """Engine users: `configure(policy="vase-attnv", budget=1024)` before `sgl.Engine(...)`.

    Keys are EvictionConfig fields and `retention_gates` (a path); validates, then writes the
    VASE_KV_EVICT_* variables.
    """
    by_field = {f: s for s, (f, _, _) in FLAGS.items()}
    by_field.update({s.replace("-", "_"): s for s in SERVER_FLAGS})
    unknown = set(kwargs) - set(by_field)
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: not an eviction setting; use {sorted(by_field)}")
    values = {by_field[k]: v for k, v in kwargs.items()}
    checked = ServerSettings.from_values(values, source=lambda s: FLAGS[s][0] if s in FLAGS
                                         else s.replace("-", "_"))
    export_to_env(values)
    return checked.config
