"""The accuracy harness' reporting (benchmarks/accuracy.py): the records compacted for a commit,
the per-arm summary (accuracy with Wilson intervals, paired differences against the full cache,
teacher-forced KL / NLL / top-1 with bootstrap intervals and paired differences between arms),
its markdown tables and plots (accuracy.png, fidelity.png, budget_curve.png), and the comparison
of two runs' shared arms."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from benchmarks import accuracy_stats as st
from benchmarks.accuracy_harness import TF_K, Arm, Records
from vase_sglang.policies import needs_gates


def _recorded_evictions(recs: dict) -> list:
    """kv_evicted of each record; a record without it is an error, not 0."""
    missing = [pid for pid, r in recs.items() if r.get("kv_evicted") is None]
    if missing:
        raise RuntimeError(f"records without kv_evicted (not from a VaSE server?): {missing[:5]}")
    return [r["kv_evicted"] for r in recs.values()]


COMPACT = "records.jsonl.gz"


def compact_row(row: dict) -> dict:
    """What the report reads, small enough to commit: the full cache's top-k reference of the
    teacher-forced rows (needed only while the policies are replayed) is dropped, and per-token
    floats are rounded to 5 decimals."""
    out = {k: v for k, v in row.items() if k not in ("ref_ids", "ref_lp")}
    for k in ("nll", "kl"):
        if k in out:
            out[k] = [round(x, 5) for x in out[k]]
    return out


def write_compact(out: Path, rows: list[dict]) -> Path:
    import gzip

    path = out / COMPACT
    with gzip.open(path, "wt") as f:
        for row in sorted(rows, key=lambda r: r["key"]):
            f.write(json.dumps(compact_row(row)) + "\n")
    return path


def load_rows(out: Path) -> list[dict]:
    """The run's records; where only the compact copy exists (a committed result), that."""
    if (out / "records.jsonl").exists():
        return list(Records(out / "records.jsonl").rows.values())
    if (out / COMPACT).exists():
        import gzip

        with gzip.open(out / COMPACT, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    raise FileNotFoundError(f"no records.jsonl or {COMPACT} in {out}")


def paired_answers(a: dict, b: dict, pids: list, boot_iters: int) -> dict:
    """Two arms' records on the same problems, paired: accuracy difference a − b with its
    bootstrap interval, the discordant problems and McNemar's p, the share of equal answers,
    and (with `output_ids`) where each pair of outputs first differs (None: identical)."""
    return {**st.paired_accuracy([float(a[p]["correct"]) for p in pids],
                                 [float(b[p]["correct"]) for p in pids], boot_iters),
            "same_answer": st.mean(a[p]["pred"] == b[p]["pred"] for p in pids),
            "divergences": [st.first_divergence(a[p]["output_ids"], b[p]["output_ids"])
                            for p in pids]}


def summarize(rows: list[dict], boot_iters: int = 10000) -> dict:
    by_arm: dict[str, dict[str, dict]] = defaultdict(dict)
    fields: dict[str, dict] = {}
    for r in rows:
        by_arm[r["arm"]][r["pid"]] = r
        fields[r["arm"]] = r["arm_fields"]
    summary = {"generation": {}, "teacher_forced": {}}
    full_name = {"greedy": Arm("full").name,
                 "sample": Arm("full", decoding="sample").name}
    for name, recs in sorted(by_arm.items()):
        f = fields[name]
        arm = Arm(**f)
        if arm.kind == "tf":
            continue
        n = len(recs)
        k = sum(r["correct"] for r in recs.values())
        lo, hi = st.wilson(k, n)
        s = {**f, "setting": arm.setting, "n": n, "correct": k, "accuracy": k / n if n else None,
             "wilson95": [lo, hi],
             "mean_tokens": st.mean(r["n_tokens"] for r in recs.values()),
             "loop_rate": st.mean(r["finish"] == "length" for r in recs.values()),
             "mean_kv_evicted": st.mean(_recorded_evictions(recs))}
        full = by_arm.get(full_name[arm.decoding], {})
        common = sorted(set(recs) & set(full))
        if arm.evicts and common:
            pair = paired_answers(recs, full, common, boot_iters)
            divs = pair.pop("divergences")
            pair["only_policy_right"] = pair.pop("only_a_right")
            pair["only_full_right"] = pair.pop("only_b_right")
            s["vs_full"] = pair
            if arm.decoding == "greedy":
                pos = [x for x in divs if x is not None]
                s["vs_full"].update({
                    "identical": st.mean(x is None for x in divs),
                    "first_divergence_median": sorted(pos)[len(pos) // 2] if pos else None,
                    "first_divergence_mean": st.mean(pos) if pos else None,
                    # eviction starts once the private cache holds budget + window tokens: an
                    # earlier divergence is batch numerics, not the policy
                    "diverged_before_first_eviction": st.mean(
                        x is not None and x < arm.budget + arm.window for x in divs)})
        summary["generation"][name] = s
    tf_full = by_arm.get(Arm("full", kind="tf").name, {})
    sums: dict[str, dict] = {}  # per tf arm: per-problem metric sums over the measured tokens
    for name, recs in sorted(by_arm.items()):
        arm = Arm(**fields[name])
        if arm.kind != "tf":
            continue
        start = arm.budget + arm.window if arm.evicts else 0
        nll_all = [x for r in recs.values() for x in r["nll"]]
        after = [x for r in recs.values() for x in r["nll"][start:]]
        agree = [x for r in recs.values() for x in r["top1_agree"][start:]]
        s = {**fields[name], "setting": arm.setting, "n": len(recs), "tokens": len(nll_all),
             "tokens_after_first_eviction": len(after),
             "nll_mean": st.mean(nll_all), "nll_after_first_eviction": st.mean(after),
             "top1_agree_after_first_eviction": st.mean(agree)}
        if arm.evicts:
            common = sorted(set(recs) & set(tf_full))
            sums[name] = per = tf_sums(recs, tf_full, common, start)
            s["n_paired"] = len(common)
            counts = [per[p]["count"] for p in common]
            for metric in TF_METRICS:
                m, lo, hi = st.cluster_bootstrap([per[p][metric] for p in common], counts,
                                                 boot_iters)
                s[f"{metric}_after_first_eviction"] = m
                s[f"{metric}_boot95_after_first_eviction"] = [lo, hi]
            kl = [x for r in recs.values() for x in r["kl"][start:]]
            s["kl_p90_after_first_eviction"] = sorted(kl)[int(0.9 * len(kl))] if kl else None
            s["kl_note"] = f"KL(full || policy) on the full cache's top-{TF_K} ids + the rest: a lower bound"
            s["compression"] = generated_compression(
                [len(recs[p]["nll"]) for p in common], arm.budget, arm.window)
        summary["teacher_forced"][name] = s
    summary["teacher_forced_pairs"] = tf_pairs(fields, sums, boot_iters)
    return summary


# per-token teacher-forced metrics, summarised over the tokens after the first eviction
TF_METRICS = ("kl", "nll_excess", "top1_agree")
# (reference arm, what it is compared with): VaSE-AttnV against each other policy at the same
# budget, and against itself without its value slots; trimkv against its VaSE hybrid
PAIR_REFERENCE = "vase-attnv"


def tf_sums(recs: dict, tf_full: dict, pids: list, start: int) -> dict:
    """Per problem: sums of KL, NLL excess over the full cache's replay (same tokens) and top-1
    agreement over the tokens after the first eviction, and their count."""
    out = {}
    for p in pids:
        r, f = recs[p], tf_full[p]
        out[p] = {"kl": sum(r["kl"][start:]),
                  "nll_excess": sum(r["nll"][start:]) - sum(f["nll"][start:]),
                  "top1_agree": sum(r["top1_agree"][start:]), "count": len(r["nll"][start:])}
    return out


def generated_compression(lengths: list[int], budget: int, window: int) -> float:
    """How many times smaller the generated tokens' cache is than under the full cache, averaged
    over the measured tokens (positions t >= T + R, where the cache holds T + (t - T) mod R of
    the t generated tokens; the prompt, never evicted, is left out)."""
    num = den = 0.0
    for n in lengths:
        for t in range(budget + window, n):
            num += t / (budget + (t - budget) % window)
            den += 1
    return num / den if den else float("nan")


def tf_pairs(fields: dict, sums: dict, boot_iters: int) -> dict:
    """Paired differences (reference − other) of the teacher-forced metrics on the problems both
    arms replayed, with a bootstrap CI over problems and p-value; significant when the 95% CI
    excludes 0."""
    pairs = {}
    # records of two gates files (say in-distribution and general gates) make two trimkv arms
    # of one label: name each by its gates, or one pair would overwrite the other
    several_gates = len({fields[n].get("gates") for n in sums} - {None, ""}) > 1

    def label(x: Arm) -> str:
        return x.label + (f" g{x.gates}" if several_gates and x.gates else "")

    for ref_name, ref in sums.items():
        a = Arm(**fields[ref_name])
        if a.value_slots is not None or not (a.policy == PAIR_REFERENCE
                                             or needs_gates(a.policy)):
            continue
        for name, other in sums.items():
            b = Arm(**fields[name])
            if name == ref_name or (b.budget, b.window) != (a.budget, a.window):
                continue
            # trimkv is the reference against its own hybrid (same gates) and, where two gates
            # files ran, against the other gates with the same value slots (once per pair:
            # the gates whose hash sorts first are the reference)
            if needs_gates(a.policy) and not (
                    b.policy == a.policy and (b.gates == a.gates or (
                        b.value_slots == a.value_slots and b.gates > a.gates))):
                continue
            pids = sorted(set(ref) & set(other))
            counts = [ref[p]["count"] for p in pids]
            assert counts == [other[p]["count"] for p in pids]  # same forced tokens
            row = {"reference": label(a), "other": label(b), "budget": a.budget,
                   "window": a.window, "n_paired": len(pids)}
            for metric in TF_METRICS:
                d, lo, hi, p = st.paired_cluster_bootstrap(
                    [ref[q][metric] for q in pids], [other[q][metric] for q in pids], counts,
                    boot_iters)
                row[metric] = {"diff": d, "boot95": [lo, hi], "p": p,
                               "significant": bool(lo > 0 or hi < 0)}
            pairs[f"{label(a)} vs {label(b)} @T={a.budget}"] = row
    return pairs


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = [s for s in summary["generation"].values() if s["decoding"] == "greedy"]
    full = next((s for s in gen if s["policy"] == "full"), None)
    lines = defaultdict(list)
    for s in gen:
        if s["policy"] != "full":
            lines[Arm(**{k: s[k] for k in ("policy", "value_slots")}).label].append(s)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for lab, ss in sorted(lines.items()):
        ss.sort(key=lambda s: s["budget"])
        xs = [s["budget"] for s in ss]
        axes[0].errorbar(xs, [s["accuracy"] for s in ss], marker="o", capsize=3, label=lab,
                         yerr=[[s["accuracy"] - s["wilson95"][0] for s in ss],
                               [s["wilson95"][1] - s["accuracy"] for s in ss]], alpha=0.8)
        axes[1].plot(xs, [s.get("vs_full", {}).get("same_answer") for s in ss], marker="o",
                     label=lab)
    if full:
        for ax, y in ((axes[0], full["accuracy"]), (axes[1], 1.0)):
            ax.axhline(y, color="k", ls="--", label="full cache")
        axes[0].axhspan(*full["wilson95"], color="k", alpha=0.08)
    axes[0].set(xlabel="budget T (tokens per layer and KV head)", ylabel="accuracy (greedy)",
                title="accuracy vs budget (95% Wilson CI)")
    axes[1].set(xlabel="budget T", ylabel="share with the same answer as full",
                title="answer agreement with the full cache")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=110)
    plt.close(fig)

    all_tf = [s for s in summary["teacher_forced"].values() if s["policy"] != "full"]
    main_budget = _main_budget(out, all_tf)
    tf = [s for s in all_tf if s["budget"] == main_budget]
    # --task champ replays texts other models wrote, not the full cache's own output
    cfg = out / "config.json"
    recorded = cfg.exists() and json.loads(cfg.read_text()).get("task") == "champ"
    replayed = "recorded solutions" if recorded else "the full-cache greedy output"
    panels = ((f"KL(full||policy), top-{TF_K}+rest", "kl"),
              ("NLL excess over full (nats/token)", "nll_excess"),
              ("top-1 agreement with the replayed text" if recorded
               else "top-1 agreement with full output", "top1_agree"))
    if tf:
        tf.sort(key=lambda s: s.get("kl_after_first_eviction") or 0)
        # two gates files make two trimkv bars: name each by its gates (as tf_pairs does)
        several_gates = len({s.get("gates") for s in tf} - {None, ""}) > 1
        labels = [Arm(**{k: s[k] for k in ("policy", "value_slots")}).label
                  + (f" g{s['gates']}" if several_gates and s.get("gates") else "") for s in tf]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        for ax, (title, metric) in zip(axes, panels):
            vals, err = _with_ci(tf, metric)
            ax.barh(labels, vals, xerr=err, capsize=3)
            ax.set_title(title + " [95% bootstrap CI]", fontsize=9)
        fig.suptitle(f"teacher-forced replay of {replayed} at T={main_budget} "
                     f"(tokens after the first eviction, n={tf[0]['n']} problems)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "fidelity.png", dpi=110)
        plt.close(fig)
    curves = defaultdict(list)
    for s in all_tf:
        curves[Arm(**{k: s[k] for k in ("policy", "value_slots")}).label].append(s)
    curves = {lab: sorted(ss, key=lambda s: s["budget"]) for lab, ss in curves.items()
              if len({s["budget"] for s in ss}) >= 2}
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for lab, ss in sorted(curves.items()):
            xs = [s["compression"] for s in ss]
            for ax, (title, metric) in zip(axes, (panels[0], panels[2])):
                vals, err = _with_ci(ss, metric)
                ax.errorbar(xs, vals, yerr=err, marker="o", capsize=3, label=lab, alpha=0.85)
        for ax, (title, _) in zip(axes, (panels[0], panels[2])):
            ax.set_xscale("log", base=2)
            ax.set(xlabel="compression of the generated tokens' cache (x, mean over measured "
                          "tokens)", title=title + " [95% bootstrap CI]")
            ax.legend(fontsize=8)
        for s in next(iter(curves.values())):  # budget labels on the first panel
            axes[0].annotate(f"T={s['budget']}", (s["compression"], s["kl_after_first_eviction"]),
                             fontsize=7, textcoords="offset points", xytext=(4, 4))
        n_min = min(s['n'] for ss in curves.values() for s in ss)
        fig.suptitle(f"budget curve (teacher-forced, R = T/4, n={n_min} problems)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / "budget_curve.png", dpi=110)
        plt.close(fig)


def _main_budget(out: Path, tf_summaries: list[dict]) -> int | None:
    cfg = out / "config.json"
    if cfg.exists():
        return json.loads(cfg.read_text())["budget"]
    budgets = [s["budget"] for s in tf_summaries]
    return max(set(budgets), key=budgets.count) if budgets else None


def _with_ci(summaries: list[dict], metric: str):
    """Values and asymmetric error bars of a teacher-forced metric."""
    key, ci = f"{metric}_after_first_eviction", f"{metric}_boot95_after_first_eviction"
    vals = [s.get(key) for s in summaries]
    lo = [v - s[ci][0] if ci in s else 0 for v, s in zip(vals, summaries)]
    hi = [s[ci][1] - v if ci in s else 0 for v, s in zip(vals, summaries)]
    return vals, [lo, hi]


def markdown(summary: dict) -> str:
    lines = ["| arm | n | accuracy [95% CI] | Δ vs full [boot 95%] | McNemar p | same answer | "
             "1st divergence (median) | loops | mean tokens |", "|---" * 9 + "|"]
    for name, s in summary["generation"].items():
        v = s.get("vs_full", {})
        fmt = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
        ci = f"{fmt(s['accuracy'])} [{fmt(s['wilson95'][0])}, {fmt(s['wilson95'][1])}]"
        d = ("–" if not v else f"{v['acc_diff']:+.2f} [{v['acc_diff_boot95'][0]:+.2f}, "
             f"{v['acc_diff_boot95'][1]:+.2f}]")
        lines.append(f"| {name} | {s['n']} | {ci} | {d} | {fmt(v.get('mcnemar_p'), 3)} | "
                     f"{fmt(v.get('same_answer'))} | {v.get('first_divergence_median', '–')} | "
                     f"{fmt(s['loop_rate'])} | {s['mean_tokens']:.0f} |")
    if summary["teacher_forced"]:
        lines += ["", "| teacher-forced arm | n | compression | NLL after 1st eviction | "
                  "NLL excess [boot 95%] | KL, lower bound [boot 95%] | top-1 agreement [boot 95%] |",
                  "|---" * 7 + "|"]
        for name, s in summary["teacher_forced"].items():
            cells = []
            for metric, p in (("nll_excess", "+.3f"), ("kl", ".4f"), ("top1_agree", ".3f")):
                v = s.get(f"{metric}_after_first_eviction")
                ci = s.get(f"{metric}_boot95_after_first_eviction")
                cells.append("–" if v is None
                             else f"{v:{p}}" + (f" [{ci[0]:{p}}, {ci[1]:{p}}]" if ci else ""))
            comp = f"{s['compression']:.1f}×" if "compression" in s else "–"
            lines.append(f"| {name} | {s['n']} | {comp} | {s['nll_after_first_eviction']:.3f} | "
                         + " | ".join(cells) + " |")
    if summary.get("teacher_forced_pairs"):
        lines += ["", "| paired difference (teacher-forced) | n | ΔKL [boot 95%] | p | "
                  "ΔNLL excess [boot 95%] | p | Δtop-1 [boot 95%] | p |", "|---" * 8 + "|"]
        for name, row in summary["teacher_forced_pairs"].items():
            cells = []
            for metric in TF_METRICS:
                m = row[metric]
                star = " *" if m["significant"] else ""
                cells.append(f"{m['diff']:+.4f} [{m['boot95'][0]:+.4f}, {m['boot95'][1]:+.4f}]"
                             f"{star} | {m['p']:.3f}")
            lines.append(f"| {name} | {row['n_paired']} | " + " | ".join(cells) + " |")
        lines.append("\n\\* the 95% interval excludes 0")
    return "\n".join(lines) + "\n"


def report(out: Path, boot_iters: int = 10000) -> dict:
    rows = load_rows(out)
    if (out / "records.jsonl").exists():
        write_compact(out, rows)
    summary = summarize(rows, boot_iters)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out)
    return summary


def compare(a_rows: list[dict], b_rows: list[dict], boot_iters: int = 10000) -> dict:
    """Each generation arm that both runs served (same arm name: policy, budget, window,
    decoding), paired per problem: run A against run B. For two runs that differ only in what the
    arm names do not say, e.g. the server's --kv-cache-dtype. Problems are matched by id and must
    have the same question in both runs (same task and seed)."""
    def by_arm(rows):
        out: dict[str, dict[str, dict]] = defaultdict(dict)
        for r in rows:
            if r["arm_fields"].get("kind", "gen") != "tf":
                out[r["arm"]][r["pid"]] = r
        return out

    a_arms, b_arms = by_arm(a_rows), by_arm(b_rows)
    result = {}
    for name in sorted(set(a_arms) & set(b_arms)):
        ra, rb = a_arms[name], b_arms[name]
        common = sorted(set(ra) & set(rb))
        if not common:
            continue
        differ = [p for p in common if ra[p].get("question") != rb[p].get("question")]
        if differ:
            raise ValueError(f"{name}: the runs hold different problems under the same ids "
                             f"(another task or seed?): {differ[:3]}")
        pair = paired_answers(ra, rb, common, boot_iters)
        divs = pair.pop("divergences")
        pos = sorted(x for x in divs if x is not None)
        ka, kb, n = (sum(bool(ra[p]["correct"]) for p in common),
                     sum(bool(rb[p]["correct"]) for p in common), len(common))
        result[name] = {
            **pair, "a_correct": ka, "b_correct": kb,
            "a_accuracy": ka / n, "a_wilson95": list(st.wilson(ka, n)),
            "b_accuracy": kb / n, "b_wilson95": list(st.wilson(kb, n)),
            "identical": st.mean(x is None for x in divs),
            "first_divergence_median": pos[len(pos) // 2] if pos else None,
            "a_mean_tokens": st.mean(ra[p]["n_tokens"] for p in common),
            "b_mean_tokens": st.mean(rb[p]["n_tokens"] for p in common)}
    return result


def compare_markdown(result: dict, a_label: str, b_label: str) -> str:
    lines = [f"| arm | n | {a_label} [95% CI] | {b_label} [95% CI] | Δ ({a_label} − {b_label}) "
             f"[boot 95%] | only {a_label} right | only {b_label} right | McNemar p | "
             "same answer | identical output | 1st divergence (median) |", "|---" * 11 + "|"]
    for name, c in result.items():
        lines.append(
            f"| {name} | {c['n_paired']} | {c['a_accuracy']:.2f} [{c['a_wilson95'][0]:.2f}, "
            f"{c['a_wilson95'][1]:.2f}] | {c['b_accuracy']:.2f} [{c['b_wilson95'][0]:.2f}, "
            f"{c['b_wilson95'][1]:.2f}] | {c['acc_diff']:+.2f} [{c['acc_diff_boot95'][0]:+.2f}, "
            f"{c['acc_diff_boot95'][1]:+.2f}] | {c['only_a_right']} | {c['only_b_right']} | "
            f"{c['mcnemar_p']:.3f} | {c['same_answer']:.2f} | {c['identical']:.2f} | "
            f"{c['first_divergence_median'] if c['first_divergence_median'] is not None else '–'} |")
    return "\n".join(lines) + "\n"
