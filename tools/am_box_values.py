"""Ablation (issue 28): Attention Matching's values fitted by least squares *within the context's range*.

AM's value fit (arXiv 2602.16284 §3.2) is unconstrained least squares; on SmolLM2 its exact solution is ~100x the
context's largest |value| in almost every head (``tools/am_solver_probe.py``), which is why ``--value-bound 2``
rejects those fits. This tries the constrained alternative, kvpack's, not the paper's: the same objective
``min ||X C - Y||^2`` (X, Y exactly as ``kvpack.methods.am_fit.fit_head`` builds them with the log-sum-exp shift,
beta fitted as usual), with every value held in a box, solved by projected gradient (200 steps, step 1/L with L
the largest eigenvalue of X^T X) from the copied values, so the result is never worse than copying on the
reference queries. It wraps ``tools/bench_am.py``; a variant asks for the box with a sentinel ridge:

    am[ridge=1e-9]   each channel within its context's own [min, max]
    am[ridge=2e-9]   every value within +-(the context's largest |value|)

    python tools/am_box_values.py --model smollm2-135m --seed 3 --cont-docs 2 --cont-length 2048 --mq-contexts 0 \\
        --ratios 0.1,0.05 --variants "kvzip,am,am[ridge=1e-9],am[ridge=2e-9]" --out runs/box.json

Every other argument is ``tools/bench_am.py``'s. Measured in BENCHMARKS.md ("Issue 28, sixteenth session"): no
consistent gain, so this stays an ablation rather than a ``--values`` option.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvpack.methods.am as am_module  # noqa: E402
from kvpack.methods import am_fit  # noqa: E402

STEPS = 200
CHANNEL_RANGE, SYMMETRIC = 1e-9, 2e-9  # the sentinel ridges


def box_least_squares(X: torch.Tensor, Y: torch.Tensor, start: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                      steps: int = STEPS) -> torch.Tensor:
    """``argmin ||X C - Y||^2`` over ``low <= C <= high`` (per column of ``C``) by projected gradient from ``start``.
    ``X`` ``[n, t]``, ``Y`` ``[n, dv]``, ``start`` ``[t, dv]``, ``low``/``high`` ``[dv]``; returns ``[t, dv]``."""
    gram, rhs = X.T @ X, X.T @ Y
    lipschitz = float(torch.linalg.eigvalsh(gram)[-1]) or 1.0
    C = start.clone()
    for _ in range(steps):
        C = torch.minimum(torch.maximum(C - (gram @ C - rhs) / lipschitz, low), high)
    return C


def fit_head(keys, values, queries, kept, scaling, fit_values=True, shift="lse", ridge=0.0, ridge_to="zero", **kw):
    """``am_fit.fit_head``, with the box when ``ridge`` is one of the sentinels (module docstring)."""
    if ridge not in (CHANNEL_RANGE, SYMMETRIC) or not fit_values:
        return am_fit.fit_head(keys, values, queries, kept, scaling, fit_values=fit_values, shift=shift,
                               ridge=ridge, ridge_to=ridge_to, **kw)
    fit = am_fit.fit_head(keys, values, queries, kept, scaling, fit_values=False, shift="lse", **kw)
    target, lse = am_fit.context_attention(queries, keys, values, scaling)
    M = ((queries.float() @ keys[kept].float().T) * scaling - lse[:, None]).exp_()  # kept entries' probabilities
    w = fit.beta.exp()
    X = (M * w) / (M @ w)[:, None]
    if ridge == CHANNEL_RANGE:
        low, high = values.amin(dim=0), values.amax(dim=0)
    else:
        top = values.abs().max()
        low, high = (-top).expand(values.shape[1]), top.expand(values.shape[1])
    fit.values = box_least_squares(X, target, values[kept].float(), low, high)
    return fit


if __name__ == "__main__":
    am_module.fit_head = fit_head
    sys.argv = [str(ROOT / "tools" / "bench_am.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
