#!/usr/bin/env python
"""Write a few head-scoring contexts for ``kvpack heads``: the pydoc text of standard-library modules.

KVzip's context-independent mode scores heads on a few contexts of the kind of text to be compressed (arXiv
2505.23416, §3.3; the official code uses SCBench English QA contexts). The bench's haystack
(``kvpack/data/haystack``) is Python documentation, so these contexts are Python documentation too, but of other
modules, so nothing is tuned to the bench's own contexts. Each file holds the first ``--tokens`` tokens (reference
tokenizer) of ``pydoc.render_doc(module, renderer=pydoc.plaintext)``.

    python tools/head_contexts.py --out runs/heads/contexts
    kvpack heads runs/heads/contexts --out runs/heads/reference.safetensors
"""

from __future__ import annotations

import argparse
import importlib
import pydoc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402

MODULES = ("json", "argparse", "datetime")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/heads/contexts", help="folder for the .txt contexts")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per context")
    ap.add_argument("--modules", default=",".join(MODULES), help="comma-separated standard-library modules")
    args = ap.parse_args()
    _, tok = kvpack.load_model(None, device="cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in [m for m in args.modules.split(",") if m]:
        text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        ids = tok.encode(text, add_special_tokens=False)[: args.tokens]
        (out / f"{name}.txt").write_text(tok.decode(ids), encoding="utf-8")
        print(f"{out / (name + '.txt')}: {len(ids)} tokens")


if __name__ == "__main__":
    main()
