#!/usr/bin/env python
"""Where an Attention Matching build spends its time: KVzip's whole build, then AM's steps on one held-out passage
(``prefill``, ``score``: KVzip's repeat pass plus the reference sources such as the self-study answers,
``select``: the split over heads and the choice within each head, such as RMS attention, and ``update_entries``:
the fits), medians over ``--repeats``, all in one process. Default configuration: the paper's
(``reference=self-study+repeat``, ``selection=rms``, 50,000 queries, always fitted), off-policy.

    python tools/bench_am_steps.py --model smollm2-135m --length 2048 --threads 1
    python tools/bench_am_steps.py --params '{}'          # AM's defaults, the reference model
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
from kvpack.compress import prefill_recorder  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.methods.base import gather  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.prefill import prefill  # noqa: E402

#: The paper's configuration (arXiv 2602.16284, the official code's AM-HighestAttnKeys query set), off-policy.
PAPER_OFF_POLICY = dict(reference="self-study+repeat", selection="rms", on_policy=False, value_bound=0,
                        held_out_check=False, queries=50_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a held-out passage)")
    ap.add_argument("--seed", type=int, default=2, help="seed of the held-out passage")
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--params", default=json.dumps(PAPER_OFF_POLICY), help="the AM configuration, as JSON")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    params = json.loads(args.params)
    model, tok = kvpack.load_model(args.model)
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=args.seed)))
    spec, layout = model_spec(model), chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, doc.text)
    seconds: dict[str, list[float]] = {}

    def timed(name, fn, *a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        seconds.setdefault(name, []).append(time.perf_counter() - t)
        return out

    for _ in range(args.repeats):
        timed("kvzip build", kvpack.compress, model, tok, doc.text, method="kvzip", ratio=args.ratio)
        scorer = get_method("am", **params)
        # the method's own recorder, as kvpack.compress gives it (ridge_search records the context's last queries)
        recorder, observed = prefill_recorder(scorer, spec, len(ids), "cpu", tok, layout, True, False)
        full = timed("am: prefill", prefill, model, ids, len(layout.prefix_ids(tok)), layout, spec, 2048, None,
                     recorder, observed)
        scores = timed("am: score", scorer.score, model, tok, full)
        keep = timed("am: select", scorer.select, scores, args.ratio, full)
        timed("am: fit", scorer.update_entries, full, keep, gather(full, keep))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    am = sum(v for k, v in med.items() if k.startswith("am:"))
    print(json.dumps({"command": " ".join(sys.argv), "context_tokens": full.context_tokens, "median_seconds": med,
                      "am steps, summed": am, "am over kvzip build": am / med["kvzip build"]}, indent=1))


if __name__ == "__main__":
    main()
