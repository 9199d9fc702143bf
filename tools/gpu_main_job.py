#!/usr/bin/env python
"""The main job on one model and context, for each method: build time over plain prefill, peak memory of the build,
file size, load throughput beside a raw read of the same bytes, and the decode step over the loaded cache against
the full cache's. Written as one Markdown table (``--out``), also printed.

* prefill: plain transformers, one forward of the context into a ``DynamicCache`` (``kvpack.bench.speed``);
* build: ``kvpack.compress`` at ``--ratio`` (``none`` at 1.0); its peak memory is CUDA's
  ``max_memory_allocated`` during the build minus what was allocated before it (the model), or on CPU the
  process's peak resident set (``ru_maxrss``, which includes the model and never goes down);
* load: ``kvpack.save`` (``--zstd-level``), then ``kvpack.load`` onto the model's device; GB/s = file bytes /
  load seconds, beside reading the same file's bytes into memory (``raw read``);
* decode: median of ``--steps`` interleaved single-token forwards over the loaded cache and over the full cache;
* ``--quant-method M`` (default kvzip): M is also built with ``quant="int4"`` and its file loaded twice, with the
  int4 rows dequantized once at load and kept as codes, dequantized on the fly by the decode kernel
  (``kvpack.load(..., dequantize=...)``, ``kvpack.compact_cache``): rows ``M int4 at-load`` / ``M int4 on-the-fly``;
  ``cache MB`` is the loaded cache's own tensors (``KvpackCache.nbytes``).

Builds and loads are timed once each after one untimed prefill (``--repeats`` rounds, medians). Used by
``tools/gpu_check.sh`` (8B shape, bf16, 32K tokens on an H200; ``--dry-run``: the reference model on CPU).

    python tools/gpu_main_job.py --model runs/shapes/llama-3.1-8b --tokens 32768 --out runs/main_job.md
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpack  # noqa: E402
from kvpack.attention import use_kvpack_attention  # noqa: E402
from kvpack.bench.speed import needle_context_ids, plain_prefill, timed  # noqa: E402

DEFAULT_METHODS = "kvzip,streaming,knorm,snapkv,h2o,d2o"


def _peak_reset(dev) -> int:
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _peak_mib(dev, before: int) -> float:
    if dev.type == "cuda":
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _raw_read_s(path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 * 2**20):
            pass
    return time.perf_counter() - t0


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded reference model)")
    ap.add_argument("--tokens", type=int, default=32768, help="context length in tokens")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--zstd-level", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per cache")
    ap.add_argument("--quant-method", default="kvzip",
                    help="also build this method with int4 and load it both ways (at-load, on-the-fly); '' for none")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto, float32, bfloat16, float16)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="build no further method once this many seconds have passed (the table keeps the done ones)")
    ap.add_argument("--out", default=None, help="Markdown file to write")
    args = ap.parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    model, tok = kvpack.load_model(args.model, device=args.device, dtype=args.dtype)
    dev = next(model.parameters()).device
    text, ids = needle_context_ids(tok, args.tokens, dev)
    n = int(ids.shape[1])
    methods = [m for m in args.methods.split(",") if m]
    # row label -> (method, quant, how the int4 rows are dequantized); an int4 build is loaded both ways
    builds = [(m, "none") for m in methods]
    if args.quant_method:  # second, so that a --budget-s cut still leaves the at-load / on-the-fly comparison
        builds.insert(1, (args.quant_method, "int4"))
    labels = {(m, q): [m] if q == "none" else [f"{m} {q} {how}" for how in ("at-load", "on-the-fly")]
              for m, q in builds}
    plain_prefill(model, ids)  # warm-up
    prefill_s = []
    rows = {label: {"build": [], "load": [], "raw": []} for ls in labels.values() for label in ls}
    caches = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVPACK_TMP")) as folder:
        for _ in range(args.repeats):
            prefill_s.append(timed(lambda: plain_prefill(model, ids))[0])
            for m, quant in builds:
                if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                    print(f"# budget of {args.budget_s} s spent: {m} (quant {quant}) not built", flush=True)
                    continue
                before = _peak_reset(dev)
                t, pack = timed(lambda: kvpack.compress(model, tok, text, method=m, chunk_size=args.chunk_size,
                                                        ratio=1.0 if m == "none" else args.ratio, quant=quant))
                peak = _peak_mib(dev, before)
                path = os.path.join(folder, f"{m}.kvpack")
                size = kvpack.save(pack, path, zstd_level=args.zstd_level)
                del pack
                raw = _raw_read_s(path)
                for label in labels[(m, quant)]:
                    r = rows[label]
                    r["build"].append(t)
                    r["peak_mib"], r["bytes"] = peak, size
                    r["raw"].append(raw)
                    caches.pop(label, None)
                    how = "on-the-fly" if label.endswith("on-the-fly") else "at-load"
                    lt, caches[label] = timed(lambda: kvpack.load(path, model, tokenizer=tok, dequantize=how))
                    r["load"].append(lt)
                    r["cache_mb"] = caches[label].nbytes() / 1e6
                os.remove(path)
    full = plain_prefill(model, ids)
    token = ids[:, -1:]

    def full_step():
        model.set_attn_implementation("sdpa")
        model(input_ids=token, past_key_values=full, use_cache=True)
        full.crop(-(full.get_seq_length() - n))

    def loaded_step(cache):
        def step():
            use_kvpack_attention(model)
            model(input_ids=token, past_key_values=cache, use_cache=True)
            cache.rewind()
        return step

    steps = {"full": full_step, **{m: loaded_step(c) for m, c in caches.items()}}
    times = {k: [] for k in steps}
    with torch.inference_mode():
        for s in range(2 + args.steps):
            for k, fn in steps.items():
                t = timed(fn)[0]
                if s >= 2:
                    times[k].append(t)
    step = {k: statistics.median(v) for k, v in times.items()}
    pre = statistics.median(prefill_s)
    peak_what = "CUDA max_memory_allocated above the model" if dev.type == "cuda" else "peak RSS of the process"
    lines = [f"`{cmd}`", "", f"{n} context tokens, model {args.model or 'reference'} ({model.dtype}), {dev} "
             f"({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}), torch {torch.__version__}; "
             f"plain prefill {pre:.3f} s; full-cache decode step {step['full'] * 1e3:.2f} ms; medians of "
             f"{args.repeats} builds/loads and {args.steps} interleaved decode steps", "",
             f"| method | build s | build / prefill | peak MiB ({peak_what}) | file MB | load s | load GB/s | "
             "raw read GB/s | cache MB | decode step ms | decode / full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in [m for m in rows if rows[m]["build"]]:
        r = rows[m]
        b, lo, raw = (statistics.median(r[k]) for k in ("build", "load", "raw"))
        lines.append(f"| {m} | {b:.3f} | {b / pre:.2f}x | {r['peak_mib']:.0f} | {r['bytes'] / 1e6:.1f} | {lo:.3f} | "
                     f"{r['bytes'] / lo / 1e9:.2f} | {r['bytes'] / raw / 1e9:.2f} | {r['cache_mb']:.1f} | "
                     f"{step[m] * 1e3:.2f} | {step[m] / step['full']:.2f}x |")
    skipped = [m for m in rows if not rows[m]["build"]]
    if skipped:
        lines += ["", f"Not built (--budget-s {args.budget_s} spent): {', '.join(skipped)}"]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
