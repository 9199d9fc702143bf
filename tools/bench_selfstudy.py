#!/usr/bin/env python
"""Attention Matching's self-study answers batched against one prompt at a time (``kvpack.methods.am_selfstudy``):
the seconds to answer the four prompts for ``--tokens`` forward calls each over a prefilled context, both paths
interleaved ``--repeats`` times in one process (medians), and the query rows each recorded (equal when both
record the same tokens).

    python tools/bench_selfstudy.py --model smollm2-135m --length 2048 --tokens 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
from kvpack.bench.continuation import continuation_docs  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402
from kvpack.methods.am import QueryReservoir  # noqa: E402
from kvpack.methods.am_selfstudy import self_study_queries  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.prefill import prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a held-out passage, seed 2)")
    ap.add_argument("--tokens", type=int, default=16, help="forward calls per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=2)))
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, doc.text), len(prefix), layout, spec, 2048)
    seconds, rows = {"batched": [], "one by one": []}, {}
    for _ in range(args.repeats):
        for name, off in (("one by one", True), ("batched", False)):
            res = [QueryReservoir(spec.num_kv_heads, 50_000) for _ in spec.compressed_layers]
            t = time.perf_counter()
            self_study_queries(model, tok, full, res, args.tokens, batched_off=off)
            seconds[name].append(time.perf_counter() - t)
            rows[name] = sum(p.shape[1] for p in res[0].parts)
    one, bat = statistics.median(seconds["one by one"]), statistics.median(seconds["batched"])
    print(f"context {full.tokens} tokens, {args.tokens} calls per prompt: one by one {one:.2f} s, batched "
          f"{bat:.2f} s ({bat / one:.2f}x); query rows per KV head of layer 0: {rows['one by one']} / {rows['batched']}")


if __name__ == "__main__":
    main()
