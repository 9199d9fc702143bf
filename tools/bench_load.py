#!/usr/bin/env python
"""Load throughput of ``.kvpack`` files against a raw read of the same bytes, and their size per context token.

One context (a needle passage of ``--tokens`` tokens) is compressed once per variant (``--method``, keep
``--ratio``): unquantized and ``--quant`` at ``--group-size`` (the CLI's defaults), each saved with zstd at
``--zstd-level`` (the CLI's default 3) and, unquantized, without zstd too. Then, interleaved over ``--repeats``
rounds (the files' order rotating each round), every file is read raw (``Path.read_bytes``: the floor any loader
pays) and loaded (``kvpack.load``: parse, verify every checksum, decompress, dequantize, build the cache). Both
read from the page cache (the files were just written), so the ratio is the loader's own work, not the disk's.
GB/s are file bytes (10^9) per second; "KV GB/s" counts the loaded cache's tensors instead. The fp16 full cache is
layers x KV heads x tokens x head_dim x 2 (K, V) x 2 bytes, as ``tools/bench_quant.py`` counts it.

    python tools/bench_load.py --model runs/shapes/qwen2.5-0.5b --tokens 4096 --repeats 9
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
from kvpack import constants as C  # noqa: E402
from kvpack import settings as S  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.bench.speed import timed  # noqa: E402
from kvpack.model import model_spec  # noqa: E402


def cache_bytes(cache) -> int:
    """Bytes of every tensor the loaded cache holds (keys, values and whatever else its layers keep)."""
    seen, total = set(), 0
    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded reference model)")
    ap.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    ap.add_argument("--ratio", type=float, default=0.3, help="fraction of the context kept (the CLI default)")
    ap.add_argument("--method", default="kvzip")
    ap.add_argument("--quant", default="int4", choices=sorted(C.QUANT_TYPES))
    ap.add_argument("--group-size", type=int, default=S.DEFAULT_GROUP_SIZE, choices=S.GROUP_SIZES)
    ap.add_argument("--zstd-level", type=int, default=S.DEFAULT_ZSTD_LEVEL)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if args.repeats < 1:
        sys.exit("error: --repeats must be >= 1")

    model, tok = kvpack.load_model(args.model, device=args.device)
    rng = random.Random(0)
    text = tasks.needle_context(tok, args.tokens, [tasks.random_fact(rng)], [0.5], rng)
    spec = model_spec(model)
    build = dict(method=args.method, ratio=args.ratio, chunk_size=args.chunk_size)
    plain = kvpack.compress(model, tok, text, **build)
    quantized = kvpack.compress(model, tok, text, **build, quant=args.quant, group_size=args.group_size)
    tokens = plain.original_tokens
    fp16_full = spec.num_layers * spec.num_kv_heads * tokens * spec.head_dim * 2 * 2
    files = [(f"none, zstd {args.zstd_level}", plain, args.zstd_level), ("none, zstd off", plain, 0),
             (f"{args.quant} (group {args.group_size}), zstd {args.zstd_level}", quantized, args.zstd_level)]
    times = {name: {"read": [], "load": []} for name, _, _ in files}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for i, (name, pack, level) in enumerate(files):
            paths[name] = Path(tmp) / f"f{i}.kvpack"
            kvpack.save(pack, paths[name], zstd_level=level)
        kv = {name: cache_bytes(kvpack.load(p, model)) for name, p in paths.items()}  # also warms the loader
        for rep in range(args.repeats):
            order = list(paths.items())
            order = order[rep % len(order):] + order[:rep % len(order)]
            for name, p in order:
                times[name]["read"].append(timed(p.read_bytes)[0])
                times[name]["load"].append(timed(lambda: kvpack.load(p, model))[0])
        sizes = {name: p.stat().st_size for name, p in paths.items()}

    print(f"model {getattr(model, 'kvpack_name', '?')} ({spec.num_layers} layers, {spec.num_kv_heads} KV heads, "
          f"head_dim {spec.head_dim}, {model.dtype}) on {model.device}; {tokens} cached tokens; {args.method} keep "
          f"{args.ratio}; {args.repeats} interleaved repeats (medians)")
    print(f"fp16 full cache: {fp16_full:,} bytes ({fp16_full / tokens:.1f} bytes per token)\n")
    print("| file | bytes | bytes per token | x smaller than fp16 full cache | raw read GB/s | load GB/s | "
          "load / raw read time | loaded KV GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in paths:
        read = statistics.median(times[name]["read"])
        load = statistics.median(times[name]["load"])
        print(f"| {name} | {sizes[name]:,} | {sizes[name] / tokens:.1f} | {fp16_full / sizes[name]:.2f} | "
              f"{sizes[name] / read / 1e9:.2f} | {sizes[name] / load / 1e9:.3f} | {load / read:.1f}x | "
              f"{kv[name] / load / 1e9:.3f} |")


if __name__ == "__main__":
    main()
