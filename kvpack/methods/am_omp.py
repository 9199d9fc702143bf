"""Attention Matching's OMP key selection (arXiv 2602.16284 §3.1, "AM-OMP"; the official code's
``compaction/algorithms/omp.py``): greedily choose the keys whose attention mass best reproduces the whole
context's, refitting the weights ``w = exp(beta)`` after each step.

For one KV head with context keys ``K`` ``[T, d]`` and reference queries ``Q`` ``[n, d]``, with the log-sum-exp shift
of ``kvpack.methods.am_fit`` (``E = exp(s Q K^T - lse(s Q K^T))``: every row sums to 1, the target mass ``y = 1``):

    S = forced entries (the recent floor), w = nnls(E[:, S], y)
    repeat until |S| = t:
        r = y - E[:, S] w                     residual of the mass of every query  [n]
        c = E^T r                             correlation of each key's mass column with it  [T]
        S += the ``k`` unselected keys of highest c
        w = nnls_box(E[:, S], y)              beta in am_fit.BETA_RANGE, as the final fit

``k`` is ``ceil((t - |forced|) / OMP_STEPS)``, so a head costs at most ``OMP_STEPS`` refits whatever its budget (the
official code's ``progressive_schedule`` also takes several keys per step: 1, then 2, then 4). The selected keys are
then fitted by ``am_fit.fit_head`` like any other selection.

Cost per head: ``E`` (``n x T`` floats) once, then per step one ``[T, n] x [n]`` product and one least-squares solve
of ``n x |S|`` (normal equations: ``O(n |S|^2)``).
"""

from __future__ import annotations

import math

import torch

from .am_fit import BETA_RANGE, context_attention, nnls_box

__all__ = ["OMP_STEPS", "omp_select"]

#: Refits per head at most (keys chosen per step: ``ceil(budget / OMP_STEPS)``).
OMP_STEPS = 32


def omp_select(keys: torch.Tensor, queries: torch.Tensor, scaling: float, t: int,
               forced: torch.Tensor | None = None, steps: int = OMP_STEPS) -> torch.Tensor:
    """The ``t`` context entries OMP keeps in one head (module docstring).

    Args:
        keys: ``[T, d]`` float32 context keys (post-RoPE; the sink left out).
        queries: ``[n, d]`` float32 reference queries, ``n >= 1``.
        scaling: the model's attention scaling.
        t: entries to keep, ``0 <= t <= T``.
        forced: ``[f]`` int64 indices kept whatever the scores (``f <= t``; the recent floor), or ``None``.
        steps: refits at most, ``>= 1``.

    Returns:
        ``[t]`` int64 indices into ``keys``, increasing. Raises ``ValueError`` if ``t`` or ``forced`` is out of
        range.
    """
    T = keys.shape[0]
    forced = torch.zeros(0, dtype=torch.int64) if forced is None else forced.to(torch.int64).cpu().unique()
    if not 0 <= t <= T or len(forced) > t or (len(forced) and (int(forced.min()) < 0 or int(forced.max()) >= T)):
        raise ValueError(f"omp_select: t={t} and {len(forced)} forced entries for {T} keys")
    if t == T:
        return torch.arange(T)
    q, k = queries.float(), keys.float()
    _, lse = context_attention(q, k, k, scaling)
    E = torch.matmul(q, k.T).mul_(scaling).sub_(lse[:, None]).exp_()  # [n, T], rows sum to 1
    y = torch.ones(E.shape[0], dtype=E.dtype, device=E.device)
    low, high = math.exp(BETA_RANGE[0]), math.exp(BETA_RANGE[1])
    chosen = torch.zeros(T, dtype=torch.bool, device=E.device)
    chosen[forced.to(E.device)] = True
    per_step = max(1, -(-(t - len(forced)) // max(1, steps)))
    current = torch.zeros_like(y)
    if len(forced):
        sel = chosen.nonzero().squeeze(1)
        current = E[:, sel] @ nnls_box(E[:, sel], y, low, high)
    while int(chosen.sum()) < t:
        corr = E.T @ (y - current)  # [T]
        corr = corr.masked_fill(chosen, float("-inf"))
        k_step = min(per_step, t - int(chosen.sum()))
        chosen[torch.sort(corr, descending=True, stable=True).indices[:k_step]] = True
        sel = chosen.nonzero().squeeze(1)
        current = E[:, sel] @ nnls_box(E[:, sel], y, low, high)
    return chosen.nonzero().squeeze(1).cpu()
