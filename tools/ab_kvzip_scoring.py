#!/usr/bin/env python
"""A/B of KVzip's two CPU scoring paths in float32, in one process, rounds interleaved.

KVzip's repeat pass (arXiv 2505.23416 §3.2) needs each chunk entry's maximum attention probability over the repeat
queries. In float32 on CPU, ``kvpack.attention.scored_attention_dense`` takes ``kvpack.stats.one_pass_attention``
(one explicit blocked pass: probabilities computed once, giving the output and the scores); other dtypes take
``_scored_attention_flash`` (the fused flash kernel for the output and log-sum-exps, then a second product for the
scores). This script builds the same context both ways (the second by swapping the function in for the run), beside
a plain prefill, and prints the medians, each build's ratio to the prefill, and whether both kept the same entries.

    python tools/ab_kvzip_scoring.py --model smollm2-135m --tokens 4096 --repeats 3
    python tools/ab_kvzip_scoring.py --model kvpack-reference --tokens 4096 --repeats 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
import kvpack.attention as attention  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.bench.speed import plain_prefill  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    rng = random.Random(0)
    text = tasks.needle_context(tok, args.tokens, [tasks.random_fact(rng)], [0.5], rng)
    layout = chat_layout(tok)
    ids = torch.tensor([layout.prefix_ids(tok) + layout.encode(tok, text)])
    one_pass = attention.one_pass_attention

    def flash_path(query, key, value, scaling, max_scores=None, **_):
        past = key.shape[2] - query.shape[2]
        return attention._scored_attention_flash(query, key, value, past, scaling, max_scores), None

    packs = {}

    def build(which: str) -> float:
        attention.one_pass_attention = one_pass if which == "one_pass" else flash_path
        seconds: dict[str, float] = {}
        try:
            packs[which] = kvpack.compress(model, tok, text, method="kvzip", ratio=0.3, stage_seconds=seconds)
        finally:
            attention.one_pass_attention = one_pass
        return seconds["score"]

    rows: dict[str, list[float]] = {k: [] for k in ("prefill", "one_pass", "flash", "score one_pass", "score flash")}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plain_prefill(model, ids)
        rows["prefill"].append(time.perf_counter() - t0)
        for which in ("one_pass", "flash"):
            t0 = time.perf_counter()
            score = build(which)
            rows[which].append(time.perf_counter() - t0)
            rows["score " + which].append(score)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{args.model}, {ids.shape[1]} tokens, {args.threads} threads, medians of {args.repeats} rounds")
    for k, v in med.items():
        ratio = f"  ({v / med['prefill']:.3f}x prefill)" if k in ("one_pass", "flash") else ""
        print(f"{k:>16}: {v:8.3f} s{ratio}")
    same = all(torch.equal(a.positions, b.positions) for a, b in zip(packs["one_pass"].layers, packs["flash"].layers))
    print("same kept entries:", same)


if __name__ == "__main__":
    main()
