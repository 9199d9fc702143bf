"""Peak memory of one ``kvpack.compress`` in a fresh process (run by ``kvpack.bench.speed.measure_memory``).

    python -m kvpack.bench.memory --tokens 4096 --method kvzip --ratio 0.3

Prints one JSON line: ``{"tokens", "method", "ratio", "baseline_bytes", "peak_bytes", "growth_bytes", "build_s",
"extended_positions", "peak_method"}``. The process loads the model and makes the context first; then it resets
the kernel's peak-RSS counter (``/proc/self/clear_refs`` value 5, Linux) so the peak covers the build alone, builds,
and reads the peak (``VmHWM``). Where the reset is unavailable it falls back to ``resource.getrusage``'s
``ru_maxrss``, which also counts what loading the model peaked at (``peak_method`` says which). ``growth_bytes`` =
peak - resident size just before the build: the memory the build itself needed, in bytes.

Contexts longer than the model's ``max_position_embeddings`` minus 256 are allowed here for the measurement only:
the process raises the config's limit (``extended_positions: true``); such answers would not be meaningful.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time


def _status_bytes(field: str) -> int | None:
    """``VmRSS``/``VmHWM`` of this process from ``/proc/self/status`` in bytes, or ``None``."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the peak RSS (``VmHWM``) to the current RSS; ``False`` where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Parse ``--tokens --method --ratio --chunk-size --model``, build once, print the JSON line; exit 0."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--method", default="kvzip")
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    import kvpack
    from kvpack import tasks

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tok = kvpack.load_model(args.model, device="cpu")
    rng = random.Random(f"kvpack-bench/memory/{args.seed}/{args.tokens}")
    text = tasks.needle_context(tok, args.tokens, [tasks.random_fact(rng)], [0.5], rng)
    limit = getattr(model.config, "max_position_embeddings", None)
    extended = bool(limit and args.tokens + 512 > limit - 256)
    if extended:
        model.config.max_position_embeddings = args.tokens + 1024
    # warm the kernels on a short context so one-time allocations do not count as the build's
    kvpack.compress(model, tok, text[:2000], method=args.method, ratio=args.ratio, chunk_size=args.chunk_size)
    reset = _reset_peak()
    baseline = _status_bytes("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    kvpack.compress(model, tok, text, method=args.method, ratio=args.ratio, chunk_size=args.chunk_size)
    build_s = time.perf_counter() - t0
    if reset and _status_bytes("VmHWM") is not None:
        peak, how = _status_bytes("VmHWM"), "VmHWM after reset"
    else:
        peak, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
    print(json.dumps({"tokens": args.tokens, "method": args.method, "ratio": args.ratio, "baseline_bytes": baseline,
                      "peak_bytes": peak, "growth_bytes": max(0, peak - baseline), "build_s": build_s,
                      "extended_positions": extended, "peak_method": how}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
