#!/usr/bin/env python
"""Time ``kvpack build`` serial against ``kvpack build --ray --workers N`` on the same documents.

Each run is the real command line in a fresh process, timed wall-clock from start to exit, so the serial figure
includes one model load and the Ray figure includes starting a local Ray, its actors and one model load per actor.
Serial and Ray runs are interleaved (serial, Ray, serial, Ray, ...) into fresh output folders, and every Ray run's
packs (every ``*.kvpack`` under ``--out``; the manifest holds timings, so it is left out) are compared byte for byte
with the serial run's. ``--threads N`` gives both modes N torch threads (serial: the process; Ray: each actor);
without it the serial build uses torch's default and each one-CPU actor one thread, and the thread count changes
float results, so bytes then match only where the defaults agree. Models: the embedded reference model and a
Qwen2.5-0.5B-shaped one (24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864; random weights) made by
``tools/make_shape_model.py qwen2.5-0.5b`` when that tool exists, else built here from the same shape (with the
reference tokenizer's 4096-entry vocabulary, so the embedding is smaller than the real model's).

    python tools/bench_ray.py --docs 4 --tokens 512 --workers 2 --repeats 2

On a machine with few cores the actors share them with each other (and with every other process), so the gain
is bounded by the cores; the point of ``--ray`` is that the same files come out on a node's GPUs or a cluster.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kvpack  # noqa: E402
from kvpack import tasks  # noqa: E402

#: Qwen2.5-0.5B's shape (its config.json), the vocabulary aside.
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


def shape_model(folder: Path) -> str:
    """The 0.5B-shaped model folder (made once)."""
    if (folder / "config.json").exists():
        return str(folder)
    maker = ROOT / "tools" / "make_shape_model.py"
    if maker.exists():
        subprocess.run([sys.executable, str(maker), "qwen2.5-0.5b", "--out", str(folder)], check=True)
        return str(folder)
    import torch
    import transformers as tf

    _, tok = kvpack.load_model(None, device="cpu")
    config = tf.Qwen2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, **QWEN25_05B)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def write_docs(folder: Path, n: int, tokens: int) -> None:
    _, tok = kvpack.load_model(None, device="cpu")
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        text = tasks.needle_context(tok, tokens, [tasks.random_fact(rng)], [0.5], rng)
        (folder / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")


def run(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return seconds


def packs(folder: Path) -> dict[str, bytes]:
    """Every ``.kvpack`` under ``folder``: relative POSIX path -> bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.kvpack"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4, help="documents per build")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per document")
    ap.add_argument("--workers", type=int, default=2, help="Ray actors")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved serial/Ray pairs per model")
    ap.add_argument("--models", default="reference,qwen2.5-0.5b-shape", help="comma-separated")
    ap.add_argument("--method", default="kvzip")
    ap.add_argument("--ratio", default="0.3")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both modes (0: their defaults)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_ray"), help="scratch folder")
    args = ap.parse_args()
    work = Path(args.work)
    docs = work / "docs"
    if not docs.exists():
        write_docs(docs, args.docs, args.tokens)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    kv = [sys.executable, "-m", "kvpack", "build", str(docs), "--method", args.method, "--ratio", args.ratio,
          "--device", "cpu", *(["--threads", str(args.threads)] if args.threads else [])]
    print(f"{args.docs} documents x {args.tokens} tokens, {args.method} ratio {args.ratio}, {os.cpu_count()} CPUs, "
          f"Ray workers {args.workers}, {args.repeats} interleaved repeats, threads {args.threads or 'default'}")
    print("| model | serial s (median) | --ray --workers {w} s (median) | serial / ray | same bytes |".format(
        w=args.workers))
    print("|---|---|---|---|---|")
    for name in [m for m in args.models.split(",") if m]:
        model = [] if name == "reference" else ["--model", shape_model(work / name)]
        serial, ray, same = [], [], True
        for r in range(args.repeats):
            s_out, r_out = work / f"out-{name}-serial-{r}", work / f"out-{name}-ray-{r}"
            for out in (s_out, r_out):
                subprocess.run(["rm", "-rf", str(out)], check=True)
            serial.append(run([*kv, *model, "--out", str(s_out)], env))
            ray.append(run([*kv, *model, "--out", str(r_out), "--ray", "--workers", str(args.workers)], env))
            same = same and packs(s_out) == packs(r_out) and len(packs(s_out)) == args.docs
        s, r = statistics.median(serial), statistics.median(ray)
        print(f"| {name} | {s:.1f} ({', '.join(f'{x:.1f}' for x in serial)}) | {r:.1f} "
              f"({', '.join(f'{x:.1f}' for x in ray)}) | {s / r:.2f}x | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
