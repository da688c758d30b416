"""The eviction step's first stage (step.py), on the host only: which requests of a running
decode batch a step evicts and how they are grouped. A request is due when its private cache
(tokens not owned by the radix tree) holds its trigger length (fixed mode: budget + window);
under memory pressure `pressure_groups` picks the requests to cut instead. Each group (settings,
candidates n, sinks) is one batched selection and compaction."""

from __future__ import annotations

import logging

from vase_sglang.elastic import Holding, freed_by_cut, water_fill
from vase_sglang.policies import POLICIES

from .state import failed, request_config, state

logger = logging.getLogger("vase_sglang.eviction")


def due_groups(rt, batch, skip=()) -> dict:
    """The requests of `batch` this step evicts on schedule (their private cache reached
    trigger_len: budget + window in fixed mode, ceiling + window in elastic mode), grouped by
    their effective settings (per-request overrides) and by (n, sinks), so each group is one
    batched select + compaction. Host state only: nothing runs on the device."""
    groups: dict[tuple, list[int]] = {}
    for i, req, cfg, private in _evictable(rt, batch, skip):
        if cfg.trigger_len is not None and private >= cfg.trigger_len:
            _add(groups, i, req, cfg.replace(budget=cfg.scheduled_budget, ceiling=None), private)
    return groups


def pressure_groups(rt, batch, skip, need: int, rank_of=lambda req: 0,
                    fixed: bool = True) -> tuple[dict, int | None]:
    """Memory pressure (the next decode step, or a waiting request, does not fit): the groups
    that free it, and the lowest level an elastic request is cut to (None: none is).
    With `fixed`, every fixed-mode request at least half a window (and a page) over its
    budget is cut back to it, due or not: an early eviction instead of a retraction, all at
    once rather than just enough for one step, so the pool has room for many steps and the
    requests stay in phase (the next eviction is again one batched group). A smaller cut
    would cost a whole scoring pass for a few slots, on every step of a pool that stays
    short; such requests are cut on schedule, within half a window. Admission pressure passes
    fixed=False: a waiting request is no reason to cut fixed caches early. Elastic requests
    are water-filled (vase_sglang/elastic.py) to free what is still needed of `need` slots;
    rank_of(req): lower ranks lose tokens first."""
    groups: dict[tuple, list[int]] = {}
    freed = 0
    holdings, elastic = [], []
    for i, req, cfg, private in _evictable(rt, batch, skip):
        if cfg.elastic:
            holdings.append(Holding(private, cfg.budget, cfg.window, rank_of(req)))
            elastic.append((i, req, cfg, private))
        # Cut back to its budget where that frees enough (with pages, dropping fewer tokens
        # than separate its length from the last page boundary frees nothing).
        elif fixed and (cut := freed_by_cut(Holding(private, cfg.budget, cfg.window), 0,
                                            rt.page_size)) >= min_fixed_cut(cfg, rt.page_size):
            _add(groups, i, req, cfg, private)
            freed += cut
    levels = water_fill(holdings, need - freed, rt.page_size) if need > freed else {}
    for j, level in levels.items():
        i, req, cfg, private = elastic[j]
        _add(groups, i, req, cfg.replace(budget=level, ceiling=None), private)
    return groups, (min(levels.values()) if levels else None)


def min_fixed_cut(cfg, page_size: int) -> int:
    """The fewest slots a pressure cut of a fixed-mode request must free: half a window,
    at least a page."""
    return max(page_size, cfg.window // 2)


def elastic_holdings(rt, batch, skip=()) -> list[Holding]:
    """The elastic requests of `batch` as the water-filling sees them (for metrics and for
    what admission pressure may reclaim)."""
    return [Holding(private, cfg.budget, cfg.window)
            for _i, _req, cfg, private in _evictable(rt, batch, skip) if cfg.elastic]


def _evictable(rt, batch, skip):
    """(index, req, its settings, its private tokens) of every request of `batch` the step
    may evict now."""
    for i, req in enumerate(batch.reqs):
        if req in skip or req.kv.req_pool_idx is None or failed(req):
            continue
        cfg = request_config(req)
        if cfg is None:
            continue  # eviction off for this request
        if req.decode_batch_idx < 1:
            # Under the overlap scheduler the first decode step is prepared before the
            # prefill result is processed, i.e. before the radix tree takes the prompt
            # (cache_protected_len is still the old match): the prompt would look private.
            continue
        if (rt.ring_slots and state(req).ring_row is None
                and POLICIES[cfg.policy].needs_queries):
            # It was given no query ring (ring.need: its cache could never reach its budget)
            # and yet is over it: scoring would read another row's queries. Not expected.
            _warn_once(rt, "no ring", f"request {req.rid}: over its budget without a query "
                       "ring: it is not evicted (nor any other such request; logged once)")
            continue
        kv = req.kv
        if kv.kv_committed_len != kv.kv_allocated_len:
            continue  # only speculative decoding over-allocates; rejected at startup
        if kv.cache_protected_len % rt.page_size:
            # The row rewrite and the page frees assume the private cache starts on a page
            # (the radix tree holds whole pages). Not seen in any tested setting; refused
            # rather than guessed at: the request keeps its whole cache.
            _warn_once(rt, "unaligned", f"request {req.rid}: its shared prefix "
                       f"({kv.cache_protected_len} tokens) does not end on a page of "
                       f"{rt.page_size} tokens: it is not evicted (nor any other such request; "
                       "logged once)")
            continue
        yield i, req, cfg, kv.kv_allocated_len - kv.cache_protected_len


def _warn_once(rt, what: str, message: str) -> None:
    if (what, 0) not in rt.warned:
        rt.warned.add((what, 0))
        logger.warning("%s", message)


def _add(groups, i, req, cfg, private) -> None:
    """Request i, cut back to cfg.budget, into its group."""
    n = private - cfg.window  # candidates: all private tokens but the newest window
    sinks = max(0, cfg.sinks - req.kv.cache_protected_len)
    # Seeds are passed per request (a tensor): requests differing only in their seed share a
    # group, so a client's many seeds do not split a step into small ones.
    groups.setdefault((cfg.replace(seed=0), n, sinks), []).append(i)
