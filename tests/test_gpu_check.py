"""The GPU check script (vase_sglang.serving.gpu_check, run as its documented command
`python -m vase_sglang.gpu_check`) on CPU: what can be checked without a GPU.

Its arguments, its JSON, its clear exit without CUDA, and one self-test run of every section
with small shapes and the Triton interpreter, in a process where SGLang and vase_sglang_patches
cannot be imported (the GPU image has neither).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vase_sglang.serving import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def _blocked_imports(tmp_path) -> Path:
    """A folder that, first on sys.path, makes `import sglang` and `import vase_sglang_patches`
    fail and leaves a marker file behind for each attempt. gpu_check itself imports neither;
    the benchmark subprocess it starts imports this tree's patches/ through its own alias
    (placed before this folder), never SGLang."""
    folder = tmp_path / "blocked"
    for name in ("sglang", "vase_sglang_patches"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"open({str(tmp_path / ('imported-' + name))!r}, 'w').close()\n"
            f"raise ImportError('{name} is not installed on the GPU image')\n")
    return folder


def _run(tmp_path, *args, interpret: bool, timeout: float):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VASE_KERNELS")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, whatever the machine has
    env["PYTHONPATH"] = os.pathsep.join([str(_blocked_imports(tmp_path)), str(ROOT)])
    env.setdefault("OMP_NUM_THREADS", "1")
    # The worktree's symlink vase_sglang_patches -> patches sits in ROOT: run from elsewhere
    # so that only the blocked one is importable.
    return subprocess.run([sys.executable, "-m", "vase_sglang.gpu_check", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _no_blocked_import_attempted(tmp_path):
    assert not list(tmp_path.glob("imported-*")), "gpu_check tried to import SGLang or the patches"


def test_without_cuda_it_exits_2_with_a_clear_message_and_a_json(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run(tmp_path, "--out", str(out), interpret=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "no-cuda" and report["sections"] == {}
    _no_blocked_import_attempted(tmp_path)


def test_cpu_self_test_runs_every_section_without_sglang(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run(tmp_path, "--device", "cpu", "--quick", "--out", str(out), interpret=True,
                timeout=900)
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS), proc.stderr[-3000:]
    errors = {k: v for k, v in sections.items() if v["status"] in ("error", "failed")}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    assert proc.returncode == 0 and report["status"] == "ok"
    _no_blocked_import_attempted(tmp_path)
    kernels = sections["kernels"]["rows"]
    assert {r["kernel"] for r in kernels} >= {"value_range", "window_attention", "cur_leverage",
                                              "compact_kv"}  # + window_attention_softcap
    assert all(r["ok"] for r in kernels)
    selections = sections["kernels"]["selections"]  # triton vs torch kept sets, per policy
    assert [r["policy"] for r in selections] == list(gpu_check.SELECTION_POLICIES)
    assert all(r["ok"] and r["agreement_min"] >= gpu_check.KEPT_AGREEMENT for r in selections)
    hf = sections["hf_reference"]
    assert {r["policy"] for r in hf["runs"]} == set(gpu_check.HF_POLICIES)
    assert all(r["tokens_equal"] and r["rounds"] >= 1 for r in hf["runs"])
    step = sections["eviction_step"]
    assert step["check"] and all(c["ok"] for c in step["check"])
    # The warm-up section: on CPU the torch backend, one step, nothing compiled, both runs.
    warm = sections["warm_up"]
    for run in ("first_start", "restart"):
        assert warm[run]["backend"] == "torch" and warm[run]["steps"] == 1, warm
        assert warm[run]["compiled"] == {} and warm[run]["probe_compiled"] == {}, warm
        assert warm[run]["probe_steps"] > 40 and not warm[run]["errors"], warm
    # CUDA graphs exist only on CUDA: recorded as skipped (or missing without capture.py).
    assert sections["graph_capture"]["status"] in ("skipped", "missing")
    # SGLang's own decode kernels (exported, SGLang unimportable here) over evicted rows and
    # merged with the cell kernel: every case, both stage-1 kernels, both row rewrites.
    decode = sections["sglang_decode"]
    rows = decode["rows"]
    assert decode["status"] == "ok" and not decode["skipped"] and all(r["ok"] for r in rows)
    assert {(r["check"], r["kernel"]) for r in rows} == {
        (c, k) for c in ("eviction_row", "global_merge") for k in ("grouped", "normal")}
    assert {r["row_rewrite"] for r in rows if r["check"] == "eviction_row"} == {"row", "kv copy"}
    assert "SGLang 0.5.23" in decode["kernels"]


@pytest.mark.parametrize("check,fault", [
    ("eviction_row", "uncompacted_length"),  # reads freed (NaN) slots past the new length
    ("eviction_row", "no_compaction"),  # the kept K/V never moved per head: finite, wrong
    ("global_merge", "all_splits"),  # the log-sum-exp over splits that hold no key (NaN)
])
def test_the_sglang_decode_check_fails_on_a_wrong_row(check, fault):
    """The sglang_decode section's cases (in this process: the interpreter) pass as built and
    fail when the row, the compaction or the log-sum-exp is wrong."""
    import dataclasses

    import torch

    from vase_sglang.serving import sglang_decode_check as S

    fn, case = ((S.eviction_row, S.QUICK_ROWS[0]) if check == "eviction_row"
                else (S.global_merge, S.QUICK_MERGES[0]))
    case = dataclasses.replace(case, layers=1)
    assert fn(case, torch.float32, "cpu")["ok"]
    bad = fn(case, torch.float32, "cpu", fault=fault)
    assert not bad["ok"] and bad["worst_fraction_of_tolerance"] != 0
    if fault == "no_compaction":  # far out of tolerance, not just a NaN
        assert isinstance(bad["max_abs_diff_out"], float) and bad["max_abs_diff_out"] > 0.1


@pytest.mark.parametrize("kernel,q_heads", [("grouped", 32), ("normal", 8)])
def test_the_gpu_tolerances_cover_an_emulation_of_sglangs_arithmetic(kernel, q_heads):
    """sglang_decode's GPU tolerances (GPU_TOL) hold at least twice what SGLang's decode
    arithmetic on a GPU (modelled in torch: sglang_decode_check.emulate) is off from the fp64
    reference, at the section's shapes (8 KV heads, D 128, 624 and 100 keys); for the 16-bit
    dtypes the output tolerance is not vacuous either (the modelled error uses >= 5% of it)."""
    import torch

    from vase_sglang.serving import sglang_decode_check as S

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tol = S.tolerance(dtype, "cuda", kernel)
        worst_out = worst_lse = 0.0
        for n, seed in ((624, 0), (624, 1), (100, 2)):
            g = torch.Generator().manual_seed(seed)
            q = (S.Q_SCALE * torch.randn(q_heads, 128, generator=g)).to(dtype)
            k = torch.randn(8, n, 128, generator=g).to(dtype)
            v = torch.randn(8, n, 128, generator=g).to(dtype)
            ref_out, ref_lse = S._attend(q, k, v, 128 ** -0.5)
            out, lse = S.emulate(kernel, q, k, v, 128 ** -0.5)
            vmax = float(v.abs().max())
            worst_out = max(worst_out, S._within(out, ref_out, tol["out_atol_per_vmax"] * vmax,
                                                 tol["out_rtol"])[2])
            worst_lse = max(worst_lse, S._within(lse, ref_lse, tol["lse_atol"], 0.0)[2])
        assert worst_out <= 0.5 and worst_lse <= 0.5, (dtype, worst_out, worst_lse)
        if dtype != torch.float32:
            assert worst_out >= 0.05, (dtype, worst_out)


def test_sglang_decode_skips_cases_past_the_budget():
    from vase_sglang.serving import sglang_decode_check as S

    result = S.section("cpu", True, lambda: 0.0)
    assert result["status"] == "ok" and not result["rows"]
    assert len(result["skipped"]) == len(S.QUICK_ROWS) + len(S.QUICK_MERGES)


def test_a_failing_kernel_comparison_fails_the_section():
    import torch

    shapes = gpu_check.QUICK_BENCH
    right = torch.ones(3)
    ok = gpu_check._compare("k", torch.float32, shapes, right, right.clone(), exact=True)
    off = gpu_check._compare("k", torch.float32, shapes, right + 1e-3, right, exact=False)
    assert ok["ok"] and not off["ok"] and off["max_abs_diff"] == pytest.approx(1e-3, rel=1e-4)


def test_arguments(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest.py sets it
    args = gpu_check.parse_args(["--out", "x.json"])
    assert args.only == gpu_check.SECTIONS and args.device == "cuda" and args.budget_s == 450
    assert gpu_check.parse_args(["--only", "kernels, hf_reference"]).only == (
        "kernels", "hf_reference")
    for bad in (["--only", "kernels,nope"], ["--budget-s", "0"], ["--device", "tpu"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def test_arguments_that_depend_on_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_check.parse_args(["--device", "cpu", "--quick"]).quick
    with pytest.raises(SystemExit):  # a GPU run must compile the kernels, not interpret them
        gpu_check.parse_args([])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "cpu"])  # the CPU self-test is --quick only
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--device", "cpu", "--quick"])


def test_the_json_is_rewritten_after_every_section(tmp_path):
    path = tmp_path / "sub" / "r.json"
    report = gpu_check.Report(path, ["--quick"])
    report.section("kernels", {"status": "ok"})
    assert json.loads(path.read_text())["sections"] == {"kernels": {"status": "ok"}}
    assert json.loads(path.read_text())["status"] == "running"
    report.section("hf_reference", {"status": "skipped", "reason": "transformers not installed"})
    report.finish(gpu_check.overall_status(report.data["sections"]))
    final = json.loads(path.read_text())
    assert final["status"] == "ok" and list(final["sections"]) == ["kernels", "hf_reference"]
    assert not list(path.parent.glob("*.tmp"))
    assert gpu_check.overall_status({"a": {"status": "ok"}, "b": {"status": "error"}}) == "failed"
    assert gpu_check.overall_status({"a": {"status": "missing"}}) == "ok"
