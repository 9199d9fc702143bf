"""Per-head budgets: how a keep ratio is split over (compressed layer, KV head) pairs, and which entries each head
keeps (Attention Matching's ``budgets``, ``max_head_ratio`` and ``recent``; the cap also serves KVzip and SnapKV).

Every function takes scores ``[layers, kv_heads, n]`` float32 (higher = more worth keeping; ``n`` context tokens, the
sink left out) and a ``total`` of context entries to keep, ``0 <= total <= layers x kv_heads x n``, and returns a
keep mask ``[layers, kv_heads, n]`` bool with exactly ``total`` entries. Ties go to the lower index (stable sorts),
so every split is deterministic.

    global          one top-k over every entry (KVzip, arXiv 2505.23416 §3.3): heads get very uneven budgets
    global-capped   the same with no head above ``cap x n`` entries: each head's candidates are its top ``cap x n``
                    entries, and the global top-k is taken over the candidates, so the surplus of a capped head goes
                    to the other heads' next-best entries by score (the paper's ``--max-ratio-per-head 0.75``,
                    arXiv 2602.16284 §4; the official code's ``apply_max_ratio_cap`` redistributes a precomputed
                    schedule's proportions by water-filling; here the scores decide)
    uniform         the same budget in every head (+-1 for rounding), top-k within each head (the official code's
                    default when no schedule is given)
    schedule        budgets proportional to a per-(layer, KV head) fraction file (``kvpack.schedule``), each
                    capped at ``cap x n`` (``fit_budgets``: the surplus is redistributed in proportion to the
                    fractions, as ``apply_max_ratio_cap``), top-k within each head

``head_floor`` (not in the AM or KVzip papers; with ``global`` and ``global-capped``): every head first keeps its
top ``floor x total / heads`` entries, a share of the even split, and the global top-k then splits the rest. It is
Ada-KV's safeguard (arXiv 2407.11550; ``alpha = 0.2`` in its official scripts' ``--floor_alpha`` and in kvpress's
``AdaKVPress.alpha_safeguard``), with two differences: Ada-KV splits each layer's budget over that layer's heads,
where this floor sits under KVzip's top-k over every layer's heads at once, and here a head's recent tokens count
in its floor. KVzip's
global top-k sends most of a small budget to a few broad heads (on SmolLM2 at keep 0.05, two of thirty layers held
39% of it) and leaves most heads their recent tokens alone; those are where the continuation loss was
(BENCHMARKS.md, "Issue 28, thirty-second session").

The cap is raised to ``ceil(total / heads)`` entries when ``total`` would not fit under it (a keep ratio above the
cap). ``protect_recent`` marks the last ``recent`` tokens of every head ``+inf``, so every split keeps them first
(counted in the head's budget; a head whose budget holds fewer keeps the earliest of them, ties going to the lower
index).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["split_evenly", "fit_budgets", "top_k_rows", "cap_entries", "floor_entries", "capped_top_k",
           "uniform_split", "scheduled_split", "split", "protect_recent", "pool_context"]


def split_evenly(total: int, parts: int) -> torch.Tensor:
    """``[parts]`` int64 summing to ``total``: ``total // parts`` each, the first ``total % parts`` one more."""
    out = torch.full((parts,), total // parts, dtype=torch.int64)
    out[: total % parts] += 1
    return out


def fit_budgets(weights: torch.Tensor, total: int, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Integer budgets proportional to ``weights``, clamped to ``[low, high]``, summing to ``total`` exactly.

    The continuous solution is ``x_l = clamp(c * w_l, low_l, high_l)`` with ``c`` found by bisection so that
    ``sum x = total`` (what a layer loses to its clamp is redistributed to the others in proportion to their
    weights); it is then rounded down and the remainder handed out by largest fractional part.

    Args:
        weights: ``[n]`` non-negative (all zero: equal weights).
        total: the budget; ``low.sum() <= total <= high.sum()``.
        low, high: ``[n]`` int64 bounds, ``low <= high``.

    Returns:
        ``[n]`` int64, ``low <= out <= high``, ``out.sum() == total``.

    Raises:
        ValueError: the bounds cannot hold ``total``.
    """
    w = weights.detach().double().cpu().clamp_min(0).numpy()
    lo, hi = low.cpu().double().numpy(), high.cpu().double().numpy()
    if not (lo.sum() <= total <= hi.sum()) or bool((lo > hi).any()):
        raise ValueError(f"budgets in [{low.tolist()}, {high.tolist()}] cannot sum to {total}")
    if not bool((w > 0).any()):
        w = np.ones_like(w)
    pos = w > 0  # zero weights stay at their low bound whatever c: the bound comes from the others
    a, b = 0.0, float((hi[pos] / w[pos]).max()) + 1.0
    for _ in range(200):  # sum(clamp(c * w)) is non-decreasing in c
        c = (a + b) / 2
        if c in (a, b):  # the interval is down to adjacent floats
            break
        if float(np.clip(c * w, lo, hi).sum()) < total:
            a = c
        else:
            b = c
    x = np.clip(b * w, lo, hi)
    out = np.clip(np.floor(x), lo, hi).astype(np.int64)
    order = np.argsort(np.floor(x) - x, kind="stable")  # largest fractional part first, ties by index
    while int(out.sum()) != total:
        step = 1 if int(out.sum()) < total else -1
        for i in order if step > 0 else order[::-1]:
            if int(out.sum()) == total:
                break
            if (step > 0 and out[i] < hi[i]) or (step < 0 and out[i] > lo[i]):
                out[i] += step
    return torch.from_numpy(out)


def top_k_rows(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` bool marking the ``k[r]`` highest scores of each row ``r`` (``scores``: ``[rows, n]``,
    ``k``: ``[rows]`` int64, ``0 <= k <= n``). Ties go to the lower index (stable sort)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    ranked = torch.arange(scores.shape[1])[None, :] < k.reshape(-1, 1)
    return torch.zeros(scores.shape, dtype=torch.bool).scatter_(1, order, ranked)


def cap_entries(cap: float, n: int, total: int, heads: int) -> int:
    """Most context entries one head may keep: ``floor(cap x n)``, raised to ``ceil(total / heads)`` when the cap
    cannot hold ``total``, at most ``n``. ``cap`` in (0, 1]; ``heads >= 1``."""
    return min(n, max(int(math.floor(cap * n + 1e-9)), -(-total // heads)))


def floor_entries(floor: float, n: int, total: int, heads: int) -> int:
    """Context entries every head keeps before the global top-k: ``floor(floor x total / heads)`` (a share of the
    even split), at most ``n`` and at most ``total // heads`` (so the floors always fit in ``total``). ``floor`` in
    [0, 1]; ``heads >= 1``."""
    return min(n, total // heads, int(math.floor(floor * total / heads + 1e-9)))


def capped_top_k(scores: torch.Tensor, total: int, cap: float = 1.0, floor: float = 0.0) -> torch.Tensor:
    """Global top-``total`` with no head above ``cap_entries(cap, ...)`` entries (module docstring,
    ``global-capped``; ``cap=1`` is the plain global top-k) and, with ``floor > 0``, every head's top
    ``floor_entries(floor, ...)`` entries kept first (``head_floor``, module docstring)."""
    scores = scores.detach().float().cpu()
    layers, heads, n = scores.shape
    flat = scores.reshape(layers * heads, n)
    limit = cap_entries(cap, n, total, layers * heads)
    low = floor_entries(floor, n, total, layers * heads)  # 0 without a floor
    if limit < n:  # only each head's top ``limit`` entries can be chosen
        candidates = top_k_rows(flat, torch.full((layers * heads,), limit, dtype=torch.int64))
    order = torch.sort(flat.reshape(-1), descending=True, stable=True).indices
    if limit < n:  # candidates first, each part by score
        cand = candidates.reshape(-1)[order]
        order = torch.cat([order[cand], order[~cand]])
    if low > 0:  # every head's floor first (low <= min(n, total // heads) <= limit), then the rest
        floors = top_k_rows(flat, torch.full((layers * heads,), low, dtype=torch.int64)).reshape(-1)[order]
        order = torch.cat([order[floors], order[~floors]])
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order[:total]] = True
    return keep.view(layers, heads, n)


def uniform_split(scores: torch.Tensor, total: int) -> torch.Tensor:
    """``total`` split evenly over every (layer, KV head) (the first ``total % heads`` one more), top-k within each
    head (module docstring, ``uniform``)."""
    layers, heads, n = scores.shape
    budgets = split_evenly(total, layers * heads).clamp_max(n)
    short = total - int(budgets.sum())  # only when total > heads x n: impossible for total <= numel
    if short:
        raise ValueError(f"uniform_split: {total} entries do not fit in {layers * heads} heads of {n}")
    return top_k_rows(scores.detach().float().cpu().reshape(layers * heads, n), budgets).view(layers, heads, n)


def scheduled_split(scores: torch.Tensor, total: int, fractions: torch.Tensor, cap: float = 1.0) -> torch.Tensor:
    """Budgets proportional to ``fractions`` ``[layers, kv_heads]`` (non-negative; all zero: equal), each at most
    ``cap_entries(cap, ...)``, summing to ``total`` (``base.fit_budgets``), top-k within each head (module
    docstring, ``schedule``). Raises ``ValueError`` if ``fractions`` has another shape."""
    layers, heads, n = scores.shape
    if tuple(fractions.shape) != (layers, heads):
        raise ValueError(f"scheduled_split: fractions of shape {list(fractions.shape)} for {layers} layers x "
                         f"{heads} KV heads")
    limit = cap_entries(cap, n, total, layers * heads)
    budgets = fit_budgets(fractions.reshape(-1), total, torch.zeros(layers * heads, dtype=torch.int64),
                          torch.full((layers * heads,), limit, dtype=torch.int64))
    return top_k_rows(scores.detach().float().cpu().reshape(layers * heads, n), budgets).view(layers, heads, n)


def split(scores: torch.Tensor, total: int, budgets: str, cap: float = 1.0,
          fractions: torch.Tensor | None = None, floor: float = 0.0) -> torch.Tensor:
    """The keep mask of split ``budgets`` (``global``, ``global-capped``, ``uniform``, ``schedule``; module
    docstring). ``cap`` applies to ``global-capped`` and ``schedule``; ``fractions`` is the schedule's; ``floor``
    (``head_floor``) to ``global`` and ``global-capped``. Raises ``ValueError`` for another split or a schedule
    without fractions."""
    if budgets == "global":
        return capped_top_k(scores, total, 1.0, floor)
    if budgets == "global-capped":
        return capped_top_k(scores, total, cap, floor)
    if budgets == "uniform":
        return uniform_split(scores, total)
    if budgets == "schedule":
        if fractions is None:
            raise ValueError("split: budgets='schedule' needs the schedule's fractions")
        return scheduled_split(scores, total, fractions, cap)
    raise ValueError(f"split: unknown budgets {budgets!r}")


def pool_context(scores: torch.Tensor, width: int, kind: str = "max") -> torch.Tensor:
    """``scores`` (``[layers, kv_heads, n]`` float) pooled along the context within each head: each entry replaced
    by the largest (``kind="max"``) or the mean (``"avg"``, zero padding counted, as torch's ``avg_pool1d``) of the
    scores within ``width // 2`` positions of it, stride 1, the length kept (``width`` odd; 1: ``scores`` as given).
    Keeping the top entries of max-pooled scores keeps a high-scoring entry's neighbours with it, so a short span is
    kept whole or not at all (SnapKV's pooling, arXiv 2404.14469 §4, Listing 1; its code offers max beside avg).
    With ``"max"``, ``-inf`` stays ``-inf`` only where every neighbour's is. Raises ``ValueError`` for another
    ``kind``."""
    if width <= 1:
        return scores
    if kind not in ("max", "avg"):
        raise ValueError(f"pool_context: kind must be 'max' or 'avg', got {kind!r}")
    layers, heads, n = scores.shape
    pool = torch.nn.functional.max_pool1d if kind == "max" else torch.nn.functional.avg_pool1d
    return pool(scores.reshape(layers * heads, 1, n), width, stride=1, padding=width // 2).view(layers, heads, n)


def protect_recent(scores: torch.Tensor, recent: int) -> torch.Tensor:
    """``scores`` (``[layers, kv_heads, n]``) with the last ``min(recent, n)`` tokens of every head set to ``+inf``
    (a copy; ``recent = 0``: the scores as given)."""
    if recent <= 0:
        return scores
    out = scores.detach().float().cpu().clone()
    out[..., max(0, out.shape[-1] - recent):] = float("inf")
    return out
