"""Attention Matching's kept entries refined by gradient descent (kvpack's, not the paper's): starting from the
closed-form fit (``am_fit``), the kept keys, their biases and their values of one KV head move together by Adam
to lower the error of the head's output over ``[sink, compacted context]`` on the reference queries.

Why: the closed form (arXiv 2602.16284 §3) keeps the selected keys as they are and fits only a scalar bias per key
and the values; the paper's own end-to-end alternative ("Cartridges", arXiv 2506.06266) trains the whole cache by
gradient through the model and costs hours. Moving the keys too, per head, on the same reference queries, costs a
few matrix products per step and gives the fit ``d`` more parameters per kept entry.

Objective, for reference queries ``Q`` ``[n, d]`` whose attention over the full context has output ``Y`` ``[n, dv]``
and log-sum-exp ``lse`` ``[n]``, and the sink's keys ``S`` ``[s, d]`` and values ``V_s`` ``[s, dv]`` (kept exact):

    full(q)    = a(q) Y(q) + (1 - a(q)) softmax(scaling q S^T) V_s,   a = sigmoid(lse - logsumexp(scaling q S^T))
    compact(q) = softmax([scaling q S^T, scaling q K^T + beta]) [V_s; V]
    loss       = sum_q ||compact(q) - full(q)||^2 / sum_q ||full(q)||^2

Keys and values move in units of their own root-mean-square (``K = K_0 + rms(K_0) dK``), beta in logits; beta is
clamped to ``+-BETA_BOUND`` (widened to hold its starting values) after each step.

Measured on SmolLM2 (BENCHMARKS.md, "Issue 28, thirty-first session"): over eight fresh 2K passages 30 steps of
1,024 queries lowered AM's continuation loss by 12% at keep 0.1 and 15% at keep 0.05, for 1.89x KVzip's build time
against AM's 1.35x; a larger step (0.02) fitted the reference queries better and continued worse at keep 0.1, and
moving beta and the values alone changed nothing.
"""

from __future__ import annotations

import torch

from .params import REFINE_LR, REFINE_MOVES

__all__ = ["REFINE_LR", "REFINE_MOVES", "BETA_BOUND", "full_output", "refine_head"]

#: beta stays within +-this after each step, or within its starting range where that is wider (the loader's bound,
#: ``kvpack.constants.MAX_ATTN_BIAS``, is 30; AM-OMP's betas start within [-27.6, 7]).
BETA_BOUND = 10.0


def full_output(queries: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, sink_keys: torch.Tensor,
                sink_values: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[n, dv]`` float32: the head's output over ``[sink, context]`` for ``queries`` ``[n, d]`` whose attention over
    the context alone is ``target`` ``[n, dv]`` with log-sum-exp ``lse`` ``[n]`` (module docstring; the split of
    attention over two blocks by their masses, as arXiv 2602.16284 §3.1 matches them), the sink's keys ``[s, d]``
    and values ``[s, dv]``, and the model's attention ``scaling``. An empty sink gives ``target``. Raises nothing
    beyond torch's errors for mismatched shapes."""
    if sink_keys.shape[0] == 0:
        return target.float()
    logits = (queries.float() @ sink_keys.float().T) * scaling
    sink_lse = logits.logsumexp(dim=-1)
    a = torch.sigmoid(lse - sink_lse)[:, None]
    return a * target.float() + (1 - a) * (logits.softmax(dim=-1) @ sink_values.float())


def refine_head(keys: torch.Tensor, beta: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                full: torch.Tensor, sink_keys: torch.Tensor, sink_values: torch.Tensor, scaling: float, steps: int,
                lr: float = REFINE_LR, batch: int = 0, seed: int = 0, beta_bound: float = BETA_BOUND,
                measure: bool = True, move: str = "keys+beta+values") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    """``steps`` Adam steps on one head's kept ``keys`` ``[t, d]``, ``beta`` ``[t]`` and ``values`` ``[t, dv]``
    (module docstring: kvpack's refinement of the closed form of arXiv 2602.16284 §3) against ``full`` ``[n, dv]``
    (``full_output``) for ``queries`` ``[n, d]``, with the sink's ``sink_keys`` ``[s, d]`` and ``sink_values``
    ``[s, dv]`` held fixed; ``lr`` in units of the keys' and values' RMS (logits for beta). ``move``
    (``REFINE_MOVES``): ``"keys"`` moves the keys alone, ``beta`` and ``values`` returned as given.

    ``batch``: each step's queries, a fresh slice of a permutation of the ``n`` (drawn from ``seed``), when ``0 <
    batch < n``; else every query each step. Returns ``(keys, beta, values, loss_before, loss_after)``: the tensors
    float32 and detached, the losses the relative squared errors over all ``n`` queries of the start and of the
    returned iterate (the best measured: with all queries each step, the best step's; with batches, the last step's
    or the start's, whichever is lower). With batches and ``measure=False`` the last step's iterate is returned
    unmeasured (both losses NaN), which saves two passes over all ``n`` queries: ``AttentionMatching`` validates it
    on other queries anyway. Raises ``ValueError`` for a ``move`` not in ``REFINE_MOVES``."""
    if move not in REFINE_MOVES:
        raise ValueError(f"refine_head: move must be one of {REFINE_MOVES}, got {move!r}")
    with torch.inference_mode(False), torch.enable_grad():
        q = queries.float().clone()
        ref = full.float().clone()
        sk, sv = sink_keys.float().clone(), sink_values.float().clone()
        k0, v0, b0 = keys.float().clone(), values.float().clone(), beta.float().clone()
        ks = k0.square().mean().sqrt().clamp_min(1e-6)
        vs = v0.square().mean().sqrt().clamp_min(1e-6)
        dk = torch.zeros_like(k0, requires_grad=True)
        every = move == "keys+beta+values"
        dv = torch.zeros_like(v0, requires_grad=every)
        b = b0.clone().requires_grad_(every)
        # beta's box: +-beta_bound, widened to hold the start (AM-OMP's clamped weights go down to log 1e-12)
        low = min(-beta_bound, float(b0.min())) if b0.numel() else -beta_bound
        high = max(beta_bound, float(b0.max())) if b0.numel() else beta_bound
        sink_logits = (q @ sk.T) * scaling  # [n, s], fixed
        opt = torch.optim.Adam([dk, dv, b] if every else [dk], lr=lr)
        n = q.shape[0]
        batched = 0 < batch < n
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if batched else None

        def loss_on(rows: torch.Tensor | None) -> torch.Tensor:
            qq, rr, sl = (q, ref, sink_logits) if rows is None else (q[rows], ref[rows], sink_logits[rows])
            logits = torch.cat([sl, (qq @ (k0 + ks * dk).T) * scaling + b], dim=1)
            out = logits.softmax(dim=-1) @ torch.cat([sv, v0 + vs * dv])
            return (out - rr).square().sum() / rr.square().sum().clamp_min(1e-12)

        def snapshot(value: float):
            return value, (k0 + ks * dk).detach().clone(), b.detach().clone(), (v0 + vs * dv).detach().clone()

        if batched and not measure:
            best = (float("nan"), k0, b0, v0)
        else:
            with torch.no_grad():
                best = snapshot(float(loss_on(None)))
        first = best[0]
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            if batched:
                at = (step * batch) % n
                rows = order[at : at + batch]
                loss = loss_on(rows)
            else:
                loss = loss_on(None)
                if step and float(loss.detach()) < best[0]:  # the iterate the last step made
                    best = snapshot(float(loss.detach()))
            loss.backward()
            opt.step()
            if every:
                with torch.no_grad():
                    b.clamp_(low, high)
        if batched and not measure:
            return *snapshot(float("nan"))[1:], first, float("nan")
        with torch.no_grad():
            last = float(loss_on(None))
        if last < best[0]:
            best = snapshot(last)
        return best[1], best[2], best[3], first, best[0]
