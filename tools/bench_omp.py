"""Time AM-OMP's key selection (``kvpack.methods.am_omp.omp_select``) for one KV head at a real model's shapes:
random keys and queries (the cost depends on the shapes and the budget, not on the values), medians of
``--repeats`` calls per budget.

    OMP_NUM_THREADS=1 python tools/bench_omp.py --tokens 2072 --queries 7300 --head-dim 64 --budgets 40,300,1550

The defaults are SmolLM2-135M's at a 2K context with the paper's reference queries (the repeat pass's 2,072 tokens x
a GQA group of 3 plus about 1,080 self-study rows per KV head); 1,550 is the 0.75 head cap of 2,072 entries.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpack.methods.am_omp import omp_select


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2072, help="context entries of the head")
    ap.add_argument("--queries", type=int, default=7300, help="reference queries of the head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--budgets", default="40,300,1550", help="comma-separated entries to keep")
    ap.add_argument("--recent", type=int, default=16, help="forced recent entries (the recent floor)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(args.tokens, args.head_dim, generator=gen)
    queries = 1.5 * torch.randn(args.queries, args.head_dim, generator=gen)
    forced = torch.arange(args.tokens - args.recent, args.tokens)
    for t in (int(b) for b in args.budgets.split(",")):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            omp_select(keys, queries, args.head_dim ** -0.5, t, forced)
            times.append(time.perf_counter() - t0)
        print(f"keep {t} of {args.tokens} entries, {args.queries} queries: {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
