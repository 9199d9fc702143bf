"""Needle retrieval: one fact planted at a depth of a held-out passage; exact match of its code in the answer.

The multi-key needle-in-a-haystack task (Kamradt 2023; RULER, arXiv 2404.06654 §3.1) as the KVzip paper
(arXiv 2505.23416, Fig. 5) and D2O (arXiv 2406.13035, §4.3) plot it: contexts of each length, facts at depths
0, 10, ..., 100 % of the passage, accuracy per compression ratio. The passages come from
``kvpack/data/haystack`` (held out from the reference model's training); every method sees the same contexts.
"""

from __future__ import annotations

import random
from collections import defaultdict

from .. import tasks
from .qa import QAContext

__all__ = ["DEFAULT_DEPTHS", "needle_contexts", "summarize_needle"]

#: Depths 0 %, 10 %, ..., 100 % of the passage.
DEFAULT_DEPTHS = tuple(round(i / 10, 1) for i in range(11))


def needle_contexts(tokenizer, lengths: list[int], depths: list[float], trials_per_depth: int, seed: int = 0,
                    documents: list[str] | None = None) -> list[QAContext]:
    """One context per (length, depth, trial): about ``length`` tokens of ``documents`` (default: the shipped
    haystack) with one fact planted at ``depth``.

    Each context is drawn from its own ``random.Random`` seeded by ``(seed, length, depth index, trial)``, so a
    context does not change when other lengths, depths or trial counts are added. Raises ``ValueError`` for a
    depth outside [0, 1].
    """
    out = []
    for length in lengths:
        for di, depth in enumerate(depths):
            for t in range(trials_per_depth):
                rng = random.Random(f"kvpack-bench/needle/{seed}/{length}/{di}/{t}")
                fact = tasks.random_fact(rng)
                text = tasks.needle_context(tokenizer, length, [fact], [depth], rng, documents)
                out.append(QAContext(f"needle/{length}/d{depth:g}/t{t}", "needle", text, (fact,), length,
                                     (float(depth),)))
    return out


def summarize_needle(rows: list[dict]) -> list[dict]:
    """Accuracy per variant: ``[{"label", "variant", "by_length": {L: acc}, "by_depth": {d: acc}, "accuracy",
    "n", "file_bytes_per_token", "build_s"}]`` (accuracy in [0, 1]; means over contexts)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["task"] == "needle" and "correct" in r:
            groups[r["variant"]["label"]].append(r)
    out = []
    for label, rs in groups.items():
        by_len, by_depth = defaultdict(list), defaultdict(list)
        for r in rs:
            by_len[r["length"]].append(r["correct"])
            by_depth[r["depth"]].append(r["correct"])
        bpt = [r["bytes_per_token"] for r in rs if r.get("bytes_per_token") is not None]
        build = [r["build_s"] for r in rs if r.get("build_s") is not None]
        out.append({"label": label, "variant": rs[0]["variant"],
                    "by_length": {str(k): sum(v) / len(v) for k, v in sorted(by_len.items())},
                    "by_depth": {f"{k:g}": sum(v) / len(v) for k, v in sorted(by_depth.items())},
                    "accuracy": sum(r["correct"] for r in rs) / len(rs), "n": len(rs),
                    "file_bytes_per_token": sum(bpt) / len(bpt) if bpt else None,
                    "build_s": sum(build) / len(build) if build else None})
    return out
