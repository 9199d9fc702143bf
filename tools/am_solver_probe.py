"""Why Attention Matching's fitted values leave the context's range: the solver, or the least-squares problem?

AM's value fit (arXiv 2602.16284 §3.2, ``kvpack.methods.am_fit.least_squares``) solves ``min ||X C - Y||`` by the
float32 normal equations (Cholesky of ``X^T X``), which square the condition number of ``X``; the paper's code uses
QR (``torch.linalg.lstsq(..., driver="gels")``). This compresses one continuation passage with AM (no value bound,
so every head is fitted) and, for each fitted head, solves the same system three ways: kvpack's Cholesky, float32
QR (the paper's ``gels``) and float64 SVD (``gelsd``, the reference). It prints, per solver, how many heads' values
exceed 2x the largest |value| of their context (what ``--value-bound 2`` rejects) and the median of
``max |C| / max |V|``, with the median condition number of ``X`` and the residuals against float64's.

    python tools/am_solver_probe.py --model smollm2-135m --seed 3 --ratio 0.1 [--out runs/solver_probe.json]
    python tools/am_solver_probe.py --model smollm2-135m --seed 3 --options "queries=16384;reference=self-study+repeat"

If the three solvers agree, the values extrapolate because the problem's exact solution does: the reference
queries determine some kept entries' values only weakly (collinear columns of ``X``), not because of float32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvpack  # noqa: E402
import kvpack.methods.am as am_module  # noqa: E402
from kvpack.bench.continuation import continuation_docs  # noqa: E402
from kvpack.bench.specs import parse_method_spec  # noqa: E402
from kvpack.methods import am_fit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or folder (default: the embedded reference model)")
    ap.add_argument("--seed", type=int, default=3, help="seed of the bench's continuation passages")
    ap.add_argument("--length", type=int, default=2048, help="context tokens")
    ap.add_argument("--ratio", type=float, default=0.1, help="AM's keep ratio")
    ap.add_argument("--options", default="", help="more AM options, as in a method spec: 'queries=16384;"
                    "reference=self-study+repeat'")
    ap.add_argument("--out", default=None, help="write each head's figures as JSON here")
    args = ap.parse_args()

    rows: list[dict] = []
    context_max: list[float] = []
    kvpack_solve, kvpack_fit = am_fit.least_squares, am_module.fit_head

    def fit_head(keys, values, *a, **k):  # remember the head's largest |value| for the solve below
        context_max.append(float(values.abs().max()))
        return kvpack_fit(keys, values, *a, **k)

    def least_squares(X, Y, fallback=None, ridge=0.0, prior=None):
        C = kvpack_solve(X, Y, fallback=fallback, ridge=ridge, prior=prior)
        if fallback is None or ridge > 0:  # the mass fit (no fallback) or a ridge: not the plain value fit
            return C
        vmax = context_max[-1]
        qr = torch.linalg.lstsq(X, Y, driver="gels").solution
        exact = torch.linalg.lstsq(X.double(), Y.double(), driver="gelsd").solution.float()
        sv = torch.linalg.svdvals(X.double())

        def residual(c: torch.Tensor) -> float:
            return float((X @ c - Y).pow(2).sum())

        rows.append({"kept": X.shape[1], "queries": X.shape[0], "cond": float(sv[0] / sv[-1].clamp_min(1e-300)),
                     "cholesky": float(C.abs().max()) / vmax, "qr": float(qr.abs().max()) / vmax,
                     "float64": float(exact.abs().max()) / vmax, "res_cholesky": residual(C),
                     "res_qr": residual(qr), "res_float64": residual(exact), "res_copied": residual(fallback)})
        return C

    am_fit.least_squares, am_module.fit_head = least_squares, fit_head
    model, tok = kvpack.load_model(args.model)
    doc = continuation_docs(tok, args.length, 1, seed=args.seed)[0]
    _, options = parse_method_spec(f"am[{args.options}]" if args.options else "am")
    kvpack.compress(model, tok, doc.text, method="am", ratio=args.ratio, **{**options, "value_bound": 0})
    med = statistics.median
    print(f"{doc.key}, keep {args.ratio}, options {args.options or '(defaults)'}: {len(rows)} fitted heads, median kept entries "
          f"{med(r['kept'] for r in rows)}, median condition number of X {med(r['cond'] for r in rows):.3g}")
    for key in ("cholesky", "qr", "float64"):
        ratios = [r[key] for r in rows]
        over = sum(x > 2 for x in ratios)
        rel = med(r[f"res_{key}"] / max(r["res_float64"], 1e-30) for r in rows)
        print(f"  {key:9s} heads over 2x the context's max |value|: {over} of {len(rows)}; median max|C|/max|V| "
              f"{med(ratios):.1f}; median residual / float64's {rel:.4f}")
    print(f"  copied values: median residual / float64's {med(r['res_copied'] / max(r['res_float64'], 1e-30) for r in rows):.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "heads": rows}, indent=1))


if __name__ == "__main__":
    main()
