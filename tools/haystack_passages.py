#!/usr/bin/env python
"""Where the bench's continuation passages fall in the haystack: its size, and for each seed the character offset
each passage starts at, with the seeds whose passages overlap it (issue 28: how fresh a "fresh seed" is).

A passage starts at a paragraph start drawn as ``kvpack.bench.continuation.continuation_docs`` draws it, and covers
about ``length`` tokens; its character span is measured with the model's tokenizer.

    python tools/haystack_passages.py --model smollm2-135m --seeds 56-70 --length 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
from kvpack import tasks  # noqa: E402
from kvpack.bench.continuation import continuation_docs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or name (default: the embedded reference model)")
    ap.add_argument("--seeds", default="56-70", help="FIRST-LAST, inclusive")
    ap.add_argument("--length", type=int, default=2048, help="context tokens per passage")
    ap.add_argument("--docs", type=int, default=2, help="passages per seed")
    ap.add_argument("--haystack", default=None, metavar="DIR", help="a folder of .txt/.md files (default: shipped)")
    args = ap.parse_args()
    first, last = (int(x) for x in args.seeds.split("-"))
    _, tok = kvpack.load_model(args.model)
    documents = tasks.haystack_documents(args.haystack)
    text = "\n\n".join(documents)
    print(f"haystack: {len(documents)} documents, {len(text):,} characters, "
          f"{len(tok.encode(text, add_special_tokens=False)):,} tokens")
    spans = {}
    for seed in range(first, last + 1):
        for doc in continuation_docs(tok, args.length, args.docs, seed=seed, documents=documents):
            start = text.find(doc.text[:200])  # the decoded passage's opening, found in the haystack
            spans[(seed, doc.key)] = (start, start + len(doc.text))
    for (seed, key), (a, b) in spans.items():
        others = [f"{s}/{k.rsplit('/', 1)[1]}" for (s, k), (c, d) in spans.items()
                  if (s, k) != (seed, key) and c < b and a < d]
        print(f"seed {seed} {key.rsplit('/', 1)[1]}: characters {a:,}-{b:,}; overlaps {', '.join(others) or '-'}")


if __name__ == "__main__":
    main()
