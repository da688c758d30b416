"""Hooks on the output path: each response's meta_info gets `kv_evicted_tokens`, the number of
its tokens evicted per (layer, KV head) so far, and `kv_min_budget`, the smallest budget its
cache was cut to (null: never cut; in elastic mode the lowest level memory pressure took it to).

SGLang's own extension point carries it: SchedulerOutputStreamer emits "additional customized
info" when its class flag `has_additional_customized_info` is set (we set it in the scheduler
process when eviction is on), and the tokenizer manager accumulates such values into meta_info
as a list, which we collapse to the latest count."""

from __future__ import annotations

from . import runtime, state

KEY = "kv_evicted_tokens"
MIN_BUDGET_KEY = "kv_min_budget"
TARGET_STREAMER = (
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
)
TARGET_BUILD_INFO = TARGET_STREAMER + ".build_additional_customized_info"
TARGET_META_INFO = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"


def enable_in_scheduler() -> None:
    """Scheduler process, eviction on: opt the streamer into additional customized info
    (a ClassVar on the target class, read by every instance)."""
    import pkgutil

    pkgutil.resolve_name(TARGET_STREAMER).has_additional_customized_info = True


def after_build_info(result, self, reqs):
    """AFTER SchedulerOutputStreamer.build_additional_customized_info."""
    if runtime.RUNTIME is None:
        return result
    result = dict(result or {})
    result[KEY] = [[state.evicted_tokens(req)] for req in reqs]
    result[MIN_BUDGET_KEY] = [[state.min_budget(req)] for req in reqs]
    return result


def after_update_meta_info(result, self, meta_info, *args, **kwargs):
    """AFTER TokenizerManager.update_request_meta_info: latest cumulative count, not a list."""
    for key, empty in ((KEY, 0), (MIN_BUDGET_KEY, None)):
        values = meta_info.get(key)
        if isinstance(values, list):
            meta_info[key] = values[-1] if values else empty


SCHEDULER_HOOKS = [(TARGET_BUILD_INFO, "AFTER", after_build_info)]
FRONTEND_HOOKS = [(TARGET_META_INFO, "AFTER", after_update_meta_info)]
