"""Per-process eviction state and the eviction step on SGLang's data structures.

One `EvictionRuntime` lives in each scheduler process (built when the model runner has its KV
pool). The step, per request whose private cache (tokens not owned by the radix tree) holds
n + window tokens with n >= budget:

  0. only after the request's first decode step (its prefill result has been processed);
  1. candidates = the n oldest private tokens; the newest `window` are never candidates;
  2. `select_tokens` picks K = budget - window of them per (layer, KV head);
  3. `compact_kv_` moves the kept K/V of every layer and head into the first K candidate slots;
  4. the row of req_to_token is rewritten so the newest `window` tokens (slots untouched) follow
     the K kept slots, and the other n - K candidate slots go back to the allocator;
  5. the request's KV lengths, the batch's seq_lens and the RoPE position offset are updated.

Steps 2-3 stream over chunks of requests x layers inside a workspace reserved at startup, so a
step's extra memory is bounded (vase_sglang/workspace.py, docs/memory.md). Nothing in the step
reads a device value on the host or copies from pageable memory: host ids are staged through
pinned buffers with non-blocking copies.

Row layout before and after (P = tree-owned prefix, never touched):
    [0, P) prefix | [P, P+n) candidates            | [P+n, P+n+R) newest R
    [0, P) prefix | [P, P+K) kept (mixed per head) | [P+K, P+K+R) newest R   (same slots)

Pages (--page-size ps > 1): paged attention backends read position p of a row from the page
of row[p - p % ps] at offset p % ps, and the allocator takes back whole pages only. P is
page-aligned (the radix tree owns whole pages), so the kept tokens fill the candidates' pages
in order as above. The newest R then follow at P+K:
  * K and n multiples of ps (the steady cycle when T and R are): their pages move whole, by
    rewriting the row as at page size 1, and the dropped candidates are whole pages;
  * otherwise their in-page offsets would not line up: their K/V (every layer and head) is
    copied into the candidate slots at P+K .. P+K+R, the row keeps its entries, and the pages
    wholly past the new length, from ceil(P+K+R) on, are freed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vase_sglang import EvictionConfig, capture, ops
from vase_sglang.policies import POLICIES, AttentionParams
from vase_sglang.workspace import (MIN_CANDIDATE_CHUNK, STREAM_CHUNK, ChunkCost, KVShapes,
                                   StepPlan, Workspace, chunk_cost, evict_chunk, plan_step,
                                   size_workspace)

from . import metrics, request_control
from .settings import RequestLimits
from .timing import StepTimer

logger = logging.getLogger("vase_sglang.eviction")

_UNSET = object()


@dataclass
class RequestEviction:
    """One request's eviction state: the only attribute this plugin keeps on sglang's Req
    (`Req._vase`; Req has no __slots__, Req.kv does). Created on first use (`state`)."""

    config: object = _UNSET  # effective EvictionConfig, None = off (request_config); cached
    pos_offset: int = 0  # tokens removed from the KV so far: true position - KV length
    evicted: int = 0  # tokens evicted per (layer, KV head) over the request's life (meta_info)
    rounds: int = 0  # evictions since the request was (re)admitted
    # crc32 of the request's first `hashed` tokens (prompt, then output): its draws' key
    hashed: int = 0
    token_crc: int = 0
    # Req.skip_radix_cache_insert before the first eviction set it (restored on retraction)
    saved_skip_insert: bool | None = None


STATE = "_vase"


def state(req) -> RequestEviction:
    """The request's eviction state, created on first use."""
    st = getattr(req, STATE, None)
    if st is None:
        st = RequestEviction()
        setattr(req, STATE, st)
    return st


def pos_offset(req) -> int:
    st = getattr(req, STATE, None)
    return 0 if st is None else st.pos_offset


def evicted_tokens(req) -> int:
    st = getattr(req, STATE, None)
    return 0 if st is None else st.evicted


@dataclass
class EvictionStats:
    evictions: int = 0  # request-rounds
    tokens_evicted: int = 0
    slots_freed: int = 0
    seconds: float = 0.0  # host wall time of the steps (what the scheduler waited for)
    device_seconds: float = 0.0  # device time of the finished steps (StepTimer)


@dataclass
class EvictionRuntime:
    cfg: EvictionConfig
    k_buffers: list
    v_buffers: list
    req_to_token: torch.Tensor
    allocator: object
    num_q_heads: int
    head_dim: int
    start_layer: int
    queries: torch.Tensor | None  # ring [layers, rows, window, H_q, D] of post-RoPE queries
    workspace: Workspace | None = None  # gathers of a step; None: sized for this server now
    stats: EvictionStats = field(default_factory=EvictionStats)
    attention: AttentionParams = AttentionParams()  # the model's logit scaling and soft-cap
    kv_head_offset: int = 0  # global index of this rank's first KV head (tensor parallel)
    # Ring row of each token of the current extend batch (SCRATCH_ROW where not kept); a
    # persistent buffer because recorded prefill graphs read it (vase_sglang.capture).
    token_rows: torch.Tensor | None = None
    page_size: int = 1  # the allocator's; the step keeps the paged row layout (module doc)
    retention: RetentionBuffers | None = None  # with --kv-evict-retention-gates: trimkv served
    limits: RequestLimits | None = None  # what requests may choose (default: from cfg)
    # The longest private cache the server admits (the model's context length): the
    # workspace holds one unit of it, streamed over candidates. None: the largest budget.
    max_candidates: int | None = None

    def __post_init__(self):
        k = self.k_buffers[0]
        ring = self.queries
        self.shapes = KVShapes(
            kv_heads=k.shape[1], q_heads=self.num_q_heads, head_dim=self.head_dim,
            kv_dtype=k.dtype, q_dtype=ring.dtype if ring is not None else k.dtype,
            ring_window=ring.shape[2] if ring is not None else self.cfg.window,
        )
        self.device_type = k.device.type  # the device the step's memory is planned for
        # Global layer ids key the draws; built once (a device arange, no host copy).
        self.layer_ids = torch.arange(self.start_layer, self.start_layer + self.num_layers,
                                      device=k.device)
        if self.limits is None:
            self.limits = RequestLimits.defaults(self.cfg)
        if self.workspace is None:  # what memory.around_profile reserved for it
            self.workspace = allocate_workspace(self.cfg, self.shapes, k.device,
                                                max_budget=self.limits.max_budget,
                                                max_candidates=self.max_candidates)
        if self.device_type == "cuda":
            # The compaction kernel's pointer tables: one host copy now, none per step.
            from vase_sglang.ops.compact import pointer_table

            pointer_table(self.k_buffers, k.device), pointer_table(self.v_buffers, k.device)
            if self.retention is not None:
                pointer_table(self.retention.log_beta, k.device)
                pointer_table(self.retention.position, k.device)
        self._warned: set[tuple[str, int]] = set()
        self.timer = StepTimer(k.device)

    def request_settings(self, custom_params) -> EvictionConfig | None:
        """A request's effective settings on this scheduler (its page size, gates, limits)."""
        return request_control.effective_config(custom_params, self.cfg, self.page_size,
                                                self.retention is not None, self.limits)

    @property
    def num_layers(self) -> int:
        return len(self.k_buffers)

    def capture_queries(self, layer_id: int, q: torch.Tensor, forward_batch) -> None:
        """Write the post-RoPE queries of the last `window` positions of each request into the
        ring at position % window. Runs inside CUDA graphs: see vase_sglang.capture."""
        ring = self.queries[layer_id - self.start_layer]
        q = q.reshape(q.shape[0], self.num_q_heads, self.head_dim)
        mode = forward_batch.forward_mode
        if mode.is_decode():
            capture.capture_decode_queries(ring, q, forward_batch.req_pool_indices,
                                           forward_batch.positions, self.cfg.window)
        elif mode.is_extend() and forward_batch.extend_seq_lens is not None:
            capture.capture_extend_queries(ring, q, self.token_rows, forward_batch.positions,
                                           self.cfg.window)

    def record_retention(self, layer_id: int, hidden_states: torch.Tensor, positions: torch.Tensor,
                         forward_batch) -> None:
        """trimkv's gate for the tokens of this forward, at their creation (every layer, prefill
        and decode): log β and true position into the side buffers. Runs inside CUDA graphs."""
        r = self.retention
        layer = layer_id - self.start_layer  # side buffers: pool layers; gates: global layers
        capture.record_retention(r.log_beta[layer], r.position[layer], hidden_states,
                                 r.w1[layer_id], r.b1[layer_id], r.w2[layer_id], r.b2[layer_id],
                                 forward_batch.out_cache_loc, positions)

    def prepare_capture(self, forward_batch) -> None:
        """Once per ForwardBatch, before its forward (recorded or replayed): the ring row of
        each extend token, which the recorded extend capture reads from `token_rows`."""
        if self.queries is None or not forward_batch.forward_mode.is_extend():
            return
        if forward_batch.extend_seq_lens is None:
            return
        capture.extend_token_rows(
            self.token_rows, forward_batch.req_pool_indices, forward_batch.extend_seq_lens,
            forward_batch.seq_lens, forward_batch.positions, self.cfg.window,
        )

    def evict(self, batch, skip=(), early: bool = False) -> int:
        """Run the eviction step on a running decode batch; returns the slots freed.
        With `early` (the next decode step does not fit in the pool) every request over its
        budget is cut back to it, due or not: an early eviction instead of a retraction. All
        at once rather than just enough for one step: the pool then has room for many steps,
        and the requests stay in phase, so the next eviction is again one batched group."""
        return self.run(batch, self.due_groups(batch, skip, early))

    def due_groups(self, batch, skip=(), early: bool = False) -> dict:
        """The requests of `batch` this step evicts, grouped by their effective settings
        (per-request overrides) and by (n, sinks), so each group is one batched select +
        compaction. Host state only: nothing runs on the device."""
        groups: dict[tuple[EvictionConfig, int, int], list[int]] = {}
        for i, req in enumerate(batch.reqs):
            if req in skip or req.kv.req_pool_idx is None:
                continue
            cfg = request_config(req)
            if cfg is None:
                continue  # eviction off for this request
            if req.decode_batch_idx < 1:
                # Under the overlap scheduler the first decode step is prepared before the
                # prefill result is processed, i.e. before the radix tree takes the prompt
                # (cache_protected_len is still the old match): the prompt would look private.
                continue
            kv = req.kv
            if kv.kv_committed_len != kv.kv_allocated_len:
                continue  # only speculative decoding over-allocates; rejected at startup
            private = kv.kv_allocated_len - kv.cache_protected_len
            if private >= cfg.trigger_len or (early and self._early_frees(cfg, private)):
                _add_to_group(groups, cfg, req, i, private)
        return groups

    def run(self, batch, groups: dict) -> int:
        """Evict `groups` (from due_groups) of `batch`; returns the slots freed."""
        if not groups:
            return 0
        start = time.perf_counter()
        self.timer.start()
        freed = 0
        new_lens = {}
        evictions, tokens = self.stats.evictions, self.stats.tokens_evicted
        for (cfg, n, sinks), members in groups.items():
            freed += self._evict_group(batch, cfg, members, n, sinks, new_lens)
        self._update_batch_lengths(batch, new_lens)
        batch.batch_is_full = False  # admission was closed on a full pool; it has room now
        self.timer.stop()
        elapsed = time.perf_counter() - start
        self.stats.seconds += elapsed
        self.stats.slots_freed += freed
        if metrics.METRICS is not None:
            metrics.METRICS.record(self.stats.evictions - evictions,
                                   self.stats.tokens_evicted - tokens, freed, elapsed)
        self.report_device_times()
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "evicted %d requests, freed %d slots in %.2f ms: %s",
                len(new_lens), freed, elapsed * 1e3,
                ", ".join(f"{batch.reqs[i].rid}: kv {n}" for i, n in new_lens.items()),
            )
        return freed

    def report_device_times(self) -> None:
        """Device time of the steps that have finished on the device (read without waiting);
        on CPU the ops run synchronously and it equals the host time."""
        done = self.timer.finished()
        self.stats.device_seconds += sum(done)
        if metrics.METRICS is not None:
            for seconds in done:
                metrics.METRICS.record_device(seconds)

    def _early_frees(self, cfg, private: int) -> bool:
        """Whether cutting a request that is not due back to its budget frees memory: with
        pages, dropping fewer tokens than separate its length from the last page boundary
        frees nothing, and would lose tokens for no gain."""
        n = private - cfg.window
        return private > cfg.budget and freed_slots(n, cfg.keep, cfg.window, self.page_size) > 0

    def _evict_group(self, batch, cfg, members, n, sinks, new_lens) -> int:
        """Evict one group; returns the slots freed (a host count: nothing is read back)."""
        reqs = [batch.reqs[i] for i in members]
        rows, starts, request, rounds, first_query, seeds = self._stage(
            [r.kv.req_pool_idx for r in reqs],
            [r.kv.cache_protected_len for r in reqs],
            [request_key(r, cfg) for r in reqs],
            [state(r).rounds for r in reqs],
            # True length L: the newest query written is at position L - 1.
            [r.kv.kv_allocated_len + pos_offset(r) - cfg.window for r in reqs],
            [request_config(r).seed for r in reqs],  # the group's cfg carries no seed
        )
        # Stream over chunks of requests and, inside, chunks of layers (and, for long caches,
        # chunks of candidates), so the gathers and score temporaries stay inside the
        # workspace (vase_sglang/workspace.py). None: this policy cannot run in it: skipped.
        plan = self._plan(cfg, n, len(reqs))
        if plan is None:
            return 0
        b_chunk, l_chunk, c_chunk = plan
        k = None
        for r0 in range(0, len(reqs), b_chunk):
            part = slice(r0, r0 + b_chunk)
            kept = self._evict_requests(cfg, n, sinks, l_chunk, rows[part], starts[part],
                                        request[part], rounds[part], first_query[part],
                                        seeds[part], candidate_chunk=c_chunk)
            if k is not None and kept != k:
                raise ValueError(f"policy {cfg.policy!r}: kept {kept} tokens in one chunk, {k} "
                                 "in another")
            k = kept
        dropped = n - k
        freed = freed_slots(n, k, cfg.window, self.page_size)
        if dropped:
            self.stats.tokens_evicted += dropped * len(reqs)
        for i, req in zip(members, reqs):
            kv = req.kv
            kv.kv_allocated_len -= dropped
            kv.kv_committed_len -= dropped
            st = state(req)
            st.pos_offset += dropped
            st.evicted += dropped
            st.rounds += 1
            if st.saved_skip_insert is None:
                # Compacted slots no longer hold the true tokens at their positions: inserting
                # them into the radix tree at finish would poison it (and double-free).
                st.saved_skip_insert = req.skip_radix_cache_insert
                req.skip_radix_cache_insert = True
            new_lens[i] = kv.kv_allocated_len
        self.stats.evictions += len(reqs)
        return freed * len(reqs)

    def _evict_requests(self, cfg, n, sinks, l_chunk, rows, starts, request, rounds,
                        first_query, seeds, candidate_chunk=None) -> int:
        """Every layer of a chunk of requests, l_chunk layers at a time (each unit's candidates
        candidate_chunk at a time where set); rewrites their rows and frees their dropped
        slots (device-only: the allocator's free is a torch.cat on page size 1). Returns how
        many candidates each request kept."""
        device = self.req_to_token.device
        cols = starts[:, None] + torch.arange(n + cfg.window, device=device)
        row_slots = self.req_to_token[rows[:, None], cols].long()  # [b, n + R]
        slots, newest = row_slots[:, :n], row_slots[:, n:]
        ring_index = None
        if POLICIES[cfg.policy].needs_queries:
            ring_index = (rows[:, None], self._ring_entries(first_query, cfg.window))
        side = now = None
        if POLICIES[cfg.policy].needs_retention:
            side = (self.retention.log_beta, self.retention.position)
            now = first_query + cfg.window  # the true length: the next token's position
        k = None
        for first in range(0, self.num_layers, l_chunk):
            keep = None  # the previous chunk's selection is dead: free it before the next
            keep = evict_chunk(
                cfg, self.k_buffers, self.v_buffers, self.queries, self.workspace,
                first_layer=first, num_layers=min(l_chunk, self.num_layers - first),
                layer_ids=self.layer_ids, slots=slots, ring_index=ring_index,
                request=request, rounds=rounds, sinks=sinks, side=side, now=now,
                attention=self.attention, head_offset=self.kv_head_offset,
                candidate_chunk=candidate_chunk, seed=seeds[:, None],
            )
            if k is not None and keep.shape[-1] != k:
                raise ValueError(f"policy {cfg.policy!r}: kept {keep.shape[-1]} tokens in one "
                                 f"chunk of layers, {k} in another")
            k = keep.shape[-1]  # cfg.keep for the built-in policies; a custom one may keep all
        if k == n:
            return k
        window = cfg.window
        if _pages_move_whole(n, k, self.page_size):
            self.req_to_token[rows[:, None], starts[:, None] + k + torch.arange(window, device=device)] = (
                newest.to(self.req_to_token.dtype)
            )
            self._free(slots[:, k:])
        else:
            # Copy the newest R into the candidate slots after the kept ones (all layers and
            # heads alike): keep[j] = n - k + j >= j, the compaction's in-place contract.
            shift = (n - k) + torch.arange(window, device=device)
            shift = shift.expand(len(rows), self.num_layers, self.shapes.kv_heads, window)
            ops.compact_kv_(self.k_buffers, self.v_buffers, row_slots[:, k:], shift)
            if side is not None:  # their log β and positions move with them
                ops.compact_kv_(side[0], side[1], row_slots[:, k:], shift)
            new_end = round_up_to_pages(k + window, self.page_size)
            old_end = round_up_to_pages(n + window, self.page_size)
            self._free(row_slots[:, new_end:old_end])
        return k

    def _free(self, slots: torch.Tensor) -> None:
        """Give back the pages of `slots` [b, m], columns that start on page boundaries and
        cover whole pages (a partial last page of the row included)."""
        if self.page_size == 1:
            self.allocator.free(slots.reshape(-1))
        elif slots.shape[1]:
            # One slot per page: the allocator's free() would dedup with torch.unique, a sync.
            self.allocator.free_page_ids((slots[:, ::self.page_size] // self.page_size).reshape(-1))

    def _plan(self, cfg, n, num_requests) -> StepPlan | None:
        """(requests, layers, candidate chunk) per chunk for this group, from the workspace
        size (arithmetic on a cost model measured once per (config, n) on meta tensors): the
        plain stage where one (request, layer) unit fits, else the unit's candidates streamed
        in chunks. Never a plan outside the workspace: where nothing fits, None (logged once)
        for a policy that cannot stream (a registered one overriding select(), say), an
        error for one that can (the workspace is sized for the longest private cache:
        workspace_bytes' max_candidates)."""
        headroom = self.workspace.headroom - group_bytes(num_requests)
        policy = POLICIES[cfg.policy]
        plan = plan_step(lambda chunk: step_cost(cfg, self.shapes, n, self.device_type, chunk),
                         n, num_requests, self.num_layers, self.workspace.buffer_bytes, headroom,
                         streams=policy.streams())
        if plan is not None:
            return plan
        need = step_cost(cfg, self.shapes, n, self.device_type)
        need = need.buffer(1, 1) + need.temporaries(1, 1)
        message = (f"an eviction step of policy {cfg.policy!r} over {n} candidates needs "
                   f"{need / 2**20:.1f} MiB per (request, layer), more than the "
                   f"{self.workspace.size / 2**20:.1f} MiB workspace")
        if policy.streams():
            raise RuntimeError(f"{message}, even streamed in chunks of "
                               f"{MIN_CANDIDATE_CHUNK} candidates: the workspace was sized "
                               "for shorter caches (workspace_bytes' max_candidates)")
        if (cfg.policy, n) not in self._warned:
            self._warned.add((cfg.policy, n))
            logger.error(
                "%s, and this policy cannot be streamed over candidate chunks (it defines no "
                "score_streamed): these requests are not evicted this time, their caches "
                "grow; raise --kv-evict-workspace-mb", message)
        return None

    def _stage(self, *columns: list[int]) -> tuple[torch.Tensor, ...]:
        """Host ints -> int64 device rows, through one pinned buffer and a non-blocking copy:
        a pageable copy would block the CPU on the forward in flight (overlap scheduler)."""
        host = torch.tensor(columns, dtype=torch.int64, pin_memory=_pinned(self.req_to_token.device))
        return tuple(host.to(self.req_to_token.device, non_blocking=True).unbind(0))

    def _ring_entries(self, first: torch.Tensor, window: int) -> torch.Tensor:
        """[B, W] ring entries of the last `window` (<= the ring's size) queries of each
        request, in the order a ring of exactly `window` entries would hold them
        (position % window), so a per-request window reproduces a server started with that
        window bit for bit. first: the position of the oldest of them."""
        ring_size = self.queries.shape[2]
        j = torch.arange(window, device=first.device)
        if window == ring_size:
            return j.expand(first.shape[0], window)
        positions = first[:, None] + (j[None, :] - first[:, None]) % window  # p = j (mod window)
        return positions % ring_size

    @staticmethod
    def _update_batch_lengths(batch, new_lens: dict[int, int]) -> None:
        # New tensors, never in place: under the overlap scheduler the previous forward
        # may still hold references to the old ones.
        idx = list(new_lens)
        lens = list(new_lens.values())
        seq_lens_cpu = batch.seq_lens_cpu.clone()
        seq_lens_cpu[idx] = torch.tensor(lens, dtype=seq_lens_cpu.dtype)
        delta = batch.seq_lens_cpu - seq_lens_cpu
        batch.seq_lens_cpu = seq_lens_cpu
        batch.seq_lens = batch.seq_lens - _to_device(delta, batch.seq_lens)
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens = batch.orig_seq_lens - _to_device(delta, batch.orig_seq_lens)
        batch.seq_lens_sum = None


@dataclass
class RetentionBuffers:
    """trimkv's state in a server (docs/retention.md): the gates of this rank's KV heads on the
    device (w1 [L, r, hidden], b1 [L, r], w2 [L, H, r], b2 [L, H], float32) and per pool layer
    the side buffers log_beta and position [slots, H, 1] float32, indexed like the KV pool.
    Position is float32 (exact below 2^24 tokens) so that one compaction call moves both."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    log_beta: list
    position: list

    @classmethod
    def allocate(cls, gates, slots: int, layers: int, kv_heads: int, head_offset: int,
                 device) -> "RetentionBuffers":
        heads = slice(head_offset, head_offset + kv_heads)

        def on_device(t):
            return t.detach().float().contiguous().to(device)

        return cls(
            w1=on_device(gates.w1), b1=on_device(gates.b1),
            w2=on_device(gates.w2[:, heads]), b2=on_device(gates.b2[:, heads]),
            log_beta=[torch.zeros(slots, kv_heads, 1, device=device) for _ in range(layers)],
            position=[torch.zeros(slots, kv_heads, 1, device=device) for _ in range(layers)],
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.log_beta, *self.position))


def side_bytes_per_token(layers: int, kv_heads: int) -> int:
    """Bytes of the trimkv side buffers per pool slot: log β and position, float32, per
    (layer, KV head)."""
    return layers * kv_heads * 2 * 4


def round_up_to_pages(tokens: int, page_size: int) -> int:
    """`tokens` rounded up to whole pages: what a row of that many tokens holds."""
    return -(-tokens // page_size) * page_size


def _pages_move_whole(n: int, k: int, page_size: int) -> bool:
    """Whether the newest window can move by rewriting the row: its source (column n) and
    destination (column k) start on page boundaries, so its pages keep their offsets."""
    return n % page_size == 0 and k % page_size == 0


def freed_slots(n: int, k: int, window: int, page_size: int) -> int:
    """Slots one request gives back when it keeps k of n candidates (whole pages)."""
    if k == n:
        return 0
    if _pages_move_whole(n, k, page_size):
        return n - k
    return round_up_to_pages(n + window, page_size) - round_up_to_pages(k + window, page_size)


def _pinned(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def _to_device(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A host tensor on `like`'s device and dtype without blocking the CPU (pinned staging)."""
    host = host.to(like.dtype)
    if _pinned(like.device):
        host = host.pin_memory()
    return host.to(like.device, non_blocking=True)


def group_bytes(num_requests: int) -> int:
    """Device memory a group holds across all its chunks: the staged ids [6, B] int64."""
    return 4096 + num_requests * 6 * 8


def request_bytes(n: int, window: int) -> int:
    """Device temporaries per request of a chunk outside the chunk stage: its row's columns
    and slots (int32 gather, then int64), the ring entries, the rewritten window and the
    freed slots (an upper bound; tests/test_step_memory.py checks the whole step)."""
    return (n + window) * (8 + 4 + 8) + window * 8 * 4 + window * (8 + 4) + n * 8


def step_cost(cfg, shapes, n, device_type, chunk: int | None = None) -> ChunkCost:
    """The chunk stage's measured cost plus what each request of a chunk holds around it;
    chunk: of the streamed stage, candidate chunks of that many tokens."""
    cost = chunk_cost(cfg, shapes, n, device_type, chunk)
    return dataclasses.replace(cost, per_request=cost.per_request + request_bytes(n, cfg.window))


class WorkspaceSize(NamedTuple):
    """A workspace's size and what it was sized to hold: `units` (request, layer) units of
    the server's own step per chunk, one unit at `max_budget` candidates at once, and private
    caches up to `max_candidates` tokens (streamed where a unit does not fit at once;
    `streams` False: the server's policy cannot stream, longer caches are not evicted)."""

    buffer: int
    headroom: int
    units: int
    max_budget: int
    max_candidates: int
    streams: bool

    def describe(self) -> str:
        longest = f"private caches up to {self.max_candidates} tokens"
        if self.max_candidates > self.max_budget:
            longest += (f", streamed in chunks of {STREAM_CHUNK} or more candidates where a "
                        f"unit does not fit at once" if self.streams else
                        " at once where they fit (the policy cannot stream over candidates: "
                        "requests that do not fit are not evicted)")
        return (f"{self.units} requests x 1 layer per chunk at the server's budget, one "
                f"(request, layer) at budget {self.max_budget}, {longest}")


def streamed_policies(cfg: EvictionConfig) -> list[str]:
    """The policies a request may choose on a server of `cfg` whose steps can stream: every
    registered one that streams (Policy.streams), those scoring with queries only where the
    server records them (request_control)."""
    queries = POLICIES[cfg.policy].needs_queries
    return [name for name, policy in POLICIES.items()
            if policy.streams() and (queries or not policy.needs_queries)]


def workspace_bytes(cfg: EvictionConfig, shapes: KVShapes, device_type: str,
                    max_requests: int = 4096, *, max_budget: int | None = None,
                    max_candidates: int | None = None) -> WorkspaceSize:
    """(buffer bytes, headroom bytes, requests per chunk, ...) of this server's eviction
    workspace. It holds, whichever is largest: DEFAULT_UNITS requests of one layer per chunk
    of its own step (n = budget candidates, every sink) or what --kv-evict-workspace-mb
    holds; one (request, layer) unit at `max_budget` candidates (default the budget: the
    largest per-request budget) at once; and, for every policy a request may choose that
    streams, one unit of `max_candidates` candidates (the longest private cache the server
    admits, e.g. the model's context length; default max_budget) streamed STREAM_CHUNK
    candidates at a time. `max_requests` bounds the group (its staged ids). Raises
    ValueError naming the flag if a requested size cannot hold them."""
    max_budget = cfg.budget if max_budget is None else max(max_budget, cfg.budget)
    max_candidates = max_budget if max_candidates is None else max(max_candidates, max_budget)
    cost = step_cost(cfg, shapes, cfg.budget, device_type)
    also = []
    if max_budget > cfg.budget and cfg.workspace_mb is None:
        # Sized here, a unit at the largest per-request budget runs at once; in a workspace
        # of a size the user set, it streams over candidates where it does not fit.
        big = step_cost(cfg.replace(budget=max_budget), shapes, max_budget, device_type)
        also.append((big.buffer(1, 1), big.temporaries(1, 1)))
    if max_candidates > cfg.budget:
        for name in streamed_policies(cfg):
            other = _request_like(cfg, name, max_budget)
            long = step_cost(other, shapes, max_candidates, device_type, STREAM_CHUNK)
            also.append((long.buffer(1, 1), long.temporaries(1, 1)))
    group = group_bytes(max_requests)
    requested = None if cfg.workspace_mb is None else cfg.workspace_mb * 2**20 - group
    buffer, temps, units = size_workspace(cost, requested, also=also)
    if units < 1:
        need = (max([cost.buffer(1, 1), *(b for b, _ in also)]) + group
                + max([cost.temporaries(1, 1), *(t for _, t in also)]))
        also = (f", one at budget {max_budget}" if max_budget > cfg.budget else "") + (
            f", a private cache of {max_candidates} tokens streamed"
            if max_candidates > cfg.budget else "")
        raise ValueError(
            f"--kv-evict-workspace-mb: {cfg.workspace_mb} MiB cannot hold one (request, layer) "
            f"unit of an eviction step ({need / 2**20:.1f} MiB for {cfg.policy} at budget "
            f"{cfg.budget}{also}); set at least {math.ceil(need / 2**20)}")
    return WorkspaceSize(buffer, temps + group, units, max_budget, max_candidates,
                         POLICIES[cfg.policy].streams())


def _request_like(cfg: EvictionConfig, policy: str, budget: int) -> EvictionConfig:
    """The server's settings with a request's policy and budget (request_control gives a
    request that changes either the default value slots), reading what such a request may
    read: trimkv with value slots (its VaSE hybrid) reads V too."""
    if policy != cfg.policy or budget != cfg.budget:
        cfg = cfg.replace(policy=policy, budget=budget, value_slots=None)
    if POLICIES[policy].needs_retention and not cfg.n_value_slots:
        cfg = cfg.replace(value_slots=1)
    return cfg


def allocate_workspace(cfg, shapes, device, max_requests: int = 4096, *,
                       max_budget: int | None = None,
                       max_candidates: int | None = None) -> Workspace:
    """The workspace workspace_bytes sizes (pass the same max_budget / max_candidates as the
    memory plan that reserved it: memory.around_profile)."""
    size = workspace_bytes(cfg, shapes, torch.device(device).type, max_requests,
                           max_budget=max_budget, max_candidates=max_candidates)
    return Workspace(torch.empty(size.buffer, dtype=torch.uint8, device=device), size.headroom)


def _add_to_group(groups, cfg, req, i, private) -> None:
    n = private - cfg.window  # candidates: all private tokens but the newest window
    sinks = max(0, cfg.sinks - req.kv.cache_protected_len)
    # Seeds are passed per request (a tensor): requests differing only in their seed share a
    # group, so a client's many seeds do not split a step into many small selections.
    groups.setdefault((cfg.replace(seed=0), n, sinks), []).append(i)


def request_key(req, cfg: EvictionConfig) -> int:
    """A request's key for its random draws at this eviction (the Draws also mix the seed,
    layer, KV head and round). The user's `sampling_seed` if set; else the crc32 of every
    token older than the window: the prompt and the outputs up to the oldest window query.
    So the same request draws the same on every run, replica, TP/DP rank and scheduler mode
    (those tokens are on the host in overlap mode too: only the newest token can be in
    flight), and n > 1 samples of one prompt draw alike only while their outputs agree."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    if seed is not None:
        return int(seed) & 0x7FFFFFFF
    st = state(req)
    # The true length minus the window: the position of the oldest window query. It only
    # grows (a retracted request re-prefills its whole true length), so the crc is extended.
    upto = req.kv.kv_allocated_len + st.pos_offset - cfg.window
    tokens = _tokens(req, st.hashed, upto)
    st.token_crc = zlib.crc32(array("q", tokens).tobytes(), st.token_crc)
    st.hashed += len(tokens)
    return st.token_crc & 0x7FFFFFFF


def _tokens(req, start: int, stop: int) -> list[int]:
    """Token ids at positions [start, stop) of prompt + output (fewer if the host does not
    hold them all, which the schedule above rules out; warned, not fatal)."""
    origin = req.origin_input_ids
    n = len(origin)
    out = list(origin[start:min(stop, n)]) if start < n else []
    if stop > n:
        out += req.output_ids[max(start, n) - n: stop - n]
    if len(out) < stop - start and "tokens" not in _WARNED:
        _WARNED.add("tokens")
        logger.warning("request %s: tokens [%d, %d) are not all on the host (%d prompt + %d "
                       "output tokens); its draws are keyed by the ones that are", req.rid,
                       start, stop, n, len(req.output_ids))
    return out


_WARNED: set[str] = set()


def request_config(req) -> EvictionConfig | None:
    """The eviction settings that apply to `req`: its `custom_params.kv_evict` merged over the
    server's, or None where eviction is off (server or request). Cached on the Req."""
    rt = RUNTIME
    if rt is None:
        return None
    st = state(req)
    cached = st.config
    if cached is _UNSET and getattr(req, "beam_group", None) is not None:
        # Beam search (BeamCoordinator.validate_and_init) replaces the leader's sampling
        # params with neutral ones, custom_params lost; its member rows alias the leader's
        # slots, so the group is never evicted. The tokenizer manager already refused beam
        # requests that would evict (request_control.refuse_beam_search).
        cached = st.config = None
    if cached is _UNSET:
        try:
            cached = rt.request_settings(req.sampling_params.custom_params)
        except ValueError as err:
            # The tokenizer manager rejects these with HTTP 400 and the scheduler aborts them
            # at intake (scheduler.after_create_req); never serve other settings than asked.
            _abort(req, err, running=True)
            cached = None
        st.config = cached
    return cached


def _abort(req, err, running: bool) -> None:
    message = (f"{err} (this server cannot apply the request's eviction settings: "
               f"the request is aborted, not served with other settings)")
    if running:  # the request holds KV: finish it at its next step, as a stop would
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        logger.error("request %s: %s", req.rid, message)
        req.to_finish = FINISH_ABORT(message, 400, "BadRequestError")
    else:
        req.set_finish_with_abort(message)


def check_new_request(req) -> None:
    """At the scheduler's intake: derive the request's settings once; settings this scheduler
    cannot apply (which the tokenizer manager let through) abort it with HTTP 400."""
    rt = RUNTIME
    if rt is None:
        return
    st = state(req)
    try:
        st.config = rt.request_settings(req.sampling_params.custom_params)
    except ValueError as err:
        st.config = None
        _abort(req, err, running=False)


def compacted(req) -> bool:
    """Whether eviction has rewritten this request's cache since it was (re)admitted."""
    st = getattr(req, STATE, None)
    return st is not None and st.rounds > 0


def reset_request(req) -> None:
    """A retracted request re-prefills its true length: it starts over, uncompacted."""
    st = getattr(req, STATE, None)
    if st is None:
        return
    st.pos_offset = st.rounds = 0  # `evicted` counts over the request's whole life
    if st.saved_skip_insert is not None:
        req.skip_radix_cache_insert = st.saved_skip_insert
        st.saved_skip_insert = None


RUNTIME: EvictionRuntime | None = None
