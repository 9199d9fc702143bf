#!/usr/bin/env python
"""Whole builds side by side: ``kvpack.compress`` of one held-out passage with KVzip and with each AM
configuration given, interleaved, medians over ``--repeats``, in one process (the issue-28 cost target: AM's build
within 1.5x KVzip's). Unlike ``bench_am_steps.py`` this is exactly what ``kvpack build`` runs per document (the
prefill with the method's recorder, scoring, selection, fit, the pack assembled), less the file write. Wall and
CPU seconds of the process are both reported (with ``--threads 1`` CPU seconds leave out time the core was taken
away on a shared machine).

    OMP_NUM_THREADS=1 python tools/bench_am_build.py --model smollm2-135m --threads 1 --repeats 2 \\
        --variants 'am' 'am[reference=self-study+repeat;selection=rms;ridge_search=true]'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
from kvpack.bench.continuation import continuation_docs  # noqa: E402
from kvpack.bench.specs import parse_method_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded reference model)")
    ap.add_argument("--length", type=int, default=2048, help="context tokens (a held-out passage)")
    ap.add_argument("--seed", type=int, default=2, help="seed of the held-out passage")
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--variants", nargs="+", default=["am"], help="method specs, e.g. am[selection=rms]")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvpack.load_model(args.model)
    doc = next(iter(continuation_docs(tok, args.length, 1, seed=args.seed)))
    variants = ["kvzip", *args.variants]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for spec in variants:
            name, params = parse_method_spec(spec)
            t, c = time.perf_counter(), time.process_time()
            kvpack.compress(model, tok, doc.text, method=name, ratio=args.ratio, **params)
            seconds[spec].append(time.perf_counter() - t)
            cpu[spec].append(time.process_time() - c)
    med = {v: statistics.median(s) for v, s in seconds.items()}
    med_cpu = {v: statistics.median(s) for v, s in cpu.items()}
    # CPU seconds of the process beside wall seconds: with --threads 1 they leave out the time other tenants of a
    # shared machine held the core, which moves the wall-clock ratio by 10-15% from run to run
    print(json.dumps({"command": " ".join(sys.argv), "seconds": seconds, "median_seconds": med,
                      "over kvzip": {v: med[v] / med["kvzip"] for v in variants},
                      "cpu_seconds": cpu, "median_cpu_seconds": med_cpu,
                      "over kvzip, cpu": {v: med_cpu[v] / med_cpu["kvzip"] for v in variants}}, indent=1))


if __name__ == "__main__":
    main()
