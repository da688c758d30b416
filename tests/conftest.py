"""Shared fixtures: tiny local models, and the real SGLang servers that several test modules
share (each start costs ~25 s on a 2-core machine); other servers are started per module."""

from __future__ import annotations

import os

# Kernel tests run Triton through its CPU interpreter; this must be set before any module
# defines a @triton.jit kernel. Server subprocesses get it removed (see servers.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from servers import (PAGE, PAGED, RADIX_OFF, RADIX_OFF_POOL, VASE_ATTNV,  # noqa: E402
                     Server, snapkv_flags, trimkv_gates)
from vase_sglang.serving.tiny_model import build_tiny_qwen3  # noqa: E402


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
def tokenizer(tiny_model_fp32):
    """The fp32 tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_fp32)


@pytest.fixture(scope="session")
def hf_model(tiny_model_fp32):
    """The fp32 tiny model in transformers, the references' model (ReferenceDecoder only reads
    it, so modules can share one copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()


# Shared servers started so far, by fixture name; each is stopped right after the last test
# that uses it (pytest_runtest_teardown below), not at the end of the session, so that idle
# servers do not pile up in memory.
SHARED_SERVERS = ("snapkv_server", "stock_server", "radix_off_server", "vase_server",
                  "paged_server")
_shared: dict[str, Server] = {}
_last_user: dict[str, str] = {}


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(session, config, items):
    """Before the other implementations: groups for pytest-xdist's --dist loadgroup
    (scripts/test.sh runs 2 workers). A module never splits, so its module-scoped servers start
    once; modules sharing a session server form one group, so that server starts once, on one
    worker, which runs the group's tests in collection order. Without xdist the marks do
    nothing. Within a group the modules are reordered (shared_server_order) so that few shared
    servers are alive at once. After the other implementations (after `-m` / `-k` deselection
    and xdist's node ids): each shared server's last user."""
    modules = {}  # module name -> (its items, the shared servers they use)
    for item in items:
        tests, servers = modules.setdefault(item.module.__name__, ([], set()))
        tests.append(item)
        servers.update(name for name in SHARED_SERVERS if name in item.fixturenames)
    position = {name: i for i, name in enumerate(modules)}
    groups = {}  # a group's first module -> its modules, in collection order
    for name, (_, servers) in modules.items():
        joined = [first for first, members in groups.items()
                  if servers & set().union(*(modules[m][1] for m in members))]
        merged = [m for first in joined for m in groups.pop(first)] + [name]
        groups[merged[0]] = sorted(merged, key=position.get)
    reordered = []
    for first in sorted(groups, key=position.get):
        for module in shared_server_order({m: modules[m][1] for m in groups[first]}):
            for item in modules[module][0]:
                item.add_marker(pytest.mark.xdist_group(first))
                reordered.append(item)
    items[:] = reordered
    yield
    for item in items:
        for name in SHARED_SERVERS:
            if name in item.fixturenames:  # requested directly or through another fixture
                _last_user[name] = item.nodeid


def pytest_configure(config):
    """Under pytest-xdist a shared server is stopped after its last user only if all its users
    run on one worker (pytest_collection_modifyitems): refuse any other distribution."""
    if (getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER")
            and config.getoption("dist") != "loadgroup"):
        raise pytest.UsageError("tests/conftest.py: with -n, use --dist loadgroup (as "
                                "scripts/test.sh does): a shared server's tests must run on one "
                                "worker")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """...and a pytest-xdist that did not group: 3.8 with pytest 9 does not (it renames node ids
    through an attribute pytest 9 dropped)."""
    if ids and not any("@" in nodeid for nodeid in ids):
        raise pytest.UsageError(f"pytest-xdist did not group the tests (--dist loadgroup): no "
                                f"group in {ids[0]}; install the versions in requirements-cpu.txt")


def shared_server_order(uses: dict[str, set[str]]) -> list[str]:
    """The modules of a group (their shared servers, in collection order) in the order they run:
    each next module is the one that starts the fewest shared servers not yet running, and,
    among those, is the last user of the most running ones (so they stop), then the first
    collected. A greedy heuristic for few servers alive at once, not an optimum."""
    left, running, order = dict(uses), set(), []
    while left:
        def cost(module):
            others = set().union(*(s for m, s in left.items() if m != module))
            return len(left[module] - running), -len((left[module] & running) - others)
        module = min(left, key=cost)  # min keeps the first collected among equals
        order.append(module)
        servers = left.pop(module)
        running = (running | servers) & set().union(*left.values())
    return order


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
def snapkv_server(tiny_model_fp32, trimkv_gates_file):
    """tiny fp32 Qwen3, snapkv (SNAPKV), a decode log line every step, Prometheus metrics on,
    trimkv's gates loaded (so requests may ask for trimkv at pages of one token, and for its
    shared budget scopes: tests/test_server_shared_scope.py), and the test-only policies
    `test-permute` (tests/permute_policy.py) and `test-fault-*`
    (tests/fault_policy.py: a step that fails at a chosen stage) loaded, so requests can
    ask for them, and docs/add_policy.md's example `vatp` (examples/my_policy.py). Shared by
    every module that needs these settings; each module runs the idle leak check
    (wait_idle_checked) after its own requests."""
    # Its query rings are held in the pool (--kv-evict-ring pool), as on a server started
    # without --max-total-tokens; the other shared servers hold them beside their pools.
    flags = snapkv_flags(trimkv_gates_file)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    examples_dir = os.path.join(os.path.dirname(tests_dir), "examples")
    env = {"VASE_KV_EVICT_PLUGINS": "permute_policy,fault_policy,my_policy",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, examples_dir,
                                                       os.environ.get("PYTHONPATH")]))}
    yield from _shared_server("snapkv_server", tiny_model_fp32, flags, env=env)


@pytest.fixture(scope="session")
def stock_server(tiny_model_fp32):
    """tiny fp32 Qwen3 without --kv-evict-policy: stock SGLang with the plugin loaded."""
    yield from _shared_server("stock_server", tiny_model_fp32, ["--dtype", "float32"])


@pytest.fixture(scope="session")
def radix_off_server(tiny_model_fp32, trimkv_gates_file):
    """tiny fp32 Qwen3, --disable-radix-cache, vase-attnv (RADIX_OFF) on a RADIX_OFF_POOL-token
    pool, a decode log line every step, trimkv's gates loaded (so requests may ask for trimkv
    and its shared scopes)."""
    flags = ["--dtype", "float32", "--decode-log-interval", "1", "--disable-radix-cache",
             "--kv-evict-retention-gates", str(trimkv_gates_file)]
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

    from vase_sglang import gates

    config = AutoConfig.from_pretrained(tiny_model_fp32)
    path = tmp_path_factory.mktemp("gates") / "gates.safetensors"
    return gates.save_gates(path, trimkv_gates(config), config)


@pytest.fixture(scope="session")
def paged_server(tiny_model_fp32, trimkv_gates_file):
    """tiny fp32 Qwen3, --page-size 16, snapkv (PAGED), trimkv's gates loaded (so requests may
    ask for trimkv), a decode log line every step. Shared by test_paged and test_server_trimkv."""
    flags = ["--dtype", "float32", "--page-size", str(PAGE), "--decode-log-interval", "1",
             "--kv-evict-retention-gates", str(trimkv_gates_file)]
    for key, value in PAGED.items():
        flags += ["--kv-evict-" + key, str(value)]
    yield from _shared_server("paged_server", tiny_model_fp32, flags)
