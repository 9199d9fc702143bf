#!/usr/bin/env python
"""Make the NVIDIA kvpress environment for ``kvpack bench --peer kvpress``, or run its worker on a job file.

kvpress (PyPI) pins ``transformers<5.3`` while kvpack needs 5.23, so kvpress lives in its own virtual environment
(``.venv-kvpress/`` by default, git-ignored): ``python -m venv``, then ``torch`` at the version kvpack's environment
runs (installed first, so pip takes the CPU build on disk instead of pulling a CUDA build), then ``kvpress==0.5.5``
with its own dependencies. ``kvpack bench --peer kvpress`` does this by itself on first use; this script does it
ahead of time and can rerun the worker by hand::

    python tools/peer_kvpress.py setup                      # make .venv-kvpress/ (a few minutes, ~1.4 GB)
    python tools/peer_kvpress.py run JOB.json RESULTS.json  # run kvpress on a job kvpack exported
    kvpack bench --peer kvpress                             # the benchmark with kvpress rows beside kvpack's

A job file is what ``kvpack.bench.peer.export_job`` writes (see ``kvpack/bench/kvpress_worker.py`` for the format);
``kvpack bench`` leaves none behind, so ``run`` is for debugging a job you saved yourself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpack.bench.peer import DEFAULT_VENV, PeerError, ensure_kvpress_venv, run_kvpress  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=DEFAULT_VENV, help=f"the kvpress virtual environment [{DEFAULT_VENV}]")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="make (or check) the kvpress virtual environment")
    run = sub.add_parser("run", help="run the kvpress worker on a job file")
    run.add_argument("job")
    run.add_argument("results")
    args = ap.parse_args()
    try:
        python = ensure_kvpress_venv(args.venv)
        if args.cmd == "setup":
            print(f"kvpress environment ready: {python}")
            return 0
        job = json.loads(Path(args.job).read_text(encoding="utf-8"))
        out = run_kvpress(job, python, Path(args.results).resolve().parent)
        Path(args.results).write_text(json.dumps(out), encoding="utf-8")
        print(f"{len(out['rows'])} rows in {out['seconds']:.0f} s -> {args.results}")
        return 0
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
