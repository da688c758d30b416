"""Per-head compaction of kept K/V into a request's first slots, for every layer of a KV pool.

For each request b, layer l, KV head h and j < K:
    k_buffers[l][slots[b, j], h] <- k_buffers[l][slots[b, keep[b, l, h, j]], h]   (and V alike)

`slots` [B, n] are the physical pool slots of the request's n candidate tokens in token order;
`keep` [B, L, H, K] are ascending candidate indices per (request, layer, head), for the layers
first_layer .. first_layer + L - 1 of the pool (a chunk of layers when the step streams them). Because keep is
ascending and distinct, keep[j] >= j: a token is only ever moved towards the front, so a pass that
reads a block of sources before writing that block is safe in place. Mixing tokens of different
heads inside one slot is sound because keys are stored after RoPE and attention over past tokens
does not depend on their order.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernel is not defined
    triton = None


# 8-bit float KV caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): SGLang stores them as uint8
# because index writes are not implemented for float8 on every device; the step moves them
# the same way, as their bytes, and scores them as float8 views (upcast by the scorers).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def stored(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the bytes it stores (a view) if it is an 8-bit float, else itself: what
    the step's gathers and moves index."""
    return t.view(torch.uint8) if t.dtype in FP8_KV_DTYPES else t


def compact_kv_reference_(
    k_buffers, v_buffers, slots: torch.Tensor, keep: torch.Tensor, first_layer: int = 0
) -> None:
    """In place; k_buffers / v_buffers are per-layer tensors [S, H, D] (one pool slot per row)."""
    num_layers = keep.shape[1]
    b, h, k = keep.shape[0], keep.shape[2], keep.shape[3]
    slots = slots.long()
    dst = slots[:, :k]  # [B, K]
    head = torch.arange(h, device=slots.device).view(1, h, 1)
    for layer in range(num_layers):
        src = torch.gather(slots.unsqueeze(1).expand(b, h, slots.shape[1]), 2, keep[:, layer].long())
        for buf in (k_buffers[first_layer + layer], v_buffers[first_layer + layer]):
            buf = stored(buf)
            moved = buf[src, head]  # [B, H, K, D], fully read before the write below
            buf[dst.unsqueeze(1).expand(b, h, k), head] = moved


if triton is not None:

    # The copy moves raw bits: elements are loaded and stored as integers of the same width.
    _WORD = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}

    # Fuses the gather and scatter of K and V for every (request, layer, head) into one launch:
    # the per-layer buffers are separate allocations, so the kernel reads each layer's base
    # address from a pointer table. One program per (b, l, h) walks j in blocks of BLOCK_J and,
    # within a block, the head dim in chunks of BLOCK_D: it reads the chunk of every source row
    # of the block before writing it, which is safe in place since keep[j] >= j (a write of
    # chunk c touches only chunk c of rows whose chunk c was read; later blocks read rows
    # keep[j'] >= j' past every destination of this one). Chunks of D keep the block's
    # registers small (the whole [BLOCK_J, D] of K and V, with 64-bit addresses, spilled).
    # Not specialised on what changes between steps (vase_sglang/warmup.py): the kept count and
    # the strides it and n give, nor the alignment of the pointer tables (a chunk of layers
    # starts at an offset of them) or of the slots (the paged copy passes a column slice).
    @triton.jit(do_not_specialize=["num_kept", "s_slot_b", "s_keep_b", "s_keep_l", "s_keep_h"],
                do_not_specialize_on_alignment=["k_table", "v_table", "slots", "keep"])
    def _compact_kernel(
        k_table, v_table, slots, keep, num_kept, d,
        s_slot_b, s_slot_n, s_keep_b, s_keep_l, s_keep_h, s_keep_k, s_buf_s, s_buf_h, s_buf_d,
        WORD: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1)
        head = tl.program_id(2).to(tl.int64)
        k_buf = tl.load(k_table + layer).to(tl.pointer_type(WORD))
        v_buf = tl.load(v_table + layer).to(tl.pointer_type(WORD))
        keep_row = keep + b * s_keep_b + layer * s_keep_l + head * s_keep_h
        slot_row = slots + b * s_slot_b
        for j0 in range(0, num_kept, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            j_ok = j < num_kept
            src_idx = tl.load(keep_row + j * s_keep_k, mask=j_ok, other=0)
            src = tl.load(slot_row + src_idx * s_slot_n, mask=j_ok, other=0).to(tl.int64)
            dst = tl.load(slot_row + j * s_slot_n, mask=j_ok, other=0).to(tl.int64)
            src_row = src[:, None] * s_buf_s + head * s_buf_h
            dst_row = dst[:, None] * s_buf_s + head * s_buf_h
            for d0 in range(0, d, BLOCK_D):
                dd = d0 + tl.arange(0, BLOCK_D)
                mask = j_ok[:, None] & (dd[None, :] < d)
                col = dd[None, :] * s_buf_d
                k_rows = tl.load(k_buf + src_row + col, mask=mask)
                v_rows = tl.load(v_buf + src_row + col, mask=mask)
                # keep[j'] may equal some j of this same block: every thread's reads of this
                # chunk must land before any thread's writes of it.
                tl.debug_barrier()
                tl.store(k_buf + dst_row + col, k_rows, mask=mask)
                tl.store(v_buf + dst_row + col, v_rows, mask=mask)


_TABLES: dict[tuple, torch.Tensor] = {}


def pointer_table(buffers, device) -> torch.Tensor:
    """int64 [L] of the layers' base addresses, built once per set of buffers and cached: a
    fresh torch.tensor on the device at every step would be a synchronising host copy. The
    key is the addresses themselves, so a reallocated pool gets a new table."""
    key = (str(device), *(t.data_ptr() for t in buffers))
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor([t.data_ptr() for t in buffers], dtype=torch.int64, device=device)
        _TABLES[key] = table
    return table


def compact_kv_triton_(
    k_buffers, v_buffers, slots: torch.Tensor, keep: torch.Tensor, first_layer: int = 0
) -> None:
    """Same contract as compact_kv_reference_ (in place)."""
    num_req, num_layers, num_heads, num_kept = keep.shape
    k_bufs, v_bufs = list(k_buffers), list(v_buffers)
    first = k_bufs[0]
    layout = (first.shape, first.stride(), first.dtype)
    if any((t.shape, t.stride(), t.dtype) != layout for t in k_bufs + v_bufs):
        raise ValueError("all K/V layer buffers must share shape, strides and dtype")
    if first_layer < 0 or first_layer + num_layers > len(k_bufs):
        raise ValueError(f"keep: layers {first_layer}..{first_layer + num_layers - 1} are not "
                         f"in the pool's {len(k_bufs)} layers")
    if keep.numel() == 0:
        return
    # The buffers are reached only through these addresses, never passed as tensor arguments.
    # The tables cover every layer of the pool; a chunk of layers starts at a view's offset.
    k_table = pointer_table(k_bufs, slots.device)[first_layer:]
    v_table = pointer_table(v_bufs, slots.device)[first_layer:]
    if slots.device.type == "meta":
        return  # memory planning: the same allocations, no launch

    d = first.shape[-1]
    _compact_kernel[(num_req, num_layers, num_heads)](
        k_table, v_table, slots, keep, num_kept, d,
        *slots.stride(), *keep.stride(), *first.stride(),
        WORD=_WORD[first.element_size()], BLOCK_J=32, BLOCK_D=min(32, triton.next_power_of_2(d)),
    )
