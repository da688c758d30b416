"""Hot-path ops of an eviction step. Each op has a readable torch reference and a Triton kernel
side by side in its own module; these functions pick one per call.

Backend choice (`VASE_KERNELS` environment variable):
  auto (default)  Triton on CUDA tensors, torch elsewhere
  torch           always the torch reference
  triton          always Triton (on CPU this needs TRITON_INTERPRET=1; used by the tests)

Meta tensors (memory planning, vase_sglang/plan.py) take the backend of the device being
planned for (`planning_for`); the Triton wrappers then make their allocations and skip the launch.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from .compact import FP8_KV_DTYPES, compact_kv_reference_, stored
from .cur_leverage import cur_leverage_reference
from .value_range import value_range_reference
from .window_attention import window_attention_reference

logger = logging.getLogger(__name__)
_announced: set[str] = set()
_planned_device: str | None = None  # the device meta tensors stand for while planning


@contextlib.contextmanager
def planning_for(device: torch.device | str):
    """Ops on meta tensors take the backend they would take on `device`."""
    global _planned_device
    saved, _planned_device = _planned_device, torch.device(device).type
    try:
        yield
    finally:
        _planned_device = saved


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def kernel_backend(device: torch.device | str) -> str:
    """'triton' or 'torch': which implementation the ops use for tensors on `device`."""
    choice = os.environ.get("VASE_KERNELS", "auto").strip().lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"VASE_KERNELS: expected auto, torch or triton, got {choice!r}")
    device = torch.device(device)
    if device.type == "meta":
        planned = _planned_device or "cpu"
        if planned == "cuda" and choice != "torch" and _triton_available():
            return "triton"
        if choice == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
            return "triton"
        return "torch"
    if choice == "torch":
        backend = "torch"
    elif choice == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("VASE_KERNELS=triton on a non-CUDA device needs TRITON_INTERPRET=1")
        backend = "triton"
    else:
        backend = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if backend + device.type not in _announced:
        _announced.add(backend + device.type)
        logger.info("vase_sglang kernels: %s on %s", backend, device.type)
    return backend


def value_range(values: torch.Tensor) -> torch.Tensor:
    """VaSE's value range of each candidate: Range(v) = max_d v - min_d v.

    Args:
        values: [..., H, n, D] any float dtype (an fp8 view included); a gathered pool view
            [..., n, H, D] transposed to [..., H, n, D] is read in place by the kernel.

    Returns:
        [..., H, n] float32 (vase-attnv's value slots go to the largest).
    """
    if kernel_backend(values.device) == "triton":
        from .value_range import value_range_triton

        return value_range_triton(values)
    return value_range_reference(values)


def window_attention(queries, keys, *, temperature: float = 1.0, pool_kernel: int = 5,
                     scaling: float | None = None, softcap: float = 0.0):
    """SnapKV's window-attention score: the attention the last W queries give each candidate
    (softmax over the candidates only), averaged over the window and the GQA group, then
    avg-pooled along the candidates (window_attention.py has the formula).

    Args:
        queries: [..., H_q, W, D] the last W queries; query head h belongs to KV head
            h // (H_q / H_kv).
        keys: [..., H_kv, n, D] the candidates' keys, post-RoPE; same leading dims and D.
        temperature: divides the logits (VaSE's tau, on top of the model's own scaling).
        pool_kernel: odd avg-pool width along n (1: no smoothing).
        scaling: the model's logit scale, logit = q . k * scaling; None: 1/sqrt(D).
        softcap: the model's tanh soft-cap of the logits (Gemma-2); 0: none.

    Returns:
        [..., H_kv, n] float32, higher = more attended = keep (each row sums to 1 over n
        before the pooling).
    """
    kwargs = dict(temperature=temperature, pool_kernel=pool_kernel, scaling=scaling,
                  softcap=softcap)
    if kernel_backend(keys.device) == "triton":
        from .window_attention import window_attention_triton

        return window_attention_triton(queries, keys, **kwargs)
    return window_attention_reference(queries, keys, **kwargs)


def cur_leverage(keys, values, projection):
    """The CUR leverage score of vase-dkv and curdkv: ||k G||^2 ||v G||^2, normalised over n.

    Args:
        keys: [..., H, n, D] the candidates' keys.
        values: [..., H, n, D] their values.
        projection: [..., D, r] the Gaussian projection G (Draws.projection), shared by the
            KV heads of a layer (broadcast over H and over keys' leading dims).

    Returns:
        [..., H, n] float32 summing to 1 over n, higher = keep.
    """
    if kernel_backend(keys.device) == "triton":
        from .cur_leverage import cur_leverage_triton

        return cur_leverage_triton(keys, values, projection)
    return cur_leverage_reference(keys, values, projection)


def compact_kv_(k_buffers, v_buffers, slots, keep, *, ascending: bool = True,
                first_layer: int = 0) -> None:
    """Moves each (request, layer, KV head)'s kept tokens to the request's first K slots, in
    place: buffer[slots[b, j], h] <- buffer[slots[b, keep[b, l, h, j]], h] for K and V.

    Args:
        k_buffers, v_buffers: per-layer pool tensors [S, H, D] (one pool slot per row; 8-bit
            float pools are moved as bytes).
        slots: [B, n] the pool slots of each request's n candidates, in token order.
        keep: [B, L, H, K] candidate indices per (request, layer, head) (select_tokens'
            output), for the pool layers first_layer .. first_layer + L - 1.
        ascending: keep is sorted per head (the kernel relies on keep[j] >= j); False: only
            the reference, which reads every source before writing, is safe in place.
        first_layer: the pool layer keep[:, 0] is for.

    Returns:
        None (the buffers are written in place).
    """
    if ascending and kernel_backend(slots.device) == "triton":
        from .compact import compact_kv_triton_

        return compact_kv_triton_(k_buffers, v_buffers, slots, keep, first_layer)
    return compact_kv_reference_(k_buffers, v_buffers, slots, keep, first_layer)


__all__ = [
    "kernel_backend",
    "planning_for",
    "value_range",
    "window_attention",
    "cur_leverage",
    "compact_kv_",
    "value_range_reference",
    "window_attention_reference",
    "cur_leverage_reference",
    "compact_kv_reference_",
    "FP8_KV_DTYPES",
    "stored",
]
