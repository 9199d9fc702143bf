"""Time the normal equations' Gram matrix of Attention Matching's least squares (``kvpack.methods.am_fit.gram``,
the block rows on and above the diagonal, mirrored) against the plain product ``X.T @ X``, for one KV head at a
real model's shapes: random ``X`` ``[queries, kept]`` (the cost depends on the shapes only), the two interleaved,
medians of ``--repeats`` calls per width, their largest difference relative to the largest entry, for each
column block of ``--blocks`` (``am_fit.GRAM_BLOCK`` is the default block).

    OMP_NUM_THREADS=1 python tools/bench_gram.py --queries 7300 --kept 300,600,1000,1536 --repeats 5
    OMP_NUM_THREADS=1 python tools/bench_gram.py --queries 6500 --kept 207,300,620,1000 --blocks 256,128,64

The default ``--queries`` is SmolLM2-135M's at a 2K context with the paper's reference queries (the repeat pass's
2,072 tokens x a GQA group of 3 plus about 1,080 self-study rows per KV head); 1,536 is about the 0.75 head cap.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpack.methods.am_fit import GRAM_BLOCK, gram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=7300, help="rows of X: fit queries of the head")
    ap.add_argument("--kept", default="300,600,1000,1536", help="comma-separated columns of X: kept entries")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", default=str(GRAM_BLOCK), help="comma-separated column blocks of gram to time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    blocks = [int(b) for b in args.blocks.split(",")]
    print("| kept | X.T @ X (ms) | " + " | ".join(f"gram, block {b} (ms)" for b in blocks)
          + " | ratios | max difference / max entry |")
    print("|---:|---:|" + "---:|" * len(blocks) + "---:|---:|")
    for t in (int(k) for k in args.kept.split(",")):
        X = torch.rand(args.queries, t, generator=gen)
        plain, blocked = [], {b: [] for b in blocks}
        diff = 0.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            G_plain = X.T @ X
            plain.append(time.perf_counter() - t0)
            for b in blocks:
                t0 = time.perf_counter()
                G = gram(X, b)
                blocked[b].append(time.perf_counter() - t0)
                diff = max(diff, float((G - G_plain).abs().max() / G_plain.abs().max()))
        a = statistics.median(plain)
        med = [statistics.median(blocked[b]) for b in blocks]
        print(f"| {t:,} | {a * 1e3:.1f} | " + " | ".join(f"{m * 1e3:.1f}" for m in med) + " | "
              + ", ".join(f"{m / a:.2f}x" for m in med) + f" | {diff:.1e} |")


if __name__ == "__main__":
    main()
