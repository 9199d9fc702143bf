#!/usr/bin/env python
"""Time the whole decode step (one token through the model) over a loaded cache against the full cache.

The context is a needle haystack of ``--tokens`` tokens (``kvpack.tasks.needle_context``, as
``tools/bench_methods.py``). Each method in ``--methods`` is built at ``--ratio`` (``none`` at 1.0), saved and
loaded with ``kvpack.load``; the full cache is a plain prefill into a ``DynamicCache`` decoded through
transformers' SDPA attention. One step is one forward of the context's last token over the cache, which is then
cut back (``rewind`` / ``crop``). Steps of all caches are interleaved, ``--steps`` rounds after ``--warmup``;
the table gives medians and each cache's ratio to the full cache's step. The ``full, 16 tokens`` row is the
full cache's step over a 16-token context: what a step costs outside attention (MLP, projections, norms,
the LM head and Python), the floor no cache can go under; ``none, 16 tokens (loaded)`` is the same through a kvpack
file and its cache (what kvpack adds outside attention). ``--ratios`` builds every method but ``none`` at each
ratio; ``--per-head-row`` adds the ``none`` cache through the per-KV-head path (one flash call per head, as before
``PackedLayer.dense_views``), for an A/B of the one-call path in the same run.

    python tools/bench_decode_step.py --tokens 4096 --methods kvzip,none --steps 60 --threads 1
    python tools/bench_decode_step.py --model /tmp/smollm2-hf --tokens 4096 --methods none,kvzip --ratios 0.3,0.1 \
        --steps 30 --threads 2 --per-head-row
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack.attention import use_kvpack_attention  # noqa: E402
from kvpack.bench.speed import needle_context_ids, plain_prefill  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or hub id (default: the embedded reference model)")
    ap.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--ratios", default=None, help="comma-separated ratios for every method but none (overrides --ratio)")
    ap.add_argument("--per-head-row", action="store_true",
                    help="also time the none cache through the per-KV-head flash path (A/B of the one-call path)")
    ap.add_argument("--methods", default="kvzip,none", help="comma-separated methods (none: ratio 1.0)")
    ap.add_argument("--steps", type=int, default=60, help="timed rounds (one step of every cache per round)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    model, tok = kvpack.load_model(args.model, device=args.device)
    dev = next(model.parameters()).device
    text, ids = needle_context_ids(tok, args.tokens, dev)
    short = ids[:, :16]
    caches = {}
    ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else [args.ratio]
    with tempfile.TemporaryDirectory() as folder:
        for m in [m for m in args.methods.split(",") if m]:
            for ratio in [1.0] if m == "none" else ratios:
                name = m if m == "none" else f"{m}@{ratio:g}"
                pack = kvpack.compress(model, tok, text, method=m, ratio=ratio)
                path = os.path.join(folder, f"{name}.kvpack")
                kvpack.save(pack, path)
                caches[name] = kvpack.load(path, model, tokenizer=tok)
                if m == "none" and args.per_head_row:
                    per_head = kvpack.load(path, model, tokenizer=tok)
                    for layer in per_head.layers:
                        layer._dense_views = False  # as if the heads were uneven: one flash call per KV head
                    caches["none[per-head]"] = per_head
        # kvpack's own floor: every entry of a 14-token context (16 with the template) through a kvpack file
        pack = kvpack.compress(model, tok, tok.decode(ids[0, :14]), method="none", ratio=1.0)
        kvpack.save(pack, os.path.join(folder, "short.kvpack"))
        short_cache = kvpack.load(os.path.join(folder, "short.kvpack"), model, tokenizer=tok)
    full, floor = plain_prefill(model, ids), plain_prefill(model, short)

    def plain_step(cache, token, length):
        def step():
            model.set_attn_implementation("sdpa")
            model(input_ids=token, past_key_values=cache, use_cache=True)
            _sync(dev)
            cache.crop(-(cache.get_seq_length() - length))
        return step

    def loaded_step(cache):
        def step():
            use_kvpack_attention(model)
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            _sync(dev)
            cache.rewind()
        return step

    steps = {"full": plain_step(full, ids[:, -1:], ids.shape[1]),
             "full, 16 tokens": plain_step(floor, short[:, -1:], short.shape[1])}
    steps["none, 16 tokens (loaded)"] = loaded_step(short_cache)
    steps.update({f"{m} (loaded)": loaded_step(c) for m, c in caches.items()})
    times = {k: [] for k in steps}
    with torch.inference_mode():
        for r in range(args.warmup + args.steps):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    kept = {m: int(c.kept_entries().sum()) for m, c in caches.items()}
    print(f"`{cmd}`\n\n{ids.shape[1]} context tokens, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{dev}; medians of {args.steps} interleaved rounds\n")
    print("| cache | median ms | vs full | tokens/s | entries | cache MiB |\n|---|---:|---:|---:|---:|---:|")
    for name, s in med.items():
        m = name.split(" ")[0]
        entries = kept.get(m, "")
        mib = f"{caches[m].nbytes() / 2**20:.2f}" if m in caches else ""
        print(f"| {name} | {s * 1e3:.3f} | {s / med['full']:.3f}x | {1 / s:.1f} | {entries} | {mib} |")


if __name__ == "__main__":
    main()
