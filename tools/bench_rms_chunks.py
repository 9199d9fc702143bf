#!/usr/bin/env python
"""The chunk size of AM's explicit attention passes (``kvpack.methods.am_fit.CHUNK_ELEMENTS``): RMS attention with
and without the context's output (``rms_attention``, the ``--select rms`` pass that also feeds the fit) and KVzip's
maximum (``max_attention``), at SmolLM2's head shape (head_dim 64) with one KV head's fit queries over a 2K and an
8K context. Each chunk is ``[rows, T]`` float32 with ``rows = CHUNK_ELEMENTS // T``; the exponential, the row sums,
the squares and the product with the values each pass over it, so a chunk that stays in the core's L2 cache saves
memory traffic. Medians over ``--repeats``, chunk sizes interleaved, one process.

With ``--base-e`` each pass also runs with the exponential in base e (``torch.exp``, as before issue 28's
thirty-ninth session) beside the module's base 2 (``exp2``), interleaved, so the two are timed side by side on a
shared machine whose speed moves by 2x between runs.

    OMP_NUM_THREADS=1 python tools/bench_rms_chunks.py --repeats 5
    OMP_NUM_THREADS=1 python tools/bench_rms_chunks.py --chunks 524288 --contexts 2048,4096,8192 --base-e
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpack.methods import am_fit  # noqa: E402


def softmax_chunks_base_e(queries: torch.Tensor, keys: torch.Tensor, scaling: float):
    """``am_fit._softmax_chunks`` as it was before the base-2 exponential: ``exp`` of the natural logits."""
    q, k = queries.float(), keys.float()
    rows = max(1, am_fit.CHUNK_ELEMENTS // max(1, k.shape[0]))
    for start in range(0, q.shape[0], rows):
        e = torch.matmul(q[start : start + rows], k.T).mul_(scaling)
        peak = e.amax(dim=-1, keepdim=True)
        e.sub_(peak).exp_()
        yield start, e, e.sum(dim=-1), peak[:, 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=8192, help="fit queries of one KV head")
    ap.add_argument("--contexts", default="2048,8192", help="context tokens, comma-separated")
    ap.add_argument("--chunks", default="4194304,1048576,524288,262144,131072,65536",
                    help="CHUNK_ELEMENTS values, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--base-e", action="store_true", help="also time the exponential in base e, interleaved")
    args = ap.parse_args()
    base2 = am_fit._softmax_chunks
    bases = {"": base2, " (base e)": softmax_chunks_base_e} if args.base_e else {"": base2}
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    chunks = [int(c) for c in args.chunks.split(",")]
    results = {}
    for T in (int(t) for t in args.contexts.split(",")):
        q, k, v = (torch.randn(n, 64, generator=g) for n in (args.queries, T, T))
        ms: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for c in chunks:
                am_fit.CHUNK_ELEMENTS = c
                for base, chunker in bases.items():
                    am_fit._softmax_chunks = chunker
                    for name, fn in (("rms+output", lambda: am_fit.rms_attention(q, k, 0.125, values=v)),
                                     ("rms", lambda: am_fit.rms_attention(q, k, 0.125)),
                                     ("max", lambda: am_fit.max_attention(q, k, 0.125))):
                        t = time.perf_counter()
                        fn()
                        ms.setdefault((name + base, c), []).append(1000 * (time.perf_counter() - t))
                am_fit._softmax_chunks = base2
        results[T] = {f"{name} @ {c}": round(statistics.median(v), 1) for (name, c), v in ms.items()}
        if args.base_e:  # each repeat's base-e time over its base-2 time, run back to back: the median of those
            results[T].update({f"{name} @ {c}, base e over base 2": round(statistics.median(
                e / b for e, b in zip(ms[(name + " (base e)", c)], ms[(name, c)])), 3)
                for (name, c) in list(ms) if not name.endswith("(base e)")})
    print(json.dumps({"command": " ".join(sys.argv), "median_ms": results}, indent=1))


if __name__ == "__main__":
    main()
