"""SnapKV-style window-attention score of each candidate key, per KV head.

score[kv, i] = mean_{q in group(kv)} avgpool_i( mean_w softmax_i(logit(q_w, k_i) / tau) )
logit(q, k) = q . k * scaling, then cap * tanh(logit / cap) where the model soft-caps (cap > 0)

`scaling` and `cap` are the layer's own (SGLang's RadixAttention.scaling / logit_cap: e.g. Granite's
attention_multiplier, Gemma-2's query_pre_attn_scalar**-0.5 and 50.0 cap), applied as SGLang's
attention backends do (triton: qk *= sm_scale; qk = cap * tanh(qk / cap)); tau is VaSE's
temperature on top of the model's logits. scaling=None means 1/sqrt(D).

The softmax runs over the candidates only (the newest `window` tokens are not candidates), as in
the official VaSE engine. Pooling is avg_pool1d(kernel, stride 1, padding kernel//2) with zero
padding counted (torch's default), and q head h belongs to KV head h // (H_q / H_kv) (repeat_kv).
Mean over the window, pooling and group mean are all linear, so their order does not matter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernels are not defined
    triton = None


def _check_logit_params(scaling, softcap) -> None:
    if scaling is not None and not (math.isfinite(scaling) and scaling > 0):
        raise ValueError(f"scaling: must be a finite number > 0 or None, got {scaling!r}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be a finite number >= 0 (0 = off), got {softcap!r}")


def window_attention_reference(
    queries: torch.Tensor, keys: torch.Tensor, *, temperature: float = 1.0, pool_kernel: int = 5,
    scaling: float | None = None, softcap: float = 0.0,
) -> torch.Tensor:
    """queries [..., H_q, W, D], keys [..., H_kv, n, D] -> [..., H_kv, n] float32."""
    *batch, h_q, w, d = queries.shape
    h_kv, n = keys.shape[-3], keys.shape[-2]
    _check_logit_params(scaling, softcap)
    group = h_q // h_kv
    q = queries.float().reshape(*batch, h_kv, group * w, d)
    qk = torch.matmul(q, keys.float().transpose(-1, -2))
    if softcap:
        scale = 1.0 / math.sqrt(d) if scaling is None else scaling
        logits = softcap * torch.tanh(qk * scale / softcap) / temperature
    else:  # one division, as before scaling existed: the 1/sqrt(D) scores stay bit-identical
        logits = qk / (math.sqrt(d) * temperature if scaling is None else temperature / scaling)
    probs = torch.softmax(logits, dim=-1).mean(dim=-2)  # mean over group and window: [..., H_kv, n]
    if pool_kernel > 1:
        flat = probs.reshape(-1, 1, n)
        flat = F.avg_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2)
        probs = flat.reshape(*batch, h_kv, n)
    return probs


if triton is not None:

    @triton.jit
    def _query_rows(q, b, kv, r, rows, w, group, d, sq_b, sq_h, sq_w, sq_d, BLOCK_D: tl.constexpr):
        """fp32 tile [rows r, BLOCK_D] of the window queries of KV head kv: row r is window
        query r % w of q head kv * group + r // w (the GQA group is contiguous, as in repeat_kv)."""
        dd = tl.arange(0, BLOCK_D)
        head = (kv * group + r // w).to(tl.int64)
        ptrs = q + b.to(tl.int64) * sq_b + head[:, None] * sq_h + (r % w)[:, None] * sq_w
        mask = (r[:, None] < rows) & (dd[None, :] < d)
        return tl.load(ptrs + dd[None, :] * sq_d, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _key_rows(k, b, kv, pos, n, d, sk_b, sk_h, sk_n, sk_d, BLOCK_D: tl.constexpr):
        """fp32 tile [positions pos, BLOCK_D] of the keys of KV head kv, zero outside [0, n)."""
        dd = tl.arange(0, BLOCK_D)
        ptrs = k + b.to(tl.int64) * sk_b + kv.to(tl.int64) * sk_h + pos[:, None].to(tl.int64) * sk_n
        mask = (pos[:, None] >= 0) & (pos[:, None] < n) & (dd[None, :] < d)
        return tl.load(ptrs + dd[None, :] * sk_d, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _tanh(x):
        # tanh as a scaled sigmoid, exactly as SGLang's triton attention kernels soft-cap (fp32).
        return 2 * tl.sigmoid(2 * x) - 1

    @triton.jit
    def _logits_log2(qt, kt, qk_scale, softcap, scale_log2, SOFTCAP: tl.constexpr):
        """The model's attention logits of a [rows, keys] tile, divided by the temperature and
        in base 2 (scale_log2 = log2(e) / tau with a soft-cap, log2(e) * scaling / tau without)."""
        s = tl.dot(qt, tl.trans(kt), input_precision="ieee")
        if SOFTCAP:
            s = softcap * _tanh(s * qk_scale / softcap)
        return s * scale_log2

    # Pass 1 fuses QK^T with an online softmax over n: it keeps, per window query, a running max
    # and sum instead of materialising the [H_q, W, n] logits; it writes log2-sum-exp2 per row.
    @triton.jit
    def _window_lse_kernel(
        q, k, lse, rows, w, n, d, group, h_kv, qk_scale, softcap, scale_log2,
        sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n, sk_d,
        SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0) // h_kv
        kv = tl.program_id(0) % h_kv
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        qt = _query_rows(q, b, kv, r, rows, w, group, d, sq_b, sq_h, sq_w, sq_d, BLOCK_D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, n, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            kt = _key_rows(k, b, kv, pos, n, d, sk_b, sk_h, sk_n, sk_d, BLOCK_D)
            s = _logits_log2(qt, kt, qk_scale, softcap, scale_log2, SOFTCAP)
            s = tl.where(pos[None, :] < n, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
            m_i = m_new
        out = lse + (b * h_kv + kv).to(tl.int64) * rows + r
        tl.store(out, m_i + tl.log2(l_i), mask=r < rows)

    # Pass 2 fuses the softmax, the mean over GQA group and window, and the avg-pool: each
    # program recomputes the probabilities of a block of keys plus a halo of HALF keys per side
    # (zero outside [0, n), which is the pool's zero padding), then pools them with a banded
    # [BLOCK_N, BLOCK_N] matrix and writes only the interior, so no [H_q, W, n] tensor exists.
    @triton.jit
    def _window_score_kernel(
        q, k, lse, out, rows, w, n, d, group, h_kv, qk_scale, softcap, scale_log2,
        sq_b, sq_h, sq_w, sq_d, sk_b, sk_h, sk_n, sk_d,
        SOFTCAP: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0) // h_kv
        kv = tl.program_id(0) % h_kv
        i = tl.arange(0, BLOCK_N)
        pos = tl.program_id(1) * (BLOCK_N - 2 * HALF) - HALF + i
        kt = _key_rows(k, b, kv, pos, n, d, sk_b, sk_h, sk_n, sk_d, BLOCK_D)
        in_range = (pos >= 0) & (pos < n)
        row_lse = lse + (b * h_kv + kv).to(tl.int64) * rows
        raw = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(0, rows, BLOCK_M):
            r = m0 + tl.arange(0, BLOCK_M)
            qt = _query_rows(q, b, kv, r, rows, w, group, d, sq_b, sq_h, sq_w, sq_d, BLOCK_D)
            s = _logits_log2(qt, kt, qk_scale, softcap, scale_log2, SOFTCAP)
            row_ok = r < rows
            l_r = tl.load(row_lse + r, mask=row_ok, other=0.0)
            p = tl.where(row_ok[:, None] & in_range[None, :], tl.exp2(s - l_r[:, None]), 0.0)
            raw += tl.sum(p, axis=0)
        raw = raw / rows
        band = tl.abs(i[:, None] - i[None, :]) <= HALF
        pooled = tl.sum(tl.where(band, raw[None, :], 0.0), axis=1) / (2 * HALF + 1)
        interior = (i >= HALF) & (i < BLOCK_N - HALF) & in_range
        tl.store(out + (b * h_kv + kv).to(tl.int64) * n + pos, pooled, mask=interior)


def window_attention_triton(
    queries: torch.Tensor, keys: torch.Tensor, *, temperature: float = 1.0, pool_kernel: int = 5,
    scaling: float | None = None, softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as window_attention_reference (pool_kernel odd, >= 1)."""
    *batch, h_q, w, d = queries.shape
    h_kv, n = keys.shape[-3], keys.shape[-2]
    if h_q % h_kv or pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"need H_q % H_kv == 0, odd pool_kernel: {h_q}, {h_kv}, {pool_kernel}")
    _check_logit_params(scaling, softcap)
    q = queries.reshape(-1, h_q, w, d)
    k = keys.reshape(-1, h_kv, n, d)
    bt, rows = q.shape[0], (h_q // h_kv) * w
    out = torch.empty(bt, h_kv, n, dtype=torch.float32, device=keys.device)
    if out.numel() == 0:
        return out.reshape(*batch, h_kv, n)
    lse = torch.empty(bt, h_kv, rows, dtype=torch.float32, device=keys.device)
    if keys.device.type == "meta":
        return out.reshape(*batch, h_kv, n)  # memory planning: the same allocations, no launch
    half = pool_kernel // 2
    block_d = max(16, triton.next_power_of_2(d))
    block_m = 32 if block_d <= 128 else 16
    block_n = max(64, triton.next_power_of_2(4 * half))
    qk_scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    if softcap:
        scale_log2 = math.log2(math.e) / temperature
    elif scaling is None:
        scale_log2 = math.log2(math.e) / (math.sqrt(d) * temperature)
    else:
        scale_log2 = math.log2(math.e) * scaling / temperature
    common = (
        rows, w, n, d, h_q // h_kv, h_kv, qk_scale, float(softcap), scale_log2,
        *q.stride(), *k.stride(),
    )
    _window_lse_kernel[(bt * h_kv, triton.cdiv(rows, block_m))](
        q, k, lse, *common, SOFTCAP=bool(softcap), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    _window_score_kernel[(bt * h_kv, triton.cdiv(n, block_n - 2 * half))](
        q, k, lse, out, *common, SOFTCAP=bool(softcap), HALF=half, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d,
    )
    return out.reshape(*batch, h_kv, n)
