"""vase-sglang: Value-aware Stochastic KV-cache Eviction (VaSE) for SGLang.

Engine-free core (this package): `EvictionConfig`, the policies and `select_tokens`, and the
scoring / compaction ops (torch references and Triton kernels side by side in `ops/`).
The SGLang hooks live in the separate package `vase_sglang_patches` (folder `patches/`).
"""

from .config import EvictionConfig
from .ops import kernel_backend
from .policies import (
    POLICIES,
    POLICY_NAMES,
    AttentionParams,
    Draws,
    Policy,
    Retention,
    SelectParams,
    policy_names,
    register_policy,
    select_tokens,
)

__version__ = "0.1.0"

__all__ = [
    "EvictionConfig",
    "POLICY_NAMES",
    "POLICIES",
    "Policy",
    "Retention",
    "Draws",
    "AttentionParams",
    "SelectParams",
    "select_tokens",
    "policy_names",
    "register_policy",
    "kernel_backend",
    "__version__",
]
