#!/usr/bin/env python
"""Hashing throughput of the two tensor checksums a pack may carry (``--checksum xxh3|sha256``): XXH3-128 and
SHA-256 over the same random bytes, one thread, best and median of ``--repeats``, in GB/s (2^30 bytes a second),
and the ratio. Verifying a pack hashes every tensor byte once, so this ratio is what ``--checksum sha256`` costs.

    python tools/bench_checksums.py --mib 64 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time

import xxhash


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="bytes hashed, in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    data = os.urandom(args.mib << 20)
    hashes = {"xxh3-128": lambda b: xxhash.xxh3_128(b).digest(), "sha256": lambda b: hashlib.sha256(b).digest()}
    times = {name: [] for name in hashes}
    for _ in range(args.repeats):  # interleaved
        for name, fn in hashes.items():
            t0 = time.perf_counter()
            fn(data)
            times[name].append(time.perf_counter() - t0)
    gb = args.mib / 1024
    print(f"{args.mib} MiB, {args.repeats} interleaved repeats\n\n| checksum | best GB/s | median GB/s |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {gb / min(ts):.2f} | {gb / statistics.median(ts):.2f} |")
    ratio = statistics.median(times["sha256"]) / statistics.median(times["xxh3-128"])
    print(f"\nsha256 / xxh3-128 time (medians): {ratio:.1f}x")


if __name__ == "__main__":
    main()
