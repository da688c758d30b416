"""The budget frontier a user chooses T from: greedy accuracy against server throughput.

Joins two benchmarks' records, nothing is run here:
- accuracy: `benchmarks/accuracy.py` summary.json (greedy arms of the main budget and of the
  `sweep` stage: one point per policy and budget T, window R = T/4, Wilson 95% interval);
- throughput: `benchmarks/concurrency_scaling.py` runs.jsonl of one or more folders, all at one
  workload (model, pool, prompt and output length, requests, client concurrency): per budget
  the policy's own `<policy>@N` runs where measured, else the budget's `--throughput-policy`
  runs (the admission bound, hence the running requests, depends on T and R only; at T = 128
  the policies' throughputs lie within 6 % of each other, docs/admission.md). The full cache
  (`full@N`, same pool) and the ceiling (stock SGLang with a pool for every request) are
  reference points at the full cache's accuracy. Runs recorded on different processors are
  refused: on a CPU the tok/s ratios follow the processor's batch curve
  (benchmarks/batch_step_profile.py), so one frontier is one machine's.

Each point's throughput is also given against the full cache's: the ratio of the medians, and,
where both were run with `--order round`, the ratio run by run within a round (round i of one
folder is paired with round i of another: the rounds must have been run as rounds, e.g. one
`--repeats i` invocation per budget in turn, as docs/frontier.md's command does).

    python benchmarks/frontier.py \\
        --accuracy docs/results/accuracy docs/results/accuracy_keyed_T64 \\
        docs/results/accuracy_seeds/eseed{1,2} \\
        --concurrency docs/results/frontier_rounds/T{128,32,64,192} --gates 3b741943 \\
        --policies vase-attnv vase-dkv snapkv trimkv --out docs/results/frontier

Several --accuracy folders: where more than one holds an arm at the same eviction seed (the
folder's config.json), the later folder's entry is used (arms served again, e.g. with the keyed
draws of a later version); an arm served at several eviction seeds (`accuracy.py
--eviction-seed`) is several draws of the policy's sampling noise, and its point is their mean
count, with its Wilson interval at that count (the problems' sampling error; the draws are
listed beside it). Their full caches must agree (same problems, same correct count), or the
folders are refused as different workloads.

Writes frontier.json, frontier.md and frontier.png. "Smallest T within the full cache's
interval": per policy, the smallest measured T whose accuracy lies inside the full cache's
Wilson 95% interval (a screening rule for a user, not a test of equivalence).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import accuracy, paired_runs  # noqa: E402
from benchmarks.accuracy_stats import wilson  # noqa: E402
from vase_sglang.policies import needs_gates, policy_names  # noqa: E402

WORKLOAD = ("model_path", "max_total_tokens", "input_len", "output_len", "num_prompts", "dtype")
# every registered policy (vase_sglang.policies.POLICIES); those without records are no points
DEFAULT_POLICIES = list(policy_names())


def merge_accuracy(summaries: list[tuple]) -> dict:
    """One summary from several accuracy folders' (name, summary.json[, eviction seed]).

    An arm is identified by its name and the eviction seed its folder served with: a later
    folder's arm of the same seed replaces the earlier one (served again, e.g. with the keyed
    draws of a later version); the same arm under other eviction seeds is another draw of the
    stochastic policies' noise, and the point becomes the mean over its draws (`draws` lists
    each one; all draws of an arm must cover the same number of problems). Every entry says
    which folder it came from (`from`, one draw) or its draws do. Folders whose full caches
    differ (n or correct) served other problems or another model, and are refused."""
    by_arm: dict[str, dict] = {}
    full = None
    for item in summaries:
        name, summary, seed = (*item, None)[:3]
        gen = summary["generation"]
        f = gen.get("full:greedy")
        if f is None:
            raise SystemExit(f"--accuracy {name}: no full-cache greedy arm to compare against")
        if full is not None and (f["n"], f["correct"]) != (full["n"], full["correct"]):
            raise SystemExit(f"--accuracy {name}: its full cache got {f['correct']}/{f['n']}, the "
                             f"first folder's {full['correct']}/{full['n']}: not one workload")
        full = full or f
        for arm, g in gen.items():
            by_arm.setdefault(arm, {})[seed] = g | {"from": name, "eviction_seed": seed}
    merged = {}
    for arm, by_seed in by_arm.items():
        draws = list(by_seed.values())
        if len(draws) == 1 or arm == "full:greedy":
            merged[arm] = draws[-1]
            continue
        if len({d["n"] for d in draws}) > 1:
            raise SystemExit(f"{arm}: draws over different numbers of problems ("
                             + ", ".join(f"{d['n']} in {d['from']}" for d in draws) + ")")
        n = draws[0]["n"]
        correct = statistics.fmean(d["correct"] for d in draws)
        merged[arm] = {k: v for k, v in draws[0].items() if k not in ("from", "eviction_seed")} | {
            "correct": correct, "accuracy": correct / n, "wilson95": list(wilson(correct, n)),
            "draws": [{k: d[k] for k in ("eviction_seed", "correct", "from")} for d in draws]}
    return {"generation": merged}


def eviction_seed(folder: Path) -> int | None:
    """The eviction seed an accuracy folder served with (accuracy.py's own rule on its
    config.json); None where the folder has no config."""
    cfg = folder / "config.json"
    if not cfg.exists():
        return None
    return accuracy.eviction_seed(argparse.Namespace(**json.loads(cfg.read_text())))


def accuracy_points(summary: dict, policies: list[str], gates: str | None) -> tuple[dict, list]:
    """(the full cache's greedy entry, [greedy entries of the policies, plain settings only]).
    trimkv arms are those of `gates` (a gates id) when given; more than one gates id without
    it is refused, as their points would be mixed."""
    gen = summary["generation"]
    full = gen["full:greedy"]
    points = []
    trim_gates = set()
    for g in gen.values():
        if g["decoding"] != "greedy" or g["policy"] not in policies or g["value_slots"] is not None:
            continue
        if needs_gates(g["policy"]):
            if gates and g["gates"] != gates:
                continue
            trim_gates.add(g["gates"])
        points.append({k: g[k] for k in ("policy", "budget", "window", "n", "correct",
                                         "accuracy", "wilson95")} | (
            {"gates": g["gates"]} if g.get("gates") else {}) | (
            {"accuracy_from": g["from"]} if g.get("from") else {}) | (
            {"draws": g["draws"]} if g.get("draws") else {}))
    if len(trim_gates) > 1:
        raise SystemExit(f"trimkv arms of several gates files ({', '.join(sorted(trim_gates))}): "
                         "name one with --gates")
    return full, sorted(points, key=lambda p: (p["policy"], p["budget"]))


def throughput_runs(folders: list[Path], gates: str | None = None) -> tuple[dict, dict]:
    """({(arm, budget, window): [rows]}, the workload they share) from runs.jsonl files; runs of
    another workload than the first folder's first run, or of another processor (the record's
    machine facts; records made before those were kept count as one unknown processor), are
    refused; with `gates` (an id, the start of its SHA-256) only the trimkv runs of that gates
    file."""
    runs, workload, cpus = defaultdict(list), None, {}
    for folder in folders:
        for line in (folder / "runs.jsonl").read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            s, row = rec["settings"], rec["row"]
            w = {k: s.get(k) for k in WORKLOAD} | {"concurrency": row["concurrency"],
                                                   "page_size": row.get("page_size", 1)}
            if " " in row["arm"]:  # another KV dtype's arm ("vase-attnv@N fp8_e4m3")
                continue
            if gates and needs_gates(row["arm"].partition("@")[0]) and not (
                    row.get("gates_sha256") or "").startswith(gates):
                continue
            workload = workload or w
            if w != workload:
                raise SystemExit(f"{folder}: a run of another workload ({w}) than the first "
                                 f"({workload}); the frontier compares one workload")
            key = (row["arm"], 0, 0) if not row["arm"].endswith("@N") or row["arm"] == "full@N" \
                else (row["arm"], s["budget"], s["window"])
            cpu = (row.get("machine") or {}).get("cpu") or "not recorded"
            cpus.setdefault(cpu, folder)
            if len(cpus) > 1:
                raise SystemExit("runs of different processors (" + ", ".join(
                    f"{c!r} in {f}" for c, f in cpus.items()) + "): a CPU's tok/s ratios follow "
                    "its batch curve, the frontier compares one machine's runs")
            runs[key].append(row)
    return dict(runs), (workload or {}) | ({"cpu": next(iter(cpus))} if cpus else {})


def summarise(rows: list[dict]) -> dict:
    tps = [r["output_throughput"] for r in rows]
    return {"throughput": statistics.median(tps), "throughput_range": [min(tps), max(tps)],
            "runs": len(rows), "mean_running": statistics.median(r["mean_running"] for r in rows),
            "peak_running": max(r["peak_running"] for r in rows),
            "bound": rows[0].get("bound")}


def paired_ratios(rows: list[dict], ref: list[dict]) -> list[float]:
    """rows' tok/s over ref's, round by round: the runs of both made with --order round and the
    same round (repeat) index; [] when no round has both."""
    paired = paired_runs.paired_ratio(rows, ref, lambda r: r["output_throughput"],
                                      paired_runs.both_in_rounds)
    return paired["per_pair"] if paired else []


def versus_full(rows: list[dict], full_rows: list[dict] | None) -> dict:
    if not rows or not full_rows:
        return {}
    paired = paired_ratios(rows, full_rows)
    return {"vs_full": statistics.median(r["output_throughput"] for r in rows)
            / statistics.median(r["output_throughput"] for r in full_rows),
            "vs_full_paired": paired}


def build(summary: dict, runs: dict, workload: dict, policies: list[str], gates: str | None,
          throughput_policy: str) -> dict:
    full_acc, points = accuracy_points(summary, policies, gates)
    out_points = []
    for p in points:
        own = runs.get((f"{p['policy']}@N", p["budget"], p["window"]))
        proxy = runs.get((f"{throughput_policy}@N", p["budget"], p["window"]))
        rows, measured_with = (own, p["policy"]) if own else (proxy, throughput_policy)
        t = summarise(rows) if rows else None
        out_points.append(p | {"throughput_measured_with": measured_with if t else None,
                               **(t or {}), **versus_full(rows, runs.get(("full@N", 0, 0)))})
    refs = {}
    for name, key in (("full", ("full@N", 0, 0)), ("ceiling", ("ceiling", 0, 0))):
        if key in runs:
            refs[name] = summarise(runs[key]) | {
                k: full_acc[k] for k in ("n", "correct", "accuracy", "wilson95")} | versus_full(
                runs[key], runs.get(("full@N", 0, 0)))
    lo, hi = full_acc["wilson95"]
    choose = {}
    for policy in sorted({p["policy"] for p in points}):
        inside = [p["budget"] for p in points
                  if p["policy"] == policy and lo <= p["accuracy"] <= hi]
        choose[policy] = min(inside) if inside else None
    return {"workload": workload, "full_cache_accuracy": {k: full_acc[k] for k in (
        "n", "correct", "accuracy", "wilson95")}, "references": refs, "points": out_points,
        "smallest_budget_within_full_interval": choose}


def ratio_cell(r: dict) -> str:
    """'2.1× (2.0, 2.2 by round)': the ratio of medians, then the paired ratios where any."""
    if "vs_full" not in r:
        return "–"
    paired = r.get("vs_full_paired") or []
    return f"{r['vs_full']:.2f}×" + (
        f" ({', '.join(f'{x:.2f}' for x in paired)} by round)" if paired else "")


def table(res: dict) -> str:
    lines = ["| policy | T / R | greedy accuracy [95% Wilson] | output tok/s [range] | runs "
             "| vs full cache | mean / peak running | throughput measured with |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in res["references"].items():
        lines.append(f"| {name} cache | – | {count(r['correct'])}/{r['n']} = {r['accuracy']:.2f} "
                     f"[{r['wilson95'][0]:.2f}, {r['wilson95'][1]:.2f}] | {r['throughput']:.1f} "
                     f"[{r['throughput_range'][0]:.1f}–{r['throughput_range'][1]:.1f}] | "
                     f"{r['runs']} | {ratio_cell(r)} | {r['mean_running']:.1f} / "
                     f"{r['peak_running']} | – |")
    for p in res["points"]:
        tp = (f"{p['throughput']:.1f} [{p['throughput_range'][0]:.1f}–"
              f"{p['throughput_range'][1]:.1f}] | {p['runs']} | {ratio_cell(p)} | "
              f"{p['mean_running']:.1f} / {p['peak_running']} | {p['throughput_measured_with']}"
              if p.get("throughput") is not None else "not measured | – | – | – | –")
        name = p["policy"] + (f" (gates {p['gates']})" if p.get("gates") else "")
        draws = p.get("draws") or []
        lines.append(f"| {name} | {p['budget']} / {p['window']} | {count(p['correct'])}/{p['n']} "
                     f"= {p['accuracy']:.2f} [{p['wilson95'][0]:.2f}, {p['wilson95'][1]:.2f}]"
                     + (f", mean of {len(draws)} draws: "
                        + ", ".join(count(d["correct"]) for d in draws) if draws else "")
                     + f" | {tp} |")
    folders = res.get("accuracy_folders") or []
    later = [p for p in res["points"]
             if folders and p.get("accuracy_from") not in (None, folders[0])]
    if later:
        lines += ["", f"Accuracy from {folders[0]}, except: " + "; ".join(
            f"{p['policy']} T = {p['budget']} from {p['accuracy_from']}" for p in later) + "."]
    drawn = [p for p in res["points"] if p.get("draws")]
    if drawn:
        lines += ["", "Means over draws: " + "; ".join(
            f"{p['policy']} T = {p['budget']}: " + ", ".join(
                f"{count(d['correct'])} (eviction seed {d['eviction_seed']}, {d['from']})"
                for d in p["draws"]) for p in drawn) + "."]
    return "\n".join(lines) + "\n"


def count(correct: float) -> str:
    """A count of right answers: an integer, or a mean over draws to one decimal."""
    return str(int(correct)) if float(correct).is_integer() else f"{correct:.1f}"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    policies = sorted({p["policy"] for p in res["points"]})
    offsets = {pol: (i - (len(policies) - 1) / 2) * 0.012 for i, pol in enumerate(policies)}
    for i, pol in enumerate(policies):
        pts = sorted((p for p in res["points"] if p["policy"] == pol and p.get("throughput")),
                     key=lambda p: p["budget"])
        if not pts:
            continue
        # same-budget points share a throughput: spread them a little sideways to see each
        xs = [p["throughput"] * (1 + offsets[pol]) for p in pts]
        ys = [p["accuracy"] for p in pts]
        err = [[p["accuracy"] - p["wilson95"][0] for p in pts],
               [p["wilson95"][1] - p["accuracy"] for p in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=pol, color=f"C{i}")
        for x, p in zip(xs, pts):  # a mean over eviction-seed draws: each draw as a small mark
            for d in p.get("draws") or []:
                ax.plot([x], [d["correct"] / p["n"]], marker="_", ms=9, color=f"C{i}", alpha=0.6)
        for x, y, p in zip(xs, ys, pts):
            ax.annotate(f"T={p['budget']}", (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=f"C{i}")
    lo, hi = res["full_cache_accuracy"]["wilson95"]
    ax.axhspan(lo, hi, color="0.85", zorder=0, label="full cache, 95% interval")
    if any(p.get("draws") for p in res["points"]):
        ax.plot([], [], marker="_", ms=9, ls="none", color="0.3", label="one eviction-seed draw")
    for name, marker in (("full", "s"), ("ceiling", "D")):
        r = res["references"].get(name)
        if r:
            ax.errorbar([r["throughput"]], [r["accuracy"]], marker=marker, color="k",
                        ls="none", label=f"{name} cache")
    w = res["workload"]
    ax.set_xscale("log")
    ax.set_xlabel(f"output tok/s (pool {w.get('max_total_tokens')}, {w.get('num_prompts')} x "
                  f"{w.get('input_len')} in / {w.get('output_len')} out, concurrency "
                  f"{w.get('concurrency')}" + (f"; {w['cpu']}" if w.get("cpu") not in (
                      None, "not recorded") else "") + ")")
    ax.set_ylabel("greedy accuracy")
    ax.set_title("What each budget T buys (throughput) and costs (answers)")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accuracy", nargs="+", required=True,
                    help="accuracy.py --out folders (summary.json); a later folder's arm replaces "
                         "an earlier one of the same name")
    ap.add_argument("--concurrency", nargs="+", required=True,
                    help="concurrency_scaling.py --out folders (runs.jsonl), one workload")
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES,
                    help="the policies plotted (default: every registered policy with records)")
    ap.add_argument("--gates", help="gates id of the trimkv arms (needed when several)")
    ap.add_argument("--throughput-policy", default="vase-attnv",
                    help="whose runs give a budget's throughput where a policy has none")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    summary = merge_accuracy([(x, json.loads((Path(x) / "summary.json").read_text()),
                               eviction_seed(Path(x))) for x in a.accuracy])
    runs, workload = throughput_runs([Path(x) for x in a.concurrency], a.gates)
    res = build(summary, runs, workload, a.policies, a.gates, a.throughput_policy)
    res["accuracy_folders"] = a.accuracy
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(res, indent=1))
    (out / "frontier.md").write_text(table(res))
    plot(res, out / "frontier.png")
    print(table(res))
    print("smallest T within the full cache's interval:",
          res["smallest_budget_within_full_interval"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
