#!/usr/bin/env python
"""Full-cache retrieval accuracy of a model by context length and needle depth (the model card's figure).

Each trial plants one "The secret code of <name> is <number>." fact at a depth in a held-out passage
(``kvpack/data/haystack``), asks "What is the secret code of <name>?" in the same user turn, and greedy-decodes
the answer with the ordinary full cache. Depths are spread evenly over 0-100%; trials are seeded.

    python tools/eval_reference_model.py --lengths 1024 2048 4096 --trials 100 --out runs/eval.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack.evaluation import full_cache_retrieval  # noqa: E402


@torch.inference_mode()
def heldout_perplexity(model, tokenizer, window: int = 1024, max_windows: int = 40) -> tuple[float, int]:
    """Perplexity of plain next-token prediction on the held-out haystack documents, in ``window``-token
    windows (BOS + text); returns (perplexity, tokens scored)."""
    from kvpack import tasks

    ids = []
    for doc in tasks.haystack_documents():
        ids += tokenizer.encode(doc, add_special_tokens=False)
    nll, count = 0.0, 0
    for start in range(0, min(len(ids), window * max_windows), window):
        chunk = [tokenizer.bos_token_id] + ids[start : start + window - 1]
        x = torch.tensor([chunk], device=model.device)
        logits = model(input_ids=x).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += len(chunk) - 1
    return float(torch.exp(torch.tensor(nll / count))), count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded reference model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, tok = kvpack.load_model(args.model)
    ppl, scored = heldout_perplexity(model, tok)
    print(f"held-out perplexity: {ppl:.2f} over {scored} tokens (1024-token windows)\n")
    results = []
    print("| context tokens | trials | accuracy | depth 0-33% | depth 33-67% | depth 67-100% | seconds |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        t0 = time.perf_counter()
        hits = [(round(d, 3), ok) for d, ok, _ in full_cache_retrieval(model, tok, length, args.trials, args.seed)]
        r = {"length": length, "trials": args.trials, "accuracy": sum(ok for _, ok in hits) / args.trials,
             "hits": hits, "seconds": round(time.perf_counter() - t0, 1)}
        bins = [[h for d, h in r["hits"] if lo <= d < hi] for lo, hi in ((0, 1 / 3), (1 / 3, 2 / 3), (2 / 3, 1.01))]
        cells = " | ".join(f"{sum(b) / max(1, len(b)):.0%}" for b in bins)
        print(f"| {length} | {args.trials} | {r['accuracy']:.1%} | {cells} | {r['seconds']} |", flush=True)
        results.append(r)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "perplexity": ppl, "results": results}, indent=1))


if __name__ == "__main__":
    main()
