"""Summarise ``tools/bench_am.py`` results over several runs (seeds): per variant and keep ratio the continuation
ΔNLL of every passage, their sum and its ratio to KVzip's, multi-query facts found, and the build time against
KVzip's (the median over passages of the per-passage ratio, both measured side by side in one process).

    python tools/am_summary.py runs/am28_off_ss16_seed8.json runs/am28_off_ss16_seed9.json runs/am28_off_ss16_seed10.json

Passages are matched across runs by their seed (from each file's command line) and key, so runs of different
variants over the same seeds line up; KVzip's row is taken from the first run that has it (the bench is
deterministic, so every run's KVzip row is the same; a mismatch is reported).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path


def _seed(command: str) -> str:
    m = re.search(r"--seed (\d+)", command)
    return m.group(1) if m else "0"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="results files of tools/bench_am.py")
    args = ap.parse_args(argv)
    cont: dict[tuple[str, float], dict[str, float]] = {}  # (variant, ratio) -> {passage: delta}
    facts: dict[tuple[str, float], list[int]] = {}  # (variant, ratio) -> [correct, asked]
    builds: dict[str, list[float]] = {}  # variant -> per-passage build / KVzip's
    seen: set[tuple] = set()  # (variant, ratio, seed, context) already counted
    for path in args.runs:
        run = json.loads(path.read_text())
        seed = _seed(run.get("command", ""))
        for row in run["continuation"]:
            cell = cont.setdefault((row["variant"], row["ratio"]), {})
            key = f"{seed}/{row['doc'].rsplit('/', 1)[-1]}"
            if key in cell and abs(cell[key] - row["delta_nll"]) > 1e-6:
                print(f"warning: {row['variant']} at {row['ratio']} on {key} differs between runs", file=sys.stderr)
            cell.setdefault(key, row["delta_nll"])
        for row in run["multiquery"]:
            mark = (row["variant"], row["ratio"], seed, row["context"])
            if mark in seen:
                continue
            seen.add(mark)
            tally = facts.setdefault((row["variant"], row["ratio"], seed), [0, 0])
            tally[0] += row["correct"]
            tally[1] += row["asked"]
        for row in run["build_seconds"]:
            base = row.get("kvzip")
            for name, seconds in row.items():
                if name not in ("doc", "kvzip") and base:
                    builds.setdefault(name, []).append(seconds / base)
    ratios = sorted({r for _, r in cont}, reverse=True)
    variants = list(dict.fromkeys(v for v, _ in cont))
    for r in ratios:
        base = cont.get(("kvzip", r), {})
        order = lambda p: (int(p.split("/")[0]), p)  # noqa: E731
        passages = sorted(base, key=order) or sorted({p for (v, rr), c in cont.items() if rr == r for p in c},
                                                     key=order)
        print(f"\nkeep {r}: continuation ΔNLL per passage (seed/doc), sum, / KVzip's; multi-query facts")
        print("| variant | " + " | ".join(passages) + " | sum | / KVzip's | multi-query |")
        print("|---|" + "---:|" * (len(passages) + 3))
        for v in variants:
            cell = cont.get((v, r))
            if not cell:
                continue
            shared = [p for p in passages if p in cell]
            total = sum(cell[p] for p in shared)
            ref = sum(base[p] for p in shared) if base else None
            mq = [facts[k] for k in facts if k[0] == v and k[1] == r]
            mq_text = f"{sum(c for c, _ in mq)}/{sum(a for _, a in mq)}" if mq else ""
            print(f"| {v} | " + " | ".join(f"{cell[p]:+.3f}" if p in cell else "" for p in passages)
                  + f" | {total:+.3f} | " + (f"{total / ref:.2f}x" if ref else "") + f" | {mq_text} |")
    if builds:
        print("\nbuild / KVzip's (median over passages; each ratio measured side by side in one process)")
        for v, xs in builds.items():
            print(f"- {v}: {statistics.median(xs):.2f}x (range {min(xs):.2f}-{max(xs):.2f}x, {len(xs)} passages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
