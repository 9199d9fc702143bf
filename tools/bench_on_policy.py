#!/usr/bin/env python
"""Attention Matching's on-policy fit: the sweep (``kvpack.methods.am_sweep``, every reference pass once, in step)
against the layer-by-layer replay (one forward call per pass and layer, ``AttentionMatching._recompute_queries``),
on one prefilled held-out passage, with the whole build of KVzip and of that AM configuration beside them.

Per repeat, in one process: ``kvpack.compress`` with KVzip and with the AM configuration (whole builds), then, on
one shared prefill, ``score`` (repeat pass and reference sources), ``select``, and ``update_entries`` by the sweep
and by the layer-by-layer replay on the same keep mask; medians over ``--repeats``. It also prints the largest
difference between the two paths' fitted values and biases (float noise: they fit on the same queries).

    python tools/bench_on_policy.py --model smollm2-135m --length 2048 --ratio 0.1
    python tools/bench_on_policy.py --model smollm2-135m --all-builds --builds-only --repeats 2   # whole builds only
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
from kvpack.bench.continuation import continuation_docs  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.methods.am import _FitTally  # noqa: E402
from kvpack.methods.base import gather  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.prefill import prefill  # noqa: E402

#: The paper's headline configuration (arXiv 2602.16284, the official code's AM-HighestAttnKeys).
PAPER = dict(reference="self-study+repeat", selection="rms", on_policy=True, value_bound=0, held_out_check=False,
             queries=50_000)


def layer_by_layer(scorer, full, keep, layers) -> None:
    """``update_entries``' fit with each layer's on-policy queries computed for that layer alone."""
    tally, reservoirs = _FitTally(), list(scorer._reservoirs)
    for i in range(len(full.spec.compressed_layers)):
        if i > 0:
            reservoirs[i] = scorer._recompute_queries(full, layers, i)
        scorer._fit_layer(full, keep, layers, i, reservoirs, tally)


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a held-out passage)")
    ap.add_argument("--seed", type=int, default=2, help="seed of the held-out passage")
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--params", default=json.dumps(PAPER), help="the AM configuration, as JSON")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--all-builds", action="store_true",
                    help="also time the configuration off-policy and AM's defaults (whole builds)")
    ap.add_argument("--builds-only", action="store_true",
                    help="time the whole builds only (no step breakdown, no layer-by-layer replay)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = json.loads(args.params)
    model, tok = kvpack.load_model(args.model)
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=args.seed)))
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        builds = [("kvzip build", "kvzip", {}), ("am build", "am", params)]
        if args.all_builds:
            builds += [("am build, off-policy", "am", {**params, "on_policy": False}),
                       ("am (defaults) build", "am", {})]
        for name, method, opts in builds:
            _, s = timed(kvpack.compress, model, tok, doc.text, method=method, ratio=args.ratio, **opts)
            seconds.setdefault(name, []).append(s)
        if args.builds_only:
            continue
        full, s = timed(prefill, model, prefix + layout.encode(tok, doc.text), len(prefix), layout, spec, 2048)
        seconds.setdefault("prefill", []).append(s)
        scorer = get_method("am", **params)
        scores, s = timed(scorer.score, model, tok, full)
        seconds.setdefault("am score (repeat pass, sources)", []).append(s)
        keep = scorer.select(scores, args.ratio, full)
        swept = gather(full, keep)
        _, s = timed(scorer.update_entries, full, keep, swept)
        seconds.setdefault("am fit, on-policy sweep", []).append(s)
        replayed = gather(full, keep)
        _, s = timed(layer_by_layer, scorer, full, keep, replayed)
        seconds.setdefault("am fit, layer by layer", []).append(s)
        gap = max(max(float((a.values.float() - b.values.float()).abs().max()),
                      float((a.biases - b.biases).abs().max()) if a.biases is not None else 0.0)
                  for a, b in zip(swept, replayed))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {"command": " ".join(sys.argv), "median_seconds": med,
           "over_kvzip_build": {k: v / med["kvzip build"] for k, v in med.items() if k.endswith("build")
                                or "build," in k}}
    if not args.builds_only:
        out.update({"context_tokens": full.context_tokens, "passes": len(scorer._policy_passes(full)),
                    "layer_by_layer_over_sweep": med["am fit, layer by layer"] / med["am fit, on-policy sweep"],
                    "largest_difference": gap})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
