"""Shared fixtures: a tiny local model and real SGLang servers started per test module."""

from __future__ import annotations

import os

# Kernel tests run Triton through its CPU interpreter; this must be set before any module
# defines a @triton.jit kernel. Server subprocesses get it removed (see servers.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vase_sglang.tiny_model import build_tiny_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """bf16 tiny Qwen3 (2 layers, 4 q / 2 kv heads, head_dim 32)."""
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3"))


@pytest.fixture(scope="session")
def tiny_model_fp32(tmp_path_factory) -> str:
    """fp32 tiny Qwen3 with larger weights, so greedy decisions have clear margins and
    reordered float sums cannot flip them."""
    return str(
        build_tiny_qwen3(
            tmp_path_factory.mktemp("models") / "tiny-qwen3-fp32", dtype="float32", init_std=0.1
        )
    )
