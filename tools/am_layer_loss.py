"""Where a compacted cache loses its continuation: each compressed layer on its own (a diagnostic, issue 28).

For each passage (``kvpack.bench.continuation``, the bench's seeds), every variant's pack is built as
``tools/bench_am.py`` builds it. Then, for each compressed layer ``l``, a hybrid cache holds the full context in every
layer but ``l``, which holds the variant's entries. Its continuation ΔNLL (nats/token over the target tokens, against
the full cache) is the loss of layer ``l`` alone. The per-layer losses of one variant need not sum to its whole loss
(the layers' errors interact), and the table prints both.

    OMP_NUM_THREADS=1 python tools/am_layer_loss.py --model smollm2-135m --seed 42 --cont-docs 1 \
        --variants "kvzip@0.1,am@0.05,kvzip@0.05" --out runs/layer_loss_seed42.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
from kvpack.bench.continuation import continuation_docs, fullcache_logprobs  # noqa: E402
from kvpack.cache import KvpackCache  # noqa: E402
from kvpack.evaluation import cache_logprobs, target_nll  # noqa: E402
from kvpack.fingerprint import model_fingerprint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_am import packs_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or name (default: the embedded reference model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cont-docs", type=int, default=1)
    ap.add_argument("--cont-length", type=int, default=2048)
    ap.add_argument("--variants", default="kvzip@0.1,am@0.05",
                    help="comma-separated SPEC@RATIO (kvzip[...] or am[...])")
    ap.add_argument("--out", default="runs/am_layer_loss.json")
    args = ap.parse_args()
    wanted = [(v.rsplit("@", 1)[0], float(v.rsplit("@", 1)[1])) for v in args.variants.split(",")]
    names = list(dict.fromkeys(n for n, _ in wanted))
    ratios = sorted({r for _, r in wanted}, reverse=True)
    model, tok = kvpack.load_model(args.model)
    fingerprint = model_fingerprint(model, tok)
    rows = []
    t0 = time.perf_counter()
    for doc in continuation_docs(tok, args.cont_length, args.cont_docs, seed=args.seed):
        ref_nll = target_nll(fullcache_logprobs(model, tok, doc), doc.target_ids)
        # the full cache as a pack: KVzip at keep 1, from the same prefill and scoring pass (no fit at keep 1)
        packs = packs_for(model, tok, doc.text, [*ratios, 1.0], None, ("global",),
                          names if "kvzip" in names else [*names, "kvzip"], None, fingerprint)
        full_pack = packs[("kvzip", "global", 1.0)]

        def loss(pack) -> float:
            lp = cache_logprobs(model, KvpackCache.from_pack(pack), doc.target_ids)
            return float(target_nll(lp, doc.target_ids) - ref_nll)

        base = loss(full_pack)
        for name, r in wanted:
            pack = packs[(name, "global", r)]
            total = loss(pack)
            compressed = [l for l, kind in enumerate(pack.metadata["layer_kinds"]) if kind == "compressed"]
            per_layer = {}
            for l in compressed:
                layers = list(full_pack.layers)
                layers[l] = pack.layers[l]
                per_layer[l] = loss(dataclasses.replace(full_pack, layers=layers))
            row = {"doc": doc.key, "variant": name, "ratio": r, "delta_nll": total, "full_pack": base,
                   "per_layer": per_layer, "layer_entries": [int(pack.layers[l].num_entries) for l in compressed]}
            rows.append(row)
            top = sorted(per_layer.items(), key=lambda kv: -kv[1])[:6]
            print(json.dumps({"doc": doc.key, "variant": name, "ratio": r, "delta_nll": round(total, 4),
                              "sum_layers": round(sum(per_layer.values()), 4),
                              "top": [(l, round(v, 4)) for l, v in top]}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows,
                                          "seconds": time.perf_counter() - t0}, indent=1))


if __name__ == "__main__":
    main()
