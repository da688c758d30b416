"""A request's query-ring slots (vase_sglang/pool_ring.py): whether it needs a ring, what admission
charges for it, waiting for a free ring, allocating it with the request's prefill and giving it
back with the request's row.

Where the rings live (memory.ring_storage_slots): in the KV pool (charged at admission like
prompt tokens, footprint.py) or, beside a --max-total-tokens pool, in a storage of their own
sized for the requests the pool can run at the server's budget. Admission charges a request by
its own budget, so with per-request budgets below the server's more requests fit the pool than
there are rings beside it: such a request waits in the queue for a ring (`waits`, checked at
admission) rather than being admitted without one (docs/memory.md)."""

from __future__ import annotations

from vase_sglang.policies import POLICIES
from vase_sglang.rows import owned_prompt

from .state import request_config, state


def need(rt, req, radix: bool) -> int:
    """Ring slots `req` needs now: none where its policy reads no queries, where it holds them
    already, or where it can never be evicted: its private cache (tokens the radix tree does
    not own; with the radix cache on, the tree owns the prompt's whole pages once it is
    prefilled) can grow to at most its budget, and every cut keeps at least the budget."""
    cfg = request_config(req)
    if not rt.ring_slots or cfg is None or state(req).ring_row is not None:
        return 0
    if not POLICIES[cfg.policy].needs_queries:
        return 0
    max_new = req.sampling_params.max_new_tokens
    prompt = len(req.origin_input_ids)
    owned = owned_prompt(prompt, rt.page_size, radix)
    if max_new is not None and prompt - owned + max_new <= cfg.budget:
        return 0
    return rt.ring_slots


def charge(rt, req, radix: bool) -> int:
    """Pool slots admitting `req` takes for its ring: `need`, where the rings are held in the
    pool; 0 beside it (memory.ring_storage_slots)."""
    return 0 if rt.ring_storage is not None else need(rt, req, radix)


def waits(rt, req, radix: bool, admitted) -> bool:
    """Whether `req` must wait for a ring: the storage beside the pool has no ring left for it
    after the requests `admitted` earlier in this scheduling round (whose rings are allocated
    with their prefill, after admission)."""
    storage = rt.ring_storage
    if storage is None:
        return False
    mine = need(rt, req, radix)
    if not mine:
        return False
    pending = sum(need(rt, r, radix) for r in admitted)
    return storage.available_size() < pending + mine


def allocate(rt, req, tree_cache) -> str | None:
    """Give `req` (with its request-table row) its ring slots: from the KV pool, evicting from
    the radix tree first as any allocation does, or from the ring's own storage. Returns None,
    or what ran out (admission charged the slots, or made the request wait for a ring: not
    expected; the caller finishes the request with it)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    slots_needed = need(rt, req, not getattr(tree_cache, "disable", True))
    if not slots_needed:
        return None
    storage = rt.ring_storage
    if storage is not None:
        slots = storage.alloc(slots_needed)
        if slots is None:
            return (f"the query-ring storage beside the KV cache pool had {storage.available_size()}"
                    f" of its {storage.size} slots free, {slots_needed} needed for the "
                    "request's query ring")
    else:
        evict_from_tree_cache(tree_cache, slots_needed)
        slots = rt.allocator.alloc(slots_needed)
        if slots is None:
            return (f"the KV cache pool had no {slots_needed} free slots for the request's "
                    "query ring")
    row = req.kv.req_pool_idx
    rt.queries.table[row, :slots_needed] = slots.to(rt.queries.table.dtype)
    state(req).ring_row = row
    if storage is None:
        rt.ring_held += slots_needed  # in the pool: SGLang's memory check counts them
    return None


def free(rt, req) -> None:
    """Give `req`'s ring slots back (finish, abort, retraction) and point its table row at the
    padding slot again."""
    st = state(req)
    if st.ring_row is None:
        return
    row = rt.queries.table[st.ring_row]
    (rt.ring_storage or rt.allocator).free(row.clone())
    row.zero_()
    if rt.ring_storage is None:
        rt.ring_held -= rt.ring_slots
    st.ring_row = None
