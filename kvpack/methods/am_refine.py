"""Attention Matching's kept entries refined by gradient descent (kvpack's, not the paper's): starting from the
closed-form fit (``am_fit``), the kept keys of one KV head (``move="keys"``), or its keys, biases and values
together (``"keys+beta+values"``), move by Adam to lower the error of the head's output over ``[sink, compacted
context]`` on the reference queries.

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
clamped to ``+-BETA_BOUND`` (widened to hold its starting values) after each step. The gradients are written out
(softmax's Jacobian-vector product, ``_loss_and_grads``) and Adam is applied by hand (``_Adam``): the same iterates
as autograd with ``torch.optim.Adam``, in a quarter of the time for the keys alone.

Measured on SmolLM2 (BENCHMARKS.md, "Issue 28, thirty-first session" and "thirty-fourth session"): moving all three
(step 0.005, 1,024 queries a step) lowered AM's continuation loss by 12-15%; the biases and values start at their
least-squares optimum for the kept keys, and moving them with the keys made the first steps worse. Moving the keys
alone (step 0.01, 512 queries a step, the method's defaults) lowered it by 20-30% at keep 0.1 and 17-38% at keep
0.05 on eight fresh passages.
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
    every = move == "keys+beta+values"
    q, ref = queries.float(), full.float()
    sk, sv = sink_keys.float(), sink_values.float()
    k0, v0, b0 = keys.float(), values.float(), beta.float()
    s = sk.shape[0]
    ks = float(k0.square().mean().sqrt().clamp_min(1e-6)) if k0.numel() else 1.0
    vs = float(v0.square().mean().sqrt().clamp_min(1e-6)) if v0.numel() else 1.0
    k, b, v = k0.clone(), b0.clone(), v0.clone()
    # beta's box: +-beta_bound, widened to hold the start (AM-OMP's clamped weights go down to log 1e-12)
    low = min(-beta_bound, float(b0.min())) if b0.numel() else -beta_bound
    high = max(beta_bound, float(b0.max())) if b0.numel() else beta_bound
    sink_logits = (q @ sk.T) * scaling  # [n, s], fixed
    n = q.shape[0]
    batched = 0 < batch < n
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if batched else None
    adam = _Adam(lr, 3 if every else 1)

    def measured(kk, bb, vv) -> float:
        return float(_loss_and_grads(q, ref, sink_logits, kk, bb, torch.cat([sv, vv]), s, scaling, False)[0])

    best = (float("nan"), k0, b0, v0) if batched and not measure else (measured(k, b, v), k0, b0, v0)
    first = best[0]
    all_values = torch.cat([sv, v])  # [s + t, dv]: fixed unless the values move
    for step in range(steps):
        rows = order[(step * batch) % n:(step * batch) % n + batch] if batched else None
        qq, rr, sl = (q, ref, sink_logits) if rows is None else (q[rows], ref[rows], sink_logits[rows])
        loss, gk, gb, gv = _loss_and_grads(qq, rr, sl, k, b, all_values, s, scaling, every)
        if not batched and step and float(loss) < best[0]:  # the iterate the last step made
            best = (float(loss), k.clone(), b.clone(), v.clone())
        # Adam on the moves in units of the start's RMS (keys, values) and in logits (beta, kept in its box)
        k = k0 + ks * adam.step(0, gk * ks)
        if every:
            v = v0 + vs * adam.step(1, gv * vs)
            b = b0 + adam.step(2, gb, low - b0, high - b0)
            all_values = torch.cat([sv, v])
        adam.tick()
    if batched and not measure:
        return k, b, v, first, float("nan")
    last = measured(k, b, v)
    if last < best[0]:
        best = (last, k, b, v)
    return best[1], best[2], best[3], first, best[0]


class _Adam:
    """Adam (Kingma and Ba, arXiv 1412.6980; ``torch.optim.Adam``'s defaults: betas 0.9 and 0.999, eps 1e-8) on
    ``count`` moves that start at zero: ``step(i, grad, low, high)`` returns move ``i`` after one update from
    ``grad`` (of the move's own shape), clamped to ``[low, high]`` (tensors of its shape) when given; ``tick()``
    ends the step. No autograd: ``refine_head`` gives the gradients itself."""

    def __init__(self, lr: float, count: int):
        self.lr, self.t = lr, 1
        self.moved: list = [None] * count
        self.m: list = [None] * count
        self.v: list = [None] * count

    def step(self, i: int, grad: torch.Tensor, low: torch.Tensor | None = None,
             high: torch.Tensor | None = None) -> torch.Tensor:
        if self.m[i] is None:
            self.m[i], self.v[i], self.moved[i] = (torch.zeros_like(grad) for _ in range(3))
        self.m[i].mul_(0.9).add_(grad, alpha=0.1)
        self.v[i].mul_(0.999).addcmul_(grad, grad, value=0.001)
        denom = (self.v[i] / (1 - 0.999 ** self.t)).sqrt_().add_(1e-8)
        self.moved[i] = self.moved[i].addcdiv(self.m[i], denom, value=-self.lr / (1 - 0.9 ** self.t))
        if low is not None:
            self.moved[i].clamp_(low, high)
        return self.moved[i]

    def tick(self) -> None:
        self.t += 1


def _loss_and_grads(q: torch.Tensor, ref: torch.Tensor, sink_logits: torch.Tensor, keys: torch.Tensor,
                    beta: torch.Tensor, values: torch.Tensor, sink: int, scaling: float, every: bool):
    """The objective (module docstring) on queries ``q`` ``[m, d]`` with targets ``ref`` ``[m, dv]`` and the sink's
    fixed logits ``sink_logits`` ``[m, s]``, for kept ``keys`` ``[t, d]`` and ``beta`` ``[t]`` and ``values``
    ``[s + t, dv]`` (the sink's first), and its gradients by hand (softmax's Jacobian-vector product): ``(loss,
    d/dkeys [t, d], d/dbeta [t], d/dvalues [t, dv])``, the last two ``None`` unless ``every``. Checked against
    autograd in ``tests/test_am_refine.py``; by hand it is 2-4x faster than autograd at these sizes."""
    logits = torch.cat([sink_logits, torch.addmm(beta, q, keys.T, alpha=scaling)], dim=1)
    p = logits.softmax(dim=-1)  # [m, s + t]
    diff = p @ values - ref
    z = ref.square().sum().clamp_min(1e-12)
    loss = diff.square().sum() / z
    g_out = diff.mul_(2 / z)  # d loss / d output
    g_p = g_out @ values.T
    g_logits = g_p.sub_((g_p * p).sum(dim=-1, keepdim=True)).mul_(p)[:, sink:]  # [m, t]
    g_keys = (g_logits.T @ q).mul_(scaling)
    if not every:
        return loss, g_keys, None, None
    return loss, g_keys, g_logits.sum(dim=0), p[:, sink:].T @ g_out
