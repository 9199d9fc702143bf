"""Retrieval-task phrasing shared by the reference model's training, its evaluation and the benchmark.

A *fact* is the sentence ``"The secret code of <name> is <number>."`` planted in a passage; the question
``"What is the secret code of <name>?"`` is asked after the passage in the same user turn, and the expected
answer is ``"The secret code of <name> is <number>."``. Scoring is exact match of the number in the answer.
This is the multi-key needle-in-a-haystack setup (Kamradt 2023; RULER, arXiv 2404.06654 §3.1).

Pure Python: no torch, so training and evaluation scripts can import it cheaply.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

__all__ = [
    "NAMES",
    "Fact",
    "random_fact",
    "fact_sentence",
    "fact_question",
    "fact_answer",
    "plant_facts",
    "answer_matches",
    "REPEAT_PROMPT",
    "repeat_from_prompt",
]

#: Names used as fact keys. Single, common English given names: each is a few BPE tokens.
NAMES = (
    "Alice Bruno Carla Daniel Elena Felix Greta Hugo Irene Jonas Karen Liam Maria Nora Oscar Paula "
    "Quentin Rosa Simon Tina Ulrich Vera Walter Xenia Yusuf Zoe Adam Bianca Cyril Diana Edgar Fiona "
    "George Hannah Ivan Julia Kevin Laura Martin Nadia Oliver Petra Rafael Sofia Thomas Ursula Victor "
    "Wendy Arthur Beatrice Charles Dora Emil Flora Gustav Helen Isaac Jane Kurt Lena Marco Nina Otto "
    "Pia Robert Sara Theo Una Viktor Wanda Albert Clara David Emma Frank Gina Henry Ida"
).split()

#: KVzip's reconstruction prompt for the first chunk (arXiv 2505.23416, §3.2).
REPEAT_PROMPT = "Repeat the previous context exactly."
# Greedy tokens allowed for an answer: the longest answer sentence is 19 tokens with the reference tokenizer
# (a multi-token name and 6 single-digit tokens) plus the end-of-turn token; 16 cut 6-digit codes short.
ANSWER_MAX_NEW_TOKENS = 32


def repeat_from_prompt(previous_tail: str) -> str:
    """KVzip's reconstruction prompt for a later chunk, which names where the chunk starts.

    ``previous_tail`` is the decoded text of the last 8 tokens of the previous chunk (arXiv 2505.23416, §3.2).
    """
    return "Repeat the part of the previous context exactly, starting with " + previous_tail


@dataclass(frozen=True)
class Fact:
    """One planted fact: a ``name`` and its secret ``code`` (a decimal string of 4-6 digits)."""

    name: str
    code: str


def random_fact(rng: random.Random, exclude: set[str] = frozenset()) -> Fact:
    """Draw a fact with a name not in ``exclude`` and a 4-6 digit code without a leading zero."""
    name = rng.choice([n for n in NAMES if n not in exclude])
    digits = rng.randint(4, 6)
    code = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    return Fact(name, code)


def fact_sentence(fact: Fact) -> str:
    """The sentence planted in the passage."""
    return f"The secret code of {fact.name} is {fact.code}."


def fact_question(fact: Fact) -> str:
    """The question asked after the passage."""
    return f"What is the secret code of {fact.name}?"


def fact_answer(fact: Fact) -> str:
    """The expected answer."""
    return f"The secret code of {fact.name} is {fact.code}."


def _sentence_boundaries(text: str) -> list[int]:
    """Character offsets just after a sentence end or line break, where a fact can be inserted."""
    cuts = [0]
    cuts += [m.end() for m in re.finditer(r"(?<=[.!?])[ \n]|\n", text)]
    cuts.append(len(text))
    return sorted(set(cuts))


def plant_facts(passage: str, facts: list[Fact], depths: list[float]) -> str:
    """Insert each fact's sentence into ``passage`` at the sentence boundary nearest its relative depth.

    ``depths`` are fractions of the passage length in characters (0.0 = start, 1.0 = end), one per fact.
    Raises ``ValueError`` if the lists differ in length or a depth lies outside [0, 1].
    """
    if len(facts) != len(depths):
        raise ValueError(f"got {len(facts)} facts but {len(depths)} depths")
    cuts = _sentence_boundaries(passage)
    inserts: list[tuple[int, int, str]] = []
    for order, (fact, depth) in enumerate(zip(facts, depths)):
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is outside [0, 1]")
        target = depth * len(passage)
        cut = min(cuts, key=lambda c: (abs(c - target), c))
        inserts.append((cut, order, fact_sentence(fact)))
    out, last = [], 0
    for cut, _, sentence in sorted(inserts):
        out.append(passage[last:cut])
        if cut == len(passage):
            out.append(("" if cut == 0 or passage[-1] in " \n" else " ") + sentence)
        else:
            out.append(sentence + " ")
        last = cut
    out.append(passage[last:])
    return "".join(out)


def answer_matches(answer: str, fact: Fact) -> bool:
    """Exact match: the fact's code appears in ``answer`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(fact.code)}(?!\d)", answer) is not None


def haystack_documents() -> list[str]:
    """The held-out documents shipped for retrieval tasks (``kvpack/data/haystack``, PSF-licensed CPython docs)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent / "data" / "haystack"
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))]


def needle_context(tokenizer, n_tokens: int, facts: list[Fact], depths: list[float], rng: random.Random) -> str:
    """A held-out passage of about ``n_tokens`` tokens (facts included) with ``facts`` planted at ``depths``.

    The passage starts at a random paragraph of the concatenated haystack documents; ``tokenizer`` is any object
    with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``.
    """
    text = "\n\n".join(haystack_documents())
    paragraph_starts = [0] + [m.end() for m in re.finditer(r"\n\n", text)]
    budget = n_tokens - sum(len(tokenizer.encode(" " + fact_sentence(f), add_special_tokens=False)) for f in facts)
    while True:
        start = rng.choice(paragraph_starts)
        ids = tokenizer.encode(text[start : start + 8 * n_tokens], add_special_tokens=False)
        if len(ids) >= budget:
            break
    passage = tokenizer.decode(ids[: max(1, budget)])
    return plant_facts(passage, facts, depths)
