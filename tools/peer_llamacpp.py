#!/usr/bin/env python
"""llama.cpp as a peer: its own state save/restore against a kvpack pack, for the same GGUF and context.

Runs in a virtual environment that has ``llama-cpp-python`` (built from its source package; kvpack is not needed
there): it prefills the chat-laid-out context once, saves the state (``Llama.save_state``, written to a file with
numpy, never pickled), restores it into a fresh model, and answers the question greedily from the restored state.
Prints one JSON line: tokens, prefill/save/restore seconds, state bytes, the answer.

    /tmp/lcpp-venv/bin/python tools/peer_llamacpp.py GGUF CONTEXT.txt "What is ...?" [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from llama_cpp import Llama, LlamaState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("context")
    ap.add_argument("question")
    ap.add_argument("--tokens", type=int, default=4096, help="context tokens kept (the start of the file)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--state", default="/tmp/llamacpp.state.npy")
    args = ap.parse_args()
    llm = Llama(args.gguf, n_ctx=8192, n_threads=args.threads, verbose=False)
    text = open(args.context, encoding="utf-8").read()
    ids = llm.tokenize(text.encode(), add_bos=False)[: args.tokens]
    text = llm.detokenize(ids).decode("utf-8", "replace")
    prefix = f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n{text}"
    ctx_ids = llm.tokenize(prefix.encode(), add_bos=False, special=True)
    t = time.perf_counter()
    llm.eval(ctx_ids)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    state = llm.save_state()
    blob = np.frombuffer(state.llama_state, dtype=np.uint8)
    np.save(args.state, blob)
    save_s = time.perf_counter() - t
    fresh = Llama(args.gguf, n_ctx=8192, n_threads=args.threads, verbose=False)
    t = time.perf_counter()
    data = np.load(args.state).tobytes()
    fresh.load_state(LlamaState(input_ids=state.input_ids, scores=state.scores, n_tokens=state.n_tokens,
                                llama_state=data, llama_state_size=len(data)))
    restore_s = time.perf_counter() - t
    q = fresh.tokenize(f"\n\n{args.question}<|im_end|>\n<|im_start|>assistant\n".encode(), add_bos=False,
                       special=True)
    out = []
    t = time.perf_counter()
    for tok in fresh.generate(q, temp=0.0, top_k=1, reset=False):
        if tok == fresh.token_eos() or len(out) >= 24:
            break
        out.append(tok)
    answer_s = time.perf_counter() - t
    print(json.dumps({"tokens": len(ctx_ids), "prefill_s": prefill_s, "save_s": save_s, "restore_s": restore_s,
                      "state_bytes": len(data), "answer_s": answer_s,
                      "answer": fresh.detokenize(out).decode("utf-8", "replace")}))


if __name__ == "__main__":
    main()
