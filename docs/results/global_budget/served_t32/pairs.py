"""The analysis behind paired_greedy.txt: an arm's greedy answers paired on problems with every
other greedy arm of an accuracy records file (benchmarks/accuracy.py's), McNemar's exact p and
a paired bootstrap interval (benchmarks/accuracy_stats.paired_accuracy).

    python docs/results/global_budget/served_t32/pairs.py results/accuracy_t32/records.jsonl \
        --arm trimkv@32/w8/ge5aa8832/global:greedy --budget 32
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks.accuracy_stats import paired_accuracy  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("records")
    ap.add_argument("--arm", required=True)
    ap.add_argument("--budget", type=int, required=True, help="the other arms: this budget's")
    a = ap.parse_args()
    rows: dict = {}
    with open(a.records) as f:
        for line in f:
            r = json.loads(line)
            if r["arm"].endswith(":greedy") and "correct" in r:
                rows.setdefault(r["arm"], {})[r["pid"]] = r
    arms = [x for x in rows if x == "full:greedy" or f"@{a.budget}/" in x]
    print({x: (sum(r["correct"] for r in rows[x].values()), len(rows[x])) for x in arms})
    mine = rows[a.arm]
    for other in (x for x in arms if x != a.arm):
        common = sorted(set(mine) & set(rows[other]))
        res = paired_accuracy([float(mine[p]["correct"]) for p in common],
                              [float(rows[other][p]["correct"]) for p in common])
        lo, hi = res["acc_diff_boot95"]
        line = (f"{a.arm} vs {other}: n={len(common)} acc diff {res['acc_diff']:+.3f} "
                f"[{lo:+.3f}, {hi:+.3f}] only this {res['only_a_right']} only other "
                f"{res['only_b_right']} p={res['mcnemar_p']:.3g}")
        if other == "full:greedy":
            right = [p for p in common if rows[other][p]["correct"]]
            line += f"; of the full cache's {len(right)} right, this keeps " \
                    f"{sum(mine[p]['correct'] for p in right)}"
        print(line)
    toks = [r["n_tokens"] for r in mine.values()]
    full = [rows["full:greedy"][p]["n_tokens"] for p in mine if p in rows.get("full:greedy", {})]
    print(f"{a.arm}: mean output tokens {sum(toks) / len(toks):.0f} (full cache "
          f"{sum(full) / max(1, len(full)):.0f}); stopped by max_new_tokens "
          f"{sum(r['finish'] == 'length' for r in mine.values())}")


if __name__ == "__main__":
    main()
