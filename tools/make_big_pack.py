#!/usr/bin/env python
"""Write a large valid ``.kvpack`` for the embedded reference model, to measure memory on multi-GiB packs
(BENCHMARKS.md "Reliability"): the header (fingerprint, layout, method) of a real ``kvpack.compress`` of a short
text, and synthetic KV: every layer and KV head keeps ``--entries`` entries at positions ``0 .. entries - 1`` of a
context of as many random token ids, keys and values drawn from N(0, 1) in ``--kv-dtype``. Written one layer at a
time into the tensors ``kvpack.save`` writes, so the tool holds the KV once (plus the encoded copy with zstd).

    python tools/make_big_pack.py --out /tmp/big.kvpack --gib 2.2 --kv-dtype float16 --zstd-level 0
    python tools/make_big_pack.py --out /tmp/big-z3.kvpack --gib 2.2 --kv-dtype float16 --zstd-level 3

Prints the file's bytes and its entries. Packs this large do not belong in git: write them under /tmp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack.pack import LayerEntries, Pack  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=2.2, help="size of the keys and values together, in GiB")
    ap.add_argument("--kv-dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--zstd-level", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model, tok = kvpack.load_model(device="cpu")
    base = kvpack.compress(model, tok, "A short text whose pack lends its header to a large one.", ratio=1.0)
    dtype = getattr(torch, args.kv_dtype)
    layers, heads = len(base.layers), int(base.layers[0].head_lengths.shape[0])
    d, dv = base.layers[0].keys.shape[1], base.layers[0].values.shape[1]
    per_entry = (d + dv) * dtype.itemsize
    n = int(args.gib * 2**30 / (per_entry * layers * heads))  # entries per head
    g = torch.Generator().manual_seed(args.seed)
    positions = torch.arange(n, dtype=torch.int32).repeat(heads)
    kept = [LayerEntries(torch.randn(n * heads, d, generator=g).to(dtype), torch.randn(n * heads, dv, generator=g)
                         .to(dtype), positions, torch.full((heads,), n, dtype=torch.int64))
            for _ in range(layers)]
    token_ids = torch.randint(8, len(tok), (n,), generator=g)
    meta = {k: v for k, v in base.metadata.items() if k != "stats"}
    pack = Pack(token_ids=token_ids, layers=kept, sink_tokens=0, metadata=meta)
    written = kvpack.save(pack, args.out, zstd_level=args.zstd_level)
    print(f"{args.out}: {written:,} bytes, {layers} layers x {heads} KV heads x {n:,} entries, {args.kv_dtype}, "
          f"zstd level {args.zstd_level}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
