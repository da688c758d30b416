"""Range(v) = max_d v[d] - min_d v[d] per (token, KV head): the VaSE value-magnitude score."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install: the reference works, the kernel is not defined
    triton = None


def value_range_reference(values: torch.Tensor) -> torch.Tensor:
    """values [..., H, n, D] -> [..., H, n] float32."""
    v = values.float()
    return v.amax(dim=-1) - v.amin(dim=-1)


if triton is not None:

    # Fuses the upcast, max and min over D into one read of V (the torch version makes an fp32
    # copy and reads it twice); each program handles BLOCK_R rows of the [rows, D] view.
    # rows (requests x layers x candidates x heads) is not specialised on: it changes with every
    # step's candidate count (vase_sglang/warmup.py).
    @triton.jit(do_not_specialize=["rows"])
    def _value_range_kernel(
        values, out, rows, d, stride_row, stride_d, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        col = tl.arange(0, BLOCK_D)
        mask = (row[:, None] < rows) & (col[None, :] < d)
        ptrs = values + row[:, None].to(tl.int64) * stride_row + col[None, :] * stride_d
        v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        hi = tl.max(tl.where(mask, v, float("-inf")), axis=1)
        lo = tl.min(tl.where(mask, v, float("inf")), axis=1)
        tl.store(out + row, hi - lo, mask=row < rows)


def value_range_triton(values: torch.Tensor) -> torch.Tensor:
    """Same contract as value_range_reference."""
    if not values.is_contiguous() and values.dim() >= 3 and values.transpose(-3, -2).is_contiguous():
        # Gathered pool rows viewed as [..., H, n, D]: read them in place, no reshape copy.
        return value_range_triton(values.transpose(-3, -2)).transpose(-2, -1)
    d = values.shape[-1]
    flat = values.reshape(-1, d)  # a view whenever the leading dims are mergeable
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=values.device)
    if flat.shape[0] > 0 and values.device.type != "meta":  # meta: memory planning, no launch
        block_r = 32
        _value_range_kernel[(triton.cdiv(flat.shape[0], block_r),)](
            flat, out, flat.shape[0], d, flat.stride(0), flat.stride(1),
            BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d),
        )
    return out.reshape(values.shape[:-1])
