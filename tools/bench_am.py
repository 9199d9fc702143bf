"""Attention Matching against KVzip from one prefill and one scoring pass per context (continuation ΔNLL and
multi-query accuracy at several keep ratios, with the ``--values`` ablation).

AM's selection is KVzip's global top-k and its scores are KVzip's (``tests/test_am.py`` checks that
``values="copy"`` holds exactly KVzip's entries), so one ``AttentionMatching.score`` (KVzip's repeat pass, which
also records the reference queries) serves KVzip and every AM variant of the same query source; a variant with
``score_queries=reference`` selects by its own source's scores. Each pack is then what ``kvpack.compress`` returns
for it (a variant with ``selection=rms`` keeps each head's count and re-chooses its entries by RMS attention over
its reference queries, as ``AttentionMatching.select`` does). Packs are laid out with ``KvpackCache.from_pack`` (no
file round trip, which ``tests/test_am.py`` covers) to save time on a loaded machine. Contexts and targets are the
bench's own (``kvpack.bench.continuation``, ``kvpack.bench.multiquery``, same seeds).

``--budgets`` is an ablation of how the budget is split over heads (the same scores, the same total):

    global   KVzip's global top-k (the default of both methods: non-uniform heads, arXiv 2505.23416 §3.3)
    head     an even split over every (layer, KV head), top-k within each head
    floorF   every head first gets its top ``F x`` the even share (e.g. ``floor0.125``), the rest by global top-k
    adakvF   Ada-KV (arXiv 2407.11550) as its paper runs it: every layer the same budget, split over that layer's
             heads by one top-k with a safeguard of ``F x`` the layer's even per-head share (``adakv0.2``: its
             scripts' ``floor_alpha``); the method's recent tokens first, counted in the safeguard
    lfloorF  every layer first keeps its top ``F x`` the even per-layer share (one top-k over that layer's heads,
             the recent tokens first), the rest by global top-k: a floor per layer instead of per head
    largest-full   a diagnostic, not an equal budget: ``global``, with the head that keeps most made complete (how
             much of the loss sits in that one head's evictions)

    python tools/bench_am.py --cont-docs 2 --cont-length 1024 --mq-contexts 1 --mq-length 1024 --mq-facts 4
    python tools/bench_am.py --cont-docs 2 --cont-length 1024 --mq-contexts 0 --ratios 0.1,0.05 \
        --budgets global,head,floor0.0625,floor0.25 --variants kvzip,am
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
from kvpack import tasks  # noqa: E402
from kvpack.bench.specs import parse_method_spec  # noqa: E402
from kvpack.bench.continuation import continuation_docs, fullcache_logprobs  # noqa: E402
from kvpack.evaluation import cache_logprobs, target_nll  # noqa: E402
from kvpack.bench.multiquery import multiquery_contexts  # noqa: E402
from kvpack.cache import KvpackCache  # noqa: E402
from kvpack.compress import assemble_pack  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.methods.base import split_evenly, top_k_rows  # noqa: E402
from kvpack.methods.budgets import capped_top_k, protect_recent  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.prefill import prefill  # noqa: E402

VARIANTS = ("kvzip", "am", "am[values=copy]", "am[values=merge]")  # method specs (kvpack.bench.specs)
#: AM parameters read only by the selection and the fit, after ``score()``: variants that differ only in these share
#: one scoring pass and its reference queries (``packs_for``).
FIT_SIDE = frozenset({"budgets", "max_head_ratio", "head_floor", "schedule", "recent", "selection",
                      "unfitted_selection", "values",
                      "queries_per_entry", "held_out_check", "shift", "value_bound", "ridge", "ridge_to", "weights",
                      "refine_steps", "refine_batch", "refine_move", "refine_lr",
                      "refine_queries", "select_queries", "select_pool"})
#: KVzip parameters read only by its selection: a kvzip variant with any other parameter scores on its own.
KVZIP_SELECT_SIDE = frozenset({"max_head_ratio"})


def split_budget(scorer, scores: torch.Tensor, ratio: float, full, budget: str) -> torch.Tensor:
    """Keep mask ``[layers, kv_heads, tokens]`` with ``round(ratio x entries)`` entries split over heads as
    ``budget`` says (module docstring): ``global``, ``head``, ``floorF``, ``adakvF`` or ``lfloorF`` (``F`` in
    [0, 1]); ``largest-full`` keeps more (a diagnostic). Exits with a message for another split."""
    layers, heads, n = scores.shape
    total = int(round(ratio * scores.numel()))
    if budget == "global":
        return scorer.select(scores, ratio, full)
    if budget == "largest-full":
        keep = scorer.select(scores, ratio, full).clone()
        keep.view(layers * heads, n)[int(keep.sum(dim=2).flatten().argmax())] = True
        return keep
    if budget == "head":
        flat = scores.detach().float().reshape(layers * heads, n)
        return top_k_rows(flat, split_evenly(total, layers * heads)).view(scores.shape)
    kind = next((k for k in ("lfloor", "adakv", "floor") if budget.startswith(k)), None)
    if kind is None:
        raise SystemExit(f"--budgets: unknown split {budget!r} (global, head, floorF, adakvF, lfloorF or "
                         "largest-full)")
    try:
        share = float(budget[len(kind):])
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise SystemExit(f"--budgets: {budget!r} needs a share in [0, 1] after {kind!r}, e.g. {kind}0.25")
    if kind == "floor":  # the method's head floor, without its recent tokens first
        return capped_top_k(scores, total, 1.0, share)
    protected = protect_recent(scores.detach().float().cpu(), getattr(scorer, "recent", 0))
    shares = split_evenly(total, layers)
    if kind == "adakv":
        return torch.cat([capped_top_k(protected[i:i + 1], int(shares[i]), 1.0, share) for i in range(layers)])
    floors = (share * shares.double()).floor().long()
    keep = torch.cat([capped_top_k(protected[i:i + 1], int(floors[i])) for i in range(layers)]).flatten()
    rest = protected.flatten().masked_fill(keep, float("-inf"))
    keep[rest.argsort(descending=True, stable=True)[: total - int(keep.sum())]] = True
    return keep.view(scores.shape)


def packs_for(model, tok, text: str, ratios: list[float], queries: int | None, budgets=("global",), variants=VARIANTS,
              timings: dict | None = None, fingerprint: dict | None = None
              ) -> dict[tuple[str, str, float], object]:
    """``{(variant, budget, ratio): Pack}`` from one prefill, one KVzip scoring pass and one reference-query pass
    per query source the variants ask for. Budget ``global`` is each variant's own selection (``Method.select``:
    for ``am`` its ``budgets``/``max_head_ratio``/``recent``; ``kvzip[max_head_ratio=0.75]`` caps KVzip); the other
    splits (``split_budget``) replace it. ``timings`` (if given) gets ``{variant: seconds}`` of a build from the
    prefill on: the prefill, the variant's scoring and query passes, its selection and fit (the ratios' mean)."""
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    t0 = time.perf_counter()
    full = prefill(model, prefix + layout.encode(tok, text), len(prefix), layout, spec, 2048)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    scores = get_method("kvzip").score(model, tok, full)
    t_kvzip = time.perf_counter() - t0
    specs = {name: parse_method_spec(name) for name in variants}
    scorers, source_seconds, source_scores, kvzip_scores = {}, {}, {}, {}

    def source_of(p: dict) -> tuple:
        # every parameter but the selection's and the fit's (FIT_SIDE) may change what score() records, so a
        # variant shares a scorer only with variants that agree on all of them (a new parameter gets its own)
        return tuple(sorted((k, v) for k, v in p.items() if k not in FIT_SIDE))

    given = {} if queries is None else {"queries": queries}  # --queries, unless a spec names its own
    out, spent = {}, {name: 0.0 for name in variants}
    for name, (method, p) in specs.items():
        if method != "am":
            continue
        key = source_of(p)
        if key not in scorers:  # the repeat pass again (it records the queries), plus any other source
            t0 = time.perf_counter()
            scorers[key] = get_method("am", **{**given, **dict(key)})
            source_scores[key] = scorers[key].score(model, tok, full)  # KVzip's, or score_queries="reference"'s
            source_seconds[key] = time.perf_counter() - t0
    for budget in budgets:
        for r in ratios:
            for name, (method, p) in specs.items():
                t0 = time.perf_counter()
                if method == "am":
                    m = get_method("am", **{**given, **p})
                    source = scorers[source_of(p)]
                    m._spec, m._reservoirs = source._spec, source._reservoirs
                    m._validation = getattr(source, "_validation", None)  # ridge_search's queries
                    m._sequences = source._sequences  # on_policy: the source's fed tokens, replayed per layer
                    m._model, m._tokenizer = model, tok
                    scores_m = source_scores[source_of(p)]
                else:
                    m = get_method(method, **p)
                    scored = tuple(sorted((k, v) for k, v in p.items() if k not in KVZIP_SELECT_SIDE))
                    if scored and scored not in kvzip_scores:  # e.g. kvzip[scoring=plus]: its own scoring pass
                        kvzip_scores[scored] = m.score(model, tok, full)
                    scores_m = kvzip_scores[scored] if scored else scores
                if budget == "global":
                    keep_m = m.select(scores_m, r, full)
                else:
                    keep_m = split_budget(m, scores_m, r, full, budget)
                    if method == "am" and m.selection != "kvzip":
                        keep_m = m.reselect_within_heads(keep_m, full, scores_m)
                out[(name, budget, r)] = assemble_pack(model, tok, text, m, r, full, keep_m, "<bench>", fingerprint)
                spent[name] += time.perf_counter() - t0
    if timings is not None:
        per = len(budgets) * len(ratios)
        for name, (method, p) in specs.items():
            scoring = t_kvzip if method != "am" else source_seconds[source_of(p)]
            timings[name] = t_prefill + scoring + spent[name] / per
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded reference model)")
    ap.add_argument("--ratios", default="0.3,0.2,0.1,0.05,0.02")
    ap.add_argument("--cont-docs", type=int, default=2)
    ap.add_argument("--cont-length", type=int, default=1024)
    ap.add_argument("--mq-contexts", type=int, default=1)
    ap.add_argument("--mq-length", type=int, default=1024)
    ap.add_argument("--mq-facts", type=int, default=4)
    ap.add_argument("--queries", type=int, default=None,
                    help="reference queries per KV head of every AM variant that names none (default: AM's own)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the passages and multi-query contexts (0: the bench's own; choose options on "
                         "another seed than the one reported)")
    ap.add_argument("--haystack", default=None, metavar="DIR",
                    help="draw the passages and contexts from the .txt/.md files in DIR (default: the shipped pages)")
    ap.add_argument("--budgets", default="global",
                    help="comma-separated splits over heads: global, head, floorF, adakvF, lfloorF, largest-full")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated method specs (kvzip or am[...])")
    ap.add_argument("--out", default="runs/bench_am.json")
    args = ap.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    budgets, variants = args.budgets.split(","), args.variants.split(",")
    for name in variants:  # one KVzip scoring pass serves every variant: kvzip[...] or am[...] only
        if parse_method_spec(name)[0] not in ("kvzip", "am"):
            ap.error(f"--variants: {name!r} is neither a kvzip[...] nor an am[...] spec")
    try:  # the haystack is read (and refused) before the model loads
        documents = None if args.haystack is None else tasks.haystack_documents(args.haystack)
    except kvpack.KvpackError as e:
        raise SystemExit(f"error: {e}") from None
    model, tok = kvpack.load_model(args.model)
    from kvpack.fingerprint import model_fingerprint

    fingerprint = model_fingerprint(model, tok)
    results = {"command": " ".join(sys.argv), "continuation": [], "multiquery": [], "build_seconds": []}
    t0 = time.perf_counter()
    for doc in continuation_docs(tok, args.cont_length, args.cont_docs, seed=args.seed, documents=documents):
        ref = fullcache_logprobs(model, tok, doc)
        ref_nll = target_nll(ref, doc.target_ids)
        timings = {}
        packs = packs_for(model, tok, doc.text, ratios, args.queries, budgets, variants, timings, fingerprint)
        results["build_seconds"].append({"doc": doc.key, **timings})
        print(json.dumps({"doc": doc.key, "build_seconds": timings}), flush=True)
        for (name, budget, r), pack in packs.items():
            lp = cache_logprobs(model, KvpackCache.from_pack(pack), doc.target_ids)
            row = {"doc": doc.key, "variant": name, "budget": budget, "ratio": r,
                   "delta_nll": target_nll(lp, doc.target_ids) - ref_nll, "fit": pack.metadata["stats"].get("fit"),
                   "head_entries": [[int(n) for n in e.head_lengths] for e in pack.layers]}
            results["continuation"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("fit", "head_entries")}), flush=True)
    for ctx in multiquery_contexts(tok, args.mq_length, args.mq_facts, args.mq_contexts, seed=args.seed,
                                   documents=documents):
        for (name, budget, r), pack in packs_for(model, tok, ctx.text, ratios, args.queries, budgets,
                                                 variants, None, fingerprint).items():
            cache = KvpackCache.from_pack(pack)
            correct = sum(tasks.answer_matches(kvpack.generate(model, tok, cache, q, max_new_tokens=32), f)
                          for f, q in zip(ctx.facts, ctx.questions))
            row = {"context": ctx.key, "variant": name, "budget": budget, "ratio": r, "correct": correct,
                   "asked": len(ctx.facts)}
            results["multiquery"].append(row)
            print(json.dumps(row), flush=True)
    results["seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
