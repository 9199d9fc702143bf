"""Would a per-pack choice between AM and KVzip, made on text the model samples after the context, pick the pack
that is better on the document's real continuation?  A diagnostic for issue 28 (BENCHMARKS.md, "Issue 28,
thirtieth session"), not a method of kvpack's.

For each passage of ``kvpack.bench.continuation`` (the bench's 2K passages of ``--seed``): the packs of KVzip and of
AM's defaults at each ``--ratios`` keep ratio, built as ``tools/bench_am.py`` builds them (``packs_for``); the real
continuation's ΔNLL (nats/token over its 256 tokens, as ``bench_am.py`` reports it); and, over ``--tokens`` tokens
sampled from the full cache after the context (temperature 1, no top-k or top-p, ``torch.manual_seed(1234 +
seed)``; the first token is the real continuation's), each pack's mean KL divergence from the full cache
(``sampled_kl``, nats per token) and its ΔNLL of the sampled tokens (``sampled_dnll``).

    OMP_NUM_THREADS=1 python tools/am_sampled_choice.py --model smollm2-135m --seed 42 --out runs/packsel30_seed42.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_am  # noqa: E402
import kvpack  # noqa: E402
from kvpack.bench.continuation import continuation_docs, fullcache_logprobs  # noqa: E402
from kvpack.cache import KvpackCache  # noqa: E402
from kvpack.evaluation import cache_logprobs, target_nll  # noqa: E402
from kvpack.fingerprint import model_fingerprint  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bench's passages")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--length", type=int, default=2048, help="context tokens")
    ap.add_argument("--ratios", default="0.1,0.05")
    ap.add_argument("--tokens", type=int, default=128, help="tokens sampled after the context")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/am_sampled_choice.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    model, tok = kvpack.load_model(args.model)
    fingerprint = model_fingerprint(model, tok)
    layout = chat_layout(tok)
    rows = []
    for doc in continuation_docs(tok, args.length, args.docs, seed=args.seed):
        ctx = layout.prefix_ids(tok) + layout.encode_text(tok, doc.text)
        torch.manual_seed(1234 + args.seed)
        with torch.inference_mode():
            gen = model.generate(input_ids=torch.tensor([ctx]), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=args.tokens, min_new_tokens=args.tokens)
            sampled = [doc.target_ids[0]] + gen[0, len(ctx):].tolist()
            logits = model(input_ids=torch.tensor([ctx + sampled[:-1]]), use_cache=False,
                           logits_to_keep=len(sampled) - 1).logits[0]
            full_sampled = torch.log_softmax(logits.float(), dim=-1)
            ref_nll = target_nll(fullcache_logprobs(model, tok, doc), doc.target_ids)
        packs = bench_am.packs_for(model, tok, doc.text, ratios, None, ("global",), ("kvzip", "am"), None, fingerprint)
        for (name, _, r), pack in packs.items():
            cache = KvpackCache.from_pack(pack)
            with torch.inference_mode():
                real = cache_logprobs(model, cache, doc.target_ids)
                on_sampled = cache_logprobs(model, cache, sampled)
            kl = float((full_sampled.exp() * (full_sampled - on_sampled)).sum(-1).mean())
            row = {"doc": doc.key, "variant": name, "ratio": r, "delta_nll": target_nll(real, doc.target_ids) - ref_nll,
                   "sampled_kl": kl,
                   "sampled_dnll": target_nll(on_sampled, sampled) - target_nll(full_sampled, sampled)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
