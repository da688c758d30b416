"""CUR leverage score (CurDKV / VaSE-DKV): ||k_i G||^2 * ||v_i G||^2, normalised over tokens.

G [..., D, r] is a Gaussian projection shared by the KV heads of one (request, layer).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernel is not defined
    triton = None


def cur_leverage_reference(
    keys: torch.Tensor, values: torch.Tensor, projection: torch.Tensor
) -> torch.Tensor:
    """keys, values [..., H, n, D], projection [..., D, r] -> [..., H, n] float32, sums to 1 over n."""
    g = projection.float().unsqueeze(-3)  # broadcast over heads
    k2 = torch.matmul(keys.float(), g).square().sum(dim=-1)
    v2 = torch.matmul(values.float(), g).square().sum(dim=-1)
    score = k2 * v2
    return score / score.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


if triton is not None:

    # Fuses both projections (K G and V G), their squared row norms and the product into one
    # pass over K and V per block of tokens; the two [n, r] projections never reach memory.
    @triton.jit
    def _cur_leverage_kernel(
        keys, values, proj, out, h, n, d, r,
        sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sp_b, sp_d, sp_r,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        b = (tl.program_id(0) // h).to(tl.int64)
        head = (tl.program_id(0) % h).to(tl.int64)
        tok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        dd = tl.arange(0, BLOCK_D)
        rr = tl.arange(0, BLOCK_R)
        g_mask = (dd[:, None] < d) & (rr[None, :] < r)
        g_ptrs = proj + b * sp_b + dd[:, None] * sp_d + rr[None, :] * sp_r
        g = tl.load(g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
        mask = (tok[:, None] < n) & (dd[None, :] < d)
        row = tok[:, None].to(tl.int64)
        k_ptrs = keys + b * sk_b + head * sk_h + row * sk_n + dd[None, :] * sk_d
        v_ptrs = values + b * sv_b + head * sv_h + row * sv_n + dd[None, :] * sv_d
        kt = tl.load(k_ptrs, mask=mask, other=0.0)
        vt = tl.load(v_ptrs, mask=mask, other=0.0)
        kg = tl.dot(kt.to(tl.float32), g, input_precision="ieee")
        vg = tl.dot(vt.to(tl.float32), g, input_precision="ieee")
        score = tl.sum(kg * kg, axis=1) * tl.sum(vg * vg, axis=1)
        tl.store(out + (b * h + head) * n + tok, score, mask=tok < n)


def cur_leverage_triton(
    keys: torch.Tensor, values: torch.Tensor, projection: torch.Tensor
) -> torch.Tensor:
    """Same contract as cur_leverage_reference (projection broadcasts over keys' leading dims)."""
    *batch, h, n, d = keys.shape
    rank = projection.shape[-1]
    k = keys.reshape(-1, h, n, d)
    v = values.reshape(-1, h, n, d)
    g = projection.expand(*batch, d, rank).reshape(-1, d, rank)
    score = torch.empty(k.shape[0], h, n, dtype=torch.float32, device=keys.device)
    if score.numel() > 0 and keys.device.type != "meta":  # meta: memory planning, no launch
        block_n = 32
        _cur_leverage_kernel[(k.shape[0] * h, triton.cdiv(n, block_n))](
            k, v, g, score, h, n, d, rank, *k.stride(), *v.stride(), *g.stride(),
            BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(d)),
            BLOCK_R=max(16, triton.next_power_of_2(rank)),
        )
    score = score.reshape(*batch, h, n)
    return score / score.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
