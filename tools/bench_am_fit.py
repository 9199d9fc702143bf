#!/usr/bin/env python
"""Attention Matching's selection and fit alone: one held-out passage prefilled and scored once, then ``select`` and
``update_entries`` (the fits) ``--repeats`` times, each timed, with the kvpack of ``--tree`` (default: this one). To
compare two commits' fits, make a worktree of the other and run both, interleaved, on a quiet machine:

    git worktree add /tmp/base <commit>
    for t in /tmp/base . /tmp/base .; do OMP_NUM_THREADS=1 python tools/bench_am_fit.py --tree $t --ratio 0.3; done
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="the kvpack checkout to time")
    ap.add_argument("--model", default="smollm2-135m", help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a held-out passage)")
    ap.add_argument("--seed", type=int, default=2, help="seed of the held-out passage")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch

    import kvpack
    from kvpack.bench.continuation import continuation_docs
    from kvpack.compress import prefill_recorder
    from kvpack.layout import chat_layout
    from kvpack.methods import get_method
    from kvpack.methods.base import gather
    from kvpack.model import model_spec
    from kvpack.prefill import prefill

    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=args.seed)))
    spec, layout = model_spec(model), chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, doc.text)
    scorer = get_method("am")
    recorder, observed = prefill_recorder(scorer, spec, len(ids), "cpu", tok, layout, True, False)
    full = prefill(model, ids, len(layout.prefix_ids(tok)), layout, spec, 2048, None, recorder, observed)
    scores = scorer.score(model, tok, full)
    select, fit = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        keep = scorer.select(scores, args.ratio, full)
        select.append(time.perf_counter() - t)
        layers = gather(full, keep)
        t = time.perf_counter()
        scorer.update_entries(full, keep, layers)
        fit.append(time.perf_counter() - t)
    print(f"{kvpack.__file__}: keep {args.ratio}, select {', '.join(f'{s:.2f}' for s in select)} s; "
          f"fit {', '.join(f'{s:.2f}' for s in fit)} s")


if __name__ == "__main__":
    main()
