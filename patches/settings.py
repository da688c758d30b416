"""How eviction settings reach every SGLang process.

SGLang spawns its scheduler processes, and `sgl.Engine(**kwargs)` only accepts real ServerArgs
fields, so the canonical channel is the environment (inherited by spawned children):

    VASE_KV_EVICT_POLICY, VASE_KV_EVICT_BUDGET, VASE_KV_EVICT_WINDOW,
    VASE_KV_EVICT_VALUE_SLOTS, VASE_KV_EVICT_SINKS, VASE_KV_EVICT_SEED,
    VASE_KV_EVICT_WORKSPACE_MB, VASE_KV_EVICT_RETENTION_GATES

VASE_KV_EVICT_PLUGINS (comma-separated modules) is imported first in every process, so
policies registered there with `vase_sglang.register_policy` can be named.

`launch_server --kv-evict-*` flags are sugar that write these variables; Engine users set them
(or call `configure(...)`) before creating the Engine.
"""

from __future__ import annotations

import os

from vase_sglang import POLICIES, POLICY_NAMES, EvictionConfig

# flag suffix -> (EvictionConfig field, type, help)
FLAGS = {
    "policy": ("policy", str, f"KV eviction policy during decode: {', '.join(POLICY_NAMES)}, "
               "trimkv (needs --kv-evict-retention-gates). Unset or 'full' keeps the whole "
               "cache (stock SGLang)."),
    "budget": ("budget", int, "Tokens kept per layer and KV head after an eviction, including "
               "the recent window (VaSE's T). Default 1024. With --page-size P a request's "
               "private cache cycles between ceil(T/P) and ceil((T+R)/P) pages; multiples of "
               "P move no K/V at eviction."),
    "window": ("window", int, "Newest tokens always kept; eviction runs every `window` decode "
               "tokens once the private cache holds budget + window. Default 64. Must be at "
               "least --page-size (each eviction frees whole pages)."),
    "value-slots": ("value_slots", int, "vase-attnv: slots reserved for the largest value "
                    "ranges. Default budget/4."),
    "sinks": ("sinks", int, "First tokens of the sequence always kept. Default 4."),
    "seed": ("seed", int, "Seed of the stochastic policies. Default 0."),
    "workspace-mb": ("workspace_mb", int, "MiB reserved at startup for one eviction step "
                     "(gathered K/V and score temporaries; the step is chunked over layers and "
                     "requests to stay inside it). Default: sized for 64 requests of one layer "
                     "at the configured budget; the size is logged at startup."),
}


# Server-only settings: not EvictionConfig fields, because a request cannot choose them (the
# gates are one file per model, loaded once per scheduler process and run for every token).
GATES = "retention-gates"
SERVER_FLAGS = {
    GATES: "Retention gates file (safetensors, `python -m vase_sglang.retention train`) of "
           "this model: the gate runs for every token and any request may ask for "
           "policy trimkv. Required by --kv-evict-policy trimkv.",
}


# The server's KV page size, exported at startup validation (server_args.after_resolve_once)
# for the per-request checks (request_control); not a setting.
PAGE_SIZE_ENV = "VASE_KV_PAGE_SIZE"


def page_size_from_env(environ=os.environ) -> int:
    return int(environ.get(PAGE_SIZE_ENV) or 1)


def env_name(suffix: str) -> str:
    return "VASE_KV_EVICT_" + suffix.upper().replace("-", "_")


def flag_name(suffix: str) -> str:
    return "--kv-evict-" + suffix


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
        if kwargs or values.get(GATES):
            first = next(s for s in (*FLAGS, GATES) if values.get(s) not in (None, ""))
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


def config_from_env(environ=os.environ) -> EvictionConfig | None:
    """The eviction config of this process, or None when eviction is off."""
    import_policy_modules(environ)
    values = {suffix: environ.get(env_name(suffix)) for suffix in (*FLAGS, *SERVER_FLAGS)}
    return config_from_values(values, source=env_name)


def gates_path_from_env(environ=os.environ) -> str | None:
    """The server's retention gates file (validated at startup), or None."""
    return environ.get(env_name(GATES)) or None


def load_server_gates(path, hf_config, source=flag_name):
    """The gates in `path` for the served model (vase_sglang.retention.load_gates); a bad file
    raises ValueError naming the flag (or variable) and the reason."""
    from vase_sglang.retention import GatesError, load_gates

    try:
        return load_gates(path, hf_config)
    except GatesError as err:
        raise ValueError(f"{source(GATES)}: {err}") from None


def export_to_env(values: dict[str, object], environ=os.environ) -> None:
    for suffix in (*FLAGS, *SERVER_FLAGS):
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
    cfg = config_from_values(values, source=lambda s: FLAGS[s][0] if s in FLAGS
                             else s.replace("-", "_"))
    for suffix in (*FLAGS, *SERVER_FLAGS):
        os.environ.pop(env_name(suffix), None)
    export_to_env(values)
    return cfg
