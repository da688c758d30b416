"""Accuracy and fidelity of the eviction policies on a real model, served by the real server.

    python benchmarks/accuracy.py run --model-path DIR --out results/accuracy [--n 100 ...]
    python benchmarks/accuracy.py throughput --model-path DIR --concurrency 16,32,64
    python benchmarks/accuracy.py report --out results/accuracy      # JSON + PNG from the records
    python benchmarks/accuracy.py export-gsm8k --n 200 --out gsm_symbolic.jsonl

Problems come from reasoning-gym (offline, fixed seed): `gsm_symbolic` (GSM8K templates with
new numbers) or `chain_sum`. `--task champ` replays, teacher-forced (stages tf and curve),
long solutions other models wrote to CHAMP's competition problems instead of the full cache's
own output (benchmarks/recorded_texts.py). The export writes GSM8K-format jsonl ({"question", "answer":
cot + "\\n#### N"}) for `python -m sglang.test.few_shot_gsm8k --data-path FILE`.

Stages of `run` (--stages, default greedy,tf,curve; each appends to records.jsonl and is
skipped on resume):
  greedy  every policy at the main budget (+ vase-attnv with value_slots=0), greedy, --n problems
  tf      teacher-forced: the full-cache greedy output replayed under each policy's evicting
          cache (forcing happens in decode, where eviction happens); per-token NLL, KL against
          full (on the full cache's top-k ids + the rest, a lower bound of the exact KL) and
          top-1 agreement, --tf-n problems; bootstrap intervals over problems, and paired
          differences of vase-attnv against every other arm at the same budget
  curve   teacher-forced budget curve: --curve-policies at the --curve budgets (window =
          budget/4), --curve-n problems; budget_curve.png (KL and top-1 vs compression)
  sweep   greedy at the other --sweep budgets (window = budget/4) for every evicting policy
          and plain trimkv (with --retention-gates), --sweep-n problems: the accuracy side of
          the budget frontier (benchmarks/frontier.py)
  sample  every policy at the main budget with temperature 0.6, top-p 0.95, --sample-n

Serving: if the plugin has per-request control (patches/request_control.py), ONE server started
with a query-scoring policy serves every arm at once (each request carries
`custom_params.kv_evict`), so the batch mixes arms; otherwise one server per eviction setting.
"""

# The code: problems, prompt and answers in benchmarks/accuracy_tasks.py; arms, stages, records,
# servers and throughput in benchmarks/accuracy_harness.py; summaries, tables, plots and compare
# in benchmarks/accuracy_report.py. This file is the command line and re-exports their names.

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the names other benchmarks and the tests use as accuracy.NAME
from benchmarks._server import sigterm_exits  # noqa: E402
from benchmarks.accuracy_harness import (  # noqa: E402, F401
    POLICIES, QUERY_POLICY, RETENTION_POLICIES, RUN_IDENTITY, SAMPLING, TF_K, Arm, Harness,
    Records, _evicted_total, check_resume, eviction_seed, gates_id, key, per_request_available,
    request_limit_flags, retention_arms, stage_arms, throughput, window_for)
from benchmarks.accuracy_report import (  # noqa: E402, F401
    COMPACT, PAIR_REFERENCE, TF_METRICS, _recorded_evictions, compact_row, compare,
    compare_markdown, generated_compression, load_rows, markdown, paired_answers, plot, report,
    summarize, tf_pairs, tf_sums, write_compact)
from benchmarks.accuracy_tasks import (  # noqa: E402, F401
    PROMPT, _answers, export_gsm8k, extract_answer, gsm8k_answer, is_right, load_problems,
    prompt_ids)
from vase_sglang.policies import needs_gates  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--model-path", required=True)
        p.add_argument("--out", default="results/accuracy")
        p.add_argument("--task", default="gsm_symbolic",
                       choices=["gsm_symbolic", "chain_sum", "champ"],
                       help="reasoning-gym problems, or champ: long solutions other models wrote "
                            "to CHAMP's competition problems (benchmarks/recorded_texts.py), "
                            "replayed teacher-forced (stages tf and curve only), their first "
                            "--max-new-tokens tokens")
        p.add_argument("--champ-model", default="GPT-4 Turbo",
                       help="--task champ: whose recorded solutions (GPT-4 Turbo, GPT-4, "
                            "GPT-3.5, PaLM 2 Medium)")
        p.add_argument("--champ-file", default=None,
                       help="--task champ: the dataset file (default: the installed "
                            "champ-dataset's v0.json)")
        p.add_argument("--seed", type=int, default=123,
                       help="problem seed (reasoning-gym), and the eviction seed unless "
                            "--eviction-seed is given")
        p.add_argument("--eviction-seed", type=int, default=None,
                       help="seed of the stochastic policies' draws (--kv-evict-seed; default "
                            "--seed): the same problems under other draws, to measure how much "
                            "one set of draws moves the results (use another --out)")
        p.add_argument("--budget", type=int, default=64, help="main budget T (~4x compression of ~280 tokens)")
        p.add_argument("--window", type=int, default=16, help="window R at the main budget")
        p.add_argument("--max-new-tokens", type=int, default=512)
        p.add_argument("--max-total-tokens", type=int, default=65536, help="server KV pool size")
        p.add_argument("--mode", default="auto", choices=["auto", "per-request", "per-arm"])
        p.add_argument("--dtype", default="float32",
                       help="server --dtype: CPUs without native bf16 run bf16 weights far slower")
        p.add_argument("--server-args", default="", help="extra launch_server arguments, one string")
        p.add_argument("--threads", type=int, default=2,
                       help="OMP threads of the server: on 2 cores, 2 threads made 70 tok/s at 64 "
                            "requests, 1 thread 45 (two 1-thread servers: 69)")
        p.add_argument("--sweep", default="32,64,128,192", help="budgets of the sweep stage")
        p.add_argument("--curve", default="32,48,64,96,128,192",
                       help="budgets of the teacher-forced budget curve (window = budget/4)")
        p.add_argument("--curve-policies", default="vase-attnv,snapkv,random",
                       help="policies of the curve stage (trimkv needs --retention-gates)")
        p.add_argument("--policies", default="",
                       help="comma list: only these policies' arms in the greedy, tf, sweep and "
                            "sample stages (the full cache always runs; default: every policy), "
                            "e.g. vase-attnv with --server-args '--kv-cache-dtype fp8_e4m3'")
        p.add_argument("--retention-gates", default=None, metavar="PATH",
                       help="retention gates (python -m vase_sglang.retention train): the server "
                            "loads them, and greedy and tf gain the arms trimkv and the hybrid "
                            "trimkv with value_slots = budget/4")
        p.add_argument("--scopes", default="head", type=lambda v: [x for x in v.split(",") if x],
                       help="comma list of budget scopes of the trimkv arms (head, layer, "
                            "global; docs/global_budget.md): one greedy and one tf arm each")

    r = sub.add_parser("run")
    common(r)
    r.add_argument("--stages", default="greedy,tf,curve",
                   help="comma list of stages in order, each optionally STAGE:N (its first N "
                        "problems), e.g. greedy:30,tf:30,greedy:100 to get fidelity early")
    r.add_argument("--n", type=int, default=100, help="problems of the greedy stage")
    r.add_argument("--tf-n", type=int, default=40)
    r.add_argument("--curve-n", type=int, default=40)
    r.add_argument("--sweep-n", type=int, default=50)
    r.add_argument("--sample-n", type=int, default=100)
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--boot-iters", type=int, default=10000)
    r.add_argument("--no-ablations", action="store_true",
                   help="greedy and tf stages without the ablations (vase-attnv with "
                        "value_slots=0, the trimkv + value slots hybrid)")

    t = sub.add_parser("throughput")
    common(t)
    t.add_argument("--concurrency", dest="concurrency_list", default="16,32,64")
    t.add_argument("--tokens", type=int, default=128)

    rp = sub.add_parser("report")
    rp.add_argument("--out", default="results/accuracy")
    rp.add_argument("--boot-iters", type=int, default=10000)

    cp = sub.add_parser("compare", help="pair the generation arms two runs share, per problem "
                        "(e.g. the same arms on an fp8 KV cache against the model dtype)")
    cp.add_argument("a", help="run A's --out folder (records.jsonl or records.jsonl.gz)")
    cp.add_argument("b", help="run B's --out folder")
    cp.add_argument("--labels", default="A,B", help="names of A and B in the table, e.g. fp8,bf16")
    cp.add_argument("--out", default=None,
                    help="folder for compare.json and compare.md (default: A's folder)")
    cp.add_argument("--boot-iters", type=int, default=10000)

    ex = sub.add_parser("export-gsm8k")
    ex.add_argument("--task", default="gsm_symbolic")
    ex.add_argument("--n", type=int, default=200)
    ex.add_argument("--seed", type=int, default=123)
    ex.add_argument("--out", required=True)

    a = ap.parse_args(argv)
    if hasattr(a, "sweep"):
        a.sweep = [int(x) for x in a.sweep.split(",") if x]
        a.curve = [int(x) for x in a.curve.split(",") if x]
        a.curve_policies = [x for x in a.curve_policies.split(",") if x]
        a.policies = [x for x in a.policies.split(",") if x]
        known = POLICIES + RETENTION_POLICIES
        unknown = set(a.policies) - set(known)
        if unknown:
            ap.error(f"--policies: unknown {sorted(unknown)}; choose from {known}")
        unknown = set(a.curve_policies) - set(known[1:])
        if unknown:
            ap.error(f"--curve-policies: unknown {sorted(unknown)}; choose from {known[1:]}")
        gated = [p for p in a.curve_policies if needs_gates(p)]
        if gated and not a.retention_gates:
            ap.error(f"--curve-policies: {gated[0]} needs --retention-gates")
        if a.retention_gates and not Path(a.retention_gates).is_file():
            ap.error(f"--retention-gates: no such file: {a.retention_gates}")
        a.gates_id = gates_id(a.retention_gates) if a.retention_gates else ""  # hashed once
    if getattr(a, "task", None) == "champ":
        if a.cmd == "throughput":
            ap.error("--task champ has no problems to answer: use gsm_symbolic or chain_sum")
        if a.cmd == "run":
            other = [x for x in a.stages.split(",")
                     if x and x.partition(":")[0] not in ("tf", "curve")]
            if other:
                ap.error(f"--task champ replays recorded texts: stages tf and curve only, not "
                         f"{', '.join(other)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    with sigterm_exits():  # a plain `kill` of a background run must still stop its server
        return _main(a)


def run_stages(h: Harness) -> dict:
    """The `run` command on a Harness (whose server, if started, stays up: call h.close())."""
    a, out = h.a, h.out
    check_resume(out, a)
    sizes = [int(x.partition(":")[2]) for x in a.stages.split(",") if x.partition(":")[2]]
    if a.task != "champ":  # recorded texts, not problems with a GSM8K answer
        export_gsm8k(load_problems(a.task, max([a.n, a.tf_n, a.curve_n, a.sweep_n, a.sample_n,
                                                *sizes]), a.seed),
                     out / f"{a.task}.gsm8k.jsonl")
    cfg = {**vars(a), "serving": h.mode}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    with open(out / "runs.jsonl", "a") as f:  # config.json is the latest run; this is every run
        f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S"), **cfg}) + "\n")
    print(f"mode: {h.mode}; records: {out / 'records.jsonl'}; server log: {out / 'server.log'}",
          file=sys.stderr)
    summary = {}
    for item in [s for s in a.stages.split(",") if s]:
        stage, _, n = item.partition(":")
        h.stage(stage, int(n) if n else None)
        summary = report(out, a.boot_iters)  # after every stage: partial results are usable
        print(f"stage {stage} done: {out / 'summary.md'}", file=sys.stderr)
    return summary


def _main(a) -> int:
    if a.cmd == "export-gsm8k":
        export_gsm8k(load_problems(a.task, a.n, a.seed), a.out)
        print(a.out)
        return 0
    if a.cmd == "report":
        print(markdown(report(Path(a.out), a.boot_iters)))
        return 0
    if a.cmd == "compare":
        labels = a.labels.split(",")
        if len(labels) != 2:
            raise SystemExit("--labels: two names, e.g. fp8,bf16")
        result = compare(load_rows(Path(a.a)), load_rows(Path(a.b)), a.boot_iters)
        if not result:
            raise SystemExit(f"no generation arm with problems in both {a.a} and {a.b}")
        out = Path(a.out or a.a)
        out.mkdir(parents=True, exist_ok=True)
        md = compare_markdown(result, *labels)
        (out / "compare.json").write_text(json.dumps(
            {"a": str(a.a), "b": str(a.b), "labels": labels, "arms": result}, indent=1))
        (out / "compare.md").write_text(md)
        print(md)
        return 0
    if a.cmd == "throughput":
        a.concurrency_list = [int(x) for x in a.concurrency_list.split(",")]
        a.concurrency = max(a.concurrency_list)
        throughput(a)
        return 0
    h = Harness(a)
    try:
        summary = run_stages(h)
    finally:
        h.close()
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
