"""D2O, Dynamic Discriminative Operations: layer-adaptive budgets, then evict and merge (Wan et al.,
arXiv 2406.13035, ICLR 2025, §3: layer-level allocation and token-level eviction with similarity-based merging),
applied once at prefill time ("prompt encoding"); the file stores the result."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..model import ModelSpec
from ..pack import LayerEntries
from ..prefill import Prefill
from ..stats import AttentionRecorder
from .base import Method, context_stats, fit_budgets, top_k_rows
from .params import D2OParams

__all__ = ["D2O", "layer_variance", "ema_thresholds", "merge_evicted", "merge_plan", "merge_rows",
           "nearest_kept"]

#: Entries of one block of evicted x kept cosine similarities (64 MB of float32).
SIM_BLOCK_ELEMENTS = 16 * 2**20
#: Kept entries per column group of the two-stage argmax in ``nearest_kept``.
ARGMAX_GROUP = 64
#: Evicted tokens per step of the blocked EMA scan.
EMA_BLOCK = 256


@dataclass
class D2O(D2OParams, Method):
    """Layer budgets from attention density, then per KV head: sinks + recent window + heavy hitters, and the
    evicted entries merged into their most similar kept entry.

    Layer level: ``F_l`` is the variance, over the context's key positions, of the column sums of layer ``l``'s
    prefill attention (the attention each key receives), per query head; the per-head variances are min-max
    normalised jointly over all compressed layers and query heads, then averaged over the layer's query heads
    (``layer_variance``). Layer ``l`` gets ``S_l = softmax(-F)_l x T`` of the ``T = round(ratio x entries)``
    entries (``alpha_l = softmax(-F)_l L rho`` of a layer's ``S`` entries), clamped to
    ``[kv_heads x min(context, sink + 1), layer size]`` and redistributed so the layers sum to ``T`` exactly.

    Token level, per KV head, with the head's share of ``S_l`` (even split, +-1): the first ``sink`` context tokens
    (after the chat-template prefix, which kvpack always keeps on top), the most recent
    ``M = round(recent_ratio x (budget - sinks))`` tokens, and the ``N = rest`` tokens with the highest cumulative
    attention (column sums, averaged over the query heads of the GQA group); ``N:M = 3:1`` by default.

    Merge (``merge="keys+values"``, the paper's): each evicted entry's key is compared by cosine similarity with
    the kept context keys of its head (the template prefix is never a merge target, so the attention sink stays as
    prefilled); its nearest kept entry is its candidate and ``s`` the similarity. Taking the evicted entries in
    position order, the threshold starts at ``tau_0 = mean(s)`` and follows ``tau_t = beta s_t + (1 - beta)
    tau_{t-1}``; entry ``t`` is merged when ``s_t >= tau_{t-1}`` and dropped otherwise (``ema_thresholds``). A kept entry ``c`` with
    merged entries ``E_c`` becomes ``(e k_c + sum_{E_c} exp(s_i) k_i) / (e + sum_{E_c} exp(s_i))``, values alike,
    at ``c``'s position (``merge_evicted``). ``merge="values"`` chooses the same merged entries and weights but
    averages only the values, leaving every kept key as prefilled; ``merge="off"`` is D2O's eviction alone.

    In a compress-once tool the selection is query-blind: the cumulative attention is the context's own prefill
    attention, whereas the paper's long-context settings prefilled a prompt that ended with the question. And the
    keys are merged after RoPE, across positions that can lie far apart, so a merged key no longer matches its
    position; ``kvpack bench`` measures the three modes side by side (README, method table).

    Cumulative attention and column sums are recorded chunk by chunk during the one prefill (``kvpack.stats``).

    Parameters (declared in ``kvpack.methods.params``):
        sink: attention-sink tokens at the start of the context kept in every head (paper: 4).
        recent_ratio: share ``M / (N + M)`` of the recent window in a head's non-sink budget (paper: 1/4).
        merge: ``"keys+values"`` (default, the paper's), ``"values"`` or ``"off"`` (see above); ``True`` and
            ``False`` are read as ``"keys+values"`` and ``"off"``.
        beta: EMA weight of the merge threshold, in [0, 1] (paper: 0.7).
    """

    fixed_scope: ClassVar[str] = "head"

    def recorder(self, spec: ModelSpec, tokens: int, device) -> AttentionRecorder:
        return AttentionRecorder(spec, tokens, column_sums=True, device=device)

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        return context_stats(prefill, "column_sums")

    def layer_budgets(self, prefill: Prefill | None, scores: torch.Tensor, total: int) -> torch.Tensor:
        layers, heads, n = scores.shape
        weights = torch.softmax(-layer_variance(prefill.stats.column_sums, prefill.sink), dim=0)
        low = min(heads * min(n, self.sink + 1), total // layers)
        return fit_budgets(weights, total, torch.full((layers,), low, dtype=torch.int64),
                           torch.full((layers,), heads * n, dtype=torch.int64))

    def select_heads(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        layers, heads, n = scores.shape
        pos = torch.arange(n)
        sinks = budgets.clamp(max=min(self.sink, n))  # [layers, heads]
        recent = torch.round((budgets - sinks).double() * self.recent_ratio).long()
        forced = (pos < sinks[..., None]) | (pos >= n - recent[..., None])  # disjoint: sinks + recent <= n
        heavy = top_k_rows(scores.masked_fill(forced, float("-inf")).reshape(layers * heads, n),
                           (budgets - sinks - recent).reshape(-1)).view(layers, heads, n)
        return forced | heavy

    def update_entries(self, prefill: Prefill, keep: torch.Tensor, layers: list[LayerEntries]) -> dict:
        if self.merge == "off":
            return {}
        merged = dropped = 0
        sink = prefill.sink
        for i, l in enumerate(prefill.spec.compressed_layers):
            entries = layers[l]
            offsets = entries.head_offsets().tolist()
            keys = prefill.keys[l][:, sink:].float().cpu()  # [kv_heads, context, d]
            values = prefill.values[l][:, sink:].float().cpu()
            for h in range(keys.shape[0]):
                kept, evicted = keep[i, h].nonzero().squeeze(1), (~keep[i, h]).nonzero().squeeze(1)
                if len(kept) == 0 or len(evicted) == 0:
                    dropped += len(evicted)
                    continue
                was_merged, target, weight = merge_plan(keys[h, kept], keys[h, evicted], self.beta)
                rows = slice(offsets[h] + sink, offsets[h] + sink + len(kept))
                if self.merge == "keys+values":
                    new_k = merge_rows(keys[h, kept], keys[h, evicted[was_merged]], target, weight)
                    entries.keys[rows] = new_k.to(entries.keys.dtype)
                new_v = merge_rows(values[h, kept], values[h, evicted[was_merged]], target, weight)
                entries.values[rows] = new_v.to(entries.values.dtype)
                merged += int(was_merged.sum())
                dropped += len(evicted) - int(was_merged.sum())
        return {"mode": self.merge, "merged": merged, "dropped": dropped}


def layer_variance(column_sums: list[torch.Tensor], sink: int) -> torch.Tensor:
    """D2O's layer density ``F``: ``[layers]`` float64 in [0, 1] (arXiv 2406.13035, §3, layer level).

    Args:
        column_sums: per compressed layer ``[heads, tokens]``, the attention each key received (query heads).
        sink: template-prefix tokens, left out (kvpack always keeps them).

    The variance over the context's key positions (population variance) is taken per (layer, query head),
    min-max normalised jointly over all layers and heads (all equal: zeros), and averaged over each layer's heads.
    """
    var = torch.stack([c[:, sink:].double().var(dim=-1, unbiased=False) for c in column_sums])  # [layers, heads]
    span = var.max() - var.min()
    norm = (var - var.min()) / span if span > 0 else torch.zeros_like(var)
    return norm.mean(dim=1)


def ema_thresholds(sims: torch.Tensor, beta: float) -> torch.Tensor:
    """The merge threshold each evicted entry meets, in order: ``[e]`` float64.

    ``out[t] = tau_{t-1}`` with ``tau_0 = mean(sims)`` (``tau`` before entry ``t``, 0-based: ``out[0] = tau_0``)
    and ``tau_t = beta * sims[t] + (1 - beta) * tau_{t-1}`` (arXiv 2406.13035, §3, token level, the EMA
    threshold). Computed in blocks of ``EMA_BLOCK`` entries as one matrix product each:
    ``out[s + t] = (1 - beta)^t tau_s + sum_{j < t} beta (1 - beta)^(t-1-j) sims[s + j]``.
    """
    s = sims.double().reshape(-1)
    out = torch.empty_like(s)
    if s.numel() == 0:
        return out
    b = min(EMA_BLOCK, s.numel())
    weights, carry = _ema_weights(float(beta), b)
    tau = s.mean()
    for start in range(0, s.numel(), b):
        block = s[start : start + b]
        m = block.numel()
        out[start : start + m] = carry[:m] * tau + weights[:m, :m] @ block
        tau = beta * block[-1] + (1.0 - beta) * out[start + m - 1]
    return out


@functools.lru_cache(maxsize=8)
def _ema_weights(beta: float, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ema_thresholds``' block matrices, float64: ``weights[t, j] = beta (1 - beta)^(t-1-j)`` for ``j < t``
    (else 0), ``[b, b]``, and ``carry[t] = (1 - beta)^t``, ``[b]``. Cached: the same for every head. Callers
    must not modify them."""
    t = torch.arange(b, dtype=torch.float64)
    lag = t[:, None] - 1 - t[None, :]  # t - 1 - j
    keep_rate = torch.tensor(1.0 - beta, dtype=torch.float64)
    weights = torch.where(lag >= 0, beta * keep_rate.pow(lag.clamp_min(0)), torch.zeros((), dtype=torch.float64))
    return weights, keep_rate.pow(t)


def nearest_kept(evicted_keys: torch.Tensor, kept_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each evicted key's most similar kept key by cosine similarity (D2O's merge candidate, arXiv 2406.13035,
    §3, token level).

    Args:
        evicted_keys: ``[e, head_dim]`` float32; kept_keys: ``[m, head_dim]`` float32, ``m >= 1``.

    Returns:
        ``(sims, nearest)``: ``[e]`` float32, the highest cosine similarity of each evicted key, and ``[e]``
        int64, the first kept index reaching it (ties go to the lower index).

    The similarities are one ``[e, m]`` product per block of evicted keys (``SIM_BLOCK_ELEMENTS``). The argmax is
    taken in two stages, because ``max`` with indices over a long row is several times slower than ``amax``: the
    row's columns are cut into groups of ``ARGMAX_GROUP``, the first group holding the row maximum is found from
    the groups' maxima, and the index is taken within that group (so the first index overall still wins ties).
    No errors beyond torch's for mismatched head sizes.
    """
    kept_n = torch.nn.functional.normalize(kept_keys, dim=-1)
    ev_n = torch.nn.functional.normalize(evicted_keys, dim=-1)
    e, m = ev_n.shape[0], kept_n.shape[0]
    sims = torch.empty(e)
    nearest = torch.empty(e, dtype=torch.int64)
    kept_t = kept_n.T.contiguous()
    block = max(1, SIM_BLOCK_ELEMENTS // max(1, m))
    for s in range(0, e, block):
        sims[s : s + block], nearest[s : s + block] = _row_argmax(ev_n[s : s + block] @ kept_t)
    return sims, nearest


def _row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=1)`` of a ``[rows, cols]`` float32 matrix (values, first index of the maximum), in two stages
    (see ``nearest_kept``)."""
    rows, cols = x.shape
    g = ARGMAX_GROUP
    whole = cols // g * g
    if whole == 0:
        best = x.max(dim=1)
        return best.values, best.indices
    grouped = x[:, :whole].view(rows, whole // g, g)
    group_idx = grouped.amax(dim=2).max(dim=1).indices  # the first group holding the row maximum
    inside = grouped.gather(1, group_idx.view(rows, 1, 1).expand(rows, 1, g)).squeeze(1).max(dim=1)
    values, indices = inside.values, group_idx * g + inside.indices
    if whole < cols:  # the last, partial group: it wins only when strictly greater (it comes last)
        rest = x[:, whole:].max(dim=1)
        better = rest.values > values
        values = torch.where(better, rest.values, values)
        indices = torch.where(better, rest.indices + whole, indices)
    return values, indices


def merge_evicted(kept_keys: torch.Tensor, kept_values: torch.Tensor, evicted_keys: torch.Tensor,
                  evicted_values: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge evicted entries of one KV head into their nearest kept entry (arXiv 2406.13035, §3, token level).

    Args:
        kept_keys, kept_values: ``[m, head_dim]`` float32, ``m >= 1``, the kept entries.
        evicted_keys, evicted_values: ``[e, head_dim]`` float32, the evicted entries in position order.
        beta: EMA weight of the threshold (see ``ema_thresholds``).

    Returns:
        ``(keys, values, merged)``: the kept entries after merging, ``[m, head_dim]`` each, and ``[e]`` bool,
        which evicted entries were merged (the others are dropped). Kept entry ``c`` becomes
        ``(e k_c + sum_i exp(s_i) k_i) / (e + sum_i exp(s_i))`` over the merged entries ``i`` whose nearest kept
        entry (cosine similarity ``s_i``, the highest; ties to the first) is ``c``.
    """
    merged, target, w = merge_plan(kept_keys, evicted_keys, beta)
    keys = merge_rows(kept_keys, evicted_keys[merged], target, w)
    values = merge_rows(kept_values, evicted_values[merged], target, w)
    return keys, values, merged


def merge_plan(kept_keys: torch.Tensor, evicted_keys: torch.Tensor, beta: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which evicted entries D2O merges, where, and with what weight (arXiv 2406.13035, §3, token level).

    Args:
        kept_keys: ``[m, head_dim]`` float32, ``m >= 1``; evicted_keys: ``[e, head_dim]`` float32 in position order.
        beta: EMA weight of the threshold (``ema_thresholds``).

    Returns:
        ``(merged, target, weight)``: ``[e]`` bool, the evicted entries whose similarity meets the threshold;
        ``[e']`` int64, the nearest kept entry of each merged one (``nearest_kept``); ``[e']`` float32, its weight
        ``exp(s_i)`` (``e' = merged.sum()``).
    """
    sims, nearest = nearest_kept(evicted_keys, kept_keys)
    merged = sims.double() >= ema_thresholds(sims, beta)
    return merged, nearest[merged], sims[merged].exp()


def merge_rows(kept: torch.Tensor, merged: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """D2O's weighted merge of rows: kept row ``c`` becomes ``(e x_c + sum_i w_i x_i) / (e + sum_i w_i)`` over the
    merged rows ``i`` with ``target[i] = c`` (arXiv 2406.13035, §3). ``kept``: ``[m, dim]`` float32; ``merged``:
    ``[e', dim]``; ``target``, ``weight``: ``[e']`` from ``merge_plan``. Returns ``[m, dim]`` float32."""
    den = torch.full((kept.shape[0],), math.e).index_add_(0, target, weight)
    return (math.e * kept).index_add_(0, target, weight[:, None] * merged) / den[:, None]
