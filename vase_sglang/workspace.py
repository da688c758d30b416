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
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import ops
from .config import EvictionConfig
from .policies import POLICIES, Retention, select_tokens

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


def gather_layout(cfg: EvictionConfig, shapes: KVShapes, b: int, l: int, n: int):
    """(shape, dtype) of each gathered tensor of a chunk: keys and values [b, l, n, H, D] (the
    pool's slot-major rows; viewed as [b, l, H, n, D]), queries [b, l, W, H_q, D], and for
    retention policies log β and positions [b, l, n, H, 1] float32 (the side buffers' rows)."""
    policy = POLICIES[cfg.policy]
    layout = []
    kv = ((b, l, n, shapes.kv_heads, shapes.head_dim), shapes.kv_dtype)
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
                side=None, now: torch.Tensor | None = None, **select_kwargs) -> torch.Tensor:
    """Gather -> select -> compact for requests `slots` [b, n] and pool layers first_layer ..
    first_layer + num_layers - 1; returns keep [b, l, H, K]. ring_index: (ring rows [b, 1],
    ring entries [b, W]) of the window queries. Retention policies (trimkv): side = (log β
    buffers, position buffers), per pool layer [slots, H, 1] float32, compacted with K/V;
    now [b] the true length of each request (the position of its next token).
    select_kwargs go to select_tokens as they are."""
    policy = POLICIES[cfg.policy]
    b, n = slots.shape
    l = num_layers
    h, d = k_buffers[0].shape[1], k_buffers[0].shape[2]
    layers = range(first_layer, first_layer + l)
    views = workspace.views(gather_layout(cfg, _shapes_of(k_buffers, ring, cfg), b, l, n))
    unread = torch.zeros((), device=slots.device).expand(b, l, h, n, d)  # shapes only, no copy
    gathered_kv, used = [], 0  # views[:used] hold the K/V gathers, in gather_layout's order
    for read, buffers in zip(kv_reads(cfg), (k_buffers, v_buffers)):
        if not read:  # random / streaming / plain trimkv
            gathered_kv.append(unread)
            continue
        out, used = views[used], used + 1
        for j, layer in enumerate(layers):
            torch.ops.aten.index.Tensor_out(buffers[layer], [slots], out=out[:, j])
        gathered_kv.append(out.transpose(2, 3))  # [b, l, H, n, D]
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
    keep = select_tokens(
        cfg, keys, values, queries,
        request=request[:, None], layer=layer_ids[None, first_layer: first_layer + l],
        round=rounds[:, None], sinks=sinks, check=False, retention=retention, **select_kwargs,
    )
    ops.compact_kv_(k_buffers, v_buffers, slots, keep, ascending=policy.ascending,
                    first_layer=first_layer)
    if policy.needs_retention:  # each slot's log β and position move with its K/V
        ops.compact_kv_(side[0], side[1], slots, keep, ascending=policy.ascending,
                        first_layer=first_layer)
    return keep


def _shapes_of(k_buffers, ring, cfg) -> KVShapes:
    k = k_buffers[0]
    q_heads = ring.shape[3] if ring is not None else k.shape[1]
    q_dtype = ring.dtype if ring is not None else k.dtype
    ring_window = ring.shape[2] if ring is not None else cfg.window
    return KVShapes(k.shape[1], q_heads, k.shape[2], k.dtype, q_dtype, ring_window)


def trace_chunk(cfg: EvictionConfig, shapes: KVShapes, n: int, b: int, l: int, sinks: int,
                device: str) -> tuple[int, int]:
    """(buffer bytes, peak bytes of the temporaries) of one real chunk stage, on meta tensors
    planned as `device` (nothing is allocated)."""
    meta = torch.device("meta")
    slots_in_pool = b * (n + 1)
    k_buffers = [torch.empty(slots_in_pool, shapes.kv_heads, shapes.head_dim, dtype=shapes.kv_dtype,
                             device=meta) for _ in range(l)]
    v_buffers = [torch.empty_like(k) for k in k_buffers]
    ring = None
    if POLICIES[cfg.policy].needs_queries:
        ring = torch.empty(l, b + 1, shapes.ring_window, shapes.q_heads, shapes.head_dim,
                           dtype=shapes.q_dtype, device=meta)
    buffer_bytes = sum(_aligned(_nbytes(s, t)) for s, t in gather_layout(cfg, shapes, b, l, n))
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
                           rounds=ids, sinks=sinks, side=side, now=ids)
        del keep
    return buffer_bytes, peak.peak


def chunk_cost(cfg: EvictionConfig, shapes: KVShapes, n: int, device: str) -> ChunkCost:
    """The cost of a chunk with n candidates, traced at the smallest of {cfg.budget, powers
    of two} >= n (costs grow with n), so a server traces a handful of sizes in its life (the
    number of sinks only changes which entries a mask sets: traced at cfg.sinks)."""
    bucket = cfg.budget if n <= cfg.budget else 1 << (n - 1).bit_length()
    return _chunk_cost(cfg, shapes, bucket, cfg.sinks, device)


@functools.lru_cache(maxsize=256)
def _chunk_cost(cfg, shapes, n, sinks, device) -> ChunkCost:
    # A 1 x 1 chunk alone can take other paths (matmul folds size-1 batch dims into one mm),
    # so a 2 x 2 chunk's peak per unit is traced too and the larger of the two is kept.
    # (torch's CPU matmul also changes path with the batch size: 8 units are traced too).
    gather, one = trace_chunk(cfg, shapes, n, 1, 1, sinks, device)
    _, four = trace_chunk(cfg, shapes, n, 2, 2, sinks, device)
    _, eight = trace_chunk(cfg, shapes, n, 4, 2, sinks, device)
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


def size_workspace(cost: ChunkCost, requested_bytes: int | None,
                   units: int = DEFAULT_UNITS) -> tuple[int, int, int]:
    """(buffer bytes, headroom bytes, units per chunk) of a workspace for steps of this cost.
    Default: `units` (request, layer) units as a chunk of that many requests of one layer.
    With a size requested, the most units that fit it (0: not even one)."""

    def need(u):
        return cost.buffer(u, 1), cost.temporaries(u, 1)

    if requested_bytes is None:
        buffer, temps = need(units)
        return buffer, temps, units
    per_unit = _aligned(cost.gather_per_unit) + cost.per_request + cost.per_unit
    fit = max(0, requested_bytes // max(1, per_unit))
    buffer = cost.buffer(fit, 1)
    return buffer, requested_bytes - buffer, fit
