"""The chunk stage of an eviction step: gather -> select -> compact for a chunk of b requests x
l layers, inside the workspace reserved at startup.

A chunk gathers the K/V (and the window queries) of its (request, layer) units into views of
one preallocated buffer (`Workspace`), selects the kept tokens per (layer, KV head) with the
policy, and compacts those layers before the next chunk starts. Draws are keyed by (seed,
request, layer, round), so the chunking never changes a choice.

Where even one (request, layer) unit does not fit (a long private cache: its n candidates'
K/V and [H_q, W, n] softmax), the unit runs streamed: its candidates are gathered `chunk` at a
time into the buffer and scored by Policy.select_streamed, which keeps only [H, n] float32
arrays (vase_sglang/stream_select.py). How big a chunk may be is decided by the plan
(vase_sglang/plan.py), from this stage's own costs measured on meta tensors.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from . import ops
from .config import EvictionConfig
from .pool_ring import gather_queries
from .policies import POLICIES, Retention, SelectParams, select_candidates, select_tokens
from .stream_select import Candidates

logger = logging.getLogger("vase_sglang.eviction")

ALIGN = 256  # bytes: every view carved from the workspace starts aligned for vector loads


@dataclass(frozen=True)
class KVShapes:
    """What an eviction step's memory depends on, besides the config and the group."""

    kv_heads: int
    q_heads: int
    head_dim: int
    kv_dtype: torch.dtype  # the KV cache's (8-bit floats: one byte per element, moved as bytes)
    q_dtype: torch.dtype  # the query ring's
    ring_window: int  # entries per row of the query ring (the server's window)


def aligned_size(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN

def tensor_bytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize

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


def layout_bytes(layout) -> int:
    """Bytes a gather layout takes in the workspace buffer (each view aligned)."""
    return sum(aligned_size(tensor_bytes(shape, dtype)) for shape, dtype in layout)


def kv_reads(cfg: EvictionConfig) -> tuple[bool, bool]:
    """Whether a step of this config gathers (keys, values). trimkv scores from the side
    buffers alone; only its value slots (the VaSE hybrid) read V."""
    policy = POLICIES[cfg.policy]
    if policy.needs_retention:
        return False, cfg.n_value_slots > 0
    return policy.reads_kv, policy.reads_kv

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

    def fits(self, layout) -> bool:
        return layout_bytes(layout) <= self.buffer_bytes

    def views(self, layout) -> list[torch.Tensor]:
        if not self.fits(layout):
            # Planned steps fit (the engine's step splits a chunk before it gets here): this is
            # a caller that planned none, or a plan that is off. Served, and said once.
            self.overflows += 1
            if self.overflows == 1:
                logger.warning("an eviction chunk's gathers need %d bytes, more than the "
                               "%d-byte workspace: allocated outside it (logged once)",
                               layout_bytes(layout), self.buffer_bytes)
            return [torch.empty(shape, dtype=dtype, device=self.buffer.device) for shape, dtype in layout]
        out, offset = [], 0
        for shape, dtype in layout:
            nbytes = tensor_bytes(shape, dtype)
            raw = self.buffer[offset: offset + nbytes]
            out.append(raw.view(dtype).view(shape))
            offset += aligned_size(nbytes)
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
    select_kwargs: further SelectParams fields (attention, head_offset, seed), as they are."""
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
                torch.ops.aten.index.Tensor_out(ops.stored(buffers[layer]), [slots],
                                                out=ops.stored(out[:, j]))
        gathered_kv.append(out.transpose(2, 3))  # [b, l, H, n, D]; streamed: a chunk's region
    keys, values = gathered_kv
    queries = None
    if policy.needs_queries:
        gathered = views[-1]
        for j, layer in enumerate(layers):
            gather_queries(ring[layer], ring_index, gathered[:, j])
        queries = gathered.permute(0, 1, 3, 2, 4)  # [b, l, H_q, W, D]
    retention = None
    if policy.needs_retention:
        log_beta, position = views[-2], views[-1]
        for j, layer in enumerate(layers):
            torch.ops.aten.index.Tensor_out(side[0][layer], [slots], out=log_beta[:, j])
            torch.ops.aten.index.Tensor_out(side[1][layer], [slots], out=position[:, j])
        age = now[:, None, None, None] - position[..., 0].transpose(2, 3)  # [b, l, H, n]
        retention = Retention(log_beta[..., 0].transpose(2, 3), age)
    params = SelectParams(request=request[:, None],
                          layer=layer_ids[None, first_layer: first_layer + l],
                          round=rounds[:, None], sinks=sinks, check=False, retention=retention,
                          **select_kwargs)
    if candidate_chunk is None:
        keep = select_tokens(cfg, keys, values, queries, params=params)
    else:
        candidates = PoolCandidates(k_buffers, v_buffers, layers, slots, regions, candidate_chunk)
        keep = select_candidates(cfg, candidates, queries, params=params)
    try:
        ops.compact_kv_(k_buffers, v_buffers, slots, keep, ascending=policy.ascending,
                        first_layer=first_layer)
        if policy.needs_retention:  # each slot's log β and position move with its K/V
            ops.compact_kv_(side[0], side[1], slots, keep, ascending=policy.ascending,
                            first_layer=first_layer)
    except Exception as err:
        raise CompactionError(f"{type(err).__name__}: {err}") from err
    return keep


class CompactionError(RuntimeError):
    """The in-place compaction failed: the chunk's K/V may be moved in part (an engine
    finishes those requests; the selection before it wrote nothing)."""


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
                    torch.ops.aten.index.Tensor_out(ops.stored(buffers[layer]), index,
                                                    out=ops.stored(view[:, j]))
                out.append(view.transpose(2, 3))  # [b, l, H, c, D]
            yield start, stop, *out


def _shapes_of(k_buffers, ring, cfg) -> KVShapes:
    k = k_buffers[0]
    q_heads = ring.shape[3] if ring is not None else k.shape[1]
    q_dtype = ring.dtype if ring is not None else k.dtype
    ring_window = ring.shape[2] if ring is not None else cfg.window
    return KVShapes(k.shape[1], q_heads, k.shape[2], k.dtype, q_dtype, ring_window)
