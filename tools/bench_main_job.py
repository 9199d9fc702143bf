#!/usr/bin/env python
"""Time the main job side by side on one context: plain prefill, a KVzip build, and loading vs re-prefilling.

All timings are medians over ``--repeats`` runs, interleaved in one process so machine noise hits every row
alike; the ratios are what to quote.

    python tools/bench_main_job.py --tokens 4096 --ratio 0.3 --repeats 5
    python tools/bench_main_job.py --tokens 4096 --ratio 0.3 --repeats 9 --quant int4 --group-size 64 --zstd-level 19

The second file loaded is the same pack with the other tensor checksum (XXH3-128 or SHA-256), so the two
checksums' load times are compared side by side.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack.bench.speed import causal_attention_alone, plain_prefill, timed  # noqa: E402
from kvpack import constants as C  # noqa: E402
from kvpack import settings as S  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.prefill import prefill as kvpack_prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--method", default="kvzip")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-size", type=int, default=2048, help="prefill and scoring chunk in tokens")
    ap.add_argument("--quant", default=C.QUANT_NONE, choices=[C.QUANT_NONE, *sorted(C.QUANT_TYPES)],
                    help="as kvpack build --quant")
    ap.add_argument("--group-size", type=int, default=S.DEFAULT_GROUP_SIZE, choices=S.GROUP_SIZES,
                    help="as kvpack build --group-size")
    ap.add_argument("--zstd-level", type=int, default=0, help="as kvpack build --zstd-level (0: off)")
    ap.add_argument("--checksum", default=S.DEFAULT_CHECKSUM, choices=C.CHECKSUMS,
                    help="as kvpack build --checksum; the other algorithm's file is loaded too, for comparison")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    model, tok = kvpack.load_model(args.model, device=args.device)
    rng = random.Random(0)
    fact = tasks.random_fact(rng)
    text = tasks.needle_context(tok, args.tokens, [fact], [0.5], rng)
    layout = chat_layout(tok)
    ids = torch.tensor([layout.prefix_ids(tok) + layout.encode(tok, text)], device=model.device)

    def prefill():
        return plain_prefill(model, ids)

    attention = causal_attention_alone(model, ids.shape[1])
    spec = model_spec(model)
    sink = len(layout.prefix_ids(tok))
    method = get_method(args.method, {"chunk_size": args.chunk_size})

    def chunked_prefill():
        return kvpack_prefill(model, ids[0].tolist(), sink, layout, spec, args.chunk_size,
                              recorder=method.recorder(spec, ids.shape[1], model.device))

    # the second file loaded: the same pack with the other tensor checksum
    other = next(c for c in C.CHECKSUMS if c != args.checksum)
    rows = {k: [] for k in ("prefill", "attention", "build", "chunked prefill", "scoring", "save", "load",
                            "load other")}
    with tempfile.TemporaryDirectory() as tmp:
        path, other_path = Path(tmp) / "ctx.kvpack", Path(tmp) / "other.kvpack"
        prefill()  # warm-up
        for rep in range(args.repeats):
            rows["prefill"].append(timed(prefill)[0])
            rows["attention"].append(timed(attention)[0])
            t, pack = timed(lambda: kvpack.compress(model, tok, text, method=args.method, ratio=args.ratio,
                                                     chunk_size=args.chunk_size, quant=args.quant,
                                                     group_size=args.group_size))
            rows["build"].append(t)
            t, filled = timed(chunked_prefill)
            rows["chunked prefill"].append(t)
            rows["scoring"].append(timed(lambda: method.score(model, tok, filled))[0])
            rows["save"].append(timed(lambda: kvpack.save(pack, path, zstd_level=args.zstd_level,
                                                          checksum=args.checksum))[0])
            kvpack.save(pack, other_path, zstd_level=args.zstd_level, checksum=other)
            loads = [("load", path), ("load other", other_path)]
            for row, p in loads if rep % 2 == 0 else loads[::-1]:  # alternate: the first load after a build is slower
                rows[row].append(timed(lambda: kvpack.load(p, model))[0])
        size = path.stat().st_size
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model {getattr(model, 'kvpack_name', '?')} on {model.device}, {ids.shape[1]} tokens, "
          f"method {args.method}, ratio {args.ratio}, quant {args.quant} (group size {args.group_size}), "
          f"zstd level {args.zstd_level}, "
          f"checksum {args.checksum}, "
          f"{args.repeats} repeats (medians)")
    print("| step | median seconds | vs plain prefill |")
    print("|---|---|---|")
    labels = {"attention": "  of which attention (SDPA alone, every layer)", "chunked prefill": "  build: chunked prefill",
              "scoring": "  build: scoring (method.score)",
              "load other": f"load, the same pack with {other} checksums"}
    for k in rows:
        print(f"| {labels.get(k, k)} | {med[k]:.4f} | {med[k] / med['prefill']:.3f}x |")
    print(f"\nKVzip build / prefill: {med['build'] / med['prefill']:.2f}x (target <= 2.1x)")
    print(f"re-prefill / load: {med['prefill'] / med['load']:.1f}x faster to load (target >= 100x); "
          f"with {other} checksums "
          f"{med['prefill'] / med['load other']:.1f}x")
    print(f"file: {size} bytes ({size / ids.shape[1]:.1f} bytes per context token)")


if __name__ == "__main__":
    main()
