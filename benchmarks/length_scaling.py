"""Throughput against generation length: does eviction's advantage grow with the chain of thought?

At one pool (--max-total-tokens N, by default room for two full-cache requests of the longest
length) and one client concurrency, every output length L of --lengths runs
`benchmarks/concurrency_scaling.py` with the full cache (`full@N`) and each policy of --policies
at budget T / window R (`<policy>@N`), in its own folder `--out/L<L>` (records resumable there:
a run cut short loses at most the run in progress). Then, per length: output tok/s, mean and
peak running requests, the mean time of a decode step (the run's wall time over its decode
steps, prefills included) and the ratio of each policy to the full cache, split into its two
factors,

    tok/s ~= mean running / mean step time  =>  ratio ~= (running ratio) x (step speed ratio),

(exact but for the first token of each request, which its prefill makes), so the table says
whether a ratio comes from more requests at once or from faster (shorter-cache) steps. ITL is
reported too, but it is a per-token median: with waves of unequal size it describes the large
wave only. Ratios pair the runs of one repeat index (a repeat's arms run on one machine, one
after another; --repeats run again on another machine adds the next index), and a second table
lists each repeat's ratio with its date and processor. Writes length_scaling.json,
length_scaling.md and length_scaling.png (ratio against length) in --out.

    python benchmarks/length_scaling.py --model-path DIR --plan       # decode steps per arm, time
    python benchmarks/length_scaling.py --model-path DIR              # run (resumes), then report
    python benchmarks/length_scaling.py --model-path DIR --report-only

--plan counts the decode steps each arm needs (waves of at most min(C, requests that fit) at
once: the full cache holds P + L per request, an evicting arm P + T + R, P = --prompt-estimate)
and the time at --step-seconds per step; no server is started.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import concurrency_scaling as cs  # noqa: E402
from benchmarks import paired_runs  # noqa: E402


def default_pool(lengths: list[int], input_len: int) -> int:
    """Room for two full-cache requests of the longest length; the server's prompts are up to
    about twice the client's --input-len (re-tokenized text, chat template)."""
    return 2 * (max(lengths) + 2 * input_len)


def concurrency_args(args, length: int) -> list[str]:
    """The concurrency_scaling.py command line of one length."""
    argv = ["--model-path", args.model_path, "--max-total-tokens", str(args.max_total_tokens),
            "--input-len", str(args.input_len), "--output-len", str(length),
            "--num-prompts", str(args.num_prompts), "--concurrency", str(args.concurrency),
            "--repeats", str(args.repeats), "--policies", *args.policies,
            "--budget", str(args.budget), "--window", str(args.window), "--arms", "full", "vase",
            "--seed", str(args.seed), "--out", str(Path(args.out) / f"L{length}")]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if args.quiet_client:
        argv.append("--quiet-client")
    return argv


def plan(args) -> list[dict]:
    """Decode steps per (length, arm): requests run in waves of at most min(C, fit) at once."""
    p = args.prompt_estimate or 1.5 * args.input_len
    rows = []
    for length in args.lengths:
        for arm, held in [("full@N", p + length)] + [
                (f"{pol}@N", p + args.budget + args.window) for pol in args.policies]:
            fit = max(1, int(args.max_total_tokens // held))
            at_once = min(args.concurrency, args.num_prompts, fit)
            steps = math.ceil(args.num_prompts / at_once) * length * args.repeats
            rows.append({"output_len": length, "arm": arm, "at_once": at_once,
                         "decode_steps": steps, "seconds": steps * args.step_seconds})
    return rows


def length_rows(args) -> dict[int, list[dict]]:
    """The recorded runs of each length whose settings are this command's (others ignored)."""
    out = {}
    cpu = cs.machine_facts(1)["cpu"]  # as concurrency_scaling resumes: this processor's runs
    for length in args.lengths:
        sub = cs.parse_args(concurrency_args(args, length))
        done, _ = cs.load_records(Path(sub.out) / cs.RECORDS, cs.run_settings(sub), cpu)
        rows = [r for r in done.values() if r["concurrency"] == args.concurrency]
        if rows:
            out[length] = rows
    return out


def step_seconds(row: dict) -> float:
    """A run's mean time per decode step: wall time over the decode steps it logged."""
    return row["duration"] / row["decode_steps"]


def paired_ratio(a: list[dict], b: list[dict], value) -> dict | None:
    """value(a run) / value(b run) for the runs of one repeat index (paired_runs): a length's
    repeat k of every arm is made by one invocation, so one index shares a machine and a day.
    Pairs recorded on two different processors are left out; None when no pair is left."""
    return paired_runs.paired_ratio(a, b, value, paired_runs.same_processor)


def summarize(by_length: dict[int, list[dict]], policies: list[str]) -> list[dict]:
    """Per length: each arm's figures (median and range over the repeats) and each policy's ratio
    to the full cache with its two factors, paired by repeat (paired_ratio: median and range of
    the per-repeat ratios), and `runs`: per repeat, when and where the full cache ran and each
    policy's throughput ratio in that repeat (None where it has no pair)."""
    table = []
    for length in sorted(by_length):
        runs = {}
        for r in by_length[length]:
            runs.setdefault(r["arm"], []).append(r)
        agg = {e["arm"]: e for e in cs.aggregate(by_length[length])}
        for arm, e in agg.items():
            e["step_ms"] = cs.spread([1000 * step_seconds(r) for r in runs[arm]])
        entry = {"output_len": length, "arms": agg, "vs_full": {}, "runs": []}
        full = runs.get("full@N")
        for pol in policies:
            arm = f"{pol}@N"
            if full is None or arm not in runs:
                continue
            ratios = {
                "throughput": paired_ratio(runs[arm], full, lambda r: r["output_throughput"]),
                "mean_running": paired_ratio(runs[arm], full, lambda r: r["mean_running"]),
                # the full cache's mean step time over the policy's (> 1: faster steps)
                "step_speed": paired_ratio(runs[arm], full, lambda r: 1 / step_seconds(r)),
            }
            if ratios["throughput"] is not None:
                entry["vs_full"][pol] = ratios
        by_repeat = {pol: dict(zip(v["throughput"]["repeats"], v["throughput"]["per_pair"]))
                     for pol, v in entry["vs_full"].items()}
        for f in sorted(full or [], key=lambda r: r["repeat"]):
            entry["runs"].append({
                "repeat": f["repeat"], "started_utc": f.get("started_utc"),
                "cpu": paired_runs.cpu(f), "full_throughput": f["output_throughput"],
                "throughput_vs_full": {pol: by_repeat.get(pol, {}).get(f["repeat"])
                                       for pol in policies}})
        table.append(entry)
    return table


def _ratio_text(r: dict) -> str:
    return f"{r['median']:.2f}×" + ("" if r["min"] == r["max"] else
                                    f" [{r['min']:.2f}–{r['max']:.2f}]")


def markdown(table: list[dict]) -> str:
    """One row per (length, arm); a policy's ratios to the full cache beside its figures."""
    lines = ["| output tokens | arm | output tok/s | vs full | peak / mean running | "
             "running vs full | step ms (mean) | step speed vs full | ITL p50 ms | retracted | "
             "eviction time |", "|" + "---|" * 11]
    for e in table:
        for arm, a in e["arms"].items():
            pol = arm.split("@")[0]
            v = e["vs_full"].get(pol)
            ref = "1" if pol == "full" else "–"
            lines.append(
                f"| {e['output_len']} | {arm} | {cs._fmt(a['output_throughput'])} | "
                f"{_ratio_text(v['throughput']) if v else ref} | "
                f"{cs._fmt(a['peak_running'], 0)} / {cs._fmt(a['mean_running'])} | "
                f"{_ratio_text(v['mean_running']) if v else ref} | "
                f"{cs._fmt(a['step_ms'], 0)} | "
                f"{_ratio_text(v['step_speed']) if v else ref} | "
                f"{cs._fmt(a['median_itl_ms'], 0)} | "
                f"{cs._fmt(a['retracted_requests'], 0)} | "
                + ("–" if a["eviction_time_share"] is None
                   else cs._fmt(a["eviction_time_share"], 2, 100) + " %") + " |")
    pols = list(dict.fromkeys(p for e in table for r in e["runs"] for p in r["throughput_vs_full"]))
    lines += ["", "Per repeat (the ratios above are the median and range of these; a repeat's "
              "arms ran on one machine, one after another):", "",
              "| output tokens | repeat | full cache started (UTC) | processor | full tok/s | "
              + " | ".join(f"{p} vs full" for p in pols) + " |",
              "|" + "---|" * (5 + len(pols))]
    for e in table:
        for r in e["runs"]:
            ratios = [("–" if r["throughput_vs_full"].get(p) is None
                       else f"{r['throughput_vs_full'][p]:.2f}×") for p in pols]
            lines.append(f"| {e['output_len']} | {r['repeat']} | {r['started_utc'] or '–'} | "
                         f"{r['cpu'] or 'not recorded'} | {r['full_throughput']:.1f} | "
                         + " | ".join(ratios) + " |")
    return "\n".join(lines)


def plot(table: list[dict], policies: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, pol in enumerate(policies):
        pts = [(e["output_len"], e["vs_full"][pol]) for e in table if pol in e["vs_full"]]
        if not pts:
            continue
        xs = [x for x, _ in pts]
        for ax, key, style in ((ax1, "throughput", "o-"), (ax2, "mean_running", "o-"),
                               (ax2, "step_speed", "s--")):
            med = [r[key]["median"] for _, r in pts]
            err = [[m - r[key]["min"] for m, (_, r) in zip(med, pts)],
                   [r[key]["max"] - m for m, (_, r) in zip(med, pts)]]
            label = pol if ax is ax1 else f"{pol}: {key.replace('_', ' ')}"
            ax.errorbar(xs, med, yerr=err, fmt=style, capsize=3, color=f"C{i}", label=label)
    for ax in (ax1, ax2):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("output tokens per request")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set(ylabel="output tok/s, policy / full cache", title=title)
    ax2.set(ylabel="policy / full cache",
            title="factors: running requests, step speed (full / policy step time)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="model directory (default: the tiny local test model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                    help="output lengths L (ignore_eos)")
    ap.add_argument("--max-total-tokens", type=int,
                    help="N, the pool of every arm (default: two full-cache requests of the "
                    "longest length, 2 (max L + 2 input-len))")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=4, help="client concurrency")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--policies", nargs="+", default=["vase-dkv", "vase-attnv"])
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=str(REPO / "results" / "length_scaling"))
    ap.add_argument("--quiet-client", action="store_true")
    ap.add_argument("--report-only", action="store_true",
                    help="no server: the report from the runs recorded in --out")
    ap.add_argument("--plan", action="store_true",
                    help="no server: decode steps and estimated time per arm, then exit")
    ap.add_argument("--step-seconds", type=float, default=0.4,
                    help="--plan's time per decode step (default 0.4: Qwen2.5-0.5B fp32 on 2 CPU "
                    "cores, 3-7 running)")
    ap.add_argument("--prompt-estimate", type=float,
                    help="--plan's prompt length as the server sees it (default 1.5 input-len)")
    args = ap.parse_args(argv)
    from vase_sglang.policies import needs_gates

    gated = [p for p in args.policies if needs_gates(p)]
    if gated:
        ap.error(f"{gated[0]} needs gates: run benchmarks/concurrency_scaling.py --gates per "
                 "length")
    for name in ("input_len", "num_prompts", "concurrency", "repeats", "budget", "window"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if any(n <= 0 for n in args.lengths):
        ap.error("--lengths must be positive")
    args.lengths = sorted(set(args.lengths))
    if args.budget <= args.window:
        ap.error(f"--budget {args.budget} must be larger than --window {args.window} (the "
                 "budget includes the window)")
    if args.lengths[0] <= args.budget + args.window:
        ap.error(f"every length must exceed T + R = {args.budget + args.window}: a request never "
                 f"evicts below it (--lengths has {args.lengths[0]})")
    if args.max_total_tokens is None:
        args.max_total_tokens = default_pool(args.lengths, args.input_len)
    if args.model_path is None:
        from vase_sglang.serving.tiny_model import build_tiny_qwen3

        args.model_path = str(build_tiny_qwen3())
    out = Path(args.out)

    if args.plan:
        rows = plan(args)
        for r in rows:
            print(f"L={r['output_len']:>6} {r['arm']:<16} {r['at_once']:>3} at once "
                  f"{r['decode_steps']:>7} decode steps  ~{r['seconds'] / 60:.0f} min")
        total = sum(r["seconds"] for r in rows)
        print(f"pool {args.max_total_tokens}: ~{total / 60:.0f} min of decoding at "
              f"{args.step_seconds} s a step, plus a server start per arm and length")
        return 0
    if not args.report_only:
        for length in args.lengths:
            print(f"\n==== output length {length} (pool {args.max_total_tokens})", flush=True)
            cs.main(concurrency_args(args, length))

    by_length = length_rows(args)
    if not by_length:
        print(f"no runs recorded in {out}/L*/ with these settings", file=sys.stderr)
        return 1
    table = summarize(by_length, args.policies)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model_path).name if Path(args.model_path).name != "hf" else \
        Path(args.model_path).parent.name
    title = (f"{model}: pool {args.max_total_tokens}, {args.concurrency} clients, "
             f"T={args.budget}/R={args.window}")
    starts = sorted(r["started_utc"] for rows in by_length.values() for r in rows
                    if r.get("started_utc"))
    loads = [r["load_1min_at_start"] for rows in by_length.values() for r in rows
             if r.get("load_1min_at_start") is not None]
    result = {
        "command": " ".join(["length_scaling.py", *(argv if argv is not None else sys.argv[1:])]),
        "settings": vars(args),
        "runs_started_utc": [starts[0], starts[-1]] if starts else None,
        "load_1min_at_start": [min(loads), max(loads)] if loads else None,
        "lengths_missing": [n for n in args.lengths if n not in by_length],
        "table": table,
    }
    (out / "length_scaling.json").write_text(json.dumps(result, indent=2, default=str))
    md = markdown(table)
    (out / "length_scaling.md").write_text(f"{title}\n\n{md}\n")
    plot(table, args.policies, out / "length_scaling.png", title)
    print(md)
    if result["lengths_missing"]:
        print(f"not yet run: L = {result['lengths_missing']}")
    print(f"wrote {out / 'length_scaling.json'}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
