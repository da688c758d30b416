"""Hooks on sglang.srt.managers and mem_cache: run the eviction step (step.py) on the running
decode batch (and an early one when the next step would not fit), retract uncompacted requests
first, reset eviction state when a request is retracted, keep compacted slots out of the radix
tree when a request finishes, and its generated tokens out of it when it is re-prefilled."""

from __future__ import annotations

import logging

import torch

from . import runtime, state, step

logger = logging.getLogger("vase_sglang.eviction")

TARGET_UPDATE_RUNNING_BATCH = "sglang.srt.managers.scheduler.Scheduler.update_running_batch"
TARGET_RESET_FOR_RETRACT = "sglang.srt.managers.schedule_batch.Req.reset_for_retract"
TARGET_RETRACTION_ORDER = (
    "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order"
)


def around_update_running_batch(original, self, batch):
    """AROUND Scheduler.update_running_batch: evict before the original checks decode memory,
    so freed slots avert needless retraction and prepare_for_decode sees the new lengths."""
    rt = runtime.RUNTIME
    if rt is not None and not batch.is_empty():
        finishing = ()
        if self.enable_overlap:
            finishing = set(self._reqs_finishing_inflight(batch))
        evict_due(self, rt, batch, finishing)
        staying = [i for i, r in enumerate(batch.reqs) if r not in finishing]
        if staying and not batch.check_decode_mem(selected_indices=staying):
            # The next step does not fit (check_decode_mem has already reclaimed what the
            # radix cache could give). Cut requests that are over budget but not yet due
            # back to it rather than let the original retract: a retracted compacted request
            # must re-prefill its whole true length.
            freed = evict_due(self, rt, batch, finishing, early=True)
            if freed:  # else nothing is over budget by a page: SGLang retracts, and says so
                # INFO like SGLang's own "KV cache pool is full. Retract requests." line.
                logger.info("KV cache pool short for the next decode step: early eviction "
                            "freed %d slots", freed)
    return original(self, batch)


def evict_due(scheduler, rt, batch, finishing, early: bool = False) -> int:
    """Evict the requests of `batch` that are due (host state decides); returns the slots
    freed. Only a step that evicts orders the scheduler's stream after the forward in flight:
    a wait on every decode step would queue every next forward behind the previous one."""
    groups = step.due_groups(rt, batch, skip=finishing, early=early)
    if not groups:
        return 0
    wait_for_forward(scheduler)
    return step.run(rt, batch, groups)


def wait_for_forward(scheduler) -> None:
    """Under the overlap scheduler the previous forward may still read (attention) or write
    (its token's slot) this KV on the forward stream: order the compaction after it on the
    device, without a host sync. run_batch then makes the next forward wait for us."""
    stream = getattr(scheduler, "forward_stream", None)
    if scheduler.enable_overlap and stream is not None and torch.cuda.is_available():
        torch.cuda.current_stream().wait_stream(stream)


def around_retraction_order(original, reqs):
    """AROUND ScheduleBatch._get_decode_retraction_order (a staticmethod)."""
    from sglang.srt.runtime_context import get_schedule

    by_priority = get_schedule().retraction_policy == "priority"
    return uncompacted_last(original(reqs), reqs, by_priority)


def uncompacted_last(order: list[int], reqs, by_priority: bool) -> list[int]:
    """Reorder SGLang's keep-order (retraction pops from the end) so that uncompacted requests
    are retracted first. A compacted request frees only about budget + window slots but must
    re-prefill its whole true length (prompt + every token generated) and loses its compacted
    cache. The sort is stable: SGLang's order (priority, then length) holds within each group,
    and with the priority policy a priority block still outranks compaction."""
    rank: dict = {}
    for i in order:  # priority blocks in SGLang's order; a single block without priorities
        rank.setdefault(reqs[i].priority if by_priority else None, len(rank))
    return sorted(order, key=lambda i: (rank[reqs[i].priority if by_priority else None],
                                        not state.compacted(reqs[i])))


TARGET_CREATE_REQ = "sglang.srt.managers.scheduler.Scheduler._create_generation_req"


def after_create_req(req, scheduler, recv_req, *args, **kwargs):
    """AFTER Scheduler._create_generation_req (SGLang's extension point for request-local
    state): derive the request's eviction settings once; settings this scheduler cannot apply
    abort the request with HTTP 400 before its prefill."""
    state.check_new_request(req)
    return req


def after_reset_for_retract(result, req):
    state.reset_request(req)


TARGET_RELEASE_KV = "sglang.srt.mem_cache.common.release_kv_cache"


def around_release_kv_cache(original, req, tree_cache, *args, checkpoint, **kwargs):
    """AROUND release_kv_cache (a finished or retracted request gives its row back; with
    `checkpoint` the tree first keeps what it can key): a compacted request's slots no longer
    hold the true tokens at their positions, so publishing them would poison the tree (and
    free its slots twice). Retraction releases before Req.reset_for_retract clears the state."""
    if checkpoint and state.compacted(req):
        checkpoint = False
    return original(req, tree_cache, *args, checkpoint=checkpoint, **kwargs)


# A retracted request re-prefills origin_input_ids + output_ids. Stock SGLang matches all of
# it against the radix tree (Req.init_next_round_input -> match_kv_cache with the limit from
# _compute_max_prefix_len) and, after the prefill, inserts all of it and locks it
# (checkpoint_kv_cache -> tree.checkpoint(req, up_to=req.extend_end)): the generated tokens
# become tree-owned (cache_protected_len = the whole length) and are never evicted again.
# These two hooks keep an evicting request's generated tokens private while it runs; only its
# original prompt is shared through the tree. Its finish-time insert is unchanged (compacted
# requests skip it anyway).
TARGET_MAX_PREFIX_LEN = "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len"
TARGET_TREE_CHECKPOINT = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint"


def around_max_prefix_len(original, req, input_len):
    """AROUND Req._compute_max_prefix_len: an evicting request matches at most its prompt."""
    limit = original(req, input_len)
    if state.request_config(req) is None:
        return limit
    return min(limit, len(req.origin_input_ids))


def around_tree_checkpoint(original, tree, req, *args, up_to, **kwargs):
    """AROUND UnifiedRadixCache.checkpoint (the running, not finished, request's insert): an
    evicting request publishes at most its prompt."""
    if not req.finished() and state.request_config(req) is not None:
        up_to = min(up_to, max(len(req.origin_input_ids), req.kv.cache_protected_len))
    return original(tree, req, *args, up_to=up_to, **kwargs)


HOOKS = [
    (TARGET_CREATE_REQ, "AFTER", after_create_req),
    (TARGET_UPDATE_RUNNING_BATCH, "AROUND", around_update_running_batch),
    (TARGET_RETRACTION_ORDER, "AROUND", around_retraction_order),
    (TARGET_RESET_FOR_RETRACT, "AFTER", after_reset_for_retract),
    (TARGET_RELEASE_KV, "AROUND", around_release_kv_cache),
    (TARGET_MAX_PREFIX_LEN, "AROUND", around_max_prefix_len),
    (TARGET_TREE_CHECKPOINT, "AROUND", around_tree_checkpoint),
]
