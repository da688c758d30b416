"""benchmarks/accuracy.py without a server: the GSM8K export and the failures it must raise
instead of measuring something else (a private answer extractor, a missing eviction count)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed

from benchmarks import accuracy as acc  # noqa: E402


def test_gsm8k_answer_has_one_final_line():
    # gsm_symbolic's chain of thought already ends with the final line
    cot = "She bakes 63 / 7 = 9 sheets.\n#### 9"
    assert acc.gsm8k_answer(cot, "9") == "She bakes 63 / 7 = 9 sheets.\n#### 9"
    assert acc.gsm8k_answer("", "-698") == "#### -698"  # chain_sum has no chain
    assert acc.gsm8k_answer("a = 2\nb = 3", "5") == "a = 2\nb = 3\n#### 5"
    # reasoning-gym writes some final lines as floats (gsm_symbolic seed 123, problem 25: '#### 51.0')
    assert acc.gsm8k_answer("x = 51\n#### 51.0", "51") == "x = 51\n#### 51"
    with pytest.raises(ValueError, match="#### 8"):
        acc.gsm8k_answer("x\n#### 8", "9")  # a chain that contradicts its answer


def test_export_gsm8k_from_reasoning_gym(tmp_path):
    pytest.importorskip("reasoning_gym")
    probs = acc.load_problems("gsm_symbolic", 4, 123)
    assert all(p["cot"].rstrip().endswith("#### " + p["answer"]) for p in probs)  # as found
    acc.export_gsm8k(probs, tmp_path / "g.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row, p in zip(rows, probs):
        assert row["question"] == p["question"]
        assert row["answer"].count("####") == 1, row["answer"]
        assert row["answer"] == p["cot"].strip()  # the chain, ending with its one final line
        # sglang.test.few_shot_gsm8k reads the number after "####"
        assert row["answer"].rsplit("#### ", 1)[1] == p["answer"]


def test_a_missing_eviction_count_is_an_error_not_zero():
    assert acc._evicted_total(0) == 0
    assert acc._evicted_total([[3, 5], [4, 1]]) == 5
    with pytest.raises(RuntimeError, match="kv_evicted_tokens"):
        acc._evicted_total(None)
    with pytest.raises(RuntimeError, match="no number"):
        acc._evicted_total([])
    assert acc._recorded_evictions({"a": {"kv_evicted": 4}, "b": {"kv_evicted": 0}}) == [4, 0]
    with pytest.raises(RuntimeError, match="'b'"):
        acc._recorded_evictions({"a": {"kv_evicted": 4}, "b": {"kv_evicted": None}})


def test_no_private_answer_extractor():
    # Without vase_sglang.serving.answers the harness must not start (it used to switch silently to
    # its own extractor and prompt).
    code = ("import sys; sys.modules['vase_sglang.serving.answers'] = None; "
            "sys.path.insert(0, '.'); import benchmarks.accuracy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "vase_sglang.serving.answers" in proc.stderr, proc.stderr[-2000:]
    assert acc.PROMPT == "{q}\n" + acc._answers.ANSWER_INSTRUCTION
    assert acc.extract_answer("so 3 + 4 = 7.\nFinal answer: 7") == "7"


def test_retention_gates_option(tmp_path):
    """--retention-gates adds trimkv and its hybrid, named by the gates file's content, and the
    server gets the file; without gates, trimkv cannot be asked for."""
    base = ["run", "--model-path", "M", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        acc.parse_args(base + ["--curve-policies", "vase-attnv,trimkv"])
    with pytest.raises(SystemExit):
        acc.parse_args(base + ["--retention-gates", str(tmp_path / "missing.safetensors")])
    assert not [x for x in acc.stage_arms("tf", acc.parse_args(base)) if x.policy == "trimkv"]

    gates = tmp_path / "g.safetensors"
    gates.write_bytes(b"one")
    a = acc.parse_args(base + ["--retention-gates", str(gates), "--curve", "32,64",
                               "--curve-policies", "snapkv,trimkv"])
    gid = acc.gates_id(gates)
    learned = [x for x in acc.stage_arms("tf", a) if x.policy == "trimkv"]
    assert [(x.setting, x.kind) for x in learned] == [
        (f"trimkv@64/w16/g{gid}", "tf"), (f"trimkv@64/w16/nv16/g{gid}", "tf")]
    assert [x.setting for x in acc.stage_arms("curve", a) if x.policy == "trimkv"] == [
        f"trimkv@32/w8/g{gid}", f"trimkv@64/w16/g{gid}"]
    flags = acc.Harness.server_flags(type("H", (), {"a": a, "mode": "per-request",
                                                     "gates_flags": acc.Harness.gates_flags})(),
                                     learned)
    assert flags[flags.index("--kv-evict-retention-gates") + 1] == str(gates.resolve())
    # other gates, other records
    gates.write_bytes(b"two")
    assert acc.gates_id(gates) != gid


def test_policies_option_keeps_only_those_arms_and_the_full_cache(tmp_path):
    base = ["run", "--model-path", "M", "--out", str(tmp_path)]
    every = acc.parse_args(base)
    assert {x.policy for x in acc.stage_arms("greedy", every)} == set(acc.POLICIES)
    a = acc.parse_args(base + ["--policies", "vase-attnv"])
    assert [x.setting for x in acc.stage_arms("greedy", a)] == [
        "full", "vase-attnv@64/w16", "vase-attnv@64/w16/nv0"]
    assert {x.policy for x in acc.stage_arms("tf", a)} == {"full", "vase-attnv"}
    assert {x.policy for x in acc.stage_arms("sweep", a)} == {"vase-attnv"}
    snap = acc.parse_args(base + ["--policies", "snapkv"])
    assert [x.setting for x in acc.stage_arms("greedy", snap)] == ["full", "snapkv@64/w16"]
    with pytest.raises(SystemExit):
        acc.parse_args(base + ["--policies", "vase-attnv,nope"])


def _gen_row(arm: str, pid: str, correct: bool, ids: list[int], question: str = "q") -> dict:
    policy = arm.partition("@")[0].partition(":")[0]
    return {"key": f"{arm}|{pid}", "arm": arm, "pid": pid, "question": f"{question} {pid}",
            "arm_fields": {"policy": policy, "budget": 64, "window": 16, "value_slots": None,
                           "decoding": "greedy", "kind": "gen"},
            "correct": correct, "pred": "1" if correct else "2", "output_ids": ids,
            "n_tokens": len(ids), "finish": "stop", "kv_evicted": 0}


def _write_run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir()
    acc.write_compact(folder, rows)
    return folder


def test_compare_pairs_two_runs_arm_by_arm(tmp_path):
    arm = "vase-attnv@64/w16:greedy"
    a = [_gen_row(arm, f"p{i}", ok, [1, 2, 3]) for i, ok in enumerate([True, True, False, False])]
    b = [_gen_row(arm, "p0", True, [1, 2, 3]), _gen_row(arm, "p1", False, [1, 9, 9]),
         _gen_row(arm, "p2", False, [1, 2, 4]), _gen_row(arm, "p3", False, [1, 2, 3])]
    # an arm only one run served, and a teacher-forced arm, are left out
    a.append(_gen_row("snapkv@64/w16:greedy", "p0", True, [1]))
    tf = _gen_row(arm + ":tf", "p0", True, [1])
    tf["arm_fields"]["kind"] = "tf"
    out = acc.compare(a + [tf], b + [dict(tf)], boot_iters=200)
    assert list(out) == [arm]
    c = out[arm]
    assert (c["n_paired"], c["a_correct"], c["b_correct"]) == (4, 2, 1)
    assert (c["only_a_right"], c["only_b_right"]) == (1, 0)
    assert c["acc_diff"] == pytest.approx(0.25)
    assert c["identical"] == pytest.approx(0.5)
    assert c["first_divergence_median"] == 2  # divergences at 1 and 2
    assert c["same_answer"] == pytest.approx(0.75)

    # the CLI writes compare.json and compare.md into A's folder
    da, db = _write_run(tmp_path / "fp8", a), _write_run(tmp_path / "base", b)
    assert acc.main(["compare", str(da), str(db), "--labels", "fp8,fp32",
                     "--boot-iters", "200"]) == 0
    assert json.loads((da / "compare.json").read_text())["arms"][arm]["only_a_right"] == 1
    assert "fp8 − fp32" in (da / "compare.md").read_text()


def test_compare_refuses_runs_of_different_problems(tmp_path):
    arm = "full:greedy"
    a = [_gen_row(arm, "p0", True, [1])]
    b = [_gen_row(arm, "p0", True, [1], question="another seed")]
    with pytest.raises(ValueError, match="different problems"):
        acc.compare(a, b, boot_iters=10)


def test_eviction_seed_defaults_to_the_problem_seed_and_a_resume_keeps_it(tmp_path):
    base = ["run", "--model-path", "M", "--out", str(tmp_path)]
    a = acc.parse_args(base)
    assert acc.eviction_seed(a) == a.seed == 123
    other = acc.parse_args(base + ["--eviction-seed", "7"])
    assert acc.eviction_seed(other) == 7 and other.seed == 123  # same problems, other draws

    acc.check_resume(tmp_path, other)  # an empty folder: nothing to resume
    (tmp_path / "config.json").write_text(json.dumps({**vars(a), "serving": "per-request"}))
    (tmp_path / "records.jsonl").write_text("")
    acc.check_resume(tmp_path, acc.parse_args(base + ["--threads", "1"]))  # how, not what
    acc.check_resume(tmp_path, acc.parse_args(base + ["--eviction-seed", "123"]))  # the same draws
    with pytest.raises(SystemExit, match="eviction_seed: 123 there, 7 now"):
        acc.check_resume(tmp_path, other)
    with pytest.raises(SystemExit, match="server_args"):
        acc.check_resume(tmp_path, acc.parse_args(
            base + ["--server-args", "--kv-cache-dtype fp8_e4m3"]))
    # a config written before --eviction-seed existed: its draws were keyed by --seed
    old = {k: v for k, v in vars(a).items() if k != "eviction_seed"}
    (tmp_path / "config.json").write_text(json.dumps(old))
    acc.check_resume(tmp_path, a)
    with pytest.raises(SystemExit, match="eviction_seed"):
        acc.check_resume(tmp_path, other)


def test_the_eviction_seed_reaches_the_server_flags(tmp_path):
    from types import SimpleNamespace

    base = ["run", "--model-path", "M", "--out", str(tmp_path), "--policies", "vase-attnv"]
    for argv, want in ((base, "123"), (base + ["--eviction-seed", "7"], "7")):
        a = acc.parse_args(argv)
        for mode, arms in (("per-request", acc.stage_arms("greedy", a)),
                           ("per-arm", [acc.Arm("vase-attnv", 64, 16)])):
            flags = acc.Harness.server_flags(SimpleNamespace(a=a, mode=mode, gates_flags=list),
                                             arms)
            assert flags[flags.index("--kv-evict-seed") + 1] == want


def test_tf_pairs_name_trimkv_arms_by_their_gates_when_two_gates_ran():
    """In-distribution and general gates replayed into one folder: each gets its own pair
    against vase-attnv (one used to overwrite the other under the label "trimkv")."""
    from dataclasses import asdict

    arms = [acc.Arm("vase-attnv", 64, 16, kind="tf"),
            acc.Arm("trimkv", 64, 16, kind="tf", gates="aaaa1111"),
            acc.Arm("trimkv", 64, 16, kind="tf", gates="bbbb2222")]
    kl = {"vase-attnv": 0.10, "aaaa1111": 0.05, "bbbb2222": 0.07}  # per-token KL of each arm
    fields, sums = {}, {}
    for arm in arms:
        fields[arm.name] = asdict(arm)
        v = kl[arm.gates or arm.policy]
        sums[arm.name] = {f"p{i}": {"count": 10, "kl": 10 * v * (1 + i / 10),
                                    "nll_excess": 10 * v, "top1_agree": 9.0} for i in range(4)}
    pairs = acc.tf_pairs(fields, sums, boot_iters=200)
    for gates in ("aaaa1111", "bbbb2222"):
        row = pairs[f"vase-attnv vs trimkv g{gates} @T=64"]
        assert math.isclose(row["kl"]["diff"], (0.10 - kl[gates]) * 1.15, rel_tol=1e-9)
    # the two gates against each other, once, on the same tokens
    row = pairs["trimkv gaaaa1111 vs trimkv gbbbb2222 @T=64"]
    assert math.isclose(row["kl"]["diff"], (0.05 - 0.07) * 1.15, rel_tol=1e-9)
    assert not any(k.startswith("trimkv gbbbb2222 vs") for k in pairs)
    # one gates file: the label stays the plain policy name
    one = {k: v for k, v in sums.items() if "bbbb" not in k}
    assert "vase-attnv vs trimkv @T=64" in acc.tf_pairs(fields, one, boot_iters=200)


def test_a_small_main_budget_still_starts_a_valid_server():
    """--budget 32 (short answers) beside the sweep's budget 192 (window 48): the one
    per-request server used to get budget 32 with window 48, and refused to start."""
    from types import SimpleNamespace

    from vase_sglang.config import EvictionConfig

    a = acc.parse_args(["run", "--model-path", "M", "--budget", "32", "--window", "8"])
    flags = acc.Harness.server_flags(SimpleNamespace(a=a, mode="per-request", gates_flags=list),
                                     acc.stage_arms("greedy", a))
    budget = int(flags[flags.index("--kv-evict-budget") + 1])
    window = int(flags[flags.index("--kv-evict-window") + 1])
    EvictionConfig(policy="vase-attnv", budget=budget, window=window)  # the server's own check
    # the requests' own settings stay within the server's per-request limits
    assert int(flags[flags.index("--kv-evict-max-budget") + 1]) >= budget
