"""Attention Matching's closed-form fit of one KV head (Zweiger et al., arXiv 2602.16284, §3; the paper's
"HighestAttnKeys" variant with its fast configuration: NNLS as clamped least squares plus two projected-gradient
steps, beta in [-3, 3], values by least squares).

For a head with context keys ``K`` ``[T, d]``, values ``V`` ``[T, dv]``, reference queries ``Q`` ``[n, d]`` and a
kept subset ``S`` (``t`` entries), with the model's attention scaling ``s`` and a per-query shift ``m(q)`` shared by
both sides:

    mass      E = exp(s Q K^T - m)  [n, T],  y = E 1  [n],  M = E[:, S]  [n, t]
              w = argmin_{low <= w <= high} ||M w - y||^2,   beta = log w                       (§3.1, Eq. 4)
    values    Y = (E V) / y  [n, dv]   (the head's attention output over the context)
              X = (M diag(w)) / (M w)  [n, t]   (attention over the kept keys with beta)
              C_v = argmin ||X C_v - Y||^2                                                        (§3.2, Eq. 5)

The shift (``shift``): ``"lse"`` (default), ``m(q) = log sum_i exp(s q.k_i)``, so ``y = 1`` and ``M`` holds the
kept entries' attention probabilities: ``m`` and ``Y`` come from one fused flash-attention call over the context
and only the ``[n, t]`` kept columns are ever exponentiated (5x faster than materialising ``E`` ``[n, T]`` at
``n = 3,840``, ``T = 4,096``); every query's mass then counts relatively (``sum_j w_j p_j(q) ~ 1``). ``"max"``,
``m(q) = max_i s q.k_i``, the paper code's shift for stability, weighs each query's mass residual by its ``y``.
The issue-level statement of the method only asks that the shift be the same on both sides; BENCHMARKS.md
compares the two.

Matching both the mass ``y`` and the normalised output ``Y`` of the context makes attention over ``[sink,
compacted context]`` match attention over ``[sink, full context]`` for every query, since the sink's own mass and
output are untouched (the sink is kept exact: beta = 0, values copied).
"""

from __future__ import annotations

import math

import torch

from ..attention_math import flash_folded
from .params import FIT_WEIGHTS, RIDGE_TARGETS

__all__ = ["BETA_RANGE", "NNLS_ITERS", "RIDGE", "RIDGE_STEPS", "GRAM_BLOCK", "gram", "nnls_box", "least_squares", "HeadFit", "fit_head",
           "context_share", "context_attention", "attention_output", "relative_error", "rms_attention", "max_attention",
           "CHUNK_ELEMENTS", "W_RANGE", "clamped_least_squares", "BETA_SOLVES"]

#: How ``fit_head`` solves the weights ``w = exp(beta)``: ``"nnls"`` (projected gradient in ``beta_range``, the
#: highest-attention-keys runs' ``nnls_iters=2``, bounds ``e^-3, e^3``) or ``"clamped"`` (``clamped_least_squares``,
#: AM-OMP's).
BETA_SOLVES = ("nnls", "clamped")

#: beta = log w is clamped to this range (the paper's configuration: w in [e^-3, e^3]).
BETA_RANGE = (-3.0, 3.0)
#: Projected-gradient steps after the clamped least-squares start (the paper's configuration: 2).
NNLS_ITERS = 2
#: Ridge added to the normal equations when plain least squares fails (not finite, or no better than its
#: fallback point), relative to the mean diagonal of the Gram matrix (the paper: a fixed 1e-6 on probabilities).
RIDGE = 1e-6
#: Ridges tried before the SVD pseudo-inverse: ``RIDGE x 10^k`` for ``k < RIDGE_STEPS`` (up to 1e-1 of the mean
#: diagonal), the first whose normal equations factorise (float32 Gram matrices of nearly equal exp-logit columns
#: are not numerically positive definite at 1e-6: seen on a head keeping all of its 1,024 entries).
RIDGE_STEPS = 6
#: ``log2(e)`` and ``ln(2)``: natural logits to base 2 and back (the exponentials are taken with ``exp2``:
#: ``_softmax_chunks``).
LOG2_E, LN_2 = 1.0 / math.log(2.0), math.log(2.0)


#: Columns per block row of ``gram`` (only the blocks on and above the diagonal are multiplied). 128 against 256 at
#: 6,500 rows on one CPU thread: 0.80x the time at 300 columns, 0.95x at 620, equal from 1,000 up
#: (``tools/bench_gram.py --blocks 256,128,64``, BENCHMARKS.md).
GRAM_BLOCK = 128


def gram(X: torch.Tensor, block: int = GRAM_BLOCK) -> torch.Tensor:
    """``X^T X``: ``[t, t]`` for ``X`` ``[n, t]``, symmetric by construction. For ``t > 2 x block`` it multiplies
    only the block rows on and above the diagonal (``X[:, i:j]^T X[:, i:]``) and mirrors the rest, as a BLAS
    ``syrk`` does: ``(t / 2 + block / 2) / t`` of the plain product's multiply-adds, 0.6-0.8x its time on one CPU
    thread at ``t = 300 .. 1,536`` (the normal equations of the least squares below are most of a fit's cost;
    BENCHMARKS.md). Each entry is the same dot product as in ``X.T @ X``. Raises nothing beyond torch's errors."""
    t = X.shape[1]
    if t <= 2 * block:
        return X.T @ X
    G = X.new_empty(t, t)
    for i in range(0, t, block):
        j = min(t, i + block)
        G[i:j, i:] = X[:, i:j].T @ X[:, i:]
    upper = G.triu(1)
    return G.triu_().add_(upper.T)


def nnls_box(M: torch.Tensor, y: torch.Tensor, low: float, high: float, iters: int = NNLS_ITERS) -> torch.Tensor:
    """Box-constrained least squares ``argmin_{low <= w <= high} ||M w - y||^2``, approximately.

    Starts from the unconstrained least-squares solution clamped to the box (``least_squares``), then takes
    ``iters`` projected-gradient steps of size ``1 / ||M||_2^2`` (the spectral norm by power iteration). When the
    unconstrained solution lies in the box it is returned exactly; more steps converge to the constrained optimum.
    arXiv 2602.16284 §3.1 (the paper's code: ``nnls_iters=2``, bounds ``e^-3, e^3``). With ``n >= t`` the power
    iteration and the gradient ``M^T M w - M^T y`` use the normal equations the start already built (``[t, t]``
    products instead of two ``[n, t]`` ones per step).

    Args:
        M: ``[n, t]`` float32; y: ``[n]`` float32; ``0 <= low <= high``; iters: ``>= 0`` steps.

    Returns:
        ``[t]`` float32 in ``[low, high]``. No errors beyond torch's for mismatched shapes.
    """
    n, t = M.shape
    G, Mty = (gram(M), M.T @ y) if n >= t and t > 0 else (None, None)  # the start's normal equations, kept
    w = least_squares(M, y[:, None], G=G, XtY=None if Mty is None else Mty[:, None])[:, 0].clamp(low, high)
    if iters <= 0 or t == 0:
        return w
    u = torch.ones(t, dtype=M.dtype, device=M.device)
    for _ in range(8):  # power iteration on M^T M from a fixed start: deterministic
        u = G @ u if G is not None else M.T @ (M @ u)
        norm = u.norm()
        if norm == 0:
            return w
        u = u / norm
    lipschitz = float(u @ (G @ u) if G is not None else (M @ u).pow(2).sum()) or 1.0
    for _ in range(iters):
        grad = G @ w - Mty if G is not None else M.T @ (M @ w - y)
        w = (w - grad / lipschitz).clamp(low, high)
    return w


def least_squares(X: torch.Tensor, Y: torch.Tensor, fallback: torch.Tensor | None = None, ridge: float = 0.0,
                  prior: torch.Tensor | None = None, G: torch.Tensor | None = None,
                  XtY: torch.Tensor | None = None) -> torch.Tensor:
    """``argmin_C ||X C - Y||^2`` in float32: the normal equations ``X^T X C = X^T Y`` by Cholesky when ``n >= t``
    (one ``[t, n] x [n, t]`` product: 2-3x faster than QR on CPU, measured in BENCHMARKS.md), else the
    minimum-norm solution ``X^T (X X^T)^-1 Y``.

    If that fails (a matrix that is not numerically positive definite, a non-finite result, or a residual above
    that of ``fallback``, a feasible point such as the copied values), the ridge-regularised normal equations
    ``(X^T X + lambda I) C = X^T Y`` are solved with the smallest ``lambda = RIDGE x 10^k x mean(diag(X^T X))``
    (``k < RIDGE_STEPS``) whose Cholesky factorisation succeeds, and failing all of those by the SVD
    pseudo-inverse (``torch.linalg.pinv``). arXiv 2602.16284
    §3.2 (the paper's code offers ``lstsq``, ``cholesky`` and ``pinv`` solvers, with a 1e-6 ridge fallback).

    With ``ridge > 0`` the ridge-regularised system ``(X^T X + lambda I) C = X^T Y + lambda P`` with ``lambda =
    ridge x mean(diag(X^T X))`` is solved first, whatever the conditioning: ``argmin ||X C - Y||^2 + lambda ||C -
    P||^2``, which shrinks ``C`` toward ``P = prior`` (zeros by default) (kvpack's option, not the paper's default:
    BENCHMARKS.md, "Attention Matching"); the steps above are its fallback.

    Args:
        X: ``[n, t]`` float32; Y: ``[n, k]`` float32; fallback: optional ``[t, k]``; ridge: ``>= 0``; prior:
            optional ``[t, k]`` float32, what the ridge shrinks toward (used only with ``ridge > 0``); G: ``gram(X)``
            and XtY: ``X^T Y`` ``[t, k]`` when the caller has them (several ridges on one design), else computed
            here.

    Returns:
        ``[t, k]`` float32.
    """
    n, t = X.shape
    if t == 0:
        return X.new_zeros(0, Y.shape[1])
    if G is None and (n >= t or ridge > 0):
        G = gram(X)  # [t, t], shared by every path below
    if XtY is None and (n >= t or ridge > 0):
        XtY = X.T @ Y  # [t, k], likewise
    if ridge > 0:
        lam = ridge * float(G.diagonal().mean().clamp_min(1e-30))
        factor, info = torch.linalg.cholesky_ex(G + lam * torch.eye(t, dtype=G.dtype, device=G.device))
        if int(info) == 0:
            rhs = XtY if prior is None else XtY + lam * prior
            C = torch.cholesky_solve(rhs, factor)
            if bool(torch.isfinite(C).all()):
                return C
    try:
        if n >= t:
            C = torch.cholesky_solve(XtY, torch.linalg.cholesky(G))
        else:  # minimum-norm solution of the underdetermined system
            C = X.T @ torch.cholesky_solve(Y, torch.linalg.cholesky(X @ X.T))
        ok = bool(torch.isfinite(C).all())
        if ok and fallback is not None:
            residuals = (X @ torch.cat([C, fallback], dim=1)).sub_(Y.repeat(1, 2)).square_()  # one product for both
            k = Y.shape[1]
            ok = float(residuals[:, :k].sum()) <= float(residuals[:, k:].sum()) * (1 + 1e-4) + 1e-12
    except RuntimeError:  # torch.linalg errors (singular systems) are RuntimeErrors
        ok = False
    if ok:
        return C
    G, rhs = (gram(X) if G is None else G), (X.T @ Y if XtY is None else XtY)
    scale = float(G.diagonal().mean().clamp_min(1e-30))
    for k in range(RIDGE_STEPS):  # the smallest ridge, 1e-6 x 10^k, whose system factorises
        lam = RIDGE * 10.0**k * scale
        factor, info = torch.linalg.cholesky_ex(G + lam * torch.eye(t, dtype=G.dtype, device=G.device))
        if int(info) == 0:
            C = torch.cholesky_solve(rhs, factor)
            if bool(torch.isfinite(C).all()):
                return C
    return torch.linalg.pinv(X) @ Y  # minimum-norm least squares by SVD: always defined


class HeadFit:
    """The compacted context of one KV head: ``beta`` ``[t]`` float32 and ``values`` ``[t, dv]`` float32 for the
    kept entries (in the order of ``kept``), plus ``mass_error``: the relative error of the fitted mass on the
    fit queries, ``mean |M w - y| / y``, and ``design``: the value fit's ``(X [n, t], Y [n, dv])`` when asked for
    (``fit_head(keep_design=True)``), else ``None``, with ``normal``: its ``(gram(X) [t, t], X^T Y [t, dv])``, so a
    caller solving the same design again with other ridges (``am_validate.choose_fit``) need not recompute them."""

    def __init__(self, beta: torch.Tensor, values: torch.Tensor, mass_error: float,
                 design: tuple[torch.Tensor, torch.Tensor] | None = None,
                 normal: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.beta, self.values, self.mass_error, self.design = beta, values, mass_error, design
        self.normal = normal


def context_share(queries: torch.Tensor, sink_keys: torch.Tensor, lse: torch.Tensor, scaling: float
                  ) -> torch.Tensor:
    """``[n]`` float32 in (0, 1): the share of each query's attention over ``[sink, context]`` that falls on the
    context, ``sigmoid(lse - logsumexp(scaling Q S^T))``, for ``queries`` ``[n, d]``, the sink's keys ``sink_keys``
    ``[s, d]`` and the context's log-sum-exp ``lse`` ``[n]``. Ones when the sink is empty.

    It is how much an error of the context's normalised output moves the head's output: attention over ``[sink,
    context]`` is ``a o_context + (1 - a) o_sink``, so a query that rests on the attention sink (``a`` near 0; most
    repeat-pass queries of a model's dormant heads) hardly reads the context at all (kvpack's weighting of the fit,
    ``weights="share"``; the paper fits every reference query alike)."""
    if sink_keys.shape[0] == 0:
        return torch.ones_like(lse)
    sink_lse = ((queries @ sink_keys.float().T) * scaling).logsumexp(dim=1)
    return torch.sigmoid(lse - sink_lse)


#: Bounds of ``w = exp(beta)`` in ``clamped_least_squares`` (AM-OMP's: the official code's ``nnls_lower_bound``
#: default and ``nnls_upper_bound=exp(7)``).
W_RANGE = (1e-12, math.exp(7.0))


def clamped_least_squares(M: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[t]`` float32 ``w``: ``argmin ||M w - y||`` (float64, rank-revealing QR on CPU) clamped to ``W_RANGE``: the
    official code's ``_nnls_pg(iters=0)``, AM-OMP's weights (arXiv 2602.16284 §3.1; ``M`` ``[n, t]``, ``y``
    ``[n]``; ``t = 0`` gives an empty tensor). Raises nothing beyond torch's errors for mismatched shapes."""
    if M.shape[1] == 0:
        return M.new_zeros(0)
    w = torch.linalg.lstsq(M.double(), y.double()[:, None], driver="gelsy" if M.device.type == "cpu" else None)
    return w.solution[:, 0].nan_to_num_(W_RANGE[0]).clamp_(*W_RANGE).float()


def fit_head(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, kept: torch.Tensor, scaling: float,
             fit_values: bool = True, beta_range: tuple[float, float] = BETA_RANGE, iters: int = NNLS_ITERS,
             shift: str = "lse", ridge: float = 0.0, ridge_to: str = "zero", weights: str = "uniform",
             sink_keys: torch.Tensor | None = None, keep_design: bool = False, beta_solve: str = "nnls",
             context: tuple[torch.Tensor, torch.Tensor] | None = None, residual_check: bool = True) -> HeadFit:
    """Fit beta (mass matching) and, if ``fit_values``, the values of one head's kept entries (module docstring).

    Args:
        keys: ``[T, d]`` float32 context keys (post-RoPE; the sink left out); values: ``[T, dv]`` float32.
        queries: ``[n, d]`` float32 reference queries (post q-norm and RoPE), ``n >= 1``.
        kept: ``[t]`` int64 indices into the ``T`` keys, increasing.
        scaling: the model's attention scaling (``1 / sqrt(d)`` unless the model says otherwise).
        fit_values: least-squares values; else the kept values are copied.
        beta_range: bounds of beta; iters: projected-gradient steps of ``nnls_box``.
        shift: ``"lse"`` or ``"max"`` (module docstring).
        ridge: the values' ridge (``least_squares``), ``0`` for plain least squares (the paper's).
        ridge_to: ``"zero"`` or ``"selected"``: the ridge shrinks the values toward zero or toward the kept
            entries' own values (``least_squares``'s ``prior``).
        weights: ``"uniform"`` (the paper's: every reference query counts alike) or ``"share"``: each query's rows
            of the mass and value fits are weighted by its ``context_share`` (kvpack's), so the fit is measured as
            the head's output over ``[sink, context]`` sees it.
        sink_keys: ``[s, d]`` float32 keys of the attention sink (kept exact), needed by ``weights="share"``.
        keep_design: also return the value fit's ``X`` and ``Y`` (``HeadFit.design``; ``am_validate``) and, with
            at least as many queries as kept entries, its normal equations (``HeadFit.normal``).
        beta_solve: ``"nnls"`` (default: ``nnls_box`` in ``beta_range`` with ``iters`` steps) or ``"clamped"``
            (``clamped_least_squares``: AM-OMP's weights, ``beta_range`` and ``iters`` unused).
        context: ``context_attention(queries, keys, values, scaling)`` when the caller has it already
            (``rms_attention(values=...)``), used with ``shift="lse"``; else it is computed here.
        residual_check: plain least-squares values whose residual on the fit queries exceeds the copied values'
            fall back to the ridge path (``least_squares``' ``fallback``). A caller that compares the candidates
            on other queries itself (``am_validate.choose_fit``, where the copied values are a candidate) turns it
            off: it costs an ``[n, t] x [t, 2 dv]`` product per head, 7% of a keep-0.3 fit, and the paper's code
            has no such check (it falls back only on a failed or non-finite solve, which ``least_squares`` still
            does).

    Returns:
        ``HeadFit`` (``t = 0``: empty tensors). Raises ``ValueError`` for another ``shift``, ``ridge_to``,
        ``weights`` or ``beta_solve``, or ``weights="share"`` without ``sink_keys``.
    """
    if beta_solve not in BETA_SOLVES:
        raise ValueError(f"fit_head: beta_solve must be one of {BETA_SOLVES}, got {beta_solve!r}")
    if ridge_to not in RIDGE_TARGETS:
        raise ValueError(f"fit_head: ridge_to must be one of {RIDGE_TARGETS}, got {ridge_to!r}")
    if weights not in FIT_WEIGHTS:
        raise ValueError(f"fit_head: weights must be one of {FIT_WEIGHTS}, got {weights!r}")
    if weights == "share" and sink_keys is None:
        raise ValueError("fit_head: weights='share' needs the sink's keys (sink_keys)")
    t = kept.shape[0]
    if t == 0:
        return HeadFit(keys.new_zeros(0), values.new_zeros(0, values.shape[1]), 0.0)
    if shift == "lse":
        target, lse = context if context is not None else context_attention(queries, keys, values, scaling)
        # [n, t]: probabilities of the kept keys, scaling q.k - lse in one product (no [n, t] temporaries), in
        # base 2 (exp2 is several times faster than exp on CPU at the same accuracy: _softmax_chunks)
        M = torch.addmm(lse[:, None].mul(-LOG2_E), queries, keys[kept].T, alpha=scaling * LOG2_E).exp2_()
        y = torch.ones_like(lse)
    elif shift == "max":
        logits = (queries @ keys.T) * scaling  # [n, T]
        E = (logits - logits.amax(dim=1, keepdim=True)).exp_()
        y = E.sum(dim=1)  # [n], >= 1
        M = E[:, kept]  # [n, t]
        target = (E @ values) / y[:, None] if fit_values else None
        lse = y.log() + logits.amax(dim=1) if weights == "share" else None
    else:
        raise ValueError(f"fit_head: shift must be 'lse' or 'max', got {shift!r}")
    a = None if weights == "uniform" else context_share(queries, sink_keys, lse, scaling)[:, None]  # [n, 1]
    Mw, yw = (M, y) if a is None else (M * a, y * a[:, 0])
    w = (clamped_least_squares(Mw, yw) if beta_solve == "clamped"
         else nnls_box(Mw, yw, math.exp(beta_range[0]), math.exp(beta_range[1]), iters))
    mass = M @ w
    mass_error = float(((mass - y).abs() / y).mean())
    copied = values[kept]
    if not fit_values:
        return HeadFit(w.log(), copied.clone(), mass_error)
    X = M.mul_(w).div_(mass[:, None])  # [n, t], in place: M is not read again
    if a is not None:  # weighted least squares: rows scaled by the query's context share
        X, target = X * a, target * a
    prior = copied if ridge_to == "selected" else None
    normal = (gram(X), X.T @ target) if keep_design and X.shape[0] >= X.shape[1] else None
    G, XtY = normal or (None, None)
    C = least_squares(X, target, fallback=copied if residual_check else None, ridge=ridge, prior=prior, G=G, XtY=XtY)
    return HeadFit(w.log(), C, mass_error, (X, target) if keep_design else None, normal)


def context_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scaling Q K^T) V, logsumexp(scaling Q K^T))``: ``[n, dv]`` and ``[n]`` float32, unmasked, for
    ``queries`` ``[n, d]``, ``keys`` ``[T, d]``, ``values`` ``[T, dv]``: the target and shift of the mass matching
    (arXiv 2602.16284 §3.1-3.2, module docstring). On CPU one fused flash-attention call
    (``kvpack.attention_math.flash_folded``; no ``[n, T]`` matrix) when keys and values have the same width, else the
    explicit product. Raises nothing beyond torch's errors for mismatched shapes."""
    q, k, v = queries.float(), keys.float(), values.float()
    if q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        out, lse = flash_folded(q[None, None], k[None, None], v[None, None], scaling)
        return out[0, 0], lse[0, 0]
    logits = (q @ k.T) * scaling
    lse = logits.logsumexp(dim=-1)
    return (logits - lse[:, None]).exp_() @ v, lse


#: Query rows x keys per chunk of the explicit ``[n, T]`` attention in ``rms_attention`` and ``max_attention``
#: (float32: 2 MiB), so their memory does not grow with the number of queries. Each chunk is passed over four or
#: five times (exponential, row sums, squares, the product with the values); at 2 MiB it stays in cache between
#: them: on one CPU thread at SmolLM2's shapes (8,192 queries over 2,048 keys) RMS with the context's output takes
#: 73 ms against 102 ms with 16 MiB chunks (``tools/bench_rms_chunks.py``, BENCHMARKS.md).
CHUNK_ELEMENTS = 1 << 19


def _softmax_chunks(queries: torch.Tensor, keys: torch.Tensor, scaling: float):
    """Yield ``(start, e, total, peak)`` per chunk of query rows from row ``start``: ``e`` ``[rows, T]`` =
    ``exp(scaling q.k - peak)`` (in place, the caller may overwrite it), ``total`` ``[rows]`` its row sums and
    ``peak`` ``[rows]`` each row's largest logit, so ``e / total`` is the chunk's softmax over the keys and
    ``log(total) + peak`` its log-sum-exp. One matrix product and one exponential per chunk (``queries`` ``[n, d]``,
    ``keys`` ``[T, d]``).

    The exponential is taken in base 2, ``exp2(log2(e) (scaling q.k - peak))`` with ``log2(e)`` folded into the
    queries' scaling: torch's CPU ``exp2`` is as accurate as its ``exp`` (both within float32 rounding of the
    float64 softmax) and about 4x faster (0.23 against 0.9 ns an element on one thread), which takes 11-14% off
    ``rms_attention`` with the values and 20-30% without (``tools/bench_rms_chunks.py --base-e``; BENCHMARKS.md,
    "Issue 28, thirty-ninth session")."""
    q, k = queries.float() * (scaling * LOG2_E), keys.float()
    rows = max(1, CHUNK_ELEMENTS // max(1, k.shape[0]))
    for start in range(0, q.shape[0], rows):
        e = torch.matmul(q[start : start + rows], k.T)  # logits in base 2
        peak = e.amax(dim=-1, keepdim=True)
        e.sub_(peak).exp2_()
        yield start, e, e.sum(dim=-1), peak[:, 0].mul_(LN_2)


def rms_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float, values: torch.Tensor | None = None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[T]`` float32: each key's root-mean-square attention probability over the queries,
    ``sqrt(mean_q softmax(scaling Q K^T)[q, t]^2)`` (``queries`` ``[n, d]``, ``keys`` ``[T, d]``): the paper code's
    ``score_method="rms"`` key selection (arXiv 2602.16284). In chunks of query rows (``CHUNK_ELEMENTS``), each
    one matrix product and one exponential, the squares summed as ``e^2^T (1 / total^2)``; 2x faster on one CPU
    thread than a fused call for the log-sum-exps followed by the explicit product (SmolLM2's shapes: 7,300 queries,
    2,072 keys). ``n = 0`` gives zeros.

    With ``values`` (``[T, dv]``) it returns ``(rms, output, lse)``: also the queries' attention over the context,
    ``context_attention``'s ``[n, dv]`` and ``[n]``, from the same exponentials (one more ``[rows, T] x [T, dv]``
    product per chunk), so a fit on these queries (``fit_head(context=...)``) need not attend over the context
    again. Raises nothing beyond torch's errors for mismatched shapes."""
    acc = torch.zeros(keys.shape[0], dtype=torch.float32, device=keys.device)
    n = queries.shape[0]
    if values is not None:
        out = torch.empty(n, values.shape[-1], dtype=torch.float32, device=keys.device)
        lse = torch.empty(n, dtype=torch.float32, device=keys.device)
        v = values.float()
    for start, e, total, peak in _softmax_chunks(queries, keys, scaling):
        if values is not None:
            stop = start + e.shape[0]
            torch.matmul(e, v, out=out[start:stop]).div_(total[:, None])
            torch.add(total.log(), peak, out=lse[start:stop])
        acc.addmv_(e.square_().T, total.square_().reciprocal_())
    rms = acc.div_(max(1, n)).sqrt_()
    return rms if values is None else (rms, out, lse)


def max_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[T]`` float32: each key's largest attention probability over the queries,
    ``max_q softmax(scaling Q K^T)[q, t]`` (``queries`` ``[n, d]``, ``keys`` ``[T, d]``): KVzip's importance score
    (arXiv 2505.23416 §3.2, Eq. 2: the maximum over the repeat pass's queries) with other queries in its place,
    the softmax over the context alone. In chunks of query rows (``CHUNK_ELEMENTS``), each one matrix product and one
    exponential. ``n = 0`` gives zeros. Raises nothing beyond torch's errors for mismatched shapes."""
    out = torch.zeros(keys.shape[0], dtype=torch.float32, device=keys.device)
    for _, e, total, _ in _softmax_chunks(queries, keys, scaling):
        torch.maximum(out, e.div_(total[:, None]).amax(dim=0), out=out)
    return out


def attention_output(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scaling Q K^T + bias) V``: ``[n, dv]`` float32 (``queries`` ``[n, d]``, ``keys`` ``[T, d]``,
    ``values`` ``[T, dv]``, ``bias`` ``[T]`` or ``None``)."""
    logits = (queries.float() @ keys.float().T) * scaling
    if bias is not None:
        logits = logits + bias.float()
    return logits.softmax(dim=-1) @ values.float()


def relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean over rows of ``||approx - reference|| / ||reference||`` (``[n, dv]`` each; rows with a zero reference
    count their absolute error)."""
    diff = (approx.float() - reference.float()).norm(dim=-1)
    return float((diff / reference.float().norm(dim=-1).clamp_min(1e-12)).mean())
