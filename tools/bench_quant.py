#!/usr/bin/env python
"""Disk size and retrieval accuracy of quantized + zstd packs against the fp16 full cache.

For each of ``--trials`` needle trials (``kvpack.evaluation.needle_trials``: one fact planted at a depth in a
held-out passage of ``--tokens`` tokens), the context is compressed with ``kvpack.compress`` (KVzip, keep
``--ratio``) without quantization and with ``--quant`` in the compact layout (the same selection: compression is
deterministic); each is stored as two files, zstd level 0 and ``--zstd-level``. Every byte of every file is counted
(header with metadata and checksums, token ids, positions, group parameters, code widths). Each variant is loaded
back from its bytes and asked the fact's question (greedy, ``kvpack.generate``).

Two references for "the fp16 full cache":
  * ``fp16 KV``: layers x kv_heads x tokens x head_dim x 2 (K and V) x 2 bytes, tokens including the chat
    template prefix. This is the primary figure (what a serving engine holds; nothing else counted).
  * ``fp16 file``: a keep-everything (ratio 1.0) pack in float16 saved without zstd (adds positions, token ids
    and the header), for comparison.

The packs' full-precision rows (the attention sink, and heads too short to quantize) are cast to
``--kv-dtype`` (default float16), so all sizes are fp16-based whatever dtype the model runs in; the retrieval runs
use the same packs.

With ``--ablation`` three more variants are asked the question (retrieval only, not stored; all in the compact
layout with uniform key widths, ``kvpack.quant.quantize_pack`` without query statistics): keys quantized and values kept, values quantized and
keys kept (both with ``--quant``), and keys int8 with values ``--quant``.
They show which half of the cache the accuracy loss comes from. With ``--key-layouts`` three other ways of
quantizing the keys are asked too, each with the values as ``--quant``: keys per token (groups along head_dim,
like the values), keys per channel in groups of half ``--group-size`` tokens, and keys un-rotated to before RoPE,
quantized per channel and rotated back (KVQuant, arXiv 2401.18079 §3.2; Llama-style rotary models only).

    python tools/bench_quant.py --tokens 4096 --trials 300 --group-size 64 --zstd-level 19   # BENCHMARKS.md
    python tools/bench_quant.py --tokens 4096 --trials 300 --ablation --key-layouts
    python tools/bench_quant.py --tokens 1024 --trials 4             # a quick check
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
import kvpack  # noqa: E402
from kvpack import constants as C  # noqa: E402
from kvpack import settings as S  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.evaluation import needle_trials  # noqa: E402
from kvpack.fileformat import load_pack, pack_to_bytes  # noqa: E402
from kvpack.loading import cache_from_pack  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.pack import LayerEntries, Pack  # noqa: E402
from kvpack.quant import dequantize_layer, quantize_pack  # noqa: E402

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def cast_pack(pack: Pack, dtype: torch.dtype) -> Pack:
    """``pack`` (unquantized) with keys and values cast to ``dtype``."""
    layers = [LayerEntries(l.keys.to(dtype), l.values.to(dtype), l.positions, l.head_lengths) for l in pack.layers]
    return Pack(pack.token_ids, layers, pack.sink_tokens, dict(pack.metadata))


def mixed_pack(base: Pack, keys_from: Pack | None, values_from: Pack | None) -> Pack:
    """``base`` (unquantized) with its keys and/or values replaced by the dequantized rows of quantized packs of the
    same selection (``None``: keep ``base``'s), in ``base``'s dtype."""
    def rows(q: Pack | None, l: int, part: str) -> torch.Tensor:
        own = getattr(base.layers[l], part)
        return own if q is None else getattr(dequantize_layer(q.layers[l], own.dtype), part)
    layers = [LayerEntries(rows(keys_from, l, "keys"), rows(values_from, l, "values"), b.positions, b.head_lengths)
              for l, b in enumerate(base.layers)]
    return Pack(base.token_ids, layers, base.sink_tokens, dict(base.metadata))


def with_keys(pack: Pack, keys: list[torch.Tensor]) -> Pack:
    """``pack`` (unquantized) with each layer's keys replaced."""
    layers = [LayerEntries(k, l.values, l.positions, l.head_lengths) for k, l in zip(keys, pack.layers)]
    return Pack(pack.token_ids, layers, pack.sink_tokens, dict(pack.metadata))


def rotate_keys(model, keys: torch.Tensor, positions: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Keys ``[n, head_dim]`` rotated by the model's RoPE at ``positions`` (``inverse``: un-rotated), in float64:
    ``k cos + rotate_half(k) sin`` (Llama-style rotary, ``model.model.rotary_emb``); the inverse uses ``-sin``."""
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions.long()[None])
    cos, sin = cos[0].double(), sin[0].double() * (-1.0 if inverse else 1.0)
    k = keys.double()
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return k * cos + rotated_half * sin


def key_layout_keys(model, base: Pack, qtype: str, group_size: int) -> dict[str, list[torch.Tensor]]:
    """Each layer's keys after the other key layouts of ``--key-layouts`` (dequantized, in ``base``'s dtype)."""
    dtype = base.layers[0].keys.dtype
    as_values = Pack(base.token_ids, [LayerEntries(l.keys, l.keys, l.positions, l.head_lengths) for l in base.layers],
                     base.sink_tokens, dict(base.metadata))  # per token: quantize the keys the way values are
    per_token = [dequantize_layer(l, dtype).values for l in quantize_pack(as_values, qtype, group_size).layers]
    half = [dequantize_layer(l, dtype).keys for l in quantize_pack(base, qtype, max(1, group_size // 2)).layers]
    out = {"keys per token": per_token, f"keys in groups of {max(1, group_size // 2)}": half}
    if hasattr(getattr(model, "model", None), "rotary_emb"):
        pre = with_keys(base, [rotate_keys(model, l.keys, l.positions, True).to(torch.float32) for l in base.layers])
        out["keys pre-RoPE"] = [rotate_keys(model, dequantize_layer(q, torch.float32).keys, l.positions, False).to(dtype)
                                for q, l in zip(quantize_pack(pre, qtype, group_size).layers, base.layers)]
    return out


def cast_rows(pack: Pack, dtype: torch.dtype) -> Pack:
    """``pack`` (quantized or not) with its full-precision rows cast to ``dtype`` (the quantized rows unchanged)."""
    layers = [LayerEntries(l.keys.to(dtype), l.values.to(dtype), l.positions, l.head_lengths, l.quant)
              for l in pack.layers]
    return Pack(pack.token_ids, layers, pack.sink_tokens, dict(pack.metadata))


def fp16_kv_bytes(model, tokens: int) -> int:
    """layers x kv_heads x tokens x head_dim x 2 (K, V) x 2 bytes."""
    spec = model_spec(model)
    return spec.num_layers * spec.num_kv_heads * tokens * spec.head_dim * 2 * 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded reference model)")
    ap.add_argument("--tokens", type=int, default=4096, help="context length in tokens")
    ap.add_argument("--trials", type=int, default=50, help="needle trials (depths spread over [0, 1])")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ratio", type=float, default=0.3, help="fraction of context KV entries kept")
    ap.add_argument("--method", default="kvzip")
    ap.add_argument("--quant", default="int4", choices=sorted(C.QUANT_TYPES))
    ap.add_argument("--group-size", type=int, default=S.DEFAULT_GROUP_SIZE, choices=S.GROUP_SIZES)
    ap.add_argument("--zstd-level", type=int, default=S.DEFAULT_ZSTD_LEVEL)
    ap.add_argument("--kv-dtype", default="float16", choices=sorted(_DTYPES),
                    help="dtype of the stored full-precision rows")
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=tasks.ANSWER_MAX_NEW_TOKENS)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: float32 on CPU)")
    ap.add_argument("--ablation", action="store_true",
                    help="also ask: --quant keys only, --quant values only, int8 keys + --quant values")
    ap.add_argument("--key-layouts", action="store_true",
                    help="also ask: keys per token, keys in half-size groups, pre-RoPE keys (values: --quant)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, tok = kvpack.load_model(args.model, device=args.device, dtype=args.dtype)
    kv_dtype = _DTYPES[args.kv_dtype]
    variants = [(q, z) for q in (C.QUANT_NONE, args.quant) for z in (0, args.zstd_level)]
    sizes = {v: [] for v in variants}
    q = f"uniform {args.quant}"
    ablations = [f"{q} keys only", f"{q} values only", f"uniform int8 keys + {args.quant} values"] if args.ablation else []
    if args.key_layouts:
        ablations += [f"{q} keys per token", f"{q} keys in groups of {max(1, args.group_size // 2)}"]
        if hasattr(getattr(model, "model", None), "rotary_emb"):
            ablations.append(f"{q} keys pre-RoPE")
    correct = {q: [] for q in (C.QUANT_NONE, args.quant, *ablations)}
    answers = {q: [] for q in (C.QUANT_NONE, args.quant, *ablations)}
    full_kv, full_file, errors = [], [], []
    trials = needle_trials(tok, args.tokens, args.trials, args.seed)
    for i, trial in enumerate(trials):
        base = kvpack.compress(model, tok, trial.context, method=args.method, ratio=args.ratio,
                               chunk_size=args.chunk_size)
        base = cast_pack(base, kv_dtype)
        quantized = kvpack.compress(model, tok, trial.context, method=args.method, ratio=args.ratio,
                                    chunk_size=args.chunk_size, quant=args.quant, group_size=args.group_size)
        packs = {C.QUANT_NONE: base, args.quant: cast_rows(quantized, kv_dtype)}
        errors.append(packs[args.quant].metadata["stats"]["quant_error"])
        full_kv.append(fp16_kv_bytes(model, base.original_tokens))
        everything = kvpack.compress(model, tok, trial.context, ratio=1.0, chunk_size=args.chunk_size)
        full_file.append(len(pack_to_bytes(cast_pack(everything, torch.float16), 0)))
        question = tasks.fact_question(trial.fact)
        for q, pack in packs.items():
            for z in (0, args.zstd_level):
                data = pack_to_bytes(pack, z)
                sizes[(q, z)].append(len(data))
            cache = cache_from_pack(load_pack(data), model, tok)  # the zstd file, decoded and dequantized
            answer = kvpack.generate(model, tok, cache, question, max_new_tokens=args.max_new_tokens)
            answers[q].append(answer)
            correct[q].append(tasks.answer_matches(answer, trial.fact))
        if ablations:
            quantized = quantize_pack(base, args.quant, args.group_size)
            variants = []
            if args.ablation:
                int8 = quantize_pack(base, "int8", args.group_size)
                variants += [mixed_pack(base, quantized, None), mixed_pack(base, None, quantized),
                             mixed_pack(base, int8, quantized)]
            if args.key_layouts:
                values_only = mixed_pack(base, None, quantized)
                variants += [with_keys(values_only, keys)
                             for keys in key_layout_keys(model, base, args.quant, args.group_size).values()]
            for name, mixed in zip(ablations, variants):
                answer = kvpack.generate(model, tok, cache_from_pack(mixed, model, tok), question,
                                         max_new_tokens=args.max_new_tokens)
                answers[name].append(answer)
                correct[name].append(tasks.answer_matches(answer, trial.fact))
        print(f"trial {i + 1}/{len(trials)} depth {trial.depth:.2f}: tokens {base.original_tokens}, "
              + ", ".join(f"{q} {'ok' if correct[q][-1] else 'wrong'}" for q in correct)
              + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    n = len(trials)
    print("\n# kvpack quantization benchmark\n")
    print(f"command: python tools/bench_quant.py {' '.join(sys.argv[1:])}")
    print(f"model: {args.model or 'embedded reference model'}; {args.method} keep {args.ratio}; "
          f"{n} trials of ~{args.tokens} context tokens ({base.original_tokens} cached tokens in the last one); "
          f"group size {args.group_size}, {args.layout} layout; stored float rows {args.kv_dtype}\n")
    print(f"fp16 KV of the full cache: {statistics.mean(full_kv):,.0f} bytes (mean); "
          f"keep-everything fp16 file: {statistics.mean(full_file):,.0f} bytes\n")
    print("| quant | zstd | bytes on disk (mean) | x smaller than fp16 KV (mean / worst) | x smaller than fp16 file |")
    print("|---|---|---|---|---|")
    for (q, z), vals in sizes.items():
        ratios = [f / s for f, s in zip(full_kv, vals)]
        rfile = statistics.mean(f / s for f, s in zip(full_file, vals))
        print(f"| {q} | {z or 'off'} | {statistics.mean(vals):,.0f} | {statistics.mean(ratios):.2f} / "
              f"{min(ratios):.2f} | {rfile:.2f} |")
    acc = {q: 100.0 * sum(c) / n for q, c in correct.items()}
    flips = sum(a != b for a, b in zip(correct[C.QUANT_NONE], correct[args.quant]))
    same = sum(a == b for a, b in zip(answers[C.QUANT_NONE], answers[args.quant]))
    print(f"\nretrieval (exact match of the code, {n} trials): none {acc[C.QUANT_NONE]:.1f}%, "
          f"{args.quant} {acc[args.quant]:.1f}% ({acc[args.quant] - acc[C.QUANT_NONE]:+.1f} points); "
          f"{flips} trial(s) changed correctness, {same}/{n} identical answer texts")
    for name in ablations:
        lost = sum(a and not b for a, b in zip(correct[C.QUANT_NONE], correct[name]))
        gained = sum(b and not a for a, b in zip(correct[C.QUANT_NONE], correct[name]))
        print(f"  ablation, {name}: {acc[name]:.1f}% ({acc[name] - acc[C.QUANT_NONE]:+.1f} points; {lost} lost, "
              f"{gained} gained)")
    worst = {k: max(e[l][k] for e in errors for l in range(len(e)))
             for k in ("key_max_abs", "value_max_abs")}
    means = {k: statistics.mean(e[l][k] for e in errors for l in range(len(e)))
             for k in ("key_mean_abs", "value_mean_abs")}
    print(f"{args.quant} error over all entries: keys max {worst['key_max_abs']:.4g} mean {means['key_mean_abs']:.4g}; "
          f"values max {worst['value_max_abs']:.4g} mean {means['value_mean_abs']:.4g}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        out = {"args": vars(args), "fp16_kv_bytes": full_kv, "fp16_file_bytes": full_file,
               "sizes": {f"{q}/zstd{z}": v for (q, z), v in sizes.items()}, "accuracy": acc,
               "correct": correct, "answers": answers, "quant_error": errors}
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
