"""Hooks on sglang.srt.server_args.ServerArgs: the --kv-evict-* flags and startup validation."""

from __future__ import annotations

import os
import sys

from . import settings

TARGET_ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
TARGET_FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
TARGET_RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"


def after_add_cli_args(result, parser):
    """AFTER ServerArgs.add_cli_args: stock argparse would reject our flags."""
    group = parser.add_argument_group("KV eviction (vase-sglang)")
    for suffix, (_field, _kind, help_text) in settings.FLAGS.items():
        group.add_argument(settings.flag_name(suffix), type=str, default=None, help=help_text)


def after_from_cli_args(result, cls, args):
    """AFTER ServerArgs.from_cli_args: validate the flags, then export them to the environment
    that the spawned scheduler processes inherit. A bad value ends the launch like argparse."""
    values = {s: getattr(args, "kv_evict_" + s.replace("-", "_"), None) for s in settings.FLAGS}
    if all(v is None for v in values.values()):
        return
    try:
        settings.config_from_values(values)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    for suffix in settings.FLAGS:  # the flags win over variables left in the environment
        os.environ.pop(settings.env_name(suffix), None)
    settings.export_to_env(values)


# (server arg, predicate on its resolved value, why) for configurations eviction cannot serve.
_UNSUPPORTED = [
    ("speculative_algorithm", lambda v: v not in (None, "", "NONE"),
     "speculative decoding writes several KV slots per step; eviction does not track drafts"),
    ("enable_dp_attention", bool, "DP attention turns decode rows into extends"),
    ("enable_mixed_chunk", bool, "mixed chunks turn decode rows into extends"),
    ("page_size", lambda v: v not in (None, 1), "only page size 1 is supported"),
    ("kv_cache_dtype", lambda v: v not in (None, "auto", "bfloat16", "float16", "float32"),
     "scores need plain floating-point K/V"),
    ("disaggregation_mode", lambda v: v not in (None, "null"), "PD disaggregation moves KV by true length"),
    ("enable_hierarchical_cache", bool, "HiCache is not tested with eviction"),
    ("enable_unified_memory", bool, "unified memory relocates slots itself"),
]


def check_server_args(server_args, cfg) -> None:
    """Reject server configurations the eviction plugin cannot serve, naming the flag."""
    for name, unsupported, why in _UNSUPPORTED:
        value = getattr(server_args, name, None)
        if unsupported(value):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag}={value} is not supported with {settings.flag_name('policy')}={cfg.policy}: "
                f"{why}. Drop {flag} or turn eviction off."
            )


def after_resolve_once(result, server_args):
    """AFTER ServerArgs.resolve_once: runs in `launch_server` and in `sgl.Engine` alike."""
    cfg = settings.config_from_env()
    if cfg is not None and cfg.evicts:
        check_server_args(server_args, cfg)


HOOKS = [
    (TARGET_ADD_CLI_ARGS, "AFTER", after_add_cli_args),
    (TARGET_FROM_CLI_ARGS, "AFTER", after_from_cli_args),
    (TARGET_RESOLVE_ONCE, "AFTER", after_resolve_once),
]
