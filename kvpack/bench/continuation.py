"""Continuation: how much a compressed cache changes the model's predictions of the document's real next tokens.

The context is the first ``length`` tokens of a held-out passage (``kvpack/data/haystack``), the target its next
``target_tokens`` (default 256) tokens. The target is teacher-forced through (a) the ordinary full cache (plain
transformers, one forward of context + target) and (b) each variant's loaded ``.kvpack`` cache
(``cache.rewind()`` afterwards). Reported per variant: the negative log-likelihood per target token, its
difference to the full cache (ΔNLL, nats/token; the perplexity-gap metric of StreamingLLM, arXiv 2309.17453 §4.1,
and H2O, arXiv 2306.14048 §5), and the mean over target positions of KL(full || compressed) of the next-token
distributions (nats; as in KIVI, arXiv 2402.02750, and KVzip's fidelity analysis, arXiv 2505.23416 §5).
"""

from __future__ import annotations

import random
import re
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import tasks
from ..errors import InputError
from ..evaluation import cache_logprobs, target_nll
from ..layout import chat_layout
from .grid import Variant, build_variants, open_variant

__all__ = ["ContinuationDoc", "continuation_docs", "full_cache_logprobs", "continuation_rows",
           "summarize_continuation"]


@dataclass(frozen=True)
class ContinuationDoc:
    """A held-out passage split into a context and its real continuation.

    Attributes:
        key: unique id within the run, e.g. ``continuation/2048/d0``.
        text: the context (decoded first ``length`` tokens of the passage).
        target_ids: the next ``target_tokens + 1`` token ids of the passage: ids ``[:-1]`` are fed, ids ``[1:]``
            are predicted (so exactly ``target_tokens`` positions are scored).
        length: context tokens asked for.
    """

    key: str
    text: str
    target_ids: tuple[int, ...]
    length: int


def continuation_docs(tokenizer, length: int, docs: int, target_tokens: int = 256, seed: int = 0,
                      documents: list[str] | None = None) -> list[ContinuationDoc]:
    """``docs`` seeded passages, each starting at a random paragraph of the concatenated ``documents`` (default:
    ``tasks.haystack_documents()``, the shipped haystack).

    Raises ``InputError`` if the haystack has no passage of ``length + target_tokens + 1`` tokens.
    """
    text = "\n\n".join(tasks.haystack_documents() if documents is None else documents)
    starts = [0] + [m.end() for m in re.finditer(r"\n\n", text)]
    need = length + target_tokens + 1
    out = []
    for d in range(docs):
        rng = random.Random(f"kvpack-bench/continuation/{seed}/{length}/{d}")
        ids = tasks.find_passage(tokenizer, text, starts, need, 8 * need, rng)
        if len(ids) < need:
            raise InputError(f"the haystack has no passage of {need} tokens for the continuation task (the "
                             f"context's {length} tokens, then {target_tokens} to predict and one more); give longer "
                             "documents or a shorter --context-length")
        out.append(ContinuationDoc(f"continuation/{length}/d{d}", tokenizer.decode(ids[:length]),
                                   tuple(ids[length:need]), length))
    return out


@torch.inference_mode()
def fullcache_logprobs(model, tokenizer, doc: ContinuationDoc) -> torch.Tensor:
    """``[target_tokens, vocab]`` float32 log-probabilities of the target positions with the full context.

    One plain transformers forward of prefix + context + target[:-1] (the ordinary full cache); row ``i`` is the
    distribution of target token ``i + 1``.
    """
    layout = chat_layout(tokenizer)
    ctx = layout.prefix_ids(tokenizer) + layout.encode_text(tokenizer, doc.text)
    fed = list(doc.target_ids[:-1])
    x = torch.tensor([ctx + fed], device=model.device)
    logits = model(input_ids=x, use_cache=False, logits_to_keep=len(fed)).logits[0]
    return F.log_softmax(logits.float(), dim=-1).cpu()


def continuation_rows(model, tokenizer, doc: ContinuationDoc, variants: list[Variant], folder, *, chunk_size: int,
                      group_size: int, zstd_level: int) -> list[dict]:
    """One row per variant (plus the ``full`` reference) for ``doc``.

    Row fields: ``task`` (``"continuation"``), ``key, length, context_tokens, target_tokens, variant``
    (``Variant.to_dict()``), ``nll`` (nats/token), ``delta_nll`` (nll - the full cache's, nats/token), ``kl``
    (mean KL(full || compressed), nats), ``top1_agreement`` (fraction of positions whose argmax matches the full
    cache's), ``forward_s`` (seconds of the teacher-forced pass), and ``build_s, load_s, file_bytes``.
    Query-aware variants are skipped (there is no question).
    """
    ref = fullcache_logprobs(model, tokenizer, doc)
    ref_nll = target_nll(ref, doc.target_ids)
    n_ctx = len(chat_layout(tokenizer).prefix_ids(tokenizer)) + len(tokenizer.encode(doc.text, add_special_tokens=False))
    base = {"task": "continuation", "key": doc.key, "length": doc.length, "context_tokens": n_ctx,
            "target_tokens": len(doc.target_ids) - 1}
    rows = [{**base, "variant": {"method": "full", "name": "full", "ratio": 1.0, "quant": "none",
                                 "query_aware": False, "label": "full"},
             "nll": ref_nll, "delta_nll": 0.0, "kl": 0.0, "top1_agreement": 1.0}]
    groups: dict[str, list[Variant]] = defaultdict(list)
    for v in variants:
        if not v.query_aware:
            groups[v.method].append(v)
    for method, vs in groups.items():
        built = build_variants(model, tokenizer, doc.text, method, sorted({v.ratio for v in vs}, reverse=True),
                               sorted({v.quant for v in vs}), chunk_size=chunk_size, group_size=group_size)
        wanted = set(vs)
        for b in built:
            if b.variant not in wanted:
                continue
            opened = open_variant(b, model, tokenizer, folder, zstd_level=zstd_level)
            t0 = time.perf_counter()
            lp = cache_logprobs(model, opened.cache, doc.target_ids)
            sec = time.perf_counter() - t0
            nll = target_nll(lp, doc.target_ids)
            kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
            agree = float((ref.argmax(-1) == lp.argmax(-1)).float().mean())
            rows.append({**base, "variant": b.variant.to_dict(), "nll": nll, "delta_nll": nll - ref_nll, "kl": kl,
                         "top1_agreement": agree, "forward_s": sec, "build_s": opened.build_s,
                         "load_s": opened.load_s, "file_bytes": opened.file_bytes,
                         "bytes_per_token": opened.bytes_per_token, "kept_fraction": opened.kept_fraction})
    return rows


def summarize_continuation(rows: list[dict]) -> list[dict]:
    """Means per variant over documents: ``[{"label", "variant", "nll", "delta_nll", "kl", "top1_agreement",
    "n"}]`` (nats/token, nats, fraction; ``None`` where a row has none). Rows with an ``error`` are left out."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["task"] == "continuation" and "error" not in r:
            groups[r["variant"]["label"]].append(r)
    out = []
    for label, rs in groups.items():
        def mean(k):  # None when a row lacks it (a peer run without its reference)
            vals = [r.get(k) for r in rs]
            return None if any(v is None for v in vals) else sum(vals) / len(vals)
        out.append({"label": label, "variant": rs[0]["variant"], "nll": mean("nll"), "delta_nll": mean("delta_nll"),
                    "kl": mean("kl"), "top1_agreement": mean("top1_agreement"), "n": len(rs)})
    return out
