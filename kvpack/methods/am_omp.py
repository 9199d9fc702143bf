"""Attention Matching's OMP key selection (arXiv 2602.16284 §3.1, "AM-OMP"; the official code's
``compaction/algorithms/omp.py`` with the settings of its headline runs, ``omp_nnls0_-inf_7_drop-7_lsq_progressive``):
greedily choose the keys whose attention mass best reproduces the whole context's, refitting the weights
``w = exp(beta)`` as it goes.

For one KV head with context keys ``K`` ``[T, d]`` and reference queries ``Q`` ``[n, d]``, with the per-query shift of
``kvpack.methods.am_fit`` (``"lse"``: ``E = exp(s Q K^T - lse(s Q K^T))``, every row sums to 1, the target mass
``y = 1``; ``"max"``, the official code's: ``E = exp(s Q K^T - max)``, ``y`` the row sums):

    S = forced entries (the recent floor; kvpack's), w = clamped_least_squares(E[:, S], y)
    until |S| = t:
        r = y - E[:, S] w                     residual of every query's mass  [n]
        c = E^T r                             correlation of each key's mass column with it  [T]
        S += the k unselected, not dropped keys of highest c
        every ``interval``-th step: w = clamped_least_squares(E[:, S], y); otherwise the new keys' w start at 1e-12
        once |S| = t: w solved again; keys with beta < -7 leave S for good and the loop goes on (3 rounds at most)

``clamped_least_squares`` (``am_fit``) is the official ``_nnls_pg`` with ``nnls_iters=0``: the unconstrained
least-squares solution clamped to ``am_fit.W_RANGE`` (``[1e-12, e^7]``, so beta in ``[-27.6, 7]``). ``k`` and ``interval`` follow the official
``DEFAULT_PROGRESSIVE_SCHEDULE`` (``SCHEDULE``: one key and one solve per step for the first 300 keys, then 2 keys a
step, then 4 past 1,500, solving every other step). The fit that follows (``am_fit.fit_head(beta_solve="clamped")``)
solves ``w`` once more on the final keys, which is exactly OMP's last solve when the fit's queries are the
selection's, then the values by least squares (``c2_method="lsq"``).

kvpack solves the least squares by the normal equations in float64, the inverse of their Cholesky factor grown one
column at a time (the official code calls ``torch.linalg.lstsq`` in float32 at every solve; on CPU that costs
``O(n |S|^2)`` a solve, this ``O(n |S| + |S|^2)``); a column nearly dependent on those before it gets a ridge of
``GRAM_FLOOR`` times its own squared norm in the factor, where the official code would retry the whole solve with a
ridge.

Cost per head: ``E`` (``n x T`` float32) and the selected columns (``n x t`` float64), then per step one
``[T, n] x [n]`` product for the correlations and ``O(n |S| + |S|^2)`` for the factor and the solve.
"""

from __future__ import annotations

import math

import torch

from .am_fit import W_RANGE, context_attention

__all__ = ["SCHEDULE", "DROP_BELOW", "DROP_ROUNDS", "GRAM_FLOOR", "omp_select"]

#: ``(below this many selected keys, keys chosen per step, steps per solve)``: the official
#: ``DEFAULT_PROGRESSIVE_SCHEDULE``; the last row (``None``) applies beyond.
SCHEDULE = ((300, 1, 1), (1500, 2, 2), (None, 4, 2))
#: Selected keys whose beta falls below ``DROP_BELOW`` are dropped and replaced, ``DROP_ROUNDS`` times at most (the
#: official ``drop_key_beta_cutoff=-7`` and its refinement limit).
DROP_BELOW, DROP_ROUNDS = -7.0, 3
#: A new column's squared residual norm in the Cholesky factor is at least this share of its squared norm.
GRAM_FLOOR = 1e-12


class _Columns:
    """The selected columns ``M`` ``[n, i]`` (float64, stored as rows ``M^T``), ``M^T y`` and the inverse ``L^-1`` of
    the Cholesky factor of ``M^T M``, grown one column at a time: appending column ``c`` with ``l = L^-1 M^T c`` and
    ``d = sqrt(c.c - l.l)`` appends the row ``[-l^T L^-1 / d, 1 / d]`` to ``L^-1``, so a step costs two products with
    ``L^-1`` and none of triangular solves."""

    def __init__(self, y: torch.Tensor, capacity: int):
        n = y.shape[0]
        self.y = y.double()
        self.Mt = torch.zeros(capacity, n, dtype=torch.float64, device=y.device)
        self.Linv = torch.zeros(capacity, capacity, dtype=torch.float64, device=y.device)
        self.b = torch.zeros(capacity, dtype=torch.float64, device=y.device)
        self.i = 0

    def add(self, columns: torch.Tensor) -> None:
        """Append ``columns`` ``[n, k]`` in order (one read of the columns so far for all ``k``)."""
        C = columns.double().T.contiguous()  # [k, n]
        start = self.i
        cross = self.Mt[:start] @ C.T  # [start, k]: the new columns against the old ones
        for j in range(C.shape[0]):
            c, i = C[j], self.i
            g = torch.cat([cross[:, j], C[:j] @ c]) if j else cross[:, j]
            Linv = self.Linv[:i, :i]
            l = Linv @ g
            cc = float(c @ c)
            d = math.sqrt(max(cc - float(l @ l), GRAM_FLOOR * max(cc, 1e-300)))
            self.Mt[i], self.b[i] = c, c @ self.y
            self.Linv[i, :i] = (l @ Linv).div_(-d)
            self.Linv[i, i] = 1.0 / d
            self.i = i + 1

    def solve(self) -> torch.Tensor:
        """``[i]`` float64 ``w``: the least-squares weights of the columns so far, clamped to ``W_RANGE``."""
        Linv = self.Linv[: self.i, : self.i]
        w = (Linv @ self.b[: self.i]) @ Linv
        return w.nan_to_num_(W_RANGE[0]).clamp_(*W_RANGE)

    def mass(self, w: torch.Tensor) -> torch.Tensor:
        return w @ self.Mt[: self.i]


def _schedule(selected: int) -> tuple[int, int]:
    for below, k, interval in SCHEDULE:
        if below is None or selected < below:
            return k, interval
    return SCHEDULE[-1][1], SCHEDULE[-1][2]


def _exp_scores(keys: torch.Tensor, queries: torch.Tensor, scaling: float, shift: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = queries.float(), keys.float()
    logits = torch.matmul(q, k.T).mul_(scaling)
    if shift == "lse":
        _, lse = context_attention(q, k, k, scaling)
        E = logits.sub_(lse[:, None]).exp_()
        return E, torch.ones(E.shape[0], dtype=E.dtype, device=E.device)
    E = logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()  # "max" (omp_select checked the shift)
    return E, E.sum(dim=1)


def omp_select(keys: torch.Tensor, queries: torch.Tensor, scaling: float, t: int,
               forced: torch.Tensor | None = None, shift: str = "lse") -> torch.Tensor:
    """The context entries OMP keeps in one head (module docstring).

    Args:
        keys: ``[T, d]`` float32 context keys (post-RoPE; the sink left out).
        queries: ``[n, d]`` float32 reference queries, ``n >= 1``.
        scaling: the model's attention scaling.
        t: entries to keep, ``0 <= t <= T``.
        forced: ``[f]`` int64 indices kept whatever the scores and never dropped (``f <= t``; the recent floor), or
            ``None``.
        shift: the per-query shift, ``"lse"`` (kvpack's default) or ``"max"`` (the official code's).

    Returns:
        ``[t']`` int64 indices into ``keys``, increasing: ``t' = t`` unless dropping keys left fewer than ``t``
        candidates (then every key not dropped). Raises ``ValueError`` if ``t``, ``forced`` or ``shift`` is out of
        range.
    """
    T = keys.shape[0]
    forced = torch.zeros(0, dtype=torch.int64) if forced is None else forced.to(torch.int64).cpu().unique()
    if not 0 <= t <= T or len(forced) > t or (len(forced) and (int(forced.min()) < 0 or int(forced.max()) >= T)):
        raise ValueError(f"omp_select: t={t} and {len(forced)} forced entries for {T} keys")
    if shift not in ("lse", "max"):
        raise ValueError(f"omp_select: shift must be 'lse' or 'max', got {shift!r}")
    if t == T:
        return torch.arange(T)
    if t == 0:
        return torch.zeros(0, dtype=torch.int64)
    E, y = _exp_scores(keys, queries, scaling, shift)
    device = E.device
    selected = torch.zeros(T, dtype=torch.bool, device=device)
    dropped = torch.zeros(T, dtype=torch.bool, device=device)
    is_forced = torch.zeros(T, dtype=torch.bool, device=device)
    is_forced[forced.to(device)] = True

    def start(indices: list[int]) -> tuple[_Columns, torch.Tensor]:
        cols = _Columns(y, t)
        if indices:
            cols.add(E[:, indices])
        return cols, (cols.solve() if indices else torch.zeros(0, dtype=torch.float64, device=device))

    order = forced.tolist()  # the selected keys in the order their columns were added
    selected[forced.to(device)] = True
    cols, w = start(order)
    step, rounds, fresh, current = 0, 0, True, None  # fresh: no solve since the key set was (re)started
    while True:
        if len(order) < t:
            if current is None:
                current = cols.mass(w)
            residual = (y.double() - current).float()
            corr = E.T @ residual
            corr.masked_fill_(selected | dropped, float("-inf"))
            k, interval = _schedule(len(order))
            k = min(k, t - len(order), int((~(selected | dropped)).sum()))
            if k == 0:
                break  # every key left was dropped: keep what there is
            new = torch.topk(corr, k).indices.tolist()
            cols.add(E[:, new])
            order += new
            selected[new] = True
            if fresh or step % interval == 0:
                w, fresh, current = cols.solve(), False, None
            else:  # the official lazy solve: the new keys start at the lower bound (their mass, 1e-12 x a
                w = torch.cat([w, w.new_full((len(new),), W_RANGE[0])])  # column, is left out of the residual)
            step += 1
            continue
        if rounds >= DROP_ROUNDS:
            break
        rounds += 1
        beta = cols.solve().log()
        drop = [j for j, b in zip(order, beta.tolist()) if b < DROP_BELOW and not bool(is_forced[j])]
        if not drop:
            break
        dropped[drop] = True
        selected[drop] = False
        gone = set(drop)
        order = [j for j in order if j not in gone]
        cols, w = start(order)
        step, fresh, current = step + 1, True, None
    return selected.nonzero().squeeze(1).cpu()
