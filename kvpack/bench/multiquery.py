"""Multi-query reuse (the KVzip setting): compress a context once, then ask several different questions of it.

Several facts are planted in one held-out passage; each variant is compressed ONCE, saved, loaded ONCE, and every
fact is asked in turn from that same loaded cache (``kvpack.generate`` rewinds between questions). This is the
setting of KVzip (arXiv 2505.23416, §2.2 and Fig. 1: query-agnostic compression must serve later, unseen
queries), where query-aware methods such as SnapKV (arXiv 2404.14469) given the first question are known to
degrade on the other questions; the query-aware variant (``snapkv-q``) is scored here for that reason, with its
accuracy on the first question reported apart from the rest.
"""

from __future__ import annotations

import random
from collections import defaultdict

from .. import tasks
from .qa import QAContext

__all__ = ["multiquery_contexts", "summarize_multiquery"]


def multiquery_contexts(tokenizer, length: int, facts_per_context: int, contexts: int, seed: int = 0,
                        documents: list[str] | None = None) -> list[QAContext]:
    """``contexts`` passages of about ``length`` tokens from ``documents`` (default: the shipped haystack), each with
    ``facts_per_context`` facts (distinct names) at evenly spread depths ``(i + 0.5) / facts_per_context``, asked in
    a seeded random order.

    Raises ``ValueError`` if ``facts_per_context`` < 1 or exceeds the number of names in ``kvpack.tasks.NAMES``.
    """
    if not 1 <= facts_per_context <= len(tasks.NAMES):
        raise ValueError(f"facts_per_context must be in [1, {len(tasks.NAMES)}], got {facts_per_context}")
    out = []
    for c in range(contexts):
        rng = random.Random(f"kvpack-bench/multiquery/{seed}/{length}/{facts_per_context}/{c}")
        facts, names = [], set()
        for _ in range(facts_per_context):
            f = tasks.random_fact(rng, exclude=names)
            names.add(f.name)
            facts.append(f)
        depths = [(i + 0.5) / facts_per_context for i in range(facts_per_context)]
        text = tasks.needle_context(tokenizer, length, facts, depths, rng, documents)
        order = list(range(facts_per_context))
        rng.shuffle(order)
        out.append(QAContext(f"multiquery/{length}/c{c}", "multiquery", text, tuple(facts[i] for i in order), length,
                             tuple(depths[i] for i in order)))
    return out


def summarize_multiquery(rows: list[dict]) -> list[dict]:
    """Accuracy per variant: ``[{"label", "variant", "accuracy" (all questions), "first" (question 1),
    "others" (questions 2..), "n"}]``, accuracies in [0, 1] (``others`` is ``None`` with one question)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["task"] == "multiquery" and "correct" in r:
            groups[r["variant"]["label"]].append(r)
    out = []
    for label, rs in groups.items():
        first = [r["correct"] for r in rs if r["question_index"] == 0]
        others = [r["correct"] for r in rs if r["question_index"] > 0]
        out.append({"label": label, "variant": rs[0]["variant"],
                    "accuracy": sum(r["correct"] for r in rs) / len(rs),
                    "first": sum(first) / len(first) if first else None,
                    "others": sum(others) / len(others) if others else None, "n": len(rs)})
    return out
