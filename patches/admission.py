"""Hooks on sglang.srt.managers.schedule_policy: admission that knows footprints are capped.

Stock admission reserves prompt + min(max_new_tokens, CLIP_MAX_NEW_TOKENS) per new request and
the remaining max_new_tokens of every running one, so the slots eviction frees would sit idle.
With eviction on, a request's private cache (tokens not owned by the radix tree) cycles between
budget and budget + window, and the scheduler hook cuts requests back to their budget early
when the next decode step would not fit (scheduler.py). So admission charges a capped request
`charge_len(cfg)` private tokens, the middle of its cycle (see there):

  * a new request is charged prompt + min(max_new_tokens, charge): the clip is set to the
    request's own charge for the duration of its admission call;
  * a running request is charged only what it can still grow up to that charge. That growth
    is certain, so SGLang's new_token_ratio (its estimate of how many requests stop early on
    EOS) only scales the part of a request's remaining tokens that is not capped;
  * the ignore_eos path with the radix cache off (`add_one_req_ignore_eos`) simulates requests
    finishing one by one and freeing prompt + max_new_tokens each; that model does not hold
    for capped requests, so they take the general path, which sums the capped charges.

Requests for which eviction is off (per-request control) keep the stock figures.
"""

from __future__ import annotations

from contextlib import contextmanager

from . import runtime

TARGET_CLIP = "sglang.srt.managers.schedule_policy.CLIP_MAX_NEW_TOKENS"
TARGET_ADD_ONE_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
TARGET_ADD_CHUNKED_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"
TARGET_RUNNING_OFFSET = (
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset"
)


def charge_len(cfg, page_size: int = 1) -> int:
    """Private tokens admission charges a capped request: the middle of its cycle between
    budget and budget + window, plus the token its next step allocates and one in flight
    under the overlap scheduler, in whole pages (the cycle in pages runs from ceil(T / ps) to
    ceil((T + R) / ps)). Charging the bottom of the cycle admits a few more requests but,
    with them in phase, the pool runs short every few steps and each time forces an early
    eviction round; charging the top leaves up to `window` tokens per request idle."""
    low = runtime.round_up_to_pages(cfg.budget, page_size)
    high = runtime.round_up_to_pages(cfg.budget + cfg.window, page_size)
    return runtime.round_up_to_pages((low + high) // 2 + 2, page_size)


@contextmanager
def _clip_for(req, page_size: int):
    """CLIP_MAX_NEW_TOKENS is a module global read at call time by every admission path; the
    scheduler admits one request at a time on one thread, so swapping it per call is safe."""
    from sglang.srt.managers import schedule_policy

    cfg = runtime.request_config(req)
    stock = schedule_policy.CLIP_MAX_NEW_TOKENS
    if cfg is not None:
        schedule_policy.CLIP_MAX_NEW_TOKENS = min(stock, charge_len(cfg, page_size))
    try:
        yield cfg
    finally:
        schedule_policy.CLIP_MAX_NEW_TOKENS = stock


def around_add_one_req(original, self, req, *args, **kwargs):
    """AROUND PrefillAdder.add_one_req."""
    with _clip_for(req, self.page_size) as cfg:
        params = req.sampling_params
        if cfg is None or not params.ignore_eos:
            return original(self, req, *args, **kwargs)
        # Route a capped ignore_eos request past the add_one_req_ignore_eos branch (its only
        # use of the flag in add_one_req); running-request charges still see ignore_eos.
        params.ignore_eos = False
        try:
            return original(self, req, *args, **kwargs)
        finally:
            params.ignore_eos = True


def around_add_chunked_req(original, self, req):
    """AROUND PrefillAdder.add_chunked_req: the last chunk reserves the decode tokens too."""
    with _clip_for(req, self.page_size):
        return original(self, req)


def around_running_offset(original, self, req):
    """AROUND PrefillAdder._get_running_request_total_token_offset."""
    cfg = runtime.request_config(req)
    if cfg is None:
        return original(self, req)
    radix = not getattr(self.tree_cache, "disable", True)  # SGLang's own test in add_one_req
    return capped_running_offset(cfg, req, self.new_token_ratio, radix, self.page_size)


def capped_running_offset(cfg, req, new_token_ratio: float, radix: bool,
                          page_size: int = 1) -> float:
    """Slots a running capped request may still take: up to its charge, the prompt apart when
    the radix tree owns it (whole pages of it: a partial last page is private, inside the
    charge). The prompt is counted from the request itself, not from cache_protected_len:
    under the overlap scheduler a request admitted in the previous round has run its prefill
    but the tree has not taken its prompt yet. A request holds whole pages."""
    remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    kv = req.kv
    prompt_pages = len(req.origin_input_ids) // page_size * page_size
    owned = max(kv.cache_protected_len, prompt_pages) if radix else 0
    held = runtime.round_up_to_pages(kv.kv_allocated_len, page_size)
    growth = max(0, owned + charge_len(cfg, page_size) - held)
    if growth < remaining:
        return float(growth)
    ratio = 1.0 if req.sampling_params.ignore_eos else new_token_ratio
    return remaining * ratio


HOOKS = [
    (TARGET_ADD_ONE_REQ, "AROUND", around_add_one_req),
    (TARGET_ADD_CHUNKED_REQ, "AROUND", around_add_chunked_req),
    (TARGET_RUNNING_OFFSET, "AROUND", around_running_offset),
]
DATA_TARGETS = [TARGET_CLIP]  # assigned, not wrapped; checked at load like the hook targets
