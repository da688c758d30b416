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
    if kernel_backend(values.device) == "triton":
        from .value_range import value_range_triton

        return value_range_triton(values)
    return value_range_reference(values)


def window_attention(queries, keys, *, temperature: float = 1.0, pool_kernel: int = 5,
                     scaling: float | None = None, softcap: float = 0.0):
    """scaling, softcap: the model's attention logit scale (None = 1/sqrt(D)) and tanh soft-cap
    (0 = none); see window_attention.py."""
    kwargs = dict(temperature=temperature, pool_kernel=pool_kernel, scaling=scaling,
                  softcap=softcap)
    if kernel_backend(keys.device) == "triton":
        from .window_attention import window_attention_triton

        return window_attention_triton(queries, keys, **kwargs)
    return window_attention_reference(queries, keys, **kwargs)


def cur_leverage(keys, values, projection):
    if kernel_backend(keys.device) == "triton":
        from .cur_leverage import cur_leverage_triton

        return cur_leverage_triton(keys, values, projection)
    return cur_leverage_reference(keys, values, projection)


def compact_kv_(k_buffers, v_buffers, slots, keep, *, ascending: bool = True,
                first_layer: int = 0) -> None:
    """keep [B, L, H, K] applies to the pool layers first_layer .. first_layer + L - 1.
    ascending=False (keep not sorted per head): only the reference, which reads every
    source before writing, is safe in place."""
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
