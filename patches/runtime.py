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

Row layout before and after (P = tree-owned prefix, never touched):
    [0, P) prefix | [P, P+n) candidates            | [P+n, P+n+R) newest R
    [0, P) prefix | [P, P+K) kept (mixed per head) | [P+K, P+K+R) newest R   (same slots)
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field

import torch

from vase_sglang import EvictionConfig, capture, select_tokens
from vase_sglang.ops import compact_kv_
from vase_sglang.policies import POLICIES, AttentionParams

from . import metrics, request_control

logger = logging.getLogger("vase_sglang.eviction")

# Attributes this plugin keeps on sglang's Req (Req has no __slots__; Req.kv does).
OFFSET = "_vase_pos_offset"  # tokens removed from the KV so far: true position - KV length
EVICTED = "_vase_evicted"  # tokens evicted per (layer, KV head), reported in meta_info
ROUNDS = "_vase_rounds"
SAVED_SKIP = "_vase_saved_skip_insert"
CONFIG = "_vase_config"  # effective EvictionConfig (None = off), see request_config
_UNSET = object()


@dataclass
class EvictionStats:
    evictions: int = 0  # request-rounds
    tokens_evicted: int = 0
    slots_freed: int = 0
    seconds: float = 0.0


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
    stats: EvictionStats = field(default_factory=EvictionStats)
    attention: AttentionParams = AttentionParams()  # the model's logit scaling and soft-cap
    kv_head_offset: int = 0  # global index of this rank's first KV head (tensor parallel)
    # Ring row of each token of the current extend batch (SCRATCH_ROW where not kept); a
    # persistent buffer because recorded prefill graphs read it (vase_sglang.capture).
    token_rows: torch.Tensor | None = None

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
        and the requests stay in phase, so the next eviction is again one batched group.
        Requests are grouped by their effective settings (per-request overrides) and by
        (n, sinks), so each group is one batched select + compaction."""
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
            if private >= cfg.trigger_len or (early and private > cfg.budget):
                _add_to_group(groups, cfg, req, i, private)
        if not groups:
            return 0
        start = time.perf_counter()
        freed = []
        new_lens = {}
        evictions, tokens = self.stats.evictions, self.stats.tokens_evicted
        for (cfg, n, sinks), members in groups.items():
            freed.append(self._evict_group(batch, cfg, members, n, sinks, new_lens))
        slots = torch.cat(freed)
        self.allocator.free(slots)
        self._update_batch_lengths(batch, new_lens)
        batch.batch_is_full = False  # admission was closed on a full pool; it has room now
        elapsed = time.perf_counter() - start
        self.stats.seconds += elapsed
        self.stats.slots_freed += int(slots.numel())
        if metrics.METRICS is not None:
            metrics.METRICS.record(self.stats.evictions - evictions,
                                   self.stats.tokens_evicted - tokens, int(slots.numel()), elapsed)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "evicted %d requests, freed %d slots in %.2f ms: %s",
                len(new_lens), slots.numel(), elapsed * 1e3,
                ", ".join(f"{batch.reqs[i].rid}: kv {n}" for i, n in new_lens.items()),
            )
        return int(slots.numel())

    def _evict_group(self, batch, cfg, members, n, sinks, new_lens) -> torch.Tensor:
        reqs = [batch.reqs[i] for i in members]
        device = self.req_to_token.device
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs], device=device, dtype=torch.int64)
        starts = torch.tensor([r.kv.cache_protected_len for r in reqs], device=device)
        cols = starts[:, None] + torch.arange(n + cfg.window, device=device)
        row_slots = self.req_to_token[rows[:, None], cols].long()  # [B, n + R]
        slots, newest = row_slots[:, :n], row_slots[:, n:]

        policy = POLICIES[cfg.policy]
        keys, values = self._gather_kv(slots, policy.reads_kv)
        queries = None
        if policy.needs_queries:
            queries = self._window_queries(reqs, rows, cfg.window)  # [B, L, H_q, W, D]
        request = torch.tensor([_request_key(r) for r in reqs], device=device)
        rounds = torch.tensor([getattr(r, ROUNDS, 0) for r in reqs], device=device)
        layers = torch.arange(self.start_layer, self.start_layer + self.num_layers, device=device)
        keep = select_tokens(
            cfg, keys, values, queries,
            request=request[:, None], layer=layers[None, :], round=rounds[:, None],
            sinks=sinks, check=False, attention=self.attention, head_offset=self.kv_head_offset,
        )
        compact_kv_(self.k_buffers, self.v_buffers, slots, keep, ascending=policy.ascending)

        k = keep.shape[-1]  # cfg.keep for the built-in policies; a custom one may keep all
        self.req_to_token[rows[:, None], starts[:, None] + k + torch.arange(cfg.window, device=device)] = (
            newest.to(self.req_to_token.dtype)
        )
        dropped = n - k
        if dropped:
            self.stats.tokens_evicted += dropped * len(reqs)
        for i, req in zip(members, reqs):
            kv = req.kv
            kv.kv_allocated_len -= dropped
            kv.kv_committed_len -= dropped
            setattr(req, OFFSET, getattr(req, OFFSET, 0) + dropped)
            setattr(req, EVICTED, getattr(req, EVICTED, 0) + dropped)
            setattr(req, ROUNDS, getattr(req, ROUNDS, 0) + 1)
            if not hasattr(req, SAVED_SKIP):
                # Compacted slots no longer hold the true tokens at their positions: inserting
                # them into the radix tree at finish would poison it (and double-free).
                setattr(req, SAVED_SKIP, req.skip_radix_cache_insert)
                req.skip_radix_cache_insert = True
            new_lens[i] = kv.kv_allocated_len
        self.stats.evictions += len(reqs)
        return slots[:, k:].reshape(-1)

    def _window_queries(self, reqs, rows: torch.Tensor, window: int) -> torch.Tensor:
        """The last `window` (<= the ring's size) queries of each request, in the order a ring
        of exactly `window` entries would hold them (position % window), so a per-request
        window reproduces a server started with that window bit for bit."""
        ring_size = self.queries.shape[2]
        if window == ring_size:
            return self.queries[:, rows].permute(1, 0, 3, 2, 4)
        # True length L: the newest query written is at position L - 1.
        first = torch.tensor([r.kv.kv_allocated_len + getattr(r, OFFSET, 0) - window for r in reqs],
                             device=rows.device)
        j = torch.arange(window, device=rows.device)
        positions = first[:, None] + (j[None, :] - first[:, None]) % window  # p = j (mod window)
        picked = self.queries[:, rows[:, None], positions % ring_size]  # [L, B, W, H_q, D]
        return picked.permute(1, 0, 3, 2, 4)

    def _gather_kv(self, slots: torch.Tensor, reads_kv: bool):
        b, n = slots.shape
        h, d = self.k_buffers[0].shape[1], self.k_buffers[0].shape[2]
        if not reads_kv:  # random / streaming: shapes only, no copy
            dummy = torch.zeros((), device=slots.device).expand(b, self.num_layers, h, n, d)
            return dummy, dummy
        keys = torch.stack([buf[slots] for buf in self.k_buffers], dim=1).transpose(2, 3)
        values = torch.stack([buf[slots] for buf in self.v_buffers], dim=1).transpose(2, 3)
        return keys, values

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
        batch.seq_lens = batch.seq_lens - delta.to(batch.seq_lens.device, batch.seq_lens.dtype)
        if getattr(batch, "orig_seq_lens", None) is not None:
            batch.orig_seq_lens = batch.orig_seq_lens - delta.to(
                batch.orig_seq_lens.device, batch.orig_seq_lens.dtype
            )
        batch.seq_lens_sum = None


def _add_to_group(groups, cfg, req, i, private) -> None:
    n = private - cfg.window  # candidates: all private tokens but the newest window
    sinks = max(0, cfg.sinks - req.kv.cache_protected_len)
    groups.setdefault((cfg, n, sinks), []).append(i)


def _request_key(req) -> int:
    """Stable id of a request for its random draws: its sampling seed if the user set one,
    else a hash of its rid (so a user-chosen rid reproduces a run)."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    if seed is not None:
        return int(seed) & 0x7FFFFFFF
    return zlib.crc32(str(req.rid).encode())


def request_config(req) -> EvictionConfig | None:
    """The eviction settings that apply to `req`: its `custom_params.kv_evict` merged over the
    server's, or None where eviction is off (server or request). Cached on the Req."""
    rt = RUNTIME
    if rt is None:
        return None
    cached = getattr(req, CONFIG, _UNSET)
    if cached is _UNSET and getattr(req, "beam_group", None) is not None:
        # Beam search (BeamCoordinator.validate_and_init) replaces the leader's sampling
        # params with neutral ones, custom_params lost; its member rows alias the leader's
        # slots, so the group is never evicted. The tokenizer manager already refused beam
        # requests that would evict (request_control.refuse_beam_search).
        cached = None
        setattr(req, CONFIG, cached)
    if cached is _UNSET:
        try:
            cached = request_control.effective_config(req.sampling_params.custom_params, rt.cfg)
        except ValueError as err:
            # The tokenizer manager rejects these with HTTP 400; only a path that skips
            # SamplingParams.verify gets here. Serve it with the server's settings.
            logger.error("request %s: %s; using the server's eviction settings", req.rid, err)
            cached = rt.cfg
        setattr(req, CONFIG, cached)
    return cached


def compacted(req) -> bool:
    """Whether eviction has rewritten this request's cache since it was (re)admitted."""
    return getattr(req, ROUNDS, 0) > 0


def reset_request(req) -> None:
    """A retracted request re-prefills its true length: it starts over, uncompacted."""
    for name in (OFFSET, ROUNDS):
        if hasattr(req, name):
            setattr(req, name, 0)
    if hasattr(req, SAVED_SKIP):
        req.skip_radix_cache_insert = getattr(req, SAVED_SKIP)
        delattr(req, SAVED_SKIP)


RUNTIME: EvictionRuntime | None = None
