#!/usr/bin/env python
"""Are planted facts found exactly when their tokens are kept? Multi-query contexts (``kvpack.bench.multiquery``,
the same seeds as ``tools/bench_am.py``) are compressed with each method and ratio; each fact is asked of the loaded
pack, and for every (layer, KV head) the script records whether all of the fact's code tokens are among the entries
that head kept. It prints, per method and ratio, the facts found, each head's share of context positions kept
(coverage) and of fact codes kept, and the agreement between "found" and "kept in the head that predicts it best".

Why: on the reference model one KV head carries retrieval (BENCHMARKS.md, "Issue 28, thirty-third session"). If
facts are found about when that head keeps their code, a method's retrieval is bounded by how many positions that
head can keep: at keep 0.05 on a 2K context the whole budget is ``0.05 x 8 heads x 2,048 = 819`` entries, 40% of
one head's positions at most, against the 80% KVzip's split gives it at keep 0.1.

    OMP_NUM_THREADS=1 python tools/am_fact_coverage.py --seeds 71,72,73,74,75,76,77,78,79 --ratios 0.1,0.05 \\
        --methods kvzip,am --out runs/coverage39.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.bench.multiquery import multiquery_contexts  # noqa: E402
from kvpack.bench.specs import parse_method_spec  # noqa: E402
from kvpack.cache import KvpackCache  # noqa: E402


def decoded_pieces(tokenizer, token_ids: list[int]) -> tuple[str, list[int], list[int]]:
    """``(text, starts, lengths)``: the sequence decoded token by token, and each token's character offset and
    length in that text (for ``code_positions``)."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    starts, at = [], 0
    for piece in pieces:
        starts.append(at)
        at += len(piece)
    return "".join(pieces), starts, [len(piece) for piece in pieces]


def code_positions(decoded: tuple[str, list[int], list[int]], code: str) -> list[int]:
    """Positions of the tokens that spell ``code`` in a sequence ``decoded`` by ``decoded_pieces`` (the fact
    sentence's ``... is <code>.``): those overlapping its last occurrence. Raises ``ValueError`` when the code is
    not in the decoded sequence."""
    text, starts, lengths = decoded
    at = text.rfind(code)
    if at < 0:
        raise ValueError(f"code {code} not in the context")
    end = at + len(code)
    return [i for i, (s, n) in enumerate(zip(starts, lengths)) if s < end and s + n > at]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--seeds", default="71,72", help="bench seeds, comma-separated (as tools/bench_am.py --seed)")
    ap.add_argument("--contexts", type=int, default=2, help="multi-query contexts per seed")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--facts", type=int, default=8)
    ap.add_argument("--ratios", default="0.1,0.05")
    ap.add_argument("--methods", default="kvzip,am", help="method specs, comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the per-fact rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for ctx in multiquery_contexts(tok, args.length, args.facts, args.contexts, seed=seed):
            for spec in args.methods.split(","):
                name, params = parse_method_spec(spec)
                for ratio in (float(r) for r in args.ratios.split(",")):
                    pack = kvpack.compress(model, tok, ctx.text, method=name, ratio=ratio, kv_dtype="float32",
                                           **params)
                    decoded = decoded_pieces(tok, pack.token_ids.tolist())  # the same for every fact
                    # per (layer, KV head): the set of positions it kept
                    kept = [set(part.tolist()) for layer in pack.layers
                            for part in layer.positions.split(layer.head_lengths.tolist())]
                    cache = KvpackCache.from_pack(pack)
                    coverage = [len(k) / pack.original_tokens for k in kept]
                    for fact, question in zip(ctx.facts, ctx.questions):
                        found = tasks.answer_matches(kvpack.generate(model, tok, cache, question, max_new_tokens=32),
                                                     fact)
                        where = code_positions(decoded, fact.code)
                        rows.append({"seed": seed, "context": ctx.key, "method": spec, "ratio": ratio,
                                     "found": bool(found), "code_positions": where, "coverage": coverage,
                                     "code_kept": [all(p in k for p in where) for k in kept]})
    summary = {}
    for spec in args.methods.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")):
            rs = [r for r in rows if r["method"] == spec and r["ratio"] == ratio]
            if not rs:
                continue
            heads = len(rs[0]["code_kept"])
            kept_share = [sum(r["code_kept"][h] for r in rs) / len(rs) for h in range(heads)]
            coverage = [sum(r["coverage"][h] for r in rs) / len(rs) for h in range(heads)]
            agree = [sum(r["code_kept"][h] == r["found"] for r in rs) for h in range(heads)]
            best = max(range(heads), key=lambda h: agree[h])
            found = sum(r["found"] for r in rs)
            kept_found = sum(r["found"] for r in rs if r["code_kept"][best])
            summary[f"{spec} @ {ratio}"] = {
                "facts": len(rs), "found": found,
                "best head (layer x kv_heads + head)": best, "its coverage": round(coverage[best], 3),
                "codes it kept": sum(r["code_kept"][best] for r in rs), "found among those": kept_found,
                "found among the others": found - kept_found,
                "agreement of found with kept there": round(agree[best] / len(rs), 3),
                "coverage per head": [round(c, 3) for c in coverage],
                "codes kept per head": [round(k, 3) for k in kept_share]}
    print(json.dumps({"command": " ".join(sys.argv), "summary": summary}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
