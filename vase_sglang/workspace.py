"""Bounded memory of an eviction step: the chunk stage, its workspace and its plan.

A step over B requests and L layers is split into chunks of b requests x l layers; a chunk
gathers K/V (and the window queries) of its (request, layer) units into views of one buffer
reserved at startup, selects, and compacts those layers before the next chunk starts. Draws
are keyed by (seed, request, layer, round), so the chunking never changes a choice.

The step's extra memory is then bounded by the workspace: `buffer` (a preallocated byte buffer
holding the gathers) plus `headroom` (reserved, left free, for the temporaries torch ops
allocate themselves: fp32 scores, sort indices, random-number arithmetic). The temporaries are
measured, not guessed: the real chunk stage runs on meta tensors under `PeakMemory`, which
follows every storage an op creates until it is freed (nothing is allocated), on the backend
the step will use (Triton on CUDA, the torch references elsewhere; `ops.planning_for`).

Where even one (request, layer) unit does not fit (a long private cache: its n candidates'
K/V and [H_q, W, n] softmax), the unit runs streamed: its candidates are gathered `chunk` at a
time into the buffer and scored by Policy.select_streamed, which keeps only [H, n] float32
arrays (vase_sglang/stream_select.py). `plan_step` picks the path and the chunk from the same
measured costs; a step never allocates outside the workspace.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import ops
from .config import EvictionConfig
from .policies import POLICIES, Retention, select_candidates, select_tokens
from .stream_select import Candidates

ALIGN = 256  # bytes: every view carved from the workspace starts aligned for vector loads
DEFAULT_UNITS = 64  # (request, layer) units per chunk the default workspace is sized for


# Ops whose device implementation allocates scratch inside the kernel call, which the
# dispatcher never sees (CUDA's segmented sort: double buffers of keys and values plus CUB
# temp storage). Counted as this many times their outputs, live during the op only.
_INTERNAL_SCRATCH = {"aten::sort": 2.0, "aten::topk": 2.0}


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the storages created while active (views and in-place/out= writes into
    existing storages count nothing), plus an allowance for kernel-internal scratch. Works on
    meta tensors, so a plan costs no memory."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address (StorageImpl*) -> bytes
        self.known: set[int] = set()  # storages that existed before
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.live:
                self.known.add(t.untyped_storage()._cdata)
        out = func(*args, **(kwargs or {}))
        scratch = _INTERNAL_SCRATCH.get(func._schema.name)
        if scratch:
            made = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                       if isinstance(t, torch.Tensor))
            self.peak = max(self.peak, self.current + int(scratch * made))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in self.known:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out


@dataclass(frozen=True)
class KVShapes:
    """What an eviction step's memory depends on, besides the config and the group."""

    kv_heads: int
    q_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    q_dtype: torch.dtype  # the query ring's
    ring_window: int  # entries per row of the query ring (the server's window)


@dataclass(frozen=True)
class ChunkCost:
    """Bytes of one chunk of b requests x l layers: `gather_per_unit` in the buffer per
    (request, layer) unit, and for the temporaries b * per_request + b * l * per_unit.

    per_unit is the traced peak of a whole 1 x 1 chunk (or a 2 x 2 chunk's per unit, if
    larger): every tensor of the stage is shaped [b or 1, l or 1, ...] and the op sequence does
    not depend on b and l (the per-layer loops free what each iteration allocates), so b * l
    times it bounds any chunk's peak; tests/test_step_memory.py checks it on a grid."""

    gather_per_unit: int
    per_unit: int
    per_request: int = 0

    def buffer(self, b: int, l: int) -> int:
        return b * l * _aligned(self.gather_per_unit)

    def temporaries(self, b: int, l: int) -> int:
        return b * self.per_request + b * l * self.per_unit


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def gather_layout(cfg: EvictionConfig, shapes: KVShapes, b: int, l: int, n: int,
                  chunk: int | None = None):
    """(shape, dtype) of each gathered tensor of a chunk: keys and values [b, l, n, H, D] (the
    pool's slot-major rows; viewed as [b, l, H, n, D]), queries [b, l, W, H_q, D], and for
    retention policies log β and positions [b, l, n, H, 1] float32 (the side buffers' rows).
    Streamed over candidate chunks of `chunk` tokens: keys and values [b, l, chunk, H, D]."""
    policy = POLICIES[cfg.policy]
    layout = []
    kv = ((b, l, n if chunk is None else min(n, chunk), shapes.kv_heads, shapes.head_dim),
          shapes.kv_dtype)
    layout += [kv] * sum(kv_reads(cfg))
    if policy.needs_queries:
        layout.append(((b, l, cfg.window, shapes.q_heads, shapes.head_dim), shapes.q_dtype))
    if policy.needs_retention:
        side = ((b, l, n, shapes.kv_heads, 1), torch.float32)
        layout += [side, side]
    return layout


def kv_reads(cfg: EvictionConfig) -> tuple[bool, bool]:
    """Whether a step of this config gathers (keys, values). trimkv scores from the side
    buffers alone; only its value slots (the VaSE hybrid) read V."""
    policy = POLICIES[cfg.policy]
    if policy.needs_retention:
        return False, cfg.n_value_slots > 0
    return policy.reads_kv, policy.reads_kv


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class Workspace:
    """One preallocated byte buffer for the gathers plus `headroom` bytes kept free for the
    temporaries. A chunk's gathers are views of the buffer; `overflows` counts the chunks
    whose gathers did not fit (a request larger than the workspace was planned for) and were
    allocated outside it."""

    def __init__(self, buffer: torch.Tensor, headroom: int):
        self.buffer = buffer
        self.headroom = int(headroom)
        self.overflows = 0

    @property
    def buffer_bytes(self) -> int:
        return self.buffer.numel()

    @property
    def size(self) -> int:
        return self.buffer_bytes + self.headroom

    def views(self, layout) -> list[torch.Tensor]:
        total = sum(_aligned(_nbytes(shape, dtype)) for shape, dtype in layout)
        if total > self.buffer_bytes:
            self.overflows += 1
            return [torch.empty(shape, dtype=dtype, device=self.buffer.device) for shape, dtype in layout]
        out, offset = [], 0
        for shape, dtype in layout:
            nbytes = _nbytes(shape, dtype)
            raw = self.buffer[offset: offset + nbytes]
            out.append(raw.view(dtype).view(shape))
            offset += _aligned(nbytes)
        return out


def evict_chunk(cfg: EvictionConfig, k_buffers, v_buffers, ring, workspace: Workspace, *,
                first_layer: int, num_layers: int, layer_ids: torch.Tensor, slots: torch.Tensor,
                ring_index, request: torch.Tensor, rounds: torch.Tensor, sinks: int,
                side=None, now: torch.Tensor | None = None, candidate_chunk: int | None = None,
                **select_kwargs) -> torch.Tensor:
    """Gather -> select -> compact for requests `slots` [b, n] and pool layers first_layer ..
    first_layer + num_layers - 1; returns keep [b, l, H, K]. ring_index: (ring rows [b, 1],
    ring entries [b, W]) of the window queries. Retention policies (trimkv): side = (log β
    buffers, position buffers), per pool layer [slots, H, 1] float32, compacted with K/V;
    now [b] the true length of each request (the position of its next token).
    candidate_chunk: the streamed path: K/V are gathered `candidate_chunk` candidates at a
    time (PoolCandidates) and scored by Policy.select_streamed, for units whose n candidates
    do not fit in the workspace at once; None: all n at once.
    select_kwargs go to select_tokens as they are."""
    policy = POLICIES[cfg.policy]
    b, n = slots.shape
    l = num_layers
    h, d = k_buffers[0].shape[1], k_buffers[0].shape[2]
    layers = range(first_layer, first_layer + l)
    views = workspace.views(gather_layout(cfg, _shapes_of(k_buffers, ring, cfg), b, l, n,
                                          candidate_chunk))
    unread = torch.zeros((), device=slots.device).expand(b, l, h, n, d)  # shapes only, no copy
    gathered_kv, used = [], 0  # views[:used] hold the K/V gathers, in gather_layout's order
    regions = []  # the K/V views, [b, l, n or candidate_chunk, H, D]; None: not read
    for read, buffers in zip(kv_reads(cfg), (k_buffers, v_buffers)):
        if not read:  # random / streaming / plain trimkv
            gathered_kv.append(unread)
            regions.append(None)
            continue
        out, used = views[used], used + 1
        regions.append(out)
        if candidate_chunk is None:
            for j, layer in enumerate(layers):
                torch.ops.aten.index.Tensor_out(buffers[layer], [slots], out=out[:, j])
        gathered_kv.append(out.transpose(2, 3))  # [b, l, H, n, D]; streamed: a chunk's region
    keys, values = gathered_kv
    queries = None
    if policy.needs_queries:
        gathered = views[-1]
        for j, layer in enumerate(layers):
            torch.ops.aten.index.Tensor_out(ring[layer], list(ring_index), out=gathered[:, j])
        queries = gathered.permute(0, 1, 3, 2, 4)  # [b, l, H_q, W, D]
    retention = None
    if policy.needs_retention:
        log_beta, position = views[-2], views[-1]
        for j, layer in enumerate(layers):
            torch.ops.aten.index.Tensor_out(side[0][layer], [slots], out=log_beta[:, j])
            torch.ops.aten.index.Tensor_out(side[1][layer], [slots], out=position[:, j])
        age = now[:, None, None, None] - position[..., 0].transpose(2, 3)  # [b, l, H, n]
        retention = Retention(log_beta[..., 0].transpose(2, 3), age)
    ids = dict(request=request[:, None], layer=layer_ids[None, first_layer: first_layer + l],
               round=rounds[:, None], sinks=sinks, check=False, retention=retention)
    if candidate_chunk is None:
        keep = select_tokens(cfg, keys, values, queries, **ids, **select_kwargs)
    else:
        candidates = PoolCandidates(k_buffers, v_buffers, layers, slots, regions, candidate_chunk)
        keep = select_candidates(cfg, candidates, queries, **ids, **select_kwargs)
    ops.compact_kv_(k_buffers, v_buffers, slots, keep, ascending=policy.ascending,
                    first_layer=first_layer)
    if policy.needs_retention:  # each slot's log β and position move with its K/V
        ops.compact_kv_(side[0], side[1], slots, keep, ascending=policy.ascending,
                        first_layer=first_layer)
    return keep


class PoolCandidates(Candidates):
    """The candidates of requests `slots` [b, n] in the pool layers `layers`, gathered from
    the KV pool `chunk` of them at a time into `regions` (workspace views [b, l, chunk, H, D]
    for keys and values; None where the config reads none). Every chunk of a pass overwrites
    the previous one's region."""

    def __init__(self, k_buffers, v_buffers, layers, slots: torch.Tensor, regions, chunk: int):
        b, n = slots.shape
        h, d = k_buffers[0].shape[1], k_buffers[0].shape[2]
        self.shape = (b, len(layers), h, n)
        self.head_dim, self.device, self.chunk = d, slots.device, chunk
        self.layers, self.slots = layers, slots
        self.sources = list(zip((k_buffers, v_buffers), regions))

    # Memory planning (meta tensors): a pass's peak is that of its steady state, since each
    # chunk frees what the one before it allocated, so a plan reads the first META_SPANS - 1
    # chunks and the last one (the same ops and shapes: nothing is computed on meta).
    META_SPANS: int | None = 3

    def spans(self):
        spans = list(super().spans())
        if self.device.type == "meta" and self.META_SPANS and len(spans) > self.META_SPANS:
            spans = spans[: self.META_SPANS - 1] + spans[-1:]
        return spans

    def chunks(self, keys: bool = False, values: bool = False):
        b, l, h, _ = self.shape
        for start, stop in self.spans():
            index = [self.slots[:, start:stop]]
            out = []
            for wanted, (buffers, region) in zip((keys, values), self.sources):
                if not wanted:
                    out.append(None)
                    continue
                if region is None:
                    raise ValueError(f"candidates: policy reads {'values' if out else 'keys'}, "
                                     "which this config does not gather (kv_reads)")
                # a partial last chunk: the first (stop - start) rows of the region, contiguous
                view = region.reshape(-1)[: b * l * (stop - start) * h * self.head_dim]
                view = view.view(b, l, stop - start, h, self.head_dim)
                for j, layer in enumerate(self.layers):
                    torch.ops.aten.index.Tensor_out(buffers[layer], index, out=view[:, j])
                out.append(view.transpose(2, 3))  # [b, l, H, c, D]
            yield start, stop, *out


def _shapes_of(k_buffers, ring, cfg) -> KVShapes:
    k = k_buffers[0]
    q_heads = ring.shape[3] if ring is not None else k.shape[1]
    q_dtype = ring.dtype if ring is not None else k.dtype
    ring_window = ring.shape[2] if ring is not None else cfg.window
    return KVShapes(k.shape[1], q_heads, k.shape[2], k.dtype, q_dtype, ring_window)


def trace_chunk(cfg: EvictionConfig, shapes: KVShapes, n: int, b: int, l: int, sinks: int,
                device: str, chunk: int | None = None) -> tuple[int, int]:
    """(buffer bytes, peak bytes of the temporaries) of one real chunk stage, on meta tensors
    planned as `device` (nothing is allocated); chunk: the streamed stage, candidate chunks
    of that many tokens."""
    meta = torch.device("meta")
    slots_in_pool = b * (n + 1)
    k_buffers = [torch.empty(slots_in_pool, shapes.kv_heads, shapes.head_dim, dtype=shapes.kv_dtype,
                             device=meta) for _ in range(l)]
    v_buffers = [torch.empty_like(k) for k in k_buffers]
    ring = None
    if POLICIES[cfg.policy].needs_queries:
        ring = torch.empty(l, b + 1, shapes.ring_window, shapes.q_heads, shapes.head_dim,
                           dtype=shapes.q_dtype, device=meta)
    layout = gather_layout(cfg, shapes, b, l, n, chunk)
    buffer_bytes = sum(_aligned(_nbytes(s, t)) for s, t in layout)
    workspace = Workspace(torch.empty(buffer_bytes, dtype=torch.uint8, device=meta), 0)
    slots = torch.empty(b, n, dtype=torch.int64, device=meta)
    ring_index = (torch.empty(b, 1, dtype=torch.int64, device=meta),
                  torch.empty(b, cfg.window, dtype=torch.int64, device=meta))
    ids = torch.empty(b, dtype=torch.int64, device=meta)
    layer_ids = torch.empty(l, dtype=torch.int64, device=meta)
    side = None
    if POLICIES[cfg.policy].needs_retention:
        side = tuple([torch.empty(slots_in_pool, shapes.kv_heads, 1, device=meta) for _ in range(l)]
                     for _ in range(2))
    with ops.planning_for(device), PeakMemory() as peak:
        keep = evict_chunk(cfg, k_buffers, v_buffers, ring, workspace, first_layer=0, num_layers=l,
                           layer_ids=layer_ids, slots=slots, ring_index=ring_index, request=ids,
                           rounds=ids, sinks=sinks, side=side, now=ids, candidate_chunk=chunk,
                           seed=ids[:, None])  # per-request seeds, as the engine passes them
        del keep
    return buffer_bytes, peak.peak


def chunk_cost(cfg: EvictionConfig, shapes: KVShapes, n: int, device: str,
               chunk: int | None = None) -> ChunkCost:
    """The cost of a chunk with n candidates, traced at the smallest of {cfg.budget, powers
    of two} >= n (costs grow with n), so a server traces a handful of sizes in its life (the
    number of sinks only changes which entries a mask sets: traced at cfg.sinks). chunk: of
    the streamed stage with candidate chunks of that many tokens (costs grow with it too; the
    plan uses powers of two, `candidate_chunks`)."""
    bucket = cfg.budget if n <= cfg.budget else 1 << (n - 1).bit_length()
    if chunk is not None and chunk >= bucket:
        chunk = None  # one chunk holds every candidate: the plain stage
    # The seed changes what is drawn, the workspace size how a step is chunked: neither
    # changes a chunk's memory, so configs differing only there share their traces.
    cfg = cfg.replace(seed=0, workspace_mb=None)
    return _chunk_cost(cfg, shapes, bucket, cfg.sinks, device, chunk)


@functools.lru_cache(maxsize=256)
def _chunk_cost(cfg, shapes, n, sinks, device, chunk=None) -> ChunkCost:
    # A 1 x 1 chunk alone can take other paths (matmul folds size-1 batch dims into one mm),
    # so a 2 x 2 chunk's peak per unit is traced too and the larger of the two is kept.
    # (torch's CPU matmul also changes path with the batch size: 8 units are traced too).
    gather, one = trace_chunk(cfg, shapes, n, 1, 1, sinks, device, chunk)
    if chunk is not None:  # the streamed stage runs one (request, layer) unit at a time
        return ChunkCost(gather, one)
    _, four = trace_chunk(cfg, shapes, n, 2, 2, sinks, device, chunk)
    _, eight = trace_chunk(cfg, shapes, n, 4, 2, sinks, device, chunk)
    return ChunkCost(gather, max(one, -(-four // 4), -(-eight // 8)))


def plan_chunks(cost: ChunkCost, num_requests: int, num_layers: int, buffer_bytes: int,
                headroom: int) -> tuple[int, int] | None:
    """(requests, layers) per chunk: all requests of a layer at once where they fit (the step
    streams over layers), more layers per chunk when room is left. None: not even one
    (request, layer) unit fits. Pure arithmetic."""

    def fits(b, l):
        return cost.buffer(b, l) <= buffer_bytes and cost.temporaries(b, l) <= headroom

    if not fits(1, 1):
        return None
    b = _largest(lambda x: fits(x, 1), num_requests)
    return b, _largest(lambda x: fits(b, x), num_layers)


def _largest(ok, limit: int) -> int:
    """Largest x in [1, limit] with ok(x), for ok monotone and ok(1) true (bisection)."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class StepPlan(NamedTuple):
    """How a group's step streams: `requests` x `layers` (request, layer) units per chunk and,
    on the streamed path (one unit per chunk), its candidates `chunk` tokens at a time (None:
    all at once)."""

    requests: int
    layers: int
    chunk: int | None


MIN_CANDIDATE_CHUNK = 16  # the smallest candidate chunk a plan tries
STREAM_CHUNK = 1024  # candidate chunk of the streamed unit a workspace is sized to hold


def candidate_chunks(n: int) -> list[int]:
    """The candidate chunks a plan tries for n candidates: powers of two from
    MIN_CANDIDATE_CHUNK up to below n, ascending."""
    sizes, c = [], MIN_CANDIDATE_CHUNK
    while c < n:
        sizes.append(c)
        c *= 2
    return sizes


def plan_step(cost_of, n: int, num_requests: int, num_layers: int, buffer_bytes: int,
              headroom: int, streams: bool = True) -> StepPlan | None:
    """The plan of a step over n candidates: the plain stage (plan_chunks) where one unit of
    it fits, else (policies that stream) the streamed stage, one (request, layer) unit at a
    time, with the largest candidate chunk at which it fits. cost_of(chunk) -> ChunkCost
    (None: the plain stage), monotone in the chunk. None: nothing fits (the caller must not
    run the step). Pure arithmetic on the costs."""
    plan = plan_chunks(cost_of(None), num_requests, num_layers, buffer_bytes, headroom)
    if plan is not None:
        return StepPlan(*plan, None)
    sizes = candidate_chunks(n) if streams else []

    def fits(i):  # i: 1-based index into sizes
        cost = cost_of(sizes[i - 1])
        return cost.buffer(1, 1) <= buffer_bytes and cost.temporaries(1, 1) <= headroom

    if not sizes or not fits(1):
        return None
    return StepPlan(1, 1, sizes[_largest(fits, len(sizes)) - 1])


def size_workspace(cost: ChunkCost, requested_bytes: int | None, units: int = DEFAULT_UNITS,
                   also=()) -> tuple[int, int, int]:
    """(buffer bytes, headroom bytes, units per chunk) of a workspace for steps of this cost.
    Default: `units` (request, layer) units as a chunk of that many requests of one layer.
    With a size requested, the most units that fit it (0: not even one). also: (buffer,
    temporaries) bytes of single units it must hold as well (a unit at the largest
    per-request budget, a streamed unit of the longest private cache); with a size requested
    that cannot hold them, 0 units."""
    need_buffer = max([b for b, _ in also], default=0)
    need_temps = max([t for _, t in also], default=0)

    def size(u):
        return max(cost.buffer(u, 1), need_buffer), max(cost.temporaries(u, 1), need_temps)

    if requested_bytes is None:
        buffer, temps = size(units)
    else:
        per_unit = _aligned(cost.gather_per_unit) + cost.per_request + cost.per_unit
        limit = max(0, requested_bytes // max(1, per_unit))
        if limit < 1 or sum(size(1)) > requested_bytes:
            return 0, requested_bytes, 0
        buffer = size(_largest(lambda u: sum(size(u)) <= requested_bytes, limit))[0]
        temps = requested_bytes - buffer

    def holds(u):
        return cost.buffer(u, 1) <= buffer and cost.temporaries(u, 1) <= temps

    most = max(units, buffer // max(1, _aligned(cost.gather_per_unit)) + 1)
    return buffer, temps, _largest(holds, most) if holds(1) else 0
