"""vase_sglang.warmup: after warm_up, a server's eviction steps compile no Triton kernel.

The GPU stand-in: Triton's real compiler for sm_80 through vase_sglang.ops.aot's fixed-target
driver (launches skipped), in a subprocess without TRITON_INTERPRET (conftest.py sets it here,
which makes the kernels interpreted at import). The ops' dispatch is forced to Triton there (on
CPU tensors it would pick torch). Compilations are counted in the kernels' own caches
(warmup.compiled_kernels). Negative controls: without warm_up the same steps compile every
kernel, and with the kernels' do_not_specialize lists emptied (as before warm-up existed) a
warm-up at the scratch shapes does not cover the shapes a server produces.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from vase_sglang import EvictionConfig, warmup
from vase_sglang.policies import POLICIES
from vase_sglang.chunk import KVShapes

ROOT = Path(__file__).resolve().parents[1]
TINY = KVShapes(kv_heads=2, q_heads=4, head_dim=32, kv_dtype=torch.bfloat16,
                q_dtype=torch.bfloat16, ring_window=16)

# Qwen3-4B's attention (8 KV / 32 query heads, head dim 128, bf16), a vase-attnv server with
# trimkv's gates and 16-token pages: every kernel, the side buffers' and the paged copy.
# warmup.probe: the chunks a server runs later, at candidate counts the scratch never had (the
# steady n = budget, early evictions, a long prompt's first), per-request budgets and windows,
# every policy, other chunk layouts, the paged copy wherever the kept count or n is off a page.
_SCRIPT = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from vase_sglang import EvictionConfig, ops, warmup
from vase_sglang.ops import aot
from vase_sglang.chunk import KVShapes

ops.kernel_backend = lambda device: "triton"  # CPU tensors, compiled kernels (launch skipped)
shapes = KVShapes(kv_heads=8, q_heads=32, head_dim=128, kv_dtype=torch.bfloat16,
                  q_dtype=torch.bfloat16, ring_window=64)
cfg = EvictionConfig(policy="vase-attnv", budget=1024, window=64, sinks=4)
server = dict(retention=True, page_size=16)


def specialise_again():
    # The kernels as before warm-up existed: every argument specialised (integer 1 / multiple
    # of 16 / other, pointer alignment).
    for name in warmup.KERNEL_MODULES:
        module = sys.modules[f"vase_sglang.ops.{name}"]
        for fn in vars(module).values():
            for param in getattr(fn, "params", []):
                param.do_not_specialize = param.do_not_specialize_on_alignment = False


out = {}
with aot.compile_for(80):
    out["cold"] = warmup.probe(cfg, shapes, "cpu", **server)
with aot.compile_for(80):
    out["warm_up"] = warmup.warm_up(cfg, shapes, "cpu", **server)
    out["warm"] = warmup.probe(cfg, shapes, "cpu", **server)
specialise_again()
with aot.compile_for(80):
    out["specialised_warm_up"] = warmup.warm_up(cfg, shapes, "cpu", **server)
    out["specialised"] = warmup.probe(cfg, shapes, "cpu", **server)
print(json.dumps(out))
"""


def _run_compiled(timeout):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VASE_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_after_warm_up_no_step_compiles_a_kernel():
    out = _run_compiled(timeout=600)
    every = {"_value_range_kernel", "_window_lse_kernel", "_window_score_kernel",
             "_cur_leverage_kernel", "_compact_kernel"}
    # Negative control: without warm-up, the first steps compile every kernel (the compaction
    # twice: K/V and trimkv's float32 side buffers of head dim 1).
    cold = out["cold"]["compiled"]
    assert set(cold) == every and cold["_compact_kernel"] == 2, out
    # warm_up compiles exactly those, once each, for all nine policies ...
    wu = out["warm_up"]
    assert wu["backend"] == "triton" and not wu["errors"], wu
    assert set(wu["policies"]) == set(POLICIES) and wu["compiled"] == cold, wu
    # ... and afterwards no step compiles anything.
    assert out["warm"]["steps"] == out["cold"]["steps"] > 40 and out["warm"]["compiled"] == {}, out
    # Negative control: specialised as before, the scratch shapes do not cover the server's.
    assert sum(out["specialised"]["compiled"].values()) > 0, out


def test_allowed_policies():
    query = EvictionConfig(policy="snapkv", budget=64, window=8)
    assert warmup.allowed_policies(query) == ["snapkv"] + [
        p for p in POLICIES if p not in ("snapkv", "trimkv")]
    assert "trimkv" in warmup.allowed_policies(query, retention=True)
    no_query = EvictionConfig(policy="vase-dkv", budget=64, window=8)
    allowed = warmup.allowed_policies(no_query)
    assert allowed[0] == "vase-dkv" and not any(POLICIES[p].needs_queries for p in allowed)
    assert "curdkv" in allowed and "random" in allowed
    assert warmup.allowed_policies(EvictionConfig(policy="full")) == []


def test_on_the_torch_backend_it_is_one_cheap_step(monkeypatch):
    monkeypatch.delenv("VASE_KERNELS", raising=False)  # auto: torch on CPU
    cfg = EvictionConfig(policy="vase-attnv", budget=48, window=16, sinks=4)
    warmup.warm_up(cfg, TINY, "cpu")  # the first call also pays torch's one-time imports
    start = time.perf_counter()
    result = warmup.warm_up(cfg, TINY, "cpu", retention=True, page_size=16)
    assert time.perf_counter() - start < 1.0
    assert result["backend"] == "torch" and result["steps"] == 1 and not result["errors"]
    assert result["policies"] == ["vase-attnv"] and result["compiled"] == {}
    assert "1 chunk steps" in result["summary"]
    assert warmup.warm_up(EvictionConfig(policy="full"), TINY, "cpu")["steps"] == 0


def test_scratch_steps_run_on_the_interpreted_kernels(monkeypatch):
    """The warm-up's own chunks, with the kernels actually computing (interpreter, ~20 s): all
    nine policies, both candidate counts, layouts and windows, trimkv's side buffers, the paged
    copy."""
    monkeypatch.setenv("VASE_KERNELS", "triton")
    cfg = EvictionConfig(policy="vase-attnv", budget=48, window=16, sinks=4)
    result = warmup.warm_up(cfg, TINY, "cpu", retention=True, page_size=16)
    assert result["backend"] == "triton" and not result["errors"], result
    assert result["policies"] == warmup.allowed_policies(cfg, retention=True)
    queries = sum(POLICIES[p].needs_queries for p in result["policies"])
    assert result["steps"] == 4 * len(result["policies"]) + 4 * queries  # + the odd window
    assert result["compiled"] == {}  # interpreted: nothing compiles


def test_a_failing_policy_is_recorded_not_raised(monkeypatch):
    monkeypatch.delenv("VASE_KERNELS", raising=False)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(POLICIES["vase-attnv"], "score", broken)
    result = warmup.warm_up(EvictionConfig(policy="vase-attnv", budget=48, window=16), TINY, "cpu")
    assert result["errors"] == {"vase-attnv": "RuntimeError: boom"} and result["policies"] == []
    assert "failed: vase-attnv" in result["summary"]
