#!/usr/bin/env python
"""Attention Matching's held-out check on SmolLM2: does AM at keep 0.1 still answer a planted fact?

The context is the real-tier test's (``tests/test_real_model.py``): about 950 tokens of the logging HOWTO with
"The secret code of Maria is 73914." planted at 60% depth. Each AM variant is compressed, saved, loaded and asked
"What is the secret code of Maria?" (24 greedy tokens). Prints one line per variant: its options and its answer.

    python tools/am_held_out_check.py [--ratio 0.1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402

VARIANTS = [{}, {"held_out_check": True}, {"held_out_check": False}, {"budgets": "global"}, {"recent": 0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ratio", type=float, default=0.1)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, tok = kvpack.load_model(args.model, device="cpu")
    haystack = Path(kvpack.__file__).parent / "data" / "haystack" / "howto_logging.txt"
    lines = tok.decode(tok.encode(haystack.read_text("utf-8"))[:950]).split("\n")
    k = int(len(lines) * 0.6)
    text = "\n".join(lines[:k] + ["The secret code of Maria is 73914."] + lines[k:])
    with tempfile.TemporaryDirectory() as tmp:
        for options in VARIANTS:
            pack = kvpack.compress(model, tok, text, method="am", ratio=args.ratio, **options)
            kvpack.save(pack, Path(tmp) / "am.kvpack")
            cache = kvpack.load(Path(tmp) / "am.kvpack", model)
            answer = kvpack.generate(model, tok, cache, "What is the secret code of Maria?", max_new_tokens=24)
            print(options or "defaults", repr(answer), flush=True)


if __name__ == "__main__":
    main()
