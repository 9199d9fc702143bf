"""How far below KVzip can any choice of reference queries take Attention Matching? An oracle bound.

Issue 28 asks AM (arXiv 2602.16284) for half of KVzip's continuation loss at keep 0.1 on SmolLM2. Every
query-agnostic source tried (repeat, self-study, sampled continuations, the prefill, pools of these) either
extrapolates or gains little. This measures what the *true* continuation's own queries would give, which no
query-agnostic method can know: for each passage the context plus its target tokens is prefilled once with a
recorder that keeps, per compressed layer, the target tokens' queries (after q-norm and RoPE, the GQA group
pooled per KV head; ``kvpack.methods.am_prefill.PrefillQueries``). Those queries then stand in for AM's reference
queries, and the pack is scored on the very tokens whose queries it was fitted to (in-sample: off-policy only in
that each layer's queries come from the full cache, as the paper's off-policy fit does).

Variants, per keep ratio, each against the full cache: ``kvzip``, ``am`` or ``am[...]`` (AM's defaults and
options, a method spec), or ``SOURCE:MODE[:bound]``. Sources of queries:

    target       the target tokens' own (the oracle; ``--split``: the first half's, scored on the second half)
    sampled      256 tokens the model samples after the context (temperature 1; ``kvpack.methods.am_continue``)
    greedy       the model's greedy continuation from a line break
    tail         the context's last 256 tokens' prefill queries, fitted over the whole context (as AM fits any
                 source: no causal mask)
    tail+repeat  those pooled with KVzip's repeat pass's (AM's default source)
    repeat       the repeat pass's alone
    causal       the context's last 256 tokens' prefill queries replayed causally: each query's target and
                 compacted attention cover only the entries at or before its position (``causal_fit``)

Modes:

    evict        entries chosen by their largest attention from the source's queries (KVzip's score with those
                 queries), split per head as AM's defaults do (global top-k capped at 0.75, the 16-token recent
                 floor), values copied
    fit          KVzip's selection, then beta and values fitted to the source's queries (no bound)
    evict+fit    the source's selection, then the same fit
    omp          OMP's selection over the source's queries, then the same fit
    :bound       AM's default value bound (a head whose values leave 2x its context's largest |value| keeps its
                 selection)

A query-agnostic method can know every source but ``target``. If even the ``target`` variants stay above half of
KVzip's loss, no reference set can take AM there at that budget on this model, whatever its source.

    python tools/am_oracle.py --model smollm2-135m --seed 8 --cont-docs 6 --cont-length 2048 --ratios 0.1,0.05 \
        --variants "kvzip,am,target:evict,target:evict+fit,target:evict+fit:bound"
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
from kvpack.bench.continuation import continuation_docs, fullcache_logprobs  # noqa: E402
from kvpack.bench.specs import parse_method_spec  # noqa: E402
from kvpack.cache import KvpackCache  # noqa: E402
from kvpack.compress import assemble_pack  # noqa: E402
from kvpack.evaluation import cache_logprobs, target_nll  # noqa: E402
from kvpack.fingerprint import model_fingerprint  # noqa: E402
from kvpack.layout import chat_layout  # noqa: E402
from kvpack.methods import get_method  # noqa: E402
from kvpack.methods.am import QueryReservoir  # noqa: E402
from kvpack.methods.am_fit import context_attention  # noqa: E402
from kvpack.methods.am_prefill import PrefillQueries  # noqa: E402
from kvpack.model import model_spec  # noqa: E402
from kvpack.prefill import prefill  # noqa: E402

VARIANTS = ("kvzip", "am", "target:evict", "target:fit", "target:evict+fit", "target:omp")
SOURCES = ("target", "sampled", "greedy", "tail", "tail+repeat", "repeat", "causal")
MODES = ("evict", "fit", "evict+fit", "omp")


def target_queries(model, ctx_ids: list[int], fed: list[int], sink: int, layout, spec) -> PrefillQueries:
    """The target tokens' queries of every compressed layer: one prefill of context + target (``tail`` = the
    target's length), per layer ``[heads, len(fed), head_dim]`` in ``tail_queries``."""
    rec = PrefillQueries(spec, len(ctx_ids) + len(fed), None, len(fed))
    prefill(model, ctx_ids + fed, sink, layout, spec, 2048, recorder=rec)
    return rec


def pooled(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[heads, n, d]`` -> ``[kv_heads, group x n, d]``: a GQA group's query heads pooled per KV head (as
    ``QueryReservoir.append`` pools them)."""
    heads, n, d = queries.shape
    return queries.reshape(kv_heads, (heads // kv_heads) * n, d)


def reservoirs_of(per_layer: list[torch.Tensor], spec, scaling: float) -> list[QueryReservoir]:
    """One ``QueryReservoir`` per compressed layer holding ``per_layer[i]`` ``[kv_heads, n, d]`` (already pooled)."""
    out = []
    for q in per_layer:
        r = QueryReservoir(spec.num_kv_heads, 50_000)
        r.scaling = scaling
        r.parts.append(q.float())
        out.append(r)
    return out


def max_attention_scores(full, per_layer: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """``[compressed layers, kv_heads, context]``: each context entry's largest attention probability over the
    context from ``per_layer[i]`` ``[kv_heads, n, d]`` queries: KVzip's score (arXiv 2505.23416 §3.2) with other
    queries in place of the repeat pass's."""
    sink, rows = full.sink, []
    for i, l in enumerate(full.spec.compressed_layers):
        keys, q = full.keys[l][:, sink:].float(), per_layer[i]
        per_head = []
        for h in range(keys.shape[0]):
            _, lse = context_attention(q[h], keys[h], keys[h], scaling)
            per_head.append(((q[h] @ keys[h].T) * scaling - lse[:, None]).exp_().amax(dim=0))
        rows.append(torch.stack(per_head))
    return torch.stack(rows)


@torch.inference_mode()
def greedy_queries(model, tok, full, reservoirs: list, tokens: int) -> list:
    """The model's greedy continuation of ``tokens`` tokens after the context (from a line break, as
    ``kvpack.methods.am_continue`` starts), its compressed layers' queries added to ``reservoirs``."""
    from kvpack.methods.am_continue import recording_cache

    cache, device = recording_cache(model, full, reservoirs)
    x = torch.tensor([[tok.encode("\n", add_special_tokens=False)[-1]]], device=device)
    for _ in range(tokens):
        x = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1].argmax().view(1, 1)
    cache.rewind()
    return reservoirs


def causal_scores(full, tails: list[torch.Tensor], start: int, scaling: float) -> torch.Tensor:
    """KVzip-like scores from the context's own last tokens' queries, causally: ``tails[i]`` ``[heads, n, d]`` at
    positions ``start ..``, each query reading only the context entries at or before its position."""
    sink, group, rows = full.sink, full.spec.num_heads // full.spec.num_kv_heads, []
    for i, l in enumerate(full.spec.compressed_layers):
        keys, kpos = full.keys[l][:, sink:].float(), full.positions[l][sink:]
        q = tails[i]
        qpos = torch.arange(start, start + q.shape[1]).repeat(group)
        mask = kpos[None, :] > qpos[:, None]  # [group n, T]: entries after the query's position
        per_head = []
        for h in range(keys.shape[0]):
            qh = q[h * group : (h + 1) * group].reshape(-1, q.shape[-1])
            logits = ((qh @ keys[h].T) * scaling).masked_fill(mask, float("-inf"))
            per_head.append(logits.softmax(dim=-1).amax(dim=0))
        rows.append(torch.stack(per_head))
    return torch.stack(rows)


def causal_fit(full, pack, keep: torch.Tensor, tails: list[torch.Tensor], start: int, scaling: float,
               bound: float) -> dict:
    """AM's fit (arXiv 2602.16284 §3: beta by mass matching, values by least squares) over the context's last
    tokens' queries replayed causally (each query's target and compacted attention over the entries at or before
    its position), written into ``pack``'s layers; a head whose values leave ``bound x`` its context's largest
    |value| keeps its selection (``bound = 0``: no bound)."""
    from kvpack.methods.am_fit import BETA_RANGE, least_squares, nnls_box
    import math

    sink, group = full.sink, full.spec.num_heads // full.spec.num_kv_heads
    fitted = rejected = 0
    for i, l in enumerate(full.spec.compressed_layers):
        entries = pack.layers[l]
        offsets = entries.head_offsets().tolist()
        biases = torch.zeros(entries.num_entries, dtype=torch.float32) if entries.biases is None else entries.biases
        keys, values, kpos = full.keys[l][:, sink:].float(), full.values[l][:, sink:].float(), full.positions[l][sink:]
        q = tails[i]
        qpos = torch.arange(start, start + q.shape[1]).repeat(group)
        visible = kpos[None, :] <= qpos[:, None]
        for h in range(keys.shape[0]):
            kept = keep[i, h].nonzero().squeeze(1)
            if len(kept) in (0, keys.shape[1]) or 2 * len(kept) > visible.shape[0]:
                continue
            qh = q[h * group : (h + 1) * group].reshape(-1, q.shape[-1])
            logits = ((qh @ keys[h].T) * scaling).masked_fill(~visible, float("-inf"))
            E = logits.softmax(dim=-1)  # [n, T], rows sum to 1 over the visible entries
            Y = E @ values[h]
            M = E[:, kept]
            w = nnls_box(M, torch.ones(M.shape[0]), math.exp(BETA_RANGE[0]), math.exp(BETA_RANGE[1]))
            mass = M @ w
            ok = mass > 1e-6
            X = (M * w)[ok] / mass[ok, None]
            C = least_squares(X, Y[ok], fallback=values[h][kept])
            if not bool(torch.isfinite(C).all()) or (bound > 0 and float(C.abs().max()) > bound * float(values[h].abs().max())):
                rejected += 1
                continue
            rows = slice(offsets[h] + sink, offsets[h] + sink + len(kept))
            entries.values[rows] = C.to(entries.values.dtype)
            biases[rows] = w.log()
            fitted += 1
        entries.biases = biases
    return {"heads_fitted": fitted, "heads_rejected": rejected}


def per_token_nll(model, pack, target_ids) -> torch.Tensor:
    """``[len(target_ids) - 1]`` NLL (nats) of each target token after the first, through ``pack``."""
    lp = cache_logprobs(model, KvpackCache.from_pack(pack), target_ids)
    return -lp.gather(1, torch.tensor(list(target_ids[1:]))[:, None])[:, 0]


def summary_table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (``main``'s): per keep ratio and variant, each passage's ΔNLL (nats/token), their
    sum, and that sum as a multiple of KVzip's at the same ratio (the issue's measure: ≤ 0.5x at keep 0.1)."""
    docs = sorted({r["doc"] for r in rows})
    cells = {(r["ratio"], r["variant"], r["doc"]): r["delta_nll"] for r in rows}
    lines = ["| keep | variant | " + " | ".join(d.rsplit("/", 1)[-1] for d in docs) + " | sum | / KVzip's |",
             "|---|---|" + "---:|" * (len(docs) + 2)]
    for ratio in sorted({r["ratio"] for r in rows}, reverse=True):
        kvzip = sum(cells.get((ratio, "kvzip", d), float("nan")) for d in docs)
        for variant in dict.fromkeys(r["variant"] for r in rows):
            got = [cells.get((ratio, variant, d), float("nan")) for d in docs]
            lines.append(f"| {ratio} | {variant} | " + " | ".join(f"{x:+.3f}" for x in got)
                         + f" | {sum(got):+.3f} | {sum(got) / kvzip:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--cont-docs", type=int, default=2)
    ap.add_argument("--cont-length", type=int, default=2048)
    ap.add_argument("--ratios", default="0.1,0.05")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="kvzip, am, or SOURCE:MODE[:bound] with SOURCE in target, sampled, repeat and MODE in "
                         "evict, fit, evict+fit, omp (':bound': AM's value bound of 2 on the fit)")
    ap.add_argument("--split", action="store_true",
                    help="out of sample: the target's queries are its first half's, every ΔNLL is its second half's")
    ap.add_argument("--target-tokens", type=int, default=256, help="continuation tokens of each passage (the bench's: 256)")
    ap.add_argument("--sampled-tokens", type=int, default=256, help="tokens of 'sampled', 'greedy' and 'tail' (the context's last ones)")
    ap.add_argument("--out", default="runs/am_oracle.json")
    ap.add_argument("--summary", metavar="JSON", help="print the table of an earlier run's --out file and exit")
    args = ap.parse_args()
    if args.summary:
        print(summary_table(json.loads(Path(args.summary).read_text())["rows"]))
        return
    ratios, variants = [float(r) for r in args.ratios.split(",")], args.variants.split(",")
    for v in variants:
        parts = v.split(":")
        if not v.startswith(("kvzip", "am")) and not (parts[0] in SOURCES and len(parts) > 1 and parts[1] in MODES
                                             and parts[2:] in ([], ["bound"])):
            ap.error(f"--variants: {v!r} is not kvzip, am or SOURCE:MODE[:bound]")
    model, tok = kvpack.load_model(args.model)
    spec, layout, fp = model_spec(model), chat_layout(tok), model_fingerprint(model, tok)
    prefix = layout.prefix_ids(tok)
    results = {"command": " ".join(sys.argv), "rows": []}
    for doc in continuation_docs(tok, args.cont_length, args.cont_docs, args.target_tokens, seed=args.seed):
        t0 = time.perf_counter()
        ctx_ids = prefix + layout.encode_text(tok, doc.text)
        full_pass = fullcache_logprobs(model, tok, doc)
        ref = -full_pass.gather(1, torch.tensor(list(doc.target_ids[1:]))[:, None])[:, 0]
        counted = slice(len(ref) // 2, None) if args.split else slice(None)
        full = prefill(model, ctx_ids, len(prefix), layout, spec, 2048)
        base = get_method("am")
        kvzip_scores = base.score(model, tok, full)
        scaling = float(base._reservoirs[0].scaling)
        sources: dict[str, list[torch.Tensor]] = {"repeat": [torch.cat(r.parts, 1) for r in base._reservoirs]}
        if any(v.startswith("target:") for v in variants):
            rec = target_queries(model, ctx_ids, list(doc.target_ids[:-1]), len(prefix), layout, spec)
            tails = [q[:, : q.shape[1] // 2] if args.split else q for q in rec.tail_queries]
            sources["target"] = [pooled(q, spec.num_kv_heads) for q in tails]
        if any(v.startswith("sampled:") for v in variants):
            from kvpack.methods.am_continue import continuation_queries

            sampled = continuation_queries(model, tok, full, base._new_reservoirs(full), args.sampled_tokens, 0)
            sources["sampled"] = [torch.cat(r.parts, 1) for r in sampled]
        if any(v.startswith("greedy:") for v in variants):
            greedy = greedy_queries(model, tok, full, base._new_reservoirs(full), args.sampled_tokens)
            sources["greedy"] = [torch.cat(r.parts, 1) for r in greedy]
        if any(v.startswith("tail") for v in variants):
            rec = PrefillQueries(spec, len(ctx_ids), None, args.sampled_tokens)
            prefill(model, ctx_ids, len(prefix), layout, spec, 2048, recorder=rec)
            sources["tail"] = [pooled(q, spec.num_kv_heads) for q in rec.tail_queries]
            sources["tail+repeat"] = [torch.cat([a, b], 1) for a, b in zip(sources["tail"], sources["repeat"])]
        if any(v.startswith("causal:") for v in variants):
            rec = PrefillQueries(spec, len(ctx_ids), None, args.sampled_tokens)
            prefill(model, ctx_ids, len(prefix), layout, spec, 2048, recorder=rec)
            causal = (rec.tail_queries, rec.tail_start)
        score_cache: dict[str, torch.Tensor] = {}
        for r in ratios:
            for name in variants:
                source, mode, *bound = name.split(":") + [""]
                if source == "causal":
                    m = get_method("am", values="copy")
                    m._spec, m._model, m._tokenizer, m._reservoirs = base._spec, model, tok, base._reservoirs
                    if mode in ("evict", "evict+fit"):
                        if "causal" not in score_cache:
                            score_cache["causal"] = causal_scores(full, *causal, scaling)
                        scores = score_cache["causal"]
                    else:
                        scores = kvzip_scores
                    keep = m.select(scores, r, full)
                    pack = assemble_pack(model, tok, doc.text, m, r, full, keep, "<oracle>", fp)
                    for layer in pack.layers:
                        layer.biases = None
                    fit = causal_fit(full, pack, keep, *causal, scaling, 2.0 if bound[0] == "bound" else 0.0) \
                        if mode != "evict" else {}
                    nll = per_token_nll(model, pack, doc.target_ids)
                    row = {"doc": doc.key, "variant": name, "ratio": r, "split": args.split,
                           "delta_nll": float((nll - ref)[counted].mean()), **fit}
                    results["rows"].append(row)
                    print(json.dumps(row), flush=True)
                    continue
                if name.startswith(("kvzip", "am")):
                    method, params = parse_method_spec(name)
                    m = get_method(method, **params)
                    scores = kvzip_scores
                else:
                    m = get_method("am", value_bound=2 if bound[0] == "bound" else 0, held_out_check=False,
                                   queries=50_000, selection="omp" if mode == "omp" else "kvzip",
                                   values="copy" if mode == "evict" else "fit")
                    if mode in ("evict", "evict+fit"):
                        if source not in score_cache:
                            score_cache[source] = max_attention_scores(full, sources[source], scaling)
                        scores = score_cache[source]
                    else:
                        scores = kvzip_scores
                if not name.startswith("kvzip"):
                    m._spec, m._model, m._tokenizer = base._spec, model, tok
                    m._reservoirs = (base._reservoirs if name.startswith("am") else
                                     reservoirs_of(sources[source], spec, scaling))
                keep = m.select(scores, r, full)
                pack = assemble_pack(model, tok, doc.text, m, r, full, keep, "<oracle>", fp)
                nll = per_token_nll(model, pack, doc.target_ids)
                fit = pack.metadata["stats"].get("fit") or {}
                row = {"doc": doc.key, "variant": name, "ratio": r, "split": args.split,
                       "delta_nll": float((nll - ref)[counted].mean()),
                       "heads_unfitted": fit.get("heads_unfitted"), "heads_rejected": fit.get("heads_rejected")}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
        print(json.dumps({"doc": doc.key, "seconds": time.perf_counter() - t0}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(summary_table(results["rows"]))


if __name__ == "__main__":
    main()
