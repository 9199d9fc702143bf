"""Attention Matching's validated value fit (kvpack's, not the paper's): each KV head takes, among a few candidate
fits, the one whose output is closest to the full context's on queries the fit never saw.

Why: the paper's plain least-squares values (arXiv 2602.16284 §3.2) extrapolate on SmolLM2 in nearly every head
whatever the reference queries (repeat pass, self-study, sampled continuations, the context's own prefill), and
queries from the same source cannot see it (BENCHMARKS.md, "Issue 28"). The validation queries here come from
another source: the context's own last ``TAIL_TOKENS`` tokens, recorded in the prefill (``am_prefill``), replayed
at their own positions with the causal mask, as the tokens that continue the context will read the cache.

Candidates, for kept entries ``S`` with fitted biases ``beta`` and the fit's design ``X``, ``Y`` (``am_fit``):

    selection      beta = 0, values copied (KVzip's entries as they are)
    copy           beta fitted, values copied
    ridge lambda   beta fitted, values argmin ||X C - Y||^2 + lambda m ||C - V_S||^2 for lambda in RIDGE_GRID
                   (m = mean diag(X^T X); lambda = 0 is the paper's plain least squares)

The error of a candidate is ``am_fit.relative_error`` of the head's output over ``[sink, context]`` (the sink
exact), against the full context's, on the validation queries.
"""

from __future__ import annotations

import torch

from ..attention import masked_attention
from .am_fit import gram, least_squares, relative_error

__all__ = ["TAIL_TOKENS", "RIDGE_GRID", "CANDIDATES", "causal_output", "choose_fit"]

#: Context tokens at the end whose prefill queries validate the fits.
TAIL_TOKENS = 256
#: Ridges tried, as shares of the mean diagonal of ``X^T X``, each toward the kept entries' own values.
RIDGE_GRID = (0.0, 1e-3, 1e-2, 1e-1, 1.0)
#: Candidate names, in the order they are tried (a tie keeps the earlier one).
CANDIDATES = ("selection", "copy", *(f"ridge={r:g}" for r in RIDGE_GRID))


def causal_output(queries: torch.Tensor, query_pos: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor,
                  values: torch.Tensor, scaling: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, dv]`` float32: attention of ``queries`` ``[n, d]`` at positions ``query_pos`` ``[n]`` over ``keys``
    ``[m, d]`` / ``values`` ``[m, dv]`` at ``key_pos`` ``[m]``, a key visible to a query when its position is not
    after the query's, with an optional per-key ``bias`` ``[m]``. Every query must see at least one key. The masked
    attention of the loaded cache (``kvpack.attention.masked_attention``) with one KV head. Raises nothing of its
    own."""
    visible = (key_pos[None, :] <= query_pos[:, None])[None]  # [1 KV head, n, m]
    out = masked_attention(queries.float()[None, None], keys.float()[None, None], values.float()[None, None], visible,
                           scaling, bias=None if bias is None else bias.float()[None])
    return out[0, :, 0]  # [1, n, 1 head, dv] -> [n, dv]


def choose_fit(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, sink: int, kept: torch.Tensor,
               beta: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, queries: torch.Tensor, query_pos: torch.Tensor,
               scaling: float, limit: float = float("inf"), normal: tuple[torch.Tensor, torch.Tensor] | None = None,
               plain: torch.Tensor | None = None, full: torch.Tensor | None = None
               ) -> tuple[str, torch.Tensor, torch.Tensor, dict[str, float]]:
    """The candidate (module docstring) with the lowest validation error for one KV head.

    Args:
        keys, values: ``[T, d]``, ``[T, dv]`` float32, the head's whole prefill (sink first); positions: ``[T]``.
        sink: the sink's entries (kept exact); kept: ``[t]`` int64 indices into the context (after the sink).
        beta: ``[t]`` fitted biases; X, Y: the fit's design ``[n, t]`` and target ``[n, dv]`` (``am_fit``).
        queries: ``[m, d]`` validation queries at positions ``query_pos`` ``[m]``; scaling: the attention scaling.
        limit: a fit with a value beyond ``+-limit`` (or not finite) is not a candidate (the loader's bound).
        normal: ``(gram(X) [t, t], X^T Y [t, dv])`` when the caller has them (``HeadFit.normal``), else computed
            here once for every ridge.
        plain: ``[t, dv]`` the ridge-0 candidate when the caller solved it already (``fit_head`` with ``ridge=0``:
            ``least_squares(X, Y, fallback=values[sink + kept])``), else solved here.
        full: ``[m, dv]`` the validation queries' output over the whole prefill (``causal_output`` over ``keys``,
            ``values``) when the caller has it, else computed here.

    Returns:
        ``(name, beta [t], values [t, dv], {candidate: error})``. Raises nothing of its own.
    """
    if full is None:
        full = causal_output(queries, query_pos, keys, positions, values, scaling)
    rows = torch.cat([torch.arange(sink, device=keys.device), sink + kept])
    copied = values[sink + kept]
    # every candidate attends over the same [sink, kept] keys, with beta = 0 (selection) or the fitted beta (the
    # rest): two softmaxes for all of them, the sink's share of each output computed once
    logits = (queries.float() @ keys[rows].float().T).mul_(scaling)  # [m, sink + t]
    logits.masked_fill_(positions[rows][None, :] > query_pos[:, None], float("-inf"))
    fitted_bias = torch.cat([torch.zeros(sink, device=keys.device), beta.float()])
    sink_values = values[:sink].float()
    probs = {0: logits.softmax(dim=-1), 1: (logits + fitted_bias).softmax(dim=-1)}
    sink_part = {b: p[:, :sink] @ sink_values for b, p in probs.items()}
    errors, best = {}, None
    G, XtY = normal if normal is not None else (gram(X), X.T @ Y)  # one normal system for every ridge
    for name in CANDIDATES:
        if name == "selection":
            b, v = torch.zeros_like(beta), copied
        elif name == "copy":
            b, v = beta, copied
        else:
            ridge = float(name.split("=")[1])
            v = plain if ridge == 0 and plain is not None else least_squares(
                X, Y, fallback=copied, ridge=ridge, prior=copied if ridge > 0 else None, G=G, XtY=XtY)
            b = beta
            if not bool((v.abs() <= limit).all()):  # also NaN
                continue
        fitted = int(name != "selection")
        out = torch.addmm(sink_part[fitted], probs[fitted][:, sink:], v.float())
        errors[name] = relative_error(full, out)
        if best is None or errors[name] < errors[best[0]]:
            best = (name, b, v)
    return best[0], best[1], best[2], errors
