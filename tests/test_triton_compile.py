"""Every Triton kernel compiles ahead of time for sm_80, sm_90 and sm_100 through the project's own
launch wrappers, within each architecture's shared-memory and register limits and without a
single register spill (vase_sglang.ops.aot --strict; no GPU needed: a driver reporting a fixed
target, launches skipped). CI compiles sm_80 in bf16 and fp32; the whole matrix is
`pytest -m slow`. Both failure modes have a negative control: tiles forced wide enough to
need more shared memory than sm_80 has, and tiles forced large enough to spill.

The compile runs in a subprocess: conftest.py sets TRITON_INTERPRET=1 for this process, which
makes every kernel an interpreted function at import.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vase_sglang.ops import aot

ROOT = Path(__file__).resolve().parents[1]
KERNELS_OF = {
    "value_range_triton": {"_value_range_kernel"},
    "window_attention_triton": {"_window_lse_kernel", "_window_score_kernel"},
    "cur_leverage_triton": {"_cur_leverage_kernel"},
    "compact_kv_triton_": {"_compact_kernel"},
    "cell_attention_triton": {"_cell_attention_kernel", "_cell_combine_kernel"},
}


SCORING = {"_window_lse_kernel", "_window_score_kernel", "_cur_leverage_kernel"}


def _compile(tmp_path, *args, timeout, tiles=None):
    """vase_sglang.ops.aot in a fresh process. tiles: {width: changes} applied to window
    attention's TILES first (the negative controls' deliberately oversized tiles)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VASE_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = tmp_path / "compile.json"
    argv = ["--json", str(out), *args]
    # import_module: the package's function window_attention shadows the submodule's name.
    code = ("import importlib, sys\n"
            "from vase_sglang.ops import aot\n"
            "window_attention = importlib.import_module('vase_sglang.ops.window_attention')\n"
            f"for width, changes in {tiles or {}!r}.items():\n"
            "    window_attention.TILES[width].update(changes)\n"
            f"sys.exit(aot.main({argv!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def _check_matrix(tmp_path, archs, dtypes, head_dims=aot.HEAD_DIMS):
    jobs = min(len(archs), os.cpu_count() or 1)  # one process per architecture
    proc, report = _compile(tmp_path, "--strict", "--jobs", str(jobs), "--arch",
                            ",".join(map(str, archs)), "--dtype", ",".join(dtypes),
                            "--head-dim", ",".join(map(str, head_dims)), timeout=1500)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    seen = {}
    for r in report["kernels"]:
        seen.setdefault((r["wrapper"], r["arch"], r["dtype"], r["head_dim"]), set()).add(r["kernel"])
        assert r["problems"] == [], r
        # No spills: the scoring kernels are the hard requirement (docs/gpu.md); value range
        # and compaction spill nothing either today, so --strict holds them to it too.
        assert r["spill_instructions"] == 0 and r["warnings"] == [], r
        assert 0 <= r["shared"] <= aot.SHARED_LIMIT[r["arch"]], r
        assert 0 < r["registers"] <= aot.MAX_REGS_PER_THREAD, r  # > 0: cuobjdump was parsed
        assert r["num_warps"] * 32 * r["registers"] <= aot.MAX_REGS_PER_BLOCK, r
    # Every wrapper (a "+softcap" variant launches the same kernels) at every combination.
    combos = [c for c in itertools.product(aot.WRAPPERS, archs, dtypes, head_dims)
              if aot.served_on(c[1], c[2])]
    assert seen == {combo: KERNELS_OF[combo[0].split("+")[0]] for combo in combos}
    assert SCORING <= {r["kernel"] for r in report["kernels"]}


def test_every_kernel_compiles_for_sm80_bf16_fp32_every_head_dim(tmp_path):
    # CI's share of the matrix below (~1/4.5 of its compile time): sm_80 has the smallest
    # shared memory per block (163 KiB), fp32 the largest tiles, bf16 is what GPUs serve.
    _check_matrix(tmp_path, [80], ["bf16", "fp32"])


@pytest.mark.slow
def test_every_kernel_compiles_for_every_arch_dtype_and_head_dim(tmp_path):
    # A cold compile of all 189 kernels took 100 s in one process (docs/gpu.md).
    _check_matrix(tmp_path, list(aot.ARCHS), list(aot.DTYPES))


def test_fp8_kv_kernels_compile_where_served_and_e4m3_cannot_on_sm80(tmp_path):
    """--kv-cache-dtype fp8_e5m2 from sm_80 and fp8_e4m3 from sm_89 (K/V in 8 bits, queries in
    bf16), head dim 128, no spills. Triton has no e4m3 below sm_89, which is why the server
    refuses fp8_e4m3 there with the Triton kernels: compiling it for sm_80 fails."""
    _check_matrix(tmp_path, [80, 90], ["fp8e5m2", "fp8e4m3"], head_dims=[128])
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VASE_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = ("import torch\n"
            "from vase_sglang.ops import aot\n"
            "with aot.compile_for(80):\n"
            "    aot.WRAPPERS['value_range_triton'](torch.float8_e4m3fn, 128)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "fp8e4nv not supported in this architecture" in proc.stderr, (
        proc.stderr[-3000:])


def test_head_dim_512_fits_but_an_untiled_head_dim_fails_the_shared_memory_limit(tmp_path):
    # The head dim is tiled (BLOCK_D <= 64), so D 512 needs no more shared memory than D 64.
    # Forced back to one [rows, 512] tile (BLOCK_D 512, as before the tiling), window attention
    # needs 256 KiB, above the 163 KiB an sm_80 block can have: the check must flag it, exit 1.
    args = ("--arch", "80", "--dtype", "bf16", "--head-dim", "512", "--wrapper",
            "window_attention_triton")
    proc, report = _compile(tmp_path, *args, timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert all(not r["problems"] and r["shared"] <= 64 * 1024 for r in report["kernels"])
    proc, report = _compile(tmp_path, *args, timeout=900, tiles={2: {"BLOCK_D": 512}})
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    over = {r["kernel"]: r for r in report["kernels"] if r["problems"]}
    assert "_window_lse_kernel" in over, report["kernels"]
    lse = over["_window_lse_kernel"]
    assert lse["shared"] > aot.SHARED_LIMIT[80]
    assert any("shared memory" in p for p in lse["problems"])


def test_strict_fails_on_spills_of_oversized_tiles(tmp_path):
    # fp32 window attention with 128 x 128 tiles over 64-wide chunks of D: within every launch
    # limit (128 KiB of shared memory, 255 registers), but ptxas spills thousands of
    # instructions. --strict must fail on that alone.
    proc, report = _compile(tmp_path, "--strict", "--arch", "80", "--dtype", "fp32",
                            "--head-dim", "256", "--wrapper", "window_attention_triton",
                            timeout=900, tiles={4: {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_D": 64,
                                                    "maxnreg": None}})
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "(--strict: a failure)" in proc.stdout
    assert all(r["problems"] == [] for r in report["kernels"]), report["kernels"]
    spilling = {r["kernel"] for r in report["kernels"] if r["spill_instructions"] > 0}
    assert spilling & SCORING, report["kernels"]
    assert all("spills" in r["warnings"][0] for r in report["kernels"] if r["spill_instructions"])


def test_the_compile_check_refuses_to_run_on_interpreted_kernels():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with aot.compile_for(90):
            pass


def test_problems_and_spill_warnings_of_a_report():
    base = dict(wrapper="w", kernel="k", arch=80, dtype="bf16", head_dim=128, num_warps=8,
                num_stages=3, shared=aot.SHARED_LIMIT[80], shared_limit=aot.SHARED_LIMIT[80],
                registers=255, stack_bytes=0, spill_instructions=0, problems=[], warnings=[],
                wrapper_seconds=0.0)
    assert aot.problems_of(aot.KernelReport(**base)) == []  # at the limits exactly: fine
    over = aot.KernelReport(**{**base, "shared": base["shared"] + 1, "registers": 256,
                               "num_warps": 16})
    assert [p.split()[0] for p in aot.problems_of(over)] == ["shared", "256", "256"]
    spills = aot.KernelReport(**{**base, "spill_instructions": 3, "stack_bytes": 16})
    assert aot.problems_of(spills) == [] and "spills" in aot.warnings_of(spills)[0]


def test_compaction_compiles_for_trimkv_side_buffers(tmp_path):
    """trimkv's side buffers (log β and position, float32 [slots, H, 1]) go through the same
    compaction kernel with a head dim of 1 (BLOCK_D = 1)."""
    proc, report = _compile(tmp_path, "--dtype", "fp32", "--head-dim", "1",
                            "--wrapper", "compact_kv_triton_", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(r["arch"] for r in report["kernels"]) == sorted(aot.ARCHS)
    assert all(r["problems"] == [] and r["head_dim"] == 1 for r in report["kernels"])
