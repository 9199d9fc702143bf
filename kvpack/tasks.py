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


#: Most bytes a haystack folder's files may hold together (``haystack_documents``): a benchmark corpus, read whole.
MAX_HAYSTACK_BYTES = 64 << 20
#: The files of a haystack folder that are read: its ``*.txt`` and ``*.md``, directly in it, by name.
HAYSTACK_SUFFIXES = (".txt", ".md")
#: Random paragraph starts tried before a context or passage of the asked length is given up on.
PASSAGE_TRIES = 1000


def haystack_documents(folder=None) -> list[str]:
    """The held-out documents of the retrieval and continuation tasks: the shipped ones (``folder=None``:
    ``kvpack/data/haystack``, PSF-licensed CPython docs, held out from the reference model's training), or the
    ``*.txt`` and ``*.md`` files directly in ``folder`` (a path; links to files are followed), sorted by name, read
    as UTF-8: your own documents.

    Raises:
        InputError: ``folder`` is not a directory, holds no such file, holds more than ``MAX_HAYSTACK_BYTES`` in
            them, or one is not UTF-8 text; each message names the folder or file and the fix.
    """
    from pathlib import Path

    from .errors import InputError

    if folder is None:
        shipped = Path(__file__).resolve().parent / "data" / "haystack"
        return [p.read_text(encoding="utf-8") for p in sorted(shipped.glob("*.txt"))]
    path = Path(folder)
    if not path.exists():
        raise InputError(f"haystack folder {str(path)!r} does not exist; give a folder of .txt or .md files")
    if not path.is_dir():
        raise InputError(f"haystack folder {str(path)!r} is not a directory; give a folder of .txt or .md files")
    try:
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in HAYSTACK_SUFFIXES and p.is_file())
    except OSError as e:
        raise InputError(f"haystack folder {str(path)!r} cannot be listed ({e.strerror or e}); check its "
                         "permissions") from None
    if not files:
        raise InputError(f"haystack folder {str(path)!r} has no .txt or .md file directly in it; put your "
                         "documents there as UTF-8 text")
    try:
        total = sum(p.stat().st_size for p in files)  # sizes before reading
    except OSError as e:
        raise InputError(f"haystack folder {str(path)!r}: a file cannot be read ({e}); check its permissions") \
            from None
    def too_large(held: str) -> InputError:
        return InputError(f"haystack folder {str(path)!r} holds {held} bytes of .txt and .md files, over the "
                          f"{MAX_HAYSTACK_BYTES:,} a benchmark corpus may hold; give a folder with fewer documents")

    if total > MAX_HAYSTACK_BYTES:
        raise too_large(f"{total:,}")
    out, left = [], MAX_HAYSTACK_BYTES
    for p in files:
        try:
            with p.open("rb") as f:  # at most what is left: a file may be larger than its size said
                data = f.read(left + 1)
            if len(data) > left:
                raise too_large("more")
            left -= len(data)
            out.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"haystack file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); convert "
                             "it or move it out of the folder") from None
        except OSError as e:
            raise InputError(f"haystack file {str(p)!r} cannot be read ({e.strerror or e}); check its permissions "
                             "or move it out of the folder") from None
    return out


def first_long_passage(tokenizer, text: str, starts: list[int], tokens: int, chars: int) -> list[int]:
    """Token ids of the first ``text[start : start + chars]`` over ``starts`` (paragraph starts, in order) that
    encodes to at least ``tokens`` tokens, or ``[]`` when none does: the fallback of a random search that missed.
    At most ``len(starts)`` encodings of ``chars`` characters each."""
    for start in starts:
        ids = tokenizer.encode(text[start : start + chars], add_special_tokens=False)
        if len(ids) >= tokens:
            return ids
    return []


def find_passage(tokenizer, text: str, starts: list[int], tokens: int, chars: int, rng: random.Random
                 ) -> list[int]:
    """Token ids of ``text[start : start + chars]`` for a start drawn from ``starts`` (paragraph starts) by ``rng``
    that encodes to at least ``tokens`` tokens, tried ``PASSAGE_TRIES`` times, then ``first_long_passage`` (at
    least one token); shorter ids (possibly ``[]``) when no start gives that many. Raises nothing of its own."""
    for _ in range(PASSAGE_TRIES):
        start = rng.choice(starts)
        ids = tokenizer.encode(text[start : start + chars], add_special_tokens=False)
        if len(ids) >= tokens:
            return ids
    # few starts lead to a passage this long: the first that does, in order (never with the shipped pages)
    return first_long_passage(tokenizer, text, starts, max(1, tokens), chars)


def needle_context(tokenizer, n_tokens: int, facts: list[Fact], depths: list[float], rng: random.Random,
                   documents: list[str] | None = None) -> str:
    """A held-out passage of about ``n_tokens`` tokens (facts included) with ``facts`` planted at ``depths``.

    The passage starts at a random paragraph of the concatenated ``documents`` (default: ``haystack_documents()``);
    ``tokenizer`` is any object with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``. Raises
    ``InputError`` when ``PASSAGE_TRIES`` paragraph starts give no passage that long.
    """
    text = "\n\n".join(haystack_documents() if documents is None else documents)
    paragraph_starts = [0] + [m.end() for m in re.finditer(r"\n\n", text)]
    budget = n_tokens - sum(len(tokenizer.encode(" " + fact_sentence(f), add_special_tokens=False)) for f in facts)
    ids = find_passage(tokenizer, text, paragraph_starts, budget, 8 * n_tokens, rng)
    if len(ids) < budget:
        from .errors import InputError

        raise InputError(f"the haystack has no passage of about {n_tokens} tokens (a context is one stretch of "
                         "text from one paragraph on); give longer documents, or ask for shorter contexts "
                         "(kvpack bench: --lengths for the needle and speed tasks, --context-length for multi-query "
                         "and continuation)")
    passage = tokenizer.decode(ids[: max(1, budget)])
    return plant_facts(passage, facts, depths)
