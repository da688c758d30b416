"""The eviction step on a running decode batch, as a pipeline of small stages:

  1. group    which requests are due (scheduled, or under memory pressure:  grouping.py,
              pressure_groups), grouped by (settings, n, sinks)             host only
  2. plan     requests x layers per chunk (and candidates per chunk) that   vase_sglang.plan
              fit the workspace
  3. per chunk of requests: stage ids, then per chunk of layers:
              gather -> select -> compact                                   vase_sglang.chunk
  4. rewrite  the rows' new layout, a pure function of (n, K, R, pages)     vase_sglang.rows
  5. apply    row writes or K/V copies, then free the dropped pages         here
  6. commit   request state, KV lengths, the batch's seq_lens; or roll      commit.py
              back and finish the chunk's requests; TP ranks agree on them

A request is due when its private cache (tokens not owned by the radix tree) holds
n + window tokens with n >= budget, after its first decode step (its prefill result has been
processed). Candidates are the n oldest private tokens; the newest `window` never are. The
policy keeps K = budget - window of them per (layer, KV head); compaction moves the kept K/V of
every layer and head into the first K candidate slots.

Failures: every group is planned, staged and checked on the host (stage 2, its ids and its
rewrite) before the first device write of the step, so what can fail on the host fails before
anything moves. Stages 3-5 run per chunk of requests, and a chunk's requests are committed
(lengths, state) only after their pages are freed: an exception raised there restores their
rows, and finishes those requests (their KV is no longer what it was) with an error naming the
stage; every other request keeps its KV and the server keeps serving; under tensor
parallelism every rank finishes the requests any rank failed (commit.py,
docs/reliability.md).

Memory: stages 2-3 stream over chunks inside the workspace reserved at startup, so a step's
extra memory is bounded (docs/memory.md). Nothing in the step reads a device value on the host
or copies from pageable memory: host ids are staged through pinned buffers with non-blocking
copies.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from vase_sglang import ops
from vase_sglang.plan import (MIN_CANDIDATE_CHUNK, StepPlan, cut_samples, group_bytes, plan_step,
                              step_cost)
from vase_sglang.chunk import CompactionError, evict_chunk, gather_layout
from vase_sglang.policies import POLICIES
from vase_sglang.rows import RowRewrite, freed_slots, rewrite_row

from . import metrics, shared_scope
from .grouping import due_groups
from .commit import (COMPACT, PLAN, REWRITE, SELECT, STAGE, StepFailure, agree, commit, fail,
                     pinned, restore_rows, update_batch_lengths)
from .state import failed, pos_offset, request_config, request_key, state

logger = logging.getLogger("vase_sglang.eviction")


SCHEDULED, DECODE_PRESSURE, ADMISSION_PRESSURE = "scheduled", "decode_pressure", "admission_pressure"
CAUSES = (SCHEDULED, DECODE_PRESSURE, ADMISSION_PRESSURE)


def evict(rt, batch, skip=()) -> int:
    """Run the scheduled eviction step on a running decode batch; returns the slots freed."""
    return run(rt, batch, due_groups(rt, batch, skip))


def run(rt, batch, groups: dict, cause: str = SCHEDULED) -> int:
    """Evict `groups` (from due_groups or pressure_groups) of `batch`; returns the slots
    freed."""
    if not groups:
        return 0
    start = time.perf_counter()
    rt.timer.start()
    freed = 0
    new_lens = {}
    evictions, tokens = rt.stats.evictions, rt.stats.tokens_evicted
    failed_before = {req for req in batch.reqs if failed(req)}
    prepared = []  # every group planned and staged before the step writes anything
    for key, members in groups.items():
        reqs = [batch.reqs[i] for i in members]
        try:
            group = _prepare_group(rt, key, members, reqs)
        except Exception as err:  # noqa: BLE001  contained: these requests fail, no others
            fail(rt, reqs, PLAN, err)
            continue
        if group is not None:
            prepared.append(group)
    for group in prepared:
        freed += _evict_group(rt, batch, group, new_lens)
    agree(rt, batch, failed_before)  # every TP rank finishes the same requests
    if new_lens:
        update_batch_lengths(batch, new_lens)
    batch.batch_is_full = False  # admission was closed on a full pool; it has room now
    rt.timer.stop()
    elapsed = time.perf_counter() - start
    rt.stats.seconds += elapsed
    rt.stats.slots_freed += freed
    if metrics.METRICS is not None:
        metrics.METRICS.record(rt.stats.evictions - evictions,
                               rt.stats.tokens_evicted - tokens, freed, elapsed, cause)
    rt.report_device_times()
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "evicted %d requests, freed %d slots in %.2f ms: %s",
            len(new_lens), freed, elapsed * 1e3,
            ", ".join(f"{batch.reqs[i].rid}: kv {n}" for i, n in new_lens.items()),
        )
    return freed


class Group(NamedTuple):
    """One group of a step, planned and staged on the host: its settings, candidates n,
    sinks, batch indices and requests, the plan, the staged ids (device rows [B]) and the
    row rewrite a chunk does when the policy keeps cfg.keep."""

    cfg: object
    n: int
    sinks: int
    members: list
    reqs: list
    plan: StepPlan | None  # None: a shared budget scope (one request at a time)
    ids: tuple
    rewrite: RowRewrite


def _prepare_group(rt, key, members, reqs) -> Group | None:
    """Stage 2 for one group, host only: its plan (None: not evicted this time), its ids
    staged, its rewrite checked."""
    cfg, n, sinks = key
    # a shared budget scope evicts one request at a time outside the workspace
    # (shared_scope.py: its temporaries are one request's candidates' scores)
    plan = None if cfg.shared_budget else plan_group(rt, cfg, n, len(reqs))
    if plan is None and not cfg.shared_budget:
        return None
    try:
        ids = _stage(rt, reqs, cfg)
        rewrite = rewrite_row(0, n, cfg.keep, cfg.window, rt.page_size)
    except Exception as err:  # noqa: BLE001
        raise StepFailure(STAGE, err) from err
    return Group(cfg, n, sinks, members, reqs, plan, ids, rewrite)


def _evict_group(rt, batch, group: Group, new_lens) -> int:
    """Evict one group, a chunk of requests at a time; returns the slots freed (a host
    count: nothing is read back). A chunk that fails is rolled back and its requests finished
    with an error (commit.fail); the chunks before it stay committed."""
    cfg, n = group.cfg, group.n
    if cfg.shared_budget:
        return _evict_shared(rt, group, new_lens)
    freed = 0
    for r0 in range(0, len(group.reqs), group.plan.requests):
        part = slice(r0, r0 + group.plan.requests)
        reqs = group.reqs[part]
        try:
            k = _evict_requests(rt, cfg, n, group.sinks, group.plan, group.rewrite,
                                *(column[part] for column in group.ids))
        except Exception as err:  # noqa: BLE001  contained: this chunk's requests fail
            fail(rt, reqs, SELECT, err)
            continue
        commit(rt, cfg, n, k, group.members[part], reqs, new_lens)
        freed += freed_slots(n, k, cfg.window, rt.page_size) * len(reqs)
    return freed


def _evict_shared(rt, group: Group, new_lens) -> int:
    """A group under a shared budget scope, one request at a time (shared_scope.evict_one):
    select over the scope and pack into the request's cells, then the row rewrite and free
    of a per-head step. A request that fails is finished with an error naming the stage."""
    cfg, n = group.cfg, group.n
    rewrite = group.rewrite
    device = rt.req_to_token.device
    freed = 0
    for i, req in zip(group.members, group.reqs):
        try:
            row_slots, view = shared_scope.evict_one(rt, cfg, n, group.sinks, req)
        except Exception as err:  # noqa: BLE001  contained: this request fails
            fail(rt, [req], SELECT, err)  # evict_one's StepFailure names its own stage
            continue
        rows = torch.tensor([req.kv.req_pool_idx], device=device)
        starts = torch.tensor([req.kv.cache_protected_len], device=device)
        # with pages, a budget off the page grid copies the newest window's K/V (and side
        # values) behind the K older slots, as a per-head step does
        side = None if rt.retention is None else (rt.retention.log_beta, rt.retention.position)
        try:
            _apply(rt, rewrite, rows, starts, row_slots[None], side)
        except Exception as err:  # noqa: BLE001
            cols = starts[:, None] + torch.arange(row_slots.shape[0], device=device)
            restore_rows(rt, rows, cols, row_slots[None])
            fail(rt, [req], REWRITE, err)
            continue
        rt.cell_views[req.kv.req_pool_idx] = view
        commit(rt, cfg, n, cfg.keep, [i], [req], new_lens)
        freed += rewrite.freed
    return freed


# -- 2. plan -----------------------------------------------------------------------------------

def plan_group(rt, cfg, n, num_requests) -> StepPlan | None:
    """(requests, layers, candidate chunk) per chunk for this group, from the workspace size
    (arithmetic on a cost model measured once per (config, n) on meta tensors): the plain
    stage where one (request, layer) unit fits, else the unit's candidates streamed in
    chunks. Never a plan outside the workspace: where nothing fits, None (logged once) for a
    policy that cannot stream (a registered one overriding select(), say), an error for one
    that can (the workspace is sized for the longest private cache: workspace_bytes'
    max_candidates)."""
    headroom = rt.workspace.headroom - group_bytes(num_requests)
    policy = POLICIES[cfg.policy]
    for exact in (False, True):  # the shared, rounded-up cost; then the cut's own (rare)
        plan = plan_step(lambda chunk: step_cost(cfg, rt.shapes, n, rt.device_type, chunk,
                                                 exact),
                         n, num_requests, rt.num_layers, rt.workspace.buffer_bytes, headroom,
                         streams=policy.streams())
        if plan is not None:
            return plan
    need = step_cost(cfg, rt.shapes, n, rt.device_type, exact=True)
    need = need.buffer(1, 1) + need.temporaries(1, 1)
    message = (f"an eviction step of policy {cfg.policy!r} over {n} candidates needs "
               f"{need / 2**20:.1f} MiB per (request, layer), more than the "
               f"{rt.workspace.size / 2**20:.1f} MiB workspace")
    if policy.streams():
        raise RuntimeError(f"{message}, even streamed in chunks of {MIN_CANDIDATE_CHUNK} "
                           "candidates: the workspace was sized for shorter caches "
                           "(workspace_bytes' max_candidates)")
    if (cfg.policy, n) not in rt.warned:
        rt.warned.add((cfg.policy, n))
        logger.error(
            "%s, and this policy cannot be streamed over candidate chunks (it defines no "
            "score_streamed): these requests are not evicted this time, their caches "
            "grow; raise --kv-evict-workspace-mb", message)
    return None


def prime_plans(rt) -> int:
    """At startup, on a server whose own mode is elastic: trace the cost of every cut its
    requests can reach (plan.cut_samples: each power-of-two bucket of levels and candidates,
    up to the longest private cache), so that no cut traces in the scheduler's step.
    Returns how many were planned."""
    cfg = rt.cfg
    if not cfg.evicts or not cfg.elastic:
        return 0
    top = rt.max_candidates or rt.limits.max_budget
    samples = cut_samples(cfg.budget, top)
    unfit = []
    for level, n in samples:
        try:
            plan_group(rt, cfg.replace(budget=level, ceiling=None), n, 1)
        except RuntimeError as err:  # a cut this workspace cannot hold: said, not fatal
            unfit.append((level, n, err))
    if unfit:
        level, n, err = unfit[0]
        logger.warning("%d of %d elastic cut sizes do not fit the step workspace even streamed, "
                       "e.g. to %d tokens over %d candidates (%s); such cuts are planned at "
                       "their own budget when they come", len(unfit), len(samples), level, n,
                       err)
    return len(samples)


# -- 3. per chunk: gather -> select -> compact, then 4. rewrite and 5. apply -------------------

def _stage(rt, reqs, cfg) -> tuple[torch.Tensor, ...]:
    """The group's per-request ids as int64 device rows [B] each: request-table row, prefix
    length, draw key, round, position of the oldest window query, seed. Host ints staged
    through one pinned buffer and a non-blocking copy: a pageable copy would block the CPU on
    the forward in flight (overlap scheduler)."""
    columns = [
        [r.kv.req_pool_idx for r in reqs],
        [r.kv.cache_protected_len for r in reqs],
        [request_key(r, cfg) for r in reqs],
        [state(r).rounds for r in reqs],
        # True length L: the newest query written is at position L - 1.
        [r.kv.kv_allocated_len + pos_offset(r) - cfg.window for r in reqs],
        [request_config(r).seed for r in reqs],  # the group's cfg carries no seed
    ]
    device = rt.req_to_token.device
    host = torch.tensor(columns, dtype=torch.int64, pin_memory=pinned(device))
    return tuple(host.to(device, non_blocking=True).unbind(0))


def _evict_requests(rt, cfg, n, sinks, plan: StepPlan, rewrite: RowRewrite, rows, starts,
                    request, rounds, first_query, seeds) -> int:
    """Every layer of a chunk of requests, plan.layers layers at a time (each unit's
    candidates plan.chunk at a time where set); then rewrites their rows and frees their
    dropped pages (device-only: the allocator's free is a torch.cat on page size 1).
    Returns how many candidates each request kept. Raises StepFailure naming the stage; a
    failure before the free restores the rows (the chunk's K/V may be compacted in part:
    its requests are finished by the caller)."""
    device = rt.req_to_token.device
    cols = starts[:, None] + torch.arange(n + cfg.window, device=device)
    row_slots = rt.req_to_token[rows[:, None], cols].long()  # [b, n + R]
    slots = row_slots[:, :n]
    ring_index = None
    if POLICIES[cfg.policy].needs_queries:
        ring_index = (rows[:, None], _ring_entries(rt.queries.shape[2], first_query, cfg.window))
    side = now = None
    if POLICIES[cfg.policy].needs_retention:
        side = (rt.retention.log_beta, rt.retention.position)
        now = first_query + cfg.window  # the true length: the next token's position
    k = None
    try:
        first = 0
        while first < rt.num_layers:
            layers = _fitting_layers(rt, cfg, len(rows), n, plan, first)
            keep = None  # the previous chunk's selection is dead: free it before the next
            keep = evict_chunk(
                cfg, rt.k_buffers, rt.v_buffers, rt.queries, rt.workspace,
                first_layer=first, num_layers=layers,
                layer_ids=rt.layer_ids, slots=slots, ring_index=ring_index,
                request=request, rounds=rounds, sinks=sinks, side=side, now=now,
                attention=rt.attention, head_offset=rt.kv_head_offset,
                candidate_chunk=plan.chunk, seed=seeds[:, None],
            )
            if k is not None and keep.shape[-1] != k:
                raise ValueError(f"policy {cfg.policy!r}: kept {keep.shape[-1]} tokens in one "
                                 f"chunk of layers, {k} in another")
            k = keep.shape[-1]  # cfg.keep for the built-in policies; a custom one may keep all
            first += layers
    except Exception as err:  # noqa: BLE001
        raise StepFailure(COMPACT if isinstance(err, CompactionError) else SELECT, err) from err
    try:
        if k != cfg.keep:
            rewrite = rewrite_row(0, n, k, cfg.window, rt.page_size)
        _apply(rt, rewrite, rows, starts, row_slots, side)
    except Exception as err:  # noqa: BLE001
        # The free is _apply's last act (one allocator call): it did not happen. Put the
        # rows back as they were, so that finishing these requests frees each slot once.
        restore_rows(rt, rows, cols, row_slots)
        raise StepFailure(REWRITE, err) from err
    return k


def _fitting_layers(rt, cfg, b: int, n: int, plan: StepPlan, first: int) -> int:
    """The plan's layers per chunk from layer `first`, halved while the chunk's gathers do
    not fit the workspace buffer (the plan is made from traces at a bucketed candidate count,
    so this only splits a plan that is off; logged once)."""
    layers = min(plan.layers, rt.num_layers - first)
    while layers > 1 and not rt.workspace.fits(
            gather_layout(cfg, rt.shapes, b, layers, n, plan.chunk)):
        layers = (layers + 1) // 2
        if ("split", 0) not in rt.warned:
            rt.warned.add(("split", 0))
            logger.warning("an eviction chunk of %d requests x %d layers over %d candidates "
                           "did not fit the %d-byte workspace as planned: split (logged once)",
                           b, plan.layers, n, rt.workspace.buffer_bytes)
    return layers


def _apply(rt, rw: RowRewrite, rows, starts, row_slots, side) -> None:
    """Carry out a row rewrite (columns relative to each request's prefix) on the chunk's
    requests: move the newest window's slots in the row, or copy their K/V (with their log β
    and positions) into the candidate slots after the kept ones; then free the dropped pages."""
    if rw.freed == 0 and rw.src == rw.dst:
        return  # every candidate kept
    window = torch.arange(rw.window, device=row_slots.device)
    if rw.move_row:
        rt.req_to_token[rows[:, None], starts[:, None] + rw.dst + window] = (
            row_slots[:, rw.src: rw.src + rw.window].to(rt.req_to_token.dtype))
    else:
        # All layers and heads alike: keep[j] = src - dst + j >= j, the compaction's in-place
        # contract (it reads ahead of where it writes).
        shift = (rw.src - rw.dst) + window
        shift = shift.expand(len(rows), rt.num_layers, rt.shapes.kv_heads, rw.window)
        ops.compact_kv_(rt.k_buffers, rt.v_buffers, row_slots[:, rw.dst:], shift)
        if side is not None:
            ops.compact_kv_(side[0], side[1], row_slots[:, rw.dst:], shift)
    _free(rt, row_slots[:, rw.free_start: rw.free_stop])


def _free(rt, slots: torch.Tensor) -> None:
    """Give back the pages of `slots` [b, m], columns that start on page boundaries and
    cover whole pages (a partial last page of the row included)."""
    if rt.page_size == 1:
        rt.allocator.free(slots.reshape(-1))
    elif slots.shape[1]:
        # One slot per page: the allocator's free() would dedup with torch.unique, a sync.
        rt.allocator.free_page_ids((slots[:, ::rt.page_size] // rt.page_size).reshape(-1))


def _ring_entries(ring_size: int, first: torch.Tensor, window: int) -> torch.Tensor:
    """[B, W] ring entries of the last `window` (<= the ring's size) queries of each
    request, in the order a ring of exactly `window` entries would hold them
    (position % window), so a per-request window reproduces a server started with that
    window bit for bit. first: the position of the oldest of them."""
    j = torch.arange(window, device=first.device)
    if window == ring_size:
        return j.expand(first.shape[0], window)
    positions = first[:, None] + (j[None, :] - first[:, None]) % window  # p = j (mod window)
    return positions % ring_size


