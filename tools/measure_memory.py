#!/usr/bin/env python
"""Peak resident memory of loading, describing, listing and verifying a pack, each in a fresh process
(BENCHMARKS.md "Reliability"; issue 30's bounds: load <= the cache's bytes + 64 MiB above the process with its
model loaded, info and ls <= 64 MiB above start-up).

``load``: a child process imports kvpack, loads the embedded reference model in ``--dtype``, reads its resident
set (``VmRSS``), runs ``kvpack.load`` and reads its peak (``VmHWM``); the cache's own bytes are
``KvpackCache.nbytes()`` (its layers) plus its int64 token ids. ``load-old``: the same through ``cache_from_pack(load_pack(...))``, the path
``kvpack.load`` took before (memory-mapped tensors in the stored dtype, then the cache built from them).
``info``, ``ls``, ``verify``: the CLI under ``/usr/bin/time -v`` (maximum resident set size), on the pack and, for
start-up, on a golden file (its folder for ``ls``).

    python tools/measure_memory.py /tmp/big.kvpack --dtype float32
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "format" / "golden" / "small_f32.kvpack"

_CHILD = r"""
import json, sys, time, torch, kvpack
from kvpack.fileformat import load_pack
from kvpack.loading import cache_from_pack

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, how, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
model, tok = kvpack.load_model(device="cpu", dtype=dtype)
before = status("VmRSS")
t0 = time.perf_counter()
cache = kvpack.load(path, model) if how == "load" else cache_from_pack(load_pack(path), model)
seconds = time.perf_counter() - t0
print(json.dumps({"rss_before": before, "peak": status("VmHWM"), "cache_bytes": cache.nbytes() + 8 * cache.token_ids.numel(),
                  "seconds": seconds}))
"""


def _peak_rss(cmd: list[str]) -> int:
    """Maximum resident set size in bytes of ``cmd`` (``/usr/bin/time -v``)."""
    out = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr[-2000:]}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)) * 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pack")
    ap.add_argument("--dtype", default="float32", help="the model's dtype for load")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip (load, load-old, info, ls, verify)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    mib = 2**20
    size = Path(args.pack).stat().st_size
    print(f"{args.pack}: {size:,} bytes ({size / 2**30:.2f} GiB)")
    for how in ("load", "load-old"):
        if how in skip:
            continue
        out = subprocess.run([sys.executable, "-c", _CHILD, args.pack, how, args.dtype], capture_output=True,
                             text=True, cwd=ROOT)
        if out.returncode:
            print(f"{how}: failed: {out.stderr[-1500:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        extra = r["peak"] - r["rss_before"] - r["cache_bytes"]
        print(f"{how:8} ({args.dtype} model): peak {r['peak'] / mib:,.0f} MiB, {r['rss_before'] / mib:,.0f} MiB "
              f"before the load, cache {r['cache_bytes'] / mib:,.0f} MiB: peak - before = "
              f"{(r['peak'] - r['rss_before']) / mib:,.0f} MiB = cache + {extra / mib:,.0f} MiB "
              f"({(r['peak'] - r['rss_before']) / r['cache_bytes']:.3f}x the cache), {r['seconds']:.1f} s")
    kvpack = [str(Path(sys.executable).parent / "kvpack")]  # the console script of this environment
    with tempfile.TemporaryDirectory() as folder:
        link = Path(folder) / "big.kvpack"
        link.symlink_to(Path(args.pack).resolve())
        steps = {"info": ([*kvpack, "info", args.pack], [*kvpack, "info", str(GOLDEN)]),
                 "ls": ([*kvpack, "ls", folder], [*kvpack, "ls", str(GOLDEN.parent)]),
                 "verify": ([*kvpack, "verify", args.pack], [*kvpack, "verify", str(GOLDEN)])}
        for step, (cmd, start) in steps.items():
            if step in skip:
                continue
            peak, base = _peak_rss(cmd), _peak_rss(start)
            print(f"{step:8}: peak {peak / mib:,.0f} MiB; on a golden file {base / mib:,.0f} MiB (start-up): "
                  f"+{(peak - base) / mib:,.1f} MiB for the pack")
    return 0


if __name__ == "__main__":
    sys.exit(main())
