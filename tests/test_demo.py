"""scripts/demo.py's launch flags: the demo's short answer must show evictions whichever
policy the user picks, and the user's own eviction flags win."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("demo", ROOT / "scripts" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


def _flags(args: list[str]) -> dict[str, str]:
    out, k = {}, 0
    while k < len(args):
        if "=" in args[k]:
            key, value = args[k].split("=", 1)
            out[key] = value
            k += 1
        else:
            out[args[k]] = args[k + 1]
            k += 2
    return out


def test_no_policy_serves_vase_attnv_at_the_demo_budget():
    assert _flags(demo.demo_eviction_flags([])) == {
        "--kv-evict-policy": "vase-attnv", "--kv-evict-budget": "128", "--kv-evict-window": "32"}


def test_a_chosen_policy_gets_the_demo_budget_unless_it_gives_one():
    # at the server's default budget (1024) a ~200-token answer would evict nothing
    got = _flags(demo.demo_eviction_flags(["--kv-evict-policy", "trimkv"]))
    assert got == {"--kv-evict-policy": "trimkv", "--kv-evict-budget": "128",
                   "--kv-evict-window": "32"}
    got = _flags(demo.demo_eviction_flags(["--kv-evict-policy=snapkv", "--kv-evict-budget=64",
                                           "--port", "3000"]))
    assert got == {"--kv-evict-policy": "snapkv", "--kv-evict-budget": "64",
                   "--kv-evict-window": "32", "--port": "3000"}


def test_full_cache_gets_no_eviction_flags():
    assert demo.demo_eviction_flags(["--kv-evict-policy", "full"]) == [
        "--kv-evict-policy", "full"]
