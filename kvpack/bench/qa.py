"""Question answering over one context for every variant: build, save, load ONCE, ask every question in turn.

Shared by the needle task (one question per context) and the multi-query task (several). Answers are greedy
(``kvpack.generate``) and scored by exact match of the planted fact's code (``kvpack.tasks.answer_matches``;
RULER, arXiv 2404.06654 §3.1). The reference answer of each question comes from plain transformers with the
ordinary full cache (``full_cache_answer``), which no kvpack code touches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import tasks
from ..generation import generate
from ..layout import chat_layout
from .grid import Variant, build_variants, open_variant

__all__ = ["QAContext", "full_cache_answer", "answer_variants"]


@dataclass(frozen=True)
class QAContext:
    """A context and the facts planted in it, asked in order.

    Attributes:
        key: a unique id within the run, e.g. ``needle/1024/d0.5/t0`` (joins kvpack's and the peer's rows).
        task: ``"needle"`` or ``"multiquery"``.
        text: the context.
        facts: the planted facts; question ``i`` asks for ``facts[i]``.
        length: the context length asked for, in tokens (the actual count is recorded per row).
        depths: where each fact sits (fraction of the passage, 0 = start).
    """

    key: str
    task: str
    text: str
    facts: tuple[tasks.Fact, ...]
    length: int
    depths: tuple[float, ...]

    @property
    def questions(self) -> list[str]:
        """One question per fact, in order."""
        return [tasks.fact_question(f) for f in self.facts]


@torch.inference_mode()
def full_cache_answer(model, tokenizer, text: str, question: str,
                      max_new_tokens: int = tasks.ANSWER_MAX_NEW_TOKENS) -> tuple[str, float]:
    """``(answer, seconds)``: greedy answer of plain transformers with the ordinary full cache.

    The sequence is kvpack's layout (chat-template prefix, context, blank line, question, end of turn), prefilled
    whole; ``seconds`` covers prefill and decoding.
    """
    layout = chat_layout(tokenizer)
    ids = layout.prefix_ids(tokenizer) + layout.encode_text(tokenizer, text) + layout.question_ids(tokenizer, question)
    x = torch.tensor([ids], device=model.device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    seconds = time.perf_counter() - t0
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True).strip(), seconds


def answer_variants(model, tokenizer, ctx: QAContext, variants: list[Variant], folder, *, chunk_size: int,
                    group_size: int, zstd_level: int, max_new_tokens: int = tasks.ANSWER_MAX_NEW_TOKENS,
                    full_reference: bool = True) -> list[dict]:
    """Rows for one context: the full-cache reference, then every variant, each asked every question in turn.

    Variants of the same (method, query-awareness) share one prefill and scoring pass (``build_variants``); each
    is saved to a ``.kvpack`` file, loaded once, and asked ``ctx.questions`` in order from that one cache. A
    query-aware variant observes the first question while compressing.

    Returns:
        One dict per (variant, question): ``task, key, length, context_tokens, depth, question_index, variant``
        (``Variant.to_dict()``, or ``{"name": "full", ...}`` for the reference), ``answer, correct, answer_s``
        (seconds to answer), and per variant ``build_s, save_s, load_s, file_bytes, bytes_per_token,
        kept_fraction``.

    Raises:
        InputError, PackFormatError, ModelMismatchError: as ``kvpack.compress``, ``kvpack.save`` and
        ``kvpack.load`` (a bad method option, an unwritable ``folder``, a model that does not fit).
    """
    rows: list[dict] = []
    base = {"task": ctx.task, "key": ctx.key, "length": ctx.length}
    if full_reference:
        n = len(chat_layout(tokenizer).prefix_ids(tokenizer)) + len(tokenizer.encode(ctx.text, add_special_tokens=False))
        for i, (fact, q) in enumerate(zip(ctx.facts, ctx.questions)):
            answer, sec = full_cache_answer(model, tokenizer, ctx.text, q, max_new_tokens)
            rows.append({**base, "context_tokens": n, "depth": ctx.depths[i], "question_index": i,
                         "variant": {"method": "full", "name": "full", "ratio": 1.0, "quant": "none",
                                     "query_aware": False, "label": "full"},
                         "answer": answer, "correct": tasks.answer_matches(answer, fact), "answer_s": sec})
    groups: dict[tuple[str, bool], list[Variant]] = {}
    for v in variants:
        groups.setdefault((v.method, v.query_aware), []).append(v)
    for (method, aware), vs in groups.items():
        ratios = sorted({v.ratio for v in vs}, reverse=True)
        quants = sorted({v.quant for v in vs})
        options = {"question": ctx.questions[0]} if aware else {}
        built = build_variants(model, tokenizer, ctx.text, method, ratios, quants, chunk_size=chunk_size,
                               group_size=group_size, query_aware=aware, **options)
        wanted = set(vs)
        for b in built:
            if b.variant not in wanted:
                continue
            opened = open_variant(b, model, tokenizer, folder, zstd_level=zstd_level)
            info = {"build_s": opened.build_s, "save_s": opened.save_s, "load_s": opened.load_s,
                    "file_bytes": opened.file_bytes, "bytes_per_token": opened.bytes_per_token,
                    "kept_fraction": opened.kept_fraction}
            for i, (fact, q) in enumerate(zip(ctx.facts, ctx.questions)):
                t0 = time.perf_counter()
                answer = generate(model, tokenizer, opened.cache, q, max_new_tokens=max_new_tokens)
                sec = time.perf_counter() - t0
                rows.append({**base, "context_tokens": opened.context_tokens, "depth": ctx.depths[i],
                             "question_index": i, "variant": b.variant.to_dict(), "answer": answer,
                             "correct": tasks.answer_matches(answer, fact), "answer_s": sec, **info})
            del opened
    return rows
