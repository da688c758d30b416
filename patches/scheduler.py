"""Hooks on sglang.srt.managers and mem_cache: run the eviction step (step.py) on the running
decode batch (and an early one when the next step would not fit), retract uncompacted requests
first, reset eviction state when a request is retracted, keep compacted slots out of the radix
tree when a request finishes, and its generated tokens out of it when it is re-prefilled."""

from __future__ import annotations

import logging

import torch

from vase_sglang.elastic import freed_by_cut

from . import footprint, grouping, metrics, ring, runtime, shared_scope, state, step

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
        finishing = _finishing(self, batch)
        evict_due(self, rt, batch, finishing)
        staying = [i for i, r in enumerate(batch.reqs) if r not in finishing]
        if staying and not batch.check_decode_mem(selected_indices=staying):
            # The next step does not fit (check_decode_mem has already reclaimed what the
            # radix cache could give). Cut requests that are over budget (fixed mode) or over
            # their floor (elastic) back rather than let the original retract: a retracted
            # compacted request must re-prefill its whole true length.
            freed = relieve_pressure(self, rt, batch, finishing, 0, step.DECODE_PRESSURE)
            if freed:  # else nothing is over budget by a page: SGLang retracts, and says so
                # INFO like SGLang's own "KV cache pool is full. Retract requests." line.
                logger.info("KV cache pool short for the next decode step: early eviction "
                            "freed %d slots", freed)
        if metrics.METRICS is not None:
            metrics.METRICS.record_holdings(grouping.elastic_holdings(rt, batch, finishing))
    return original(self, batch)


def _finishing(scheduler, batch):
    """Requests whose last token, in flight under the overlap scheduler, finishes them."""
    return set(scheduler._reqs_finishing_inflight(batch)) if scheduler.enable_overlap else ()


def evict_due(scheduler, rt, batch, finishing) -> int:
    """Evict the requests of `batch` that are due (host state decides); returns the slots
    freed. Only a step that evicts orders the scheduler's stream after the forward in flight:
    a wait on every decode step would queue every next forward behind the previous one."""
    groups = grouping.due_groups(rt, batch, skip=finishing)
    if not groups:
        return 0
    wait_for_forward(scheduler)
    return step.run(rt, batch, groups)


def relieve_pressure(scheduler, rt, batch, finishing, shortfall: int, cause: str) -> int:
    """Free at least `shortfall` slots plus headroom for the next `window` decode steps of the
    batch (so that pressure does not return on every step) from the requests of `batch`
    (grouping.pressure_groups: admission pressure cuts elastic requests only); returns the slots
    freed."""
    staying = sum(1 for r in batch.reqs if r not in finishing)
    need = shortfall + rt.cfg.window * staying
    groups, level = grouping.pressure_groups(rt, batch, finishing, need, _rank_of(scheduler),
                                         fixed=cause != step.ADMISSION_PRESSURE)
    if not groups:
        return 0
    wait_for_forward(scheduler)
    freed = step.run(rt, batch, groups, cause)
    if level is not None and metrics.METRICS is not None:
        metrics.METRICS.record_level(level)
    return freed


def _rank_of(scheduler):
    """Who loses tokens first under pressure: with --enable-priority-scheduling the requests
    SGLang would schedule last (SGLang's own order of priority values), else all alike."""
    if not getattr(scheduler, "enable_priority_scheduling", False):
        return lambda req: 0
    sign = -1 if getattr(scheduler, "schedule_low_priority_values_first", False) else 1
    return lambda req: sign * (req.priority or 0)


TARGET_NEW_PREFILL = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"


def around_get_new_batch_prefill(original, self, running_batch):
    """AROUND Scheduler.get_new_batch_prefill: admission pressure. A waiting request that the
    floor-charged admission (footprint.py) would take but the free pool cannot hold (it stops
    admission with NO_TOKEN; footprint records the shortfall) is made room for by cutting
    elastic requests over their floors, when they hold enough above them to cover it, so it
    is admitted at the next scheduling round instead of waiting for a request to finish."""
    with footprint.recording_shortfall() as shortfall:
        plan = original(self, running_batch)
    rt = runtime.RUNTIME
    batch = plan.running_batch
    if rt is None or not shortfall or batch is None or batch.is_empty():
        return plan
    finishing = _finishing(self, batch)
    reclaimable = sum(freed_by_cut(h, 0, rt.page_size)
                      for h in grouping.elastic_holdings(rt, batch, finishing))
    if reclaimable >= shortfall[0]:
        freed = relieve_pressure(self, rt, batch, finishing, shortfall[0], step.ADMISSION_PRESSURE)
        if freed:
            logger.info("a waiting request does not fit the KV cache pool: elastic eviction "
                        "freed %d slots", freed)
    return plan


def wait_for_forward(scheduler) -> None:
    """Under the overlap scheduler the previous forward may still read (attention) or write
    (its token's slot) this KV on the forward stream: order the compaction after it on the
    device, without a host sync. run_batch then makes the next forward wait for us. The
    stream is there: after_init_overlap refused to start without it."""
    if _orders_streams(scheduler):
        torch.cuda.current_stream().wait_stream(scheduler.forward_stream)


def _orders_streams(scheduler) -> bool:
    return scheduler.enable_overlap and torch.cuda.is_available()


TARGET_INIT_OVERLAP = "sglang.srt.managers.scheduler.Scheduler.init_overlap"


def after_init_overlap(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.init_overlap: with the overlap scheduler on CUDA the step must order
    its compaction after the forward in flight (wait_for_forward), on the scheduler's
    `forward_stream`. An SGLang that made none would leave a silent race: refuse to start."""
    if _orders_streams(scheduler) and getattr(scheduler, "forward_stream", None) is None:
        raise RuntimeError(
            "vase-sglang: the overlap scheduler has no forward_stream to order the KV "
            "eviction step after the forward in flight; start with --disable-overlap-schedule "
            "or turn eviction off")
    return result


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
    free its slots twice). Retraction releases before Req.reset_for_retract clears the state.
    The request's query-ring slots go back with its row."""
    if checkpoint and state.compacted(req):
        checkpoint = False
    shared_scope.forget(req)
    result = original(req, tree_cache, *args, checkpoint=checkpoint, **kwargs)
    rt = runtime.RUNTIME
    if rt is not None:
        ring.free(rt, req)
    return result


TARGET_PREPARE_EXTEND = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"


def after_prepare_for_extend(result, batch, *args, **kwargs):
    """AFTER ScheduleBatch.prepare_for_extend (a prefill batch has its rows and slots): each
    request whose policy scores with queries gets its query-ring slots (ring.py), from the pool
    (charged at admission, footprint.py) or from the ring storage beside it (admission made
    the request wait for a free ring), before the forward that captures its prompt's last
    queries. Where none is left (not expected) the request is finished with an error naming
    what ran out, rather than served without its ring."""
    rt = runtime.RUNTIME
    if rt is not None and rt.ring_slots:
        for req in batch.reqs:
            short = ring.allocate(rt, req, batch.tree_cache)
            if short is not None:
                logger.error("request %s: %s", req.rid, short)
                state.mark_failed(req, f"{short}; the request was stopped")
    return result


TARGET_UNCACHED = ("sglang.srt.managers.scheduler_components.invariant_checker."
                   "SchedulerInvariantChecker._get_total_uncached_sizes")


def around_uncached_sizes(original, checker, *args, **kwargs):
    """AROUND SchedulerInvariantChecker._get_total_uncached_sizes (SGLang's busy-time memory
    check: available + evictable + protected + held + uncached == total): the query-ring
    slots the requests hold are outside their rows, and counted here."""
    full, swa = original(checker, *args, **kwargs)
    rt = runtime.RUNTIME
    return (full + (rt.ring_held if rt is not None else 0)), swa


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
    (TARGET_INIT_OVERLAP, "AFTER", after_init_overlap),
    (TARGET_CREATE_REQ, "AFTER", after_create_req),
    (TARGET_NEW_PREFILL, "AROUND", around_get_new_batch_prefill),
    (TARGET_UPDATE_RUNNING_BATCH, "AROUND", around_update_running_batch),
    (TARGET_RETRACTION_ORDER, "AROUND", around_retraction_order),
    (TARGET_RESET_FOR_RETRACT, "AFTER", after_reset_for_retract),
    (TARGET_RELEASE_KV, "AROUND", around_release_kv_cache),
    (TARGET_PREPARE_EXTEND, "AFTER", after_prepare_for_extend),
    (TARGET_UNCACHED, "AROUND", around_uncached_sizes),
    (TARGET_MAX_PREFIX_LEN, "AROUND", around_max_prefix_len),
    (TARGET_TREE_CHECKPOINT, "AROUND", around_tree_checkpoint),
]
