"""tests/conftest.py's order of the modules that share servers: every module once, and fewer
shared servers alive at once than in collection order."""

from conftest import shared_server_order

# The modules of this suite that share servers (as of this writing), in collection order, with
# the servers they use.
USES = {
    "test_admission": {"radix_off"},
    "test_bad_inputs": {"snapkv"},
    "test_frontend": {"vase"},
    "test_metrics": {"snapkv"},
    "test_paged": {"paged", "snapkv"},
    "test_request_control": {"snapkv", "stock", "vase"},
    "test_server_eviction": {"radix_off", "snapkv"},
    "test_server_exactness": {"snapkv", "stock"},
    "test_server_trimkv": {"paged"},
}


def _most_alive(order, uses):
    """A shared server is alive from its first user to its last, in this order."""
    span = {}
    for i, module in enumerate(order):
        for server in uses[module]:
            span[server] = (span.get(server, (i, i))[0], i)
    return max(sum(a <= i <= b for a, b in span.values()) for i in range(len(order)))


def test_order_keeps_fewer_shared_servers_alive():
    order = shared_server_order(USES)
    assert sorted(order) == sorted(USES)
    assert _most_alive(list(USES), USES) == 5  # collection order
    assert _most_alive(order, USES) == 3


def test_order_of_independent_modules_is_collection_order():
    uses = {"a": {"x"}, "b": {"y"}, "c": {"x"}}
    assert shared_server_order(uses) == ["a", "c", "b"]  # x stops before y starts
    assert shared_server_order({"a": {"x"}, "b": {"x"}}) == ["a", "b"]


def test_workers_without_loadgroup_are_refused():
    """-n with another distribution would put a shared server's tests on both workers."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
           os.path.join(here, "test_suite_grouping.py"), "-k", "collection_order"]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "with -n, use --dist loadgroup" in refused.stdout + refused.stderr
    # with --dist loadgroup it runs (one worker is enough to check the grouping)
    ok = subprocess.run(cmd + ["-n", "1", "--dist", "loadgroup"], env=env, capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
