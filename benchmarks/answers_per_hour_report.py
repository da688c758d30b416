"""The answers-per-hour benchmark's summary (benchmarks/answers_per_hour.py): each (arm, round,
workload) run's figures from its records, correct answers per hour with bootstrap intervals
(resampling problems and rounds; paired against stock), tokens per answer paired per problem,
McNemar, latency percentiles, the multi-turn figures; summary.{json,md} and the PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks import accuracy as acc
from benchmarks import accuracy_stats as st
from benchmarks import elastic_load as el
from benchmarks import paired_runs

STOCK = "stock"
WORKLOADS = ("all", "poisson", "multiturn")


def answered(rows: dict) -> dict[str, dict]:
    """A record file's finished problems (request or conversation rows) by problem id."""
    return {r["pid"]: r for r in rows.values() if r.get("kind") in ("request", "conversation")}



# ----------------------------------------------------------------------------- statistics


def percentiles(xs: list[float]) -> dict:
    return {"p50": el.percentile(xs, 50), "p90": el.percentile(xs, 90)}


def answers_per_hour(correct: int | float, wall_s: float) -> float:
    return 3600.0 * correct / wall_s


def answers_per_hour_ci(correct, wall, ref_correct=None, ref_wall=None, iters: int = 10000,
                        seed: int = 0, level: float = 0.95) -> dict:
    """Correct answers per hour of rounds x problems (`correct`: one row of 0/1 per round, the
    same problems in each; `wall`: each round's seconds): the pooled figure, all correct answers
    over all wall time, and a percentile bootstrap interval resampling problems and rounds. With
    a reference (stock's rows and walls on the same problems and rounds) the ratio of the two,
    each resample drawing the same problems and rounds for both: paired. Resamples where the
    reference has no correct answer are left out of the ratio's interval (`undefined`)."""
    import numpy as np

    c = np.asarray(correct, dtype=float)
    w = np.asarray(wall, dtype=float)
    rounds, n = c.shape
    rng = np.random.default_rng(seed)
    rr = rng.integers(0, rounds, size=(iters, rounds))
    pp = rng.integers(0, n, size=(iters, n))

    def resampled(x, walls):
        picked = np.take_along_axis(x[rr], pp[:, None, :], axis=2)  # iters x rounds x problems
        return picked.sum(axis=(1, 2)), walls[rr].sum(axis=1)

    def interval(values):
        values = np.sort(values)
        if not len(values):
            return [None, None]
        k = len(values)
        return [float(values[int((1 - level) / 2 * k)]),
                float(values[min(k - 1, int((1 + level) / 2 * k))])]

    num, den = resampled(c, w)
    own = 3600.0 * num / den
    out = {"answers_per_hour": answers_per_hour(c.sum(), w.sum()), "ci95": interval(own)}
    if ref_correct is None:
        return out
    rc, rw = np.asarray(ref_correct, dtype=float), np.asarray(ref_wall, dtype=float)
    rnum, rden = resampled(rc, rw)
    ref = 3600.0 * rnum / rden
    ok = ref > 0
    ref_point = answers_per_hour(rc.sum(), rw.sum())
    out.update(ratio=out["answers_per_hour"] / ref_point if ref_point > 0 else None,
               ratio_ci95=interval(own[ok] / ref[ok]), undefined=int((~ok).sum()))
    return out


def run_figures(rows: dict[str, dict], segments: list[dict]) -> dict:
    """One (arm, round, workload) run's figures from its records (rows: the problems counted)."""
    rows_l = list(rows.values())
    ids = sorted({r["segment"] for r in rows_l})
    # each segment's time to its last answer (a cut segment's unfinished work is not counted)
    wall = sum(max(r["finished_at"] for r in rows_l if r["segment"] == s) for s in ids)
    segs = [s for s in segments if s["segment"] in ids]
    correct = sum(bool(r["correct"]) for r in rows_l)
    tokens = [r["n_tokens"] for r in rows_l]
    steps = sum(s["decode_steps"] for s in segs)
    evict = [s["eviction_seconds"] for s in segs if s.get("eviction_seconds") is not None]
    turns = ([r["turn1"] for r in rows_l] + [r["turn2"] for r in rows_l]
             if rows_l and "turn1" in rows_l[0] else rows_l)
    causes = {}
    for s in segs:
        for k, v in (s.get("evictions_by_cause") or {}).items():
            causes[k] = causes.get(k, 0.0) + v
    return {
        "n": len(rows_l), "correct": correct, "wall_s": wall,
        "answers_per_hour": answers_per_hour(correct, wall) if wall > 0 else None,
        "tokens_per_answer_mean": st.mean(tokens), "tokens_per_answer_p90": el.percentile(tokens, 90),
        "tokens_per_correct_answer": sum(tokens) / correct if correct else None,
        "finished_by_length": st.mean(r.get("finish") == "length" for r in turns),
        "ttft_s": percentiles([r["ttft"] for r in turns]),
        "itl_s": percentiles([x for r in turns for x in r["itl"]]),
        "latency_s": percentiles([r["latency"] for r in turns]),
        "peak_running": max((s["peak_running"] for s in segs), default=None),
        "mean_running": (sum(s["mean_running"] * s["decode_steps"] for s in segs) / steps
                         if steps else None),
        "retractions": sum(r["num_retractions"] for r in turns),
        "retractions_logged": sum(s["retractions"] for s in segs) if segs else None,
        "eviction_seconds": sum(evict) if evict else None,
        "eviction_share": sum(evict) / wall if evict and wall > 0 else None,
        "eviction_steps": (sum(s["eviction_steps"] for s in segs)
                           if segs and segs[0].get("eviction_steps") is not None else None),
        "evictions_by_cause": causes or None,
        "segments": len(ids),
        # a segment cut before its server figures were recorded: running, retractions logged
        # and eviction time cover only the other segments
        "server_figures_complete": len(segs) == len(ids),
        "processors": sorted({(s.get("machine") or {}).get("cpu") or "not recorded"
                              for s in segs}),
    }


def turn_figures(rows: dict[str, dict]) -> dict:
    """A multi-turn run's per-turn figures: accuracy of each turn, turn 2 consistent with turn
    1, and what the server had cached for turn 2 against what turn 1 left."""
    rows_l = list(rows.values())
    t1, t2 = [r["turn1"] for r in rows_l], [r["turn2"] for r in rows_l]
    left = [a["prompt_tokens"] + a["n_tokens"] for a in t1]  # turn 1's conversation
    cached = [b["cached_tokens"] for b in t2]
    return {
        "conversations": len(rows_l),
        "turn1_correct": sum(bool(a["correct"]) for a in t1),
        "turn2_correct": sum(bool(b["correct"]) for b in t2),
        "turn2_consistent": sum(bool(b["consistent"]) for b in t2),
        "turn1_tokens_mean": st.mean(left),
        "turn2_prompt_tokens_mean": st.mean(b["prompt_tokens"] for b in t2),
        "turn2_cached_tokens_mean": st.mean(cached),
        "turn2_cached_share_of_turn1": sum(cached) / sum(left) if left else None,
        "turn2_prefilled_tokens_mean": st.mean(b["prompt_tokens"] - b["cached_tokens"] for b in t2),
        "turn2_ttft_s": percentiles([b["ttft"] for b in t2]),
    }


def versus_stock(arm_runs: dict[int, dict], stock_runs: dict[int, dict], pids: list[str],
                 boot_iters: int) -> dict | None:
    """An arm against stock on the rounds both finished and the same problems: answers per hour
    (pooled ratio, paired bootstrap interval, round by round), output tokens per problem
    (paired), McNemar (first common round; each round's p)."""
    rounds = sorted(set(arm_runs) & set(stock_runs))
    if not rounds:
        return None

    def correct_rows(runs):
        return [[float(bool(runs[r]["rows"][p]["correct"])) for p in pids] for r in rounds]

    ci = answers_per_hour_ci(correct_rows(arm_runs), [arm_runs[r]["figures"]["wall_s"] for r in rounds],
                             correct_rows(stock_runs),
                             [stock_runs[r]["figures"]["wall_s"] for r in rounds], boot_iters)
    per_round = None
    if all(stock_runs[r]["figures"]["answers_per_hour"] for r in rounds):
        per_round = paired_runs.paired_ratio(
            [{"repeat": r, **arm_runs[r]["figures"]} for r in rounds],
            [{"repeat": r, **stock_runs[r]["figures"]} for r in rounds],
            lambda run: run["answers_per_hour"], lambda x, y: True)
    # tokens per problem, averaged over the common rounds, paired per problem
    tok_a = [st.mean(arm_runs[r]["rows"][p]["n_tokens"] for r in rounds) for p in pids]
    tok_s = [st.mean(stock_runs[r]["rows"][p]["n_tokens"] for r in rounds) for p in pids]
    diff, lo, hi = st.paired_bootstrap(tok_a, tok_s, iters=boot_iters)
    mcnemar = [st.paired_accuracy(*(
        [float(bool(runs[r]["rows"][p]["correct"])) for p in pids]
        for runs in (arm_runs, stock_runs)), iters=boot_iters) for r in rounds]
    first = mcnemar[0]
    return {"rounds": rounds, "answers_per_hour_ratio": ci["ratio"],
            "answers_per_hour_ratio_ci95": ci["ratio_ci95"],
            "resamples_without_stock_answers": ci["undefined"],
            "answers_per_hour_ratio_by_round": per_round,
            "tokens_per_answer_diff": diff, "tokens_per_answer_diff_ci95": [lo, hi],
            "tokens_per_answer_ratio": st.mean(tok_a) / st.mean(tok_s) if st.mean(tok_s) else None,
            "acc_diff": first["acc_diff"], "acc_diff_ci95": first["acc_diff_boot95"],
            "only_arm_right": first["only_a_right"], "only_stock_right": first["only_b_right"],
            "mcnemar_p": first["mcnemar_p"], "mcnemar_round": rounds[0],
            "mcnemar_p_by_round": [m["mcnemar_p"] for m in mcnemar]}


def turn_versus_stock(arm_runs: dict, stock_runs: dict, pids: list[str], boot_iters: int) -> dict | None:
    """Turn 2 against stock's on the first round both finished: accuracy (McNemar), cached and
    re-prefilled tokens per conversation (paired)."""
    rounds = sorted(set(arm_runs) & set(stock_runs))
    if not rounds:
        return None
    a, s = arm_runs[rounds[0]]["rows"], stock_runs[rounds[0]]["rows"]
    acc2 = st.paired_accuracy([float(bool(a[p]["turn2"]["correct"])) for p in pids],
                              [float(bool(s[p]["turn2"]["correct"])) for p in pids], boot_iters)
    cached = st.paired_bootstrap([a[p]["turn2"]["cached_tokens"] for p in pids],
                                 [s[p]["turn2"]["cached_tokens"] for p in pids], iters=boot_iters)
    return {"round": rounds[0], "turn2_acc_diff": acc2["acc_diff"],
            "turn2_acc_diff_ci95": acc2["acc_diff_boot95"], "turn2_mcnemar_p": acc2["mcnemar_p"],
            "turn2_cached_tokens_diff": cached[0], "turn2_cached_tokens_diff_ci95": list(cached[1:])}


def load_runs(out: Path) -> dict[tuple[str, str, int], dict]:
    """Every record file: (workload, arm, round) -> its finished problems and segments."""
    runs = {}
    for path in sorted((out / "records").glob("*.jsonl")):
        rows = acc.Records(path).rows
        segs = [r for r in rows.values() if r.get("kind") == "segment"]
        done = answered(rows)
        if not done and not segs:
            continue
        first = next(iter(done.values()), None) or segs[0]
        runs[(first["workload"], first["arm"], first["round"])] = {"rows": done, "segments": segs}
    return runs


def summarize(runs: dict, pids: dict[str, list[str]], arm_order: list[str] | None = None,
              boot_iters: int = 10000) -> dict:
    """Per workload and arm, over its finished rounds (every problem of `pids[workload]`
    answered): the figures above, and against stock. Runs not finished are listed apart."""
    summary: dict = {"workloads": {}, "unfinished": []}
    finished: dict[str, dict[str, dict[int, dict]]] = {}
    for (w, arm, rnd), run_ in runs.items():
        want = pids.get(w, [])
        if want and all(p in run_["rows"] for p in want):
            rows = {p: run_["rows"][p] for p in want}
            entry = {"rows": rows, "figures": run_figures(rows, run_["segments"])}
            if w == "multiturn":
                entry["figures"].update(turn_figures(rows))
            finished.setdefault(w, {}).setdefault(arm, {})[rnd] = entry
        else:
            summary["unfinished"].append({"workload": w, "arm": arm, "round": rnd,
                                          "answered": sum(p in run_["rows"] for p in want),
                                          "of": len(want)})
    order = {name: i for i, name in enumerate(arm_order or [])}
    for w in (x for x in WORKLOADS if x in finished):
        table = {}
        arms = sorted(finished[w], key=lambda x: (x != STOCK, order.get(x, len(order)), x))
        for arm in arms:
            by_round = finished[w][arm]
            rounds = sorted(by_round)
            figs = [by_round[r]["figures"] for r in rounds]
            rows = [row for r in rounds for row in by_round[r]["rows"].values()]
            turns = ([x for row in rows for x in (row["turn1"], row["turn2"])]
                     if w == "multiturn" else rows)
            tokens = [row["n_tokens"] for row in rows]
            ci = answers_per_hour_ci([[float(bool(by_round[r]["rows"][p]["correct"]))
                                       for p in pids[w]] for r in rounds],
                                     [f["wall_s"] for f in figs], iters=boot_iters)
            s = {"rounds": rounds, "n": len(pids[w]),
                 "correct_by_round": [f["correct"] for f in figs],
                 "answers_per_hour": ci["answers_per_hour"], "answers_per_hour_ci95": ci["ci95"],
                 "answers_per_hour_by_round": [f["answers_per_hour"] for f in figs],
                 "wall_s_by_round": [f["wall_s"] for f in figs],
                 "tokens_per_answer_mean": st.mean(tokens),
                 "tokens_per_answer_p90": el.percentile(tokens, 90),
                 "tokens_per_correct_answer": (sum(tokens) / sum(f["correct"] for f in figs)
                                               if any(f["correct"] for f in figs) else None),
                 "ttft_s": percentiles([x["ttft"] for x in turns]),
                 "itl_s": percentiles([y for x in turns for y in x["itl"]]),
                 "latency_s": percentiles([x["latency"] for x in turns]),
                 "peak_running": max((f["peak_running"] for f in figs
                                      if f["peak_running"] is not None), default=None),
                 "mean_running_by_round": [f["mean_running"] for f in figs],
                 "finished_by_length_by_round": [f["finished_by_length"] for f in figs],
                 "retractions_by_round": [f["retractions"] for f in figs],
                 "retractions_logged_by_round": [f["retractions_logged"] for f in figs],
                 "eviction_share_by_round": [f["eviction_share"] for f in figs],
                 "segments_by_round": [f["segments"] for f in figs],
                 "server_figures_complete": all(f["server_figures_complete"] for f in figs),
                 "processors": sorted({p for f in figs for p in f["processors"]}),
                 "by_round": figs}
            if w == "multiturn":
                for k in ("turn1_correct", "turn2_correct", "turn2_consistent"):
                    s[f"{k}_by_round"] = [f[k] for f in figs]
                for k in ("turn1_tokens_mean", "turn2_prompt_tokens_mean",
                          "turn2_cached_tokens_mean", "turn2_prefilled_tokens_mean",
                          "turn2_cached_share_of_turn1"):
                    s[k] = st.mean(f[k] for f in figs)
                s["turn2_ttft_s"] = percentiles([row["turn2"]["ttft"] for row in rows])
            if arm != STOCK and STOCK in finished[w]:
                s["vs_stock"] = versus_stock(by_round, finished[w][STOCK], pids[w], boot_iters)
                if w == "multiturn":
                    s["vs_stock"].update(turn_versus_stock(by_round, finished[w][STOCK], pids[w],
                                                           boot_iters) or {})
            table[arm] = s
        summary["workloads"][w] = table
    return summary


# ----------------------------------------------------------------------------- report


def _f(x, spec=".1f", scale=1.0) -> str:
    return "–" if x is None else format(scale * x, spec)


def _ci(pair, spec=".1f") -> str:
    return "–" if not pair or pair[0] is None else f"[{pair[0]:{spec}}, {pair[1]:{spec}}]"


def _pcts(p, spec=".1f", scale=1.0) -> str:
    return f"{_f(p['p50'], spec, scale)} / {_f(p['p90'], spec, scale)}"


def markdown(summary: dict) -> str:
    lines = []
    for w, table in summary["workloads"].items():
        lines += [f"### workload: {w}", ""]
        if w == "multiturn":
            lines += ["| arm | rounds | turn 1 / turn 2 correct (of n) | turn 2 consistent | "
                      "turn 1 tokens (prompt + answer) | turn 2 prompt / cached / prefilled again "
                      "| turn 2 TTFT p50 / p90 (s) | turn 2 vs stock: Δ accuracy [95%], McNemar p |",
                      "|---|---|---|---|---|---|---|---|"]
            for arm, s in table.items():
                v = s.get("vs_stock") or {}
                vs = ("–" if "turn2_acc_diff" not in v else
                      f"{v['turn2_acc_diff']:+.2f} {_ci(v['turn2_acc_diff_ci95'], '+.2f')}, "
                      f"p = {v['turn2_mcnemar_p']:.2f}")
                lines.append(
                    f"| {arm} | {len(s['rounds'])} | "
                    f"{','.join(map(str, s['turn1_correct_by_round']))} / "
                    f"{','.join(map(str, s['turn2_correct_by_round']))} (of {s['n']}) | "
                    f"{','.join(map(str, s['turn2_consistent_by_round']))} | "
                    f"{_f(s['turn1_tokens_mean'])} | {_f(s['turn2_prompt_tokens_mean'])} / "
                    f"{_f(s['turn2_cached_tokens_mean'])} / {_f(s['turn2_prefilled_tokens_mean'])} "
                    f"| {_pcts(s['turn2_ttft_s'], '.2f')} | {vs} |")
            lines.append("")
            continue
        lines += ["| arm | rounds | correct (of n) | answers / h [95%] | vs stock [95%] (by round) "
                  "| wall (s) | tokens / answer mean / p90 | Δ tokens vs stock [95%] | "
                  "TTFT p50 / p90 (s) | ITL p50 / p90 (ms) | latency p50 / p90 (s) | "
                  "running peak / mean | retractions | eviction share | McNemar p vs stock |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, s in table.items():
            v = s.get("vs_stock") or {}
            ratio = "–"
            if v.get("answers_per_hour_ratio") is not None:
                by = v.get("answers_per_hour_ratio_by_round")
                rounds = "" if not by else " (" + ", ".join(f"{x:.2f}" for x in by["per_pair"]) + ")"
                ratio = (f"{v['answers_per_hour_ratio']:.2f}× "
                         f"{_ci(v['answers_per_hour_ratio_ci95'], '.2f')}{rounds}")
            dtok = ("–" if not v else f"{v['tokens_per_answer_diff']:+.1f} "
                    f"{_ci(v['tokens_per_answer_diff_ci95'], '+.1f')}")
            share = [x for x in s["eviction_share_by_round"] if x is not None]
            lines.append(
                f"| {arm} | {len(s['rounds'])} | {','.join(map(str, s['correct_by_round']))} "
                f"(of {s['n']}) | {_f(s['answers_per_hour'])} {_ci(s['answers_per_hour_ci95'])} | "
                f"{ratio} | {', '.join(f'{x:.1f}' for x in s['wall_s_by_round'])} | "
                f"{_f(s['tokens_per_answer_mean'])} / {_f(s['tokens_per_answer_p90'], '.0f')} | "
                f"{dtok} | {_pcts(s['ttft_s'], '.2f')} | {_pcts(s['itl_s'], '.0f', 1e3)} | "
                f"{_pcts(s['latency_s'])} | {_f(s['peak_running'], '.0f')} / "
                f"{', '.join(_f(x) for x in s['mean_running_by_round'])} | "
                f"{', '.join(map(str, s['retractions_by_round']))} | "
                f"{', '.join(f'{100 * x:.2f} %' for x in share) or '–'} | "
                f"{_f(v.get('mcnemar_p'), '.2f')} |")
        lines.append("")
    notes = []
    for w, table in summary["workloads"].items():
        for arm, s in table.items():
            if any(k > 1 for k in s["segments_by_round"]):
                notes.append(f"- {w}, {arm}: resumed after a cut (segments by round "
                             f"{s['segments_by_round']}): its wall time leaves out the work in "
                             "flight at the cut")
            if not s["server_figures_complete"]:
                notes.append(f"- {w}, {arm}: a cut segment has no server figures (running "
                             "requests, logged retractions, eviction time cover the others)")
    for u in summary["unfinished"]:
        notes.append(f"- unfinished: {u['workload']}, {u['arm']}, round {u['round']}: "
                     f"{u['answered']} of {u['of']} answered (not in the tables)")
    procs = sorted({p for t in summary["workloads"].values() for s in t.values()
                    for p in s["processors"]})
    notes.append(f"- processor: {', '.join(procs) or 'not recorded'}")
    return "\n".join(lines + notes) + "\n"


def plot(summary: dict, out: Path) -> Path | None:
    single = [w for w in summary["workloads"] if w != "multiturn"]
    if not single:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(single), 3, figsize=(15, 4.2 * len(single)), squeeze=False)
    for row, w in zip(axes, single):
        table = summary["workloads"][w]
        names = list(table)
        xs = range(len(names))
        colors = [f"C{i}" for i in xs]

        def bars(ax, values, cis, title, ylabel):
            ys = [v if v is not None else math.nan for v in values]
            err = [[y - (c[0] if c and c[0] is not None else y) for y, c in zip(ys, cis)],
                   [(c[1] if c and c[1] is not None else y) - y for y, c in zip(ys, cis)]]
            ax.bar(xs, ys, yerr=err, capsize=3, color=colors)
            ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
            ax.set(title=f"{w}: {title}", ylabel=ylabel)
            ax.grid(alpha=0.3, axis="y")

        bars(row[0], [table[n]["answers_per_hour"] for n in names],
             [table[n]["answers_per_hour_ci95"] for n in names],
             "correct answers per hour [95%]", "answers / hour")
        vs = [table[n].get("vs_stock") or {} for n in names]
        bars(row[1], [1.0 if n == STOCK else v.get("answers_per_hour_ratio")
                      for n, v in zip(names, vs)],
             [None if n == STOCK else v.get("answers_per_hour_ratio_ci95") for n, v in zip(names, vs)],
             "answers per hour / stock's, paired [95%]", "ratio")
        row[1].axhline(1.0, color="k", lw=0.8)
        bars(row[2], [table[n]["tokens_per_answer_mean"] for n in names], [None] * len(names),
             "output tokens per answer (bar: mean, dot: p90)", "tokens")
        row[2].plot(list(xs), [table[n]["tokens_per_answer_p90"] for n in names], "ko")
    cfg = summary.get("config")
    if cfg:
        fig.suptitle(f"{Path(str(cfg['model_path'])).name}: pool {cfg['max_total_tokens']} tokens, "
                     f"{cfg['problems']} problems, natural stopping (greedy)")
    path = out / "answers_per_hour.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_sizes(cfg: dict, runs: dict) -> dict[str, int]:
    """Problems a run of each workload has: the latest command's (config.json), or more where
    the records hold runs started larger (their first segment's n) — a later command that adds
    Poisson arms without --multi-turn must not hide the conversations already recorded."""
    n = {"all": cfg["problems"], "poisson": cfg["problems"], "multiturn": cfg["multi_turn"]}
    for (w, _, _), run_ in runs.items():
        first = [s["n"] for s in run_["segments"] if s.get("segment") == 0 and "n" in s]
        n[w] = max([n.get(w, 0)] + first)
    return n


def report(out: Path, boot_iters: int = 10000) -> dict:
    cfg = json.loads((out / "config.json").read_text())
    runs = load_runs(out)
    n = run_sizes(cfg, runs)
    probs = acc.load_problems(cfg["task"], max(n.values()), cfg["seed"])
    pids = {w: [p["pid"] for p in probs[:k]] for w, k in n.items()}
    summary = summarize(runs, pids, cfg.get("arms"), boot_iters)
    summary["config"] = cfg
    plot(summary, out)
    (out / "summary.md").write_text(markdown(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
