#!/usr/bin/env python
"""Attention Matching's self-study answers batched against one prompt at a time (``kvpack.methods.am_selfstudy``):
the seconds to answer the four prompts for ``--tokens`` forward calls each over a prefilled context, both paths
interleaved ``--repeats`` times in one process (medians), and the query rows each recorded (equal when both
record the same tokens).

    python tools/bench_selfstudy.py --model smollm2-135m --length 2048 --tokens 16

With ``--tree`` the kvpack of another checkout is timed, so two commits' batched paths can be compared, interleaved,
on a quiet machine (``--batched-only`` skips the one-prompt-at-a-time path):

    git worktree add /tmp/base <commit>
    for t in /tmp/base . /tmp/base .; do OMP_NUM_THREADS=1 python tools/bench_selfstudy.py --model smollm2-135m \\
        --threads 1 --batched-only --tree $t; done

``--samples 1,2,4 --temperature 0.7`` times one, two and four sampled answers per prompt (``--self-study-samples``),
interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the kvpack checkout to time")
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a held-out passage, seed 2)")
    ap.add_argument("--tokens", type=int, default=16, help="forward calls per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batched-only", action="store_true", help="time the batched path alone")
    ap.add_argument("--samples", default="1", help="answers per prompt, e.g. 1,2,4: each count is timed "
                    "(batched), interleaved; above 1 needs --temperature above 0")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; else sampled (am's: 0.7)")
    args = ap.parse_args()
    counts = [int(c) for c in args.samples.split(",")]
    sys.path.insert(0, str(Path(args.tree).resolve()))

    import torch

    import kvpack
    from kvpack.bench.continuation import continuation_docs
    from kvpack.layout import chat_layout
    from kvpack.methods.am import QueryReservoir
    from kvpack.methods.am_selfstudy import self_study_queries
    from kvpack.model import model_spec
    from kvpack.prefill import prefill

    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=2)))
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, doc.text), len(prefix), layout, spec, 2048)
    paths = [] if args.batched_only or counts != [1] else [("one by one", True, 1)]
    paths += [("batched" if c == 1 else f"batched, {c} answers", False, c) for c in counts]
    seconds, rows = {name: [] for name, _, _ in paths}, {}
    for _ in range(args.repeats):
        for name, off, count in paths:
            res = [QueryReservoir(spec.num_kv_heads, 50_000) for _ in spec.compressed_layers]
            # older trees (--tree) take neither: pass them only when asked
            sampling = {"temperature": args.temperature} if args.temperature else {}
            sampling.update({"samples": count} if count != 1 else {})
            t = time.perf_counter()
            self_study_queries(model, tok, full, res, args.tokens, batched_off=off, **sampling)
            seconds[name].append(time.perf_counter() - t)
            rows[name] = sum(p.shape[1] for p in res[0].parts)
    for name, _, count in paths:
        if count != 1:
            print(f"{name}: {statistics.median(seconds[name]):.2f} s "
                  f"({', '.join(f'{s:.2f}' for s in seconds[name])}), query rows {rows[name]}")
    if "batched" not in seconds:
        return
    bat = statistics.median(seconds["batched"])
    print(f"{kvpack.__file__}: context {full.tokens} tokens, {args.tokens} calls per prompt: batched {bat:.2f} s "
          f"({', '.join(f'{s:.2f}' for s in seconds['batched'])}), query rows per KV head of layer 0: "
          f"{rows['batched']}")
    if "one by one" in seconds:
        one = statistics.median(seconds["one by one"])
        print(f"one by one {one:.2f} s (batched: {bat / one:.2f}x of it), query rows {rows['one by one']}")


if __name__ == "__main__":
    main()
