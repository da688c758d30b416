"""The query ring inside the KV pool: a request that scores with queries owns a few pool slots,
and their K and V storage hold its last `window` post-RoPE queries of every layer.

Why: a ring with one row per request-table row is memory reserved for requests that may never
run (a prompt-length guess sized it, and capped concurrency). Held as ordinary pool slots, a
request's ring costs what it uses, is charged to it at admission, and goes back to the pool when
it finishes, is aborted or retracted; a request whose policy reads no queries holds none.

Layout. One slot of one layer stores `cell` = H_kv * D * kv_itemsize bytes in K and as many in
V. One window position of one layer is H_q * D query elements in the ring's dtype, i.e.
C = H_q * D * q_itemsize / cell cells (G = H_q / H_kv for equal dtypes; twice that for bf16
queries over an fp8 cache: the ring keeps the model's dtype). Positions [0, ceil(W / 2)) live in
the K storage of the request's slots, positions [ceil(W / 2), W) in their V storage, C cells a
position:

    position p < Wk:  cells of K[layer][table[row, (p)      * C + c]], c < C
    position p >= Wk: cells of V[layer][table[row, (p - Wk) * C + c]]

so a request holds Wk * C slots (Qwen3-4B, W = 64, G = 4: 128 slots; the tiny test model, G = 2:
W slots). `table` [request rows, slots per request] maps a request-table row to its slots; row 0
(SGLang's padding row, the capture's scratch row) and rows without a ring map to slot 0, SGLang's
padding slot, which absorbs their writes as it does the K/V of padding tokens.

Writes and gathers are static-shaped index ops with no host reads (they run inside CUDA graphs):
a write goes to both K and V, the half it does not belong to redirected to slot 0; a gather
reads both halves and keeps each position's own (one temporary the size of the gathered queries
per layer, counted by the step's traced cost). The attention backends never see these slots:
they are in no row of req_to_token and never in the radix tree.
"""

from __future__ import annotations

import math

import torch

PADDING_SLOT = 0  # SGLang's padding slot of the KV pool: never a request's token


def cells_per_position(q_heads: int, head_dim: int, q_dtype: torch.dtype, kv_heads: int,
                       kv_itemsize: int) -> int:
    """Cells (one slot's K or V storage of one layer) one window position takes."""
    position = q_heads * head_dim * q_dtype.itemsize
    cell = kv_heads * head_dim * kv_itemsize
    if position % cell:
        raise ValueError(f"query ring: a position of {q_heads} query heads x {head_dim} "
                         f"({q_dtype}) does not fill whole cells of {kv_heads} KV heads x "
                         f"{head_dim} x {kv_itemsize} bytes")
    return position // cell


def slots_per_request(window: int, q_heads: int, head_dim: int, q_dtype: torch.dtype,
                      kv_heads: int, kv_itemsize: int, page_size: int = 1) -> int:
    """Pool slots a request's ring takes (whole pages)."""
    slots = math.ceil(window / 2) * cells_per_position(q_heads, head_dim, q_dtype, kv_heads,
                                                       kv_itemsize)
    return -(-slots // page_size) * page_size


class RingSlots:
    """A free list of the slots 1..size of a ring storage of its own (slot 0: padding): alloc
    and free are device ops on host-known sizes, as SGLang's token allocator's are."""

    def __init__(self, size: int, device):
        self.size = size
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    def available_size(self) -> int:
        return self.free_slots.shape[0]

    def alloc(self, need: int) -> torch.Tensor | None:
        if need > self.free_slots.shape[0]:
            return None
        out, self.free_slots = self.free_slots[:need], self.free_slots[need:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots = torch.cat([self.free_slots, slots.to(self.free_slots.dtype)])


def _bytes(buffer: torch.Tensor) -> torch.Tensor:
    """A pool buffer [slots, H, D] as bytes [slots, H * D * itemsize] (a view)."""
    return buffer.view(torch.uint8).view(buffer.shape[0], -1)


class PoolRing:
    """The ring of every layer over the pool's K/V buffers (per layer [slots, H_kv, D], any
    dtype) and `table` [rows, slots per request] (int64). Looks like the ring tensor it
    replaces where the step and the capture read it: `shape` (layers, rows, window, H_q, D),
    `dtype`, and ring[layer] (a PoolRingLayer)."""

    def __init__(self, k_buffers, v_buffers, table: torch.Tensor, window: int, q_heads: int,
                 head_dim: int, dtype: torch.dtype):
        self.k_buffers, self.v_buffers, self.table = k_buffers, v_buffers, table
        self.dtype = dtype
        self.shape = (len(k_buffers), table.shape[0], window, q_heads, head_dim)
        k = k_buffers[0]
        self.cells = cells_per_position(q_heads, head_dim, dtype, k.shape[1], k.element_size())
        self.k_half = math.ceil(window / 2)
        if table.shape[1] < self.k_half * self.cells:
            raise ValueError(f"query ring: table of {table.shape[1]} slots per request, "
                             f"{self.k_half * self.cells} needed")

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, layer: int) -> "PoolRingLayer":
        return PoolRingLayer(self, _bytes(self.k_buffers[layer]), _bytes(self.v_buffers[layer]))


class PoolRingLayer:
    """One layer of a PoolRing: ring[rows, positions] = q and gather(), as on a tensor
    [rows, window, H_q, D]."""

    def __init__(self, ring: PoolRing, k_bytes: torch.Tensor, v_bytes: torch.Tensor):
        self.ring, self.k_bytes, self.v_bytes = ring, k_bytes, v_bytes
        self.dtype = ring.dtype
        self.shape = ring.shape[1:]

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor):
        """(in the V half [...], slots [..., C]) of each (row, position), broadcast."""
        ring = self.ring
        positions = positions.to(torch.int64)
        in_v = positions >= ring.k_half
        first = (positions - in_v * ring.k_half) * ring.cells
        cells = first[..., None] + torch.arange(ring.cells, device=positions.device)
        return in_v, ring.table[rows.to(torch.int64)[..., None], cells]

    def __setitem__(self, index, value: torch.Tensor) -> None:
        """ring[rows, positions] = value [n, H_q, D] (rows, positions [n])."""
        rows, positions = index
        in_v, slots = self._slots(rows, positions)
        n = slots.shape[0]
        data = value.to(self.dtype).contiguous().view(torch.uint8).view(n, self.ring.cells, -1)
        mask = in_v[:, None]
        self.k_bytes[torch.where(mask, PADDING_SLOT, slots)] = data
        self.v_bytes[torch.where(mask, slots, PADDING_SLOT)] = data

    def gather(self, index, out: torch.Tensor) -> None:
        """out [b, W, H_q, D] (the ring's dtype; a view whose last two dims are contiguous)
        = ring[rows [b, 1], entries [b, W]]."""
        in_v, slots = self._slots(*index)  # [b, W], [b, W, C]
        cells = out.view(torch.uint8).view(*out.shape[:-2], self.ring.cells, -1)
        torch.ops.aten.index.Tensor_out(self.k_bytes, [slots], out=cells)
        from_v = self.v_bytes[slots]
        torch.where(in_v[..., None, None], from_v, cells, out=cells)


def gather_queries(ring_layer, index, out: torch.Tensor) -> None:
    """out = ring_layer[index] for a ring tensor of one layer [rows, W, H_q, D] or a
    PoolRingLayer."""
    if isinstance(ring_layer, PoolRingLayer):
        ring_layer.gather(index, out)
    else:
        torch.ops.aten.index.Tensor_out(ring_layer, list(index), out=out)
