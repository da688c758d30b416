"""Hooks on sglang.srt.managers.schedule_policy: admission that knows footprints are capped.

Stock admission reserves prompt + min(max_new_tokens, CLIP_MAX_NEW_TOKENS) per new request and
the remaining max_new_tokens of every running one, so the slots eviction frees would sit idle.
With eviction on, a request's private cache never exceeds budget + window tokens: a new request
is charged at most that, and a running one only what it can still grow before its next
eviction."""

from __future__ import annotations

from . import runtime

TARGET_CLIP = "sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS"
TARGET_RUNNING_OFFSET = (
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset"
)


def cap_new_request_estimate(cfg) -> None:
    """Scheduler process: the module global every admission path reads at call time."""
    from sglang.srt.managers import schedule_policy

    schedule_policy.CLIP_MAX_NEW_TOKENS = min(schedule_policy.CLIP_MAX_NEW_TOKENS, cfg.trigger_len)


def around_running_offset(original, self, req):
    """AROUND PrefillAdder._get_running_request_total_token_offset."""
    rt = runtime.RUNTIME
    if rt is None:
        return original(self, req)
    ratio = 1.0 if req.sampling_params.ignore_eos else self.new_token_ratio
    remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    private = req.kv.kv_allocated_len - req.kv.cache_protected_len
    growth = max(0, rt.cfg.trigger_len - private)
    return min(remaining, growth) * ratio


HOOKS = [(TARGET_RUNNING_OFFSET, "AROUND", around_running_offset)]
DATA_TARGETS = [TARGET_CLIP]  # assigned, not wrapped; checked at load like the hook targets
