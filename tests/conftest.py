"""Shared fixtures: tiny local models, and the real SGLang servers that several test modules
share (each start costs ~25 s on a 2-core machine); other servers are started per module."""

from __future__ import annotations

import os

# Kernel tests run Triton through its CPU interpreter; this must be set before any module
# defines a @triton.jit kernel. Server subprocesses get it removed (see servers.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from servers import SNAPKV, Server  # noqa: E402
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


@pytest.fixture(scope="session")
def snapkv_server(tiny_model_fp32):
    """tiny fp32 Qwen3, snapkv (SNAPKV), a decode log line every step, Prometheus metrics on.
    Shared by every module that needs these settings; each module runs the idle leak check
    (wait_idle_checked) after its own requests."""
    flags = ["--dtype", "float32", "--decode-log-interval", "1", "--enable-metrics"]
    for key, value in SNAPKV.items():
        flags += ["--kv-evict-" + key, str(value)]
    with Server(tiny_model_fp32, flags, timeout=600) as server:
        yield server


@pytest.fixture(scope="session")
def stock_server(tiny_model_fp32):
    """tiny fp32 Qwen3 without --kv-evict-policy: stock SGLang with the plugin loaded."""
    with Server(tiny_model_fp32, ["--dtype", "float32"], timeout=600) as server:
        yield server
