#!/usr/bin/env python
"""How far the refinement (``kvpack.methods.am_refine``) takes each KV head, measured per head on reference queries
the refinement never saw (a diagnostic, issue 28).

One passage is compacted with ``--method am`` (refinement off) while every fitted head's problem is recorded: its
context keys and values, its fit queries and its kept entries. Then per head the fit queries are split at random,
three quarters to fit on and a quarter held out; the closed form (``am_fit.fit_head``) is fitted on the first part,
and each ``--configs`` entry refines it. The table gives, over the heads, the mean relative error of the head's
output over ``[sink, compacted context]`` against the full context's on the held-out quarter, the geometric mean of
its ratio to the closed form's, how many heads it made worse, and the refinement's seconds. These queries come from
the same sources as the fit's, so a lower error here is necessary, not sufficient: the continuation ΔNLL of
``tools/bench_am.py`` is the measure.

    OMP_NUM_THREADS=1 python tools/am_refine_probe.py --model smollm2-135m --haystack /tmp/heldout_topics --seed 5 \\
        --ratio 0.05 --configs keys:30:512:0.01 keys+beta+values:30:1024:0.005
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
import kvpack.methods.am as am  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.bench.continuation import continuation_docs  # noqa: E402
from kvpack.methods.am_fit import attention_output, context_attention, fit_head, relative_error  # noqa: E402
from kvpack.methods.am_refine import REFINE_MOVES, full_output, refine_head  # noqa: E402


def record_heads(model, tok, text: str, ratio: float) -> list[dict]:
    """Compact ``text`` with AM's defaults at ``ratio``, refinement off, and return each fitted and validated head's
    problem: ``k_ctx`` ``[T, d]``, ``v_ctx`` ``[T, dv]`` (sink left out), ``sink_k``, ``sink_v`` ``[s, d]``,
    ``queries`` ``[n, d]``, ``kept`` ``[t]`` and ``scaling`` (``fit_head``'s and ``choose_fit``'s arguments, read as
    AM passes them)."""
    heads, original, original_choice = [], am.fit_head, am.choose_fit

    def recording(keys, values, queries, kept, scaling, **kw):
        heads.append(dict(k_ctx=keys.clone(), v_ctx=values.clone(), queries=queries.clone(), kept=kept.clone(),
                          scaling=scaling, sink_k=kw["sink_keys"].clone(), sink_v=None))
        return original(keys, values, queries, kept, scaling, **kw)

    def choosing(keys, values, positions, sink, *rest, **kw):  # right after the same head's fit: its sink's values
        heads[-1]["sink_v"] = values[:sink].clone()
        return original_choice(keys, values, positions, sink, *rest, **kw)

    am.fit_head, am.choose_fit = recording, choosing
    try:
        kvpack.compress(model, tok, text, method="am", ratio=ratio, refine_steps=0)
    finally:
        am.fit_head, am.choose_fit = original, original_choice
    return [h for h in heads if h["sink_v"] is not None]


def probe(heads: list[dict], configs: list[tuple[str, int, int, float]], seed: int) -> dict:
    """Per head, the closed form and each ``(move, steps, batch, lr)`` refinement of it on three quarters of its
    queries, measured on the rest (module docstring). Returns ``{config name: summary}``."""
    gen = torch.Generator().manual_seed(seed)
    rows, seconds = [], {c: 0.0 for c in configs}
    for h in heads:
        n = h["queries"].shape[0]
        perm = torch.randperm(n, generator=gen)
        fit_q, test_q = h["queries"][perm[: 3 * n // 4]], h["queries"][perm[3 * n // 4:]]
        sk, sv = h["sink_k"], h["sink_v"]
        ctx = context_attention(fit_q, h["k_ctx"], h["v_ctx"], h["scaling"])
        fit = fit_head(h["k_ctx"], h["v_ctx"], fit_q, h["kept"], h["scaling"], context=ctx)
        full = full_output(fit_q, ctx[0], ctx[1], sk, sv, h["scaling"])
        want = attention_output(test_q, torch.cat([sk, h["k_ctx"]]), torch.cat([sv, h["v_ctx"]]), h["scaling"])

        def error(keys, beta, values) -> float:
            got = attention_output(test_q, torch.cat([sk, keys]), torch.cat([sv, values]), h["scaling"],
                                   torch.cat([torch.zeros(sk.shape[0]), beta]))
            return relative_error(want, got)

        row = {"closed form": error(h["k_ctx"][h["kept"]], fit.beta, fit.values)}
        for c in configs:
            move, steps, batch, lr = c
            t = time.perf_counter()
            k, b, v, _, _ = refine_head(h["k_ctx"][h["kept"]], fit.beta, fit.values, fit_q, full, sk, sv,
                                        h["scaling"], steps, lr=lr, batch=batch, measure=False, move=move)
            seconds[c] += time.perf_counter() - t
            row[c] = error(k, b, v)
        rows.append(row)
    out = {}
    for c in ["closed form", *configs]:
        name = c if isinstance(c, str) else f"{c[0]}:{c[1]}:{c[2]}:{c[3]:g}"
        ratios = [r[c] / max(r["closed form"], 1e-12) for r in rows]
        out[name] = {"mean_error": statistics.mean(r[c] for r in rows),
                     "geomean_vs_closed_form": math.exp(statistics.mean(math.log(max(x, 1e-12)) for x in ratios)),
                     "heads_worse": sum(x > 1 for x in ratios), "seconds": seconds.get(c, 0.0)}
    return {"heads": len(rows), "configs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--haystack", default=None, help="folder of .txt/.md files (default: the shipped haystack)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens")
    ap.add_argument("--seed", type=int, default=5, help="seed of the passage (and of the query split)")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--configs", nargs="+", default=["keys:30:512:0.01", "keys+beta+values:30:1024:0.005"],
                    help="refinements as MOVE:STEPS:BATCH:LR, MOVE one of " + ", ".join(REFINE_MOVES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = []
    for c in args.configs:
        move, steps, batch, lr = c.split(":")
        if move not in REFINE_MOVES:
            ap.error(f"--configs: {move!r} is not one of {REFINE_MOVES}")
        configs.append((move, int(steps), int(batch), float(lr)))
    model, tok = kvpack.load_model(args.model)
    docs = tasks.haystack_documents(args.haystack) if args.haystack else None
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=args.seed, documents=docs)))
    heads = record_heads(model, tok, doc.text, args.ratio)
    print(json.dumps({"command": " ".join(sys.argv), **probe(heads, configs, args.seed)}, indent=1))


if __name__ == "__main__":
    main()
