"""Shared fixtures: tiny local models, and the real SGLang servers that several test modules
share (each start costs ~25 s on a 2-core machine); other servers are started per module."""

from __future__ import annotations

import os

# Kernel tests run Triton through its CPU interpreter; this must be set before any module
# defines a @triton.jit kernel. Server subprocesses get it removed (see servers.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from servers import (PAGE, PAGED, RADIX_OFF, RADIX_OFF_POOL, SNAPKV, VASE_ATTNV,  # noqa: E402
                     Server, trimkv_gates)
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


# Shared servers started so far, by fixture name; each is stopped right after the last test
# that uses it (pytest_runtest_teardown below), not at the end of the session, so that idle
# servers do not pile up in memory.
SHARED_SERVERS = ("snapkv_server", "stock_server", "radix_off_server", "vase_server",
                  "paged_server")
_shared: dict[str, Server] = {}
_last_user: dict[str, str] = {}


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselection
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for name in SHARED_SERVERS:
            if name in item.fixturenames:  # requested directly or through another fixture
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    for name, nodeid in _last_user.items():
        if nodeid == item.nodeid and name in _shared:
            _shared.pop(name).stop()


def _shared_server(name, model, flags, **kwargs):
    with Server(model, flags, timeout=600, **kwargs) as server:
        _shared[name] = server
        yield server
        _shared.pop(name, None)


@pytest.fixture(scope="session")
def snapkv_server(tiny_model_fp32):
    """tiny fp32 Qwen3, snapkv (SNAPKV), a decode log line every step, Prometheus metrics on,
    and the test-only policy `test-permute` (tests/permute_policy.py) loaded, so requests can
    ask for it. Shared by every module that needs these settings; each module runs the idle
    leak check (wait_idle_checked) after its own requests."""
    flags = ["--dtype", "float32", "--decode-log-interval", "1", "--enable-metrics"]
    for key, value in SNAPKV.items():
        flags += ["--kv-evict-" + key, str(value)]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {"VASE_KV_EVICT_PLUGINS": "permute_policy",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    yield from _shared_server("snapkv_server", tiny_model_fp32, flags, env=env)


@pytest.fixture(scope="session")
def stock_server(tiny_model_fp32):
    """tiny fp32 Qwen3 without --kv-evict-policy: stock SGLang with the plugin loaded."""
    yield from _shared_server("stock_server", tiny_model_fp32, ["--dtype", "float32"])


@pytest.fixture(scope="session")
def radix_off_server(tiny_model_fp32):
    """tiny fp32 Qwen3, --disable-radix-cache, vase-attnv (RADIX_OFF) on a RADIX_OFF_POOL-token
    pool, a decode log line every step."""
    flags = ["--dtype", "float32", "--decode-log-interval", "1", "--disable-radix-cache"]
    for key, value in RADIX_OFF.items():
        flags += ["--kv-evict-" + key, str(value)]
    yield from _shared_server("radix_off_server", tiny_model_fp32, flags,
                              max_total_tokens=RADIX_OFF_POOL)


@pytest.fixture(scope="session")
def vase_server(tiny_model_fp32):
    """tiny fp32 Qwen3, vase-attnv (VASE_ATTNV), SGLang's sampling generator seeded
    (--random-seed 0) for the frontend programs, which cannot send per-request seeds."""
    flags = ["--dtype", "float32", "--random-seed", "0"]
    for key, value in VASE_ATTNV.items():
        flags += ["--kv-evict-" + key, str(value)]
    yield from _shared_server("vase_server", tiny_model_fp32, flags)


@pytest.fixture(scope="session")
def trimkv_gates_file(tiny_model_fp32, tmp_path_factory):
    """servers.trimkv_gates (seed 7) for the tiny fp32 model, saved as a gates file."""
    from transformers import AutoConfig

    from vase_sglang import retention

    config = AutoConfig.from_pretrained(tiny_model_fp32)
    path = tmp_path_factory.mktemp("gates") / "gates.safetensors"
    return retention.save_gates(path, trimkv_gates(config), config)


@pytest.fixture(scope="session")
def paged_server(tiny_model_fp32, trimkv_gates_file):
    """tiny fp32 Qwen3, --page-size 16, snapkv (PAGED), trimkv's gates loaded (so requests may
    ask for trimkv), a decode log line every step. Shared by test_paged and test_server_trimkv."""
    flags = ["--dtype", "float32", "--page-size", str(PAGE), "--decode-log-interval", "1",
             "--kv-evict-retention-gates", str(trimkv_gates_file)]
    for key, value in PAGED.items():
        flags += ["--kv-evict-" + key, str(value)]
    yield from _shared_server("paged_server", tiny_model_fp32, flags)
