"""Counter-based random numbers: every draw is a pure function of (seed, stream, index).

Why not torch.Generator: a batched eviction step scores many (request, layer) pairs at once, and
each must get its own reproducible stream, keyed by (seed, request, layer, round), independent of
which other requests share the batch and of the device. A 32-bit integer hash (lowbias32) over
int64 tensors gives that on any device with no host state.
"""

from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 without ever overflowing int64: split c into 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 finaliser on int64 tensors; input may be any int64, output in [0, 2**32)."""
    x = (x ^ (x >> 32)) & _M32  # fold the high half so 64-bit ids are not truncated
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def stream_key(seed: int, *parts, device=None) -> torch.Tensor:
    """Hash (seed, *parts) into one 32-bit key per element; seed (an int or an int tensor)
    and parts broadcast like tensors."""
    mask = (1 << 63) - 1
    if isinstance(seed, torch.Tensor):
        key = mix32(seed.to(device=device, dtype=torch.int64) & mask)
    else:
        # torch.full, not torch.tensor: a Python int becomes a fill on the device, not a
        # synchronising host-to-device copy (the eviction step must not block the CPU).
        key = mix32(torch.full((), seed & mask, dtype=torch.int64, device=device))
    for i, part in enumerate(parts):
        if isinstance(part, torch.Tensor):
            part = part.to(device=device, dtype=torch.int64)
        else:
            part = torch.full((), part, dtype=torch.int64, device=device) if isinstance(part, int) \
                else torch.as_tensor(part, dtype=torch.int64, device=device)
        key = mix32(key ^ mix32(part + 0x9E3779B9 * (i + 1)))
    return key


def uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float32 for each (key, index) pair; key and index broadcast, both int64."""
    bits = mix32(key ^ mix32(index + 0x632BE5AB))
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(key, index)))


def normal(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """N(0, 1) float32 by Box-Muller on two independent uniforms per index."""
    u1 = uniform(key, 2 * index)
    u2 = uniform(key, 2 * index + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
