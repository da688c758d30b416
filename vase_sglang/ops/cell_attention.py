"""Decode attention over a request's packed *cells* (issue 52, vase_sglang/cells.py).

Under a shared (layer or global) KV budget a request's K older slots are L·K·H cells
(layer l', older slot j, KV head h'), each holding a token of any (layer, KV head); the cells
(layer l, KV head h) owns are listed, sorted, in `order[offsets[l·H + h] : offsets[l·H + h + 1]]`
(`CellMap.segments`). Attention of (layer l, head h) at decode is a softmax over its plain tokens
(prompt and newest slots, which the attention backend reads through `req_to_token` as usual)
and over the cells it owns, which live in *any* layer's K/V buffer. This module computes the
cells' part as a partial softmax: the output normalised over the owned cells and the log-sum-exp
of their logits, so that the backend's plain part and this part merge exactly
(`merge_attention`):

    lse = log sum_c exp(logit_c),   out = sum_c exp(logit_c - lse) v_c,
    logit_c = q . k_c * scaling, then cap * tanh(logit_c / cap) where the model soft-caps.

A (layer, head) owning no cell gives lse = -inf and out = 0, which merges as nothing.

The Triton kernel reads the cells where they lie. SGLang's pool keeps one tensor per layer
(`k_buffer[l]`: [slots, H, D]), separate allocations, so the kernel is given a **pointer table**
(int64 [L] of the layers' base addresses, `compact.pointer_table`, built once per pool and
cached, as the compaction kernel reads the same buffers), not a stacked view: stacking would copy
the whole pool every step, and a pool allocated as views of one tensor would need SGLang's
allocator changed. Each cell's row address is then table[l'] + slot · stride_s + h' · stride_h.

It is CUDA-graph friendly: the grid is (B, H, num_splits), fixed by the shapes alone (never by
how many cells a head owns), every program splits its head's segment into `num_splits` equal
chunks on the device (the chunk is computed from `offsets` inside the kernel, as split-KV decode
kernels do with sequence lengths), so a head owning 240 cells is spread over num_splits programs
instead of one; a second small kernel merges the splits' partial results. No value is read on the
host, and every allocation's shape is static.
"""

from __future__ import annotations

import math

import torch

from .compact import pointer_table
from .window_attention import _check_logit_params

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernels are not defined
    triton = None


def _check_shapes(q, k_buffers, v_buffers, older_slots, order, offsets, layer) -> None:
    if len(k_buffers) != len(v_buffers) or not k_buffers:
        raise ValueError(f"k_buffers / v_buffers: one tensor per layer each, got "
                         f"{len(k_buffers)} / {len(v_buffers)}")
    num_layers = len(k_buffers)
    first = k_buffers[0]
    if first.dim() != 3 or q.dim() != 3 or q.shape[-1] != first.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and buffers {tuple(first.shape)}: expected "
                         "[B, H_q, D] and [S, H, D] with the same D")
    b, h_q, _ = q.shape
    h = first.shape[1]
    if h_q % h:
        raise ValueError(f"H_q = {h_q} is not a multiple of the KV heads H = {h}")
    k = older_slots.shape[-1]
    if (older_slots.shape != (b, k) or order.shape != (b, num_layers * k * h)
            or offsets.shape != (b, num_layers * h + 1)):
        raise ValueError(f"older_slots {tuple(older_slots.shape)}, order {tuple(order.shape)}, "
                         f"offsets {tuple(offsets.shape)}: expected [{b}, K], [{b}, L·K·H] and "
                         f"[{b}, L·H + 1] with L = {num_layers}, H = {h}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is not one of the pool's {num_layers} layers")


def cell_attention_reference(q, k_buffers, v_buffers, older_slots, order, offsets, layer: int,
                             scaling: float, softcap: float = 0.0):
    """Decode attention of one layer over the cells each of its KV heads owns (torch).

    Args:
        q: [B, H_q, D] the new tokens' queries at `layer`; query head q reads KV head
            q // (H_q / H) (repeat_kv's grouping).
        k_buffers, v_buffers: sequences of L tensors [S, H, D] (the pool's per-layer K / V,
            any float dtype); cell (l', j, h') of request b is k_buffers[l'][older_slots[b, j], h'].
        older_slots: [B, K] the pool slots of each request's K older slots (int).
        order: [B, L·K·H] per request, the flat cell indices (l'·K + j)·H + h' sorted by owner
            (CellMap.segments).
        offsets: [B, L·H + 1] per request: (layer l, head h) owns order[offsets[l·H + h] :
            offsets[l·H + h + 1]].
        layer: the layer l whose heads attend.
        scaling: logit = q . k * scaling.
        softcap: the model's tanh soft-cap of the logits (cap · tanh(logit / cap)); 0: none.

    Returns:
        (out [B, H_q, D] float32, lse [B, H_q] float32): the attention over the owned cells
        only, and the natural-log sum of exp of their logits; out = 0 and lse = -inf where the
        (layer, head) owns no cell.
    """
    _check_shapes(q, k_buffers, v_buffers, older_slots, order, offsets, layer)
    _check_logit_params(scaling, softcap)
    b, h_q, d = q.shape
    num_layers, h, k = len(k_buffers), k_buffers[0].shape[1], older_slots.shape[1]
    n = num_layers * k * h
    slots = older_slots.long()
    idx = order.long()[..., None].expand(b, n, d)

    def cells(buffers):  # [B, L·K·H, D] float32, in each request's order
        flat = torch.stack([buf[slots].float() for buf in buffers], 1).reshape(b, n, d)
        return flat.gather(1, idx)

    seg = offsets.long()[:, layer * h:(layer + 1) * h + 1]  # [B, H + 1]
    rank = torch.arange(n, device=q.device)
    # cells no head of this layer owns (other layers', padding slots) may hold anything
    theirs = ((rank < seg[:, :1]) | (rank >= seg[:, -1:]))[..., None]  # [B, L·K·H, 1]
    keys = cells(k_buffers).masked_fill(theirs, 0.0)
    values = cells(v_buffers).masked_fill(theirs, 0.0)
    mine = (rank >= seg[:, :-1, None]) & (rank < seg[:, 1:, None])  # [B, H, L·K·H]
    mine = mine.repeat_interleave(h_q // h, dim=1)  # [B, H_q, L·K·H]
    logits = torch.einsum("bqd,bnd->bqn", q.float(), keys) * scaling
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mine, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # 0: no cell
    return torch.einsum("bqn,bnd->bqd", probs, values), lse


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Exact log-sum-exp merge of two partial softmax attentions over disjoint key sets.

    Args:
        out_a, out_b: [..., D] each part's output, normalised over its own keys.
        lse_a, lse_b: [...] each part's natural-log sum of exp of its logits (-inf: no key).

    Returns:
        (out [..., D] float32, lse [...] float32): the attention over both key sets. Where one
        side is empty (-inf), the other is returned exactly (whatever the empty side's out
        holds); where both are, out = 0 and lse = -inf.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    out_a, out_b = out_a.float(), out_b.float()
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isinf(top), 0.0, top)  # both empty: any finite shift
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # 0 for an empty side
    total = w_a + w_b
    lse = top + torch.log(total)  # -inf where both are empty
    safe = torch.where(total > 0, total, 1.0)
    out = (torch.where(w_a[..., None] > 0, out_a * (w_a / safe)[..., None], 0.0)
           + torch.where(w_b[..., None] > 0, out_b * (w_b / safe)[..., None], 0.0))
    return out, lse


def split_lse(attn_lse, kv_indptr, num_kv_splits, min_block: int = 32):
    """The total log-sum-exp of each request's keys from a split-KV decode's per-split ones.

    SGLang's Triton decode (stage 1) splits request b's L keys (kv_indptr[b + 1] -
    kv_indptr[b]) into k = num_kv_splits[b] chunks of c = ceil(ceil(L / k) / min_block) ·
    min_block keys: split s holds keys [s·c, min((s + 1)·c, L)) and stores, if it holds any,
    attn_lse[b, :, s] = e_max + log(e_sum) (natural log); a split holding no key stores
    nothing, so its entry is whatever the buffer held and is left out here.

    Args:
        attn_lse: [B, H_q, S] the per-split log-sum-exps (S = the decode's max_kv_splits).
        kv_indptr: [>= B + 1] each request's start in kv_indices (int).
        num_kv_splits: [>= B] each request's split count (int, >= 1).
        min_block: the kernel's MIN_BLOCK_KV (32 in SGLang 0.5.23).

    Returns:
        [B, H_q] float32: log sum over the request's keys of exp(logit); -inf for a request of
        no key. Device ops only (no host read): safe under CUDA-graph capture.
    """
    b, _, s = attn_lse.shape
    indptr = kv_indptr[: b + 1].long()
    length = indptr[1:] - indptr[:-1]  # [B]
    k = num_kv_splits[:b].long().clamp_min(1)
    per = (length + k - 1) // k
    per = (per + min_block - 1) // min_block * min_block
    start = per[:, None] * torch.arange(s, device=attn_lse.device)  # [B, S]
    holds = (start < length[:, None])[:, None, :]  # split s holds keys iff s·c < L
    return torch.logsumexp(attn_lse.float().masked_fill(~holds, float("-inf")), dim=-1)


if triton is not None:
    from .window_attention import _logits_log2, _mma

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                  torch.float32: tl.float32, torch.float8_e4m3fn: tl.float8e4nv,
                  torch.float8_e5m2: tl.float8e5}

    # One program per (request b, KV head h, split): it reads the query rows of h's GQA group
    # (padded to BLOCK_G >= 16 rows for the tensor cores' dot), finds its chunk of h's segment
    # of `order` and runs an online softmax over it in blocks of BLOCK_N cells: each cell's row
    # is gathered from its own layer's buffer (pointer table) at its slot and head. q . k and
    # p . v are tl.dot's with fp32 accumulation (window_attention's _mma and its dot modes:
    # bf16 / fp16 q and K to the MMA as they are, fp32 / mixed / fp8 through tf32x3; p . v
    # always in fp32 operands through tf32x3, so the probabilities are not rounded to 16 bits).
    # It writes the chunk's normalised output and log2-sum-exp2 (-inf for an empty chunk).
    # `layer` is not specialised on: one compilation serves every layer.
    @triton.jit(do_not_specialize=["layer"],
                do_not_specialize_on_alignment=["k_table", "v_table"])
    def _cell_attention_kernel(
        q, k_table, v_table, slots, order, offsets, out_part, lse_part,
        layer, num_older, h_kv, group, d, qk_scale, softcap, scale_log2,
        sq_b, sq_h, s_slot_b, s_slot_k, s_ord_b, s_ord_n, s_off_b, s_off_n, s_buf_s, s_buf_h,
        KV: tl.constexpr, ALIGNED: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
        PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
        seg = offsets + b * s_off_b + (layer * h_kv + h) * s_off_n
        start = tl.load(seg).to(tl.int32)
        end = tl.load(seg + s_off_n).to(tl.int32)
        # equal chunks of whole blocks; the last programs of a short segment get none
        per = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
        lo = start + split * per
        hi = tl.minimum(lo + per, end)

        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        g_ok = g < group
        d_ok = dd < d
        q_head = (h * group + g).to(tl.int64)
        q_tile = tl.load(q + b * sq_b + q_head[:, None] * sq_h + dd[None, :],
                         mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        cells_per_layer = num_older * h_kv
        order_row = order + b * s_ord_b
        slot_row = slots + b * s_slot_b
        for c0 in range(lo, hi, BLOCK_N):
            i = c0 + tl.arange(0, BLOCK_N)
            ok = i < hi
            cell = tl.load(order_row + i.to(tl.int64) * s_ord_n, mask=ok, other=0).to(tl.int32)
            src_layer = cell // cells_per_layer
            src_head = cell % h_kv
            j = (cell // h_kv) % num_older
            slot = tl.load(slot_row + j.to(tl.int64) * s_slot_k, mask=ok, other=0).to(tl.int64)
            row = slot * s_buf_s + src_head.to(tl.int64) * s_buf_h
            k_row = tl.load(k_table + src_layer, mask=ok, other=0).to(tl.pointer_type(KV)) + row
            v_row = tl.load(v_table + src_layer, mask=ok, other=0).to(tl.pointer_type(KV)) + row
            if ALIGNED:  # addresses read from memory: tell the compiler rows are 16 B aligned,
                k_row = tl.multiple_of(k_row, 16)  # so that a row loads in 16-byte vectors
                v_row = tl.multiple_of(v_row, 16)
            kv_ok = ok[:, None] & d_ok[None, :]
            k_tile = tl.load(k_row[:, None] + dd[None, :], mask=kv_ok, other=0.0)
            s = _mma(q_tile, tl.trans(k_tile), tl.zeros([BLOCK_G, BLOCK_N], tl.float32),
                     UPCAST, PRECISION)
            s = _logits_log2(s, qk_scale, softcap, scale_log2, SOFTCAP)
            s = tl.where(ok[None, :], s, float("-inf"))
            # every block holds a valid cell, so m_new is finite on every row (padded rows
            # have zero queries: logits 0)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_tile = tl.load(v_row[:, None] + dd[None, :], mask=kv_ok, other=0.0)
            acc = _mma(p, v_tile, acc * alpha[:, None], True, PV_PRECISION)
            m_i = m_new
        out_row = ((b * h_kv + h) * group + g).to(tl.int64) * num_splits + split  # [B, H_q, S]
        some = l_i > 0  # False: an empty chunk (lse -inf, out 0)
        safe = tl.where(some, l_i, 1.0)
        tl.store(lse_part + out_row, tl.where(some, m_i + tl.log2(safe), float("-inf")),
                 mask=g_ok)
        res = tl.where(some[:, None], acc / safe[:, None], 0.0)
        tl.store(out_part + out_row[:, None] * d + dd[None, :], res,
                 mask=g_ok[:, None] & d_ok[None, :])

    # One program per (request, query head): the splits' log-sum-exp merge, natural log out.
    @triton.jit
    def _cell_combine_kernel(out_part, lse_part, out, lse, num_splits, d,
                             BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        s_ok = s < num_splits
        part = tl.load(lse_part + row * num_splits + s, mask=s_ok, other=float("-inf"))
        top = tl.max(part, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp2(part - shift)  # 0 for empty chunks
        total = tl.sum(w, axis=0)
        o = tl.load(out_part + (row * num_splits + s)[:, None] * d + dd[None, :],
                    mask=s_ok[:, None] & (dd[None, :] < d), other=0.0)
        some = total > 0  # False: the head owns no cell (lse -inf, out 0)
        safe = tl.where(some, total, 1.0)
        res = tl.sum(w[:, None] * o, axis=0) / safe
        tl.store(out + row * d + dd, res, mask=dd < d)
        tl.store(lse + row, tl.where(some, (top + tl.log2(safe)) * 0.6931471805599453,
                                     float("-inf")))


# Splits per (request, KV head): enough programs to fill a GPU at small batches (B·H·16 >= 128
# at B·H >= 8) and to spread a head owning hundreds of cells; capped by the most cells one
# head can own (L·K·H) in blocks of BLOCK_N, both static.
NUM_SPLITS = 16
# Cells per block, and warps, by the width of K/V's elements and the head dim: no spills at
# D 64 / 128 / 256, bf16 / fp16 / fp32 / fp8, sm_80 / 90 / 100 (vase_sglang.ops.aot --strict).
TILES = {64: dict(BLOCK_N=32, num_warps=4), 128: dict(BLOCK_N=32, num_warps=4),
         256: dict(BLOCK_N=16, num_warps=8)}


def cell_attention_triton(q, k_buffers, v_buffers, older_slots, order, offsets, layer: int,
                          scaling: float, softcap: float = 0.0, *,
                          num_splits: int = NUM_SPLITS):
    """Same contract as cell_attention_reference (K/V in bf16, fp16, fp32 or an fp8 view,
    computed in fp32). num_splits: programs per (request, KV head), each taking an equal
    chunk of the head's cells (capped by L·K·H / BLOCK_N)."""
    from .window_attention import dot_mode

    _check_shapes(q, k_buffers, v_buffers, older_slots, order, offsets, layer)
    _check_logit_params(scaling, softcap)
    if num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    k_bufs, v_bufs = list(k_buffers), list(v_buffers)
    first = k_bufs[0]
    layout = (first.shape, first.stride(), first.dtype)
    if any((t.shape, t.stride(), t.dtype) != layout for t in k_bufs + v_bufs):
        raise ValueError("all K/V layer buffers must share shape, strides and dtype")
    if first.stride(-1) != 1:
        raise ValueError("K/V layer buffers: the head dim must be contiguous (stride 1)")
    if first.dtype not in _TL_DTYPES:
        raise ValueError(f"K/V dtype {first.dtype}: one of {sorted(map(str, _TL_DTYPES))}")
    b, h_q, d = q.shape
    h, num_older = first.shape[1], older_slots.shape[1]
    group = h_q // h
    tile = dict(TILES.get(triton.next_power_of_2(d), TILES[256]))
    block_n = tile.pop("BLOCK_N")
    splits = max(1, min(num_splits, triton.cdiv(len(k_bufs) * num_older * h, block_n)))
    device = q.device
    out = torch.empty(b, h_q, d, dtype=torch.float32, device=device)
    lse = torch.empty(b, h_q, dtype=torch.float32, device=device)
    if b == 0:
        return out, lse
    out_part = torch.empty(b, h_q, splits, d, dtype=torch.float32, device=device)
    lse_part = torch.empty(b, h_q, splits, dtype=torch.float32, device=device)
    k_table = pointer_table(k_bufs, device)
    v_table = pointer_table(v_bufs, device)
    if device.type == "meta":
        return out, lse  # memory planning: the same allocations, no launch
    if q.stride(-1) != 1:
        q = q.contiguous()
    # Every cell row starts 16-byte aligned (the common case: D · element size a multiple of
    # 16): the kernel then loads rows in 16-byte vectors.
    size = first.element_size()
    aligned = all(t.data_ptr() % 16 == 0 for t in k_bufs + v_bufs) and all(
        stride * size % 16 == 0 for stride in first.stride()[:2])
    upcast, precision = dot_mode(q.dtype, first.dtype)
    _, pv_precision = dot_mode(torch.float32)
    qk_scale = float(scaling)
    scale_log2 = math.log2(math.e) * (1.0 if softcap else qk_scale)
    block_d = max(16, triton.next_power_of_2(d))
    _cell_attention_kernel[(b, h, splits)](
        q, k_table, v_table, older_slots, order, offsets, out_part, lse_part,
        layer, num_older, h, group, d, qk_scale, float(softcap), scale_log2,
        q.stride(0), q.stride(1), *older_slots.stride(), *order.stride(), *offsets.stride(),
        first.stride(0), first.stride(1), KV=_TL_DTYPES[first.dtype], ALIGNED=aligned,
        SOFTCAP=bool(softcap),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=upcast, PRECISION=precision, PV_PRECISION=pv_precision, **tile,
    )
    _cell_combine_kernel[(b * h_q,)](
        out_part, lse_part, out, lse, splits, d,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4,
    )
    return out, lse


def cell_attention(q, k_buffers, v_buffers, older_slots, order, offsets, layer: int,
                   scaling: float, softcap: float = 0.0):
    """The cells' part of decode attention, by the ops' backend choice (vase_sglang.ops:
    Triton on CUDA, the torch reference elsewhere, VASE_KERNELS overrides). Same arguments
    and results as cell_attention_reference."""
    from . import kernel_backend

    fn = cell_attention_triton if kernel_backend(q.device) == "triton" else cell_attention_reference
    return fn(q, k_buffers, v_buffers, older_slots, order, offsets, layer, scaling, softcap)
