"""Hooks on sglang.srt.server_args.ServerArgs: the --kv-evict-* flags and startup validation."""

from __future__ import annotations

import sys

from vase_sglang.config import check_page_size

from . import settings, supported

TARGET_ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
TARGET_FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
TARGET_RESOLVE_ONCE = "sglang.srt.server_args.ServerArgs.resolve_once"


def after_add_cli_args(result, parser):
    """AFTER ServerArgs.add_cli_args: stock argparse would reject our flags."""
    group = parser.add_argument_group("KV eviction (vase-sglang)")
    for suffix, (_field, _kind, help_text) in settings.FLAGS.items():
        group.add_argument(settings.flag_name(suffix), type=str, default=None, help=help_text)
    for suffix, help_text in settings.SERVER_FLAGS.items():
        group.add_argument(settings.flag_name(suffix), type=str, default=None, help=help_text)


def after_from_cli_args(result, cls, args):
    """AFTER ServerArgs.from_cli_args: validate the flags, then export them to the environment
    that the spawned scheduler processes inherit. A bad value ends the launch like argparse."""
    values = {s: getattr(args, "kv_evict_" + s.replace("-", "_"), None)
              for s in (*settings.FLAGS, *settings.SERVER_FLAGS)}
    if all(v is None for v in values.values()):
        return
    try:
        settings.ServerSettings.from_values(values)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    settings.export_to_env(values)  # the flags win over variables left in the environment


def check_server_args(server_args, cfg) -> None:
    """Refuse server configurations outside the allowlist (supported.py), naming each flag,
    and models whose positions the eviction offset cannot correct."""
    problems = []
    for name, value, why in supported.unsupported(server_args):
        flag = supported.flag(name)
        fix = (f"Drop {flag} or turn eviction off." if supported.user_set(server_args, name)
               else f"SGLang chose it for this launch; set {flag} to a supported value "
                    "(docs/supported.md) or turn eviction off.")
        problems.append(f"{flag}={value} is not supported with "
                        f"{settings.flag_name('policy')}={cfg.policy}: {why}. {fix}")
    page_size = resolved_page_size(server_args)
    try:
        check_page_size(cfg, page_size)
    except ValueError as err:
        chosen = ("" if server_args.page_size == page_size else
                  f" (SGLang resolved the page size to {page_size} for this launch, e.g. for "
                  f"its attention backend)")
        problems.append(f"{settings.flag_name('window')}={cfg.window} does not fit "
                        f"--page-size={page_size}{chosen}: {str(err).split(': ', 1)[1]}.")
    if cfg.shared_budget and (problem := supported.shared_scope_refusal(server_args)):
        problems.append(f"{settings.flag_name('budget-scope')}={cfg.budget_scope} cannot be "
                        f"served here: {problem}")
    if settings.current().ring == "beside" and not server_args.max_total_tokens:
        problems.append(f"{settings.flag_name('ring')}=beside needs --max-total-tokens (the "
                        "pool the rings are held beside); use pool or auto")
    mrope = _mrope_architecture(server_args)
    if mrope:
        problems.append(
            f"--model-path: {mrope} rotates queries and keys with mrope_positions (multimodal "
            f"RoPE), which the eviction position offset does not correct; it is not supported "
            f"with {settings.flag_name('policy')}={cfg.policy}."
        )
    if problems:
        raise ValueError("\n".join(problems))


def resolved_page_size(server_args) -> int:
    """The page size the server will run with: SGLang keeps its resolution apart from the raw
    flag (e.g. trtllm_mha, the sm_100 default, turns page size 1 into 64)."""
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(server_args, "page_size") or 1


def _mrope_architecture(server_args) -> str | None:
    """The architecture name if SGLang runs this model with mrope positions (ModelConfig
    .model_is_mrope: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and other "mrope_section" models)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of

    model_config = model_config_of(server_args)
    if not getattr(model_config, "model_is_mrope", False):
        return None
    return ", ".join(model_config.hf_config.architectures or ["this model"])


def check_gates(server_args, path: str | None) -> None:
    """A bad --kv-evict-retention-gates file stops the launch here, before any process is
    spawned (each scheduler loads the file again with the same check)."""
    if path:
        from sglang.srt.arg_groups.model_override_base import model_config_of

        settings.load_server_gates(path, model_config_of(server_args).hf_config)


def after_resolve_once(result, server_args):
    """AFTER ServerArgs.resolve_once: runs in `launch_server` and in `sgl.Engine` alike."""
    server = settings.current()
    if server.evicts:
        check_server_args(server_args, server.config)
        check_gates(server_args, server.gates_path)


HOOKS = [
    (TARGET_ADD_CLI_ARGS, "AFTER", after_add_cli_args),
    (TARGET_FROM_CLI_ARGS, "AFTER", after_from_cli_args),
    (TARGET_RESOLVE_ONCE, "AFTER", after_resolve_once),
]
