"""What every compression method shares: parameters, budgets, top-k selection, gathering, and the merge hook.

A method is a small dataclass whose fields are its parameters (declared once in ``kvpack.methods.params``, which
the command line, ``--methods`` specs and ``kvpack ls`` read without importing torch); it writes only how it scores (``score``) and, where
its paper says so, how it splits the budget (``layer_budgets``, ``select_heads``) or changes the kept entries
(``update_entries``, D2O's merge). ``kvpack.compress`` drives every method the same way::

    recorder = method.recorder(spec, tokens, device)          # prefill attention statistics, or None
    full = prefill(..., recorder=recorder, observed_ids=method.observed_ids(tokenizer, layout))
    scores = method.score(model, tokenizer, full)             # [compressed_layers, kv_heads, context_tokens]
    keep = method.select(scores, ratio, full)                 # exactly round(ratio x entries) entries
    layers = gather(full, keep)                               # sink + kept entries per head, in position order
    merged = method.update_entries(full, keep, layers)        # D2O: merge evicted entries into kept ones

The budget is ``round(ratio x entries)`` context entries over all compressed layers x KV heads x context tokens.
``select`` picks the top scores within a scope:

    global  one top-k over everything (heads and layers get non-uniform budgets; KVzip, arXiv 2505.23416 §3.3);
            a method with a ``max_head_ratio`` below 1 caps each head at that share of its own entries
            (``kvpack.methods.budgets.capped_top_k``)
    layer   per-layer budgets (``layer_budgets``, else an even split), top-k over each layer's heads x tokens
    head    the layer budget split evenly over its KV heads (+-1 for rounding), top-k within each head

The attention sink (the chat-template prefix) is kept in every head of compressed layers and is not counted;
sliding-window layers of hybrid models are kept intact and are not counted either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..model import ModelSpec
from ..pack import LayerEntries
from ..prefill import Prefill
from ..stats import AttentionRecorder
from .budgets import capped_top_k, fit_budgets, split_evenly, top_k_rows
from .params import SCOPES, MethodParams

__all__ = ["Method", "SCOPES", "select_global", "top_k_rows", "split_evenly", "fit_budgets", "gather",
           "context_stats"]


@dataclass
class Method(MethodParams):
    """Base class of compression methods. A method inherits its parameters (dataclass fields, ``name`` and
    ``scopes``) from its class in ``kvpack.methods.params`` and writes how it scores.

    Class attributes:
        fixed_scope: the scope of a method without a ``budget`` field.
        stats_key: the key of ``update_entries``' statistics in the pack's ``metadata["stats"]``.
    """

    fixed_scope: ClassVar[str] = "global"
    stats_key: ClassVar[str] = "merge"

    @property
    def scope(self) -> str:
        """The top-k scope ``select`` uses: the ``budget`` parameter, or ``fixed_scope``."""
        return getattr(self, "budget", self.fixed_scope) if self.scopes else self.fixed_scope

    def kept_ratio(self, ratio: float) -> float:
        """The ratio actually kept (``none`` keeps everything, whatever is asked)."""
        return ratio

    def recorder(self, spec: ModelSpec, tokens: int, device) -> AttentionRecorder | None:
        """The prefill attention statistics ``score`` needs (``kvpack.stats``), or ``None`` (the default)."""
        return None

    def observed_ids(self, tokenizer, layout) -> list[int]:
        """Tokens fed after the context only for the recorder to see their attention (SnapKV's question)."""
        return []

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        """Scores ``[compressed_layers, kv_heads, context_tokens]`` float32, higher = more worth keeping."""
        raise NotImplementedError

    def layer_budgets(self, prefill: Prefill | None, scores: torch.Tensor, total: int) -> torch.Tensor | None:
        """``[compressed_layers]`` int64 context entries per layer summing to ``total``, or ``None`` (default:
        the scope decides: global top-k, or an even split)."""
        return None

    def select_heads(self, scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """Keep mask ``[layers, kv_heads, tokens]`` bool with ``budgets[l, h]`` (``[layers, kv_heads]`` int64)
        entries in head ``(l, h)``; default: the top scores of each head."""
        layers, heads, n = scores.shape
        return top_k_rows(scores.reshape(layers * heads, n), budgets.reshape(-1)).view(layers, heads, n)

    def select(self, scores: torch.Tensor, ratio: float, prefill: Prefill | None = None) -> torch.Tensor:
        """Keep mask ``[layers, kv_heads, tokens]`` bool with exactly ``round(ratio * scores.numel())`` entries.

        Args:
            scores: ``[compressed_layers, kv_heads, context_tokens]`` from ``score``.
            ratio: fraction kept, in (0, 1].
            prefill: passed to ``layer_budgets`` (D2O reads its attention statistics).

        Ties are broken by index (stable sort), so the selection is deterministic.
        """
        scores = scores.detach().float().cpu().nan_to_num(nan=float("-inf"))
        layers, heads, n = scores.shape
        total = int(round(ratio * scores.numel()))
        per_layer = self.layer_budgets(prefill, scores, total)
        scope = self.scope
        if per_layer is None:
            if scope == "global":
                cap = float(getattr(self, "max_head_ratio", 1.0))
                if cap >= 1.0:
                    return select_global(scores, ratio)
                return capped_top_k(scores, total, cap)
            per_layer = split_evenly(total, layers)
        elif scope == "global":
            raise RuntimeError(f"{self.name}: layer budgets need the 'layer' or 'head' scope")
        if scope == "layer":
            return top_k_rows(scores.reshape(layers, heads * n), per_layer).view(layers, heads, n)
        per_head = torch.stack([split_evenly(int(b), heads) for b in per_layer])
        return self.select_heads(scores, per_head)

    def update_entries(self, prefill: Prefill, keep: torch.Tensor, layers: list[LayerEntries]) -> dict:
        """Change the gathered entries in place after selection (D2O's merge); returns statistics for the
        pack's metadata (``{}``: nothing changed, the default)."""
        return {}


# ---------------------------------------------------------------------------------------------------------------
def select_global(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep mask ``[layers, kv_heads, tokens]`` bool of the top ``round(ratio * scores.numel())`` scores.

    Ties are broken by index (stable sort on CPU), so the selection is deterministic.
    """
    flat = scores.detach().float().cpu().reshape(1, -1)
    return top_k_rows(flat, torch.tensor([int(round(ratio * flat.numel()))])).view(scores.shape)


# ---------------------------------------------------------------------------------------------------------------
# statistics and gathering


def context_stats(prefill: Prefill, which: str) -> torch.Tensor:
    """A recorded attention statistic of the context keys, per KV head: ``[compressed_layers, kv_heads,
    context_tokens]`` float32 on the prefill's device.

    ``which``: ``"column_sums"`` or ``"window_sums"`` (``kvpack.stats.AttentionRecorder``). The query heads of a
    GQA group are averaged. Raises ``RuntimeError`` if the prefill did not record it.
    """
    sums = getattr(prefill.stats, which, None)
    if sums is None:
        raise RuntimeError(f"the prefill did not record {which}; the method's recorder() must ask for it")
    kv_heads = prefill.spec.num_kv_heads
    return torch.stack([s.view(kv_heads, -1, s.shape[-1]).mean(dim=1)[:, prefill.sink :] for s in sums])


def gather(prefill: Prefill, keep: torch.Tensor) -> list[LayerEntries]:
    """Per-layer kept entries: the sink plus the context positions ``keep`` marks, in position order.

    ``keep``: ``[compressed_layers, kv_heads, context_tokens]`` bool, in the order of
    ``prefill.spec.compressed_layers``. Sliding layers are copied whole.
    """
    layers = []
    compressed = {l: i for i, l in enumerate(prefill.spec.compressed_layers)}
    sink = torch.arange(prefill.sink)
    for l, (k, v, pos) in enumerate(zip(prefill.keys, prefill.values, prefill.positions)):
        k, v, pos = k.cpu(), v.cpu(), pos.cpu()
        if l not in compressed:
            heads = k.shape[0]
            layers.append(LayerEntries(
                keys=k.reshape(-1, k.shape[-1]).clone(), values=v.reshape(-1, v.shape[-1]).clone(),
                positions=pos.to(torch.int32).repeat(heads),
                head_lengths=torch.full((heads,), k.shape[1], dtype=torch.int64)))
            continue
        rows_k, rows_v, rows_p, lengths = [], [], [], []
        for h in range(k.shape[0]):
            idx = torch.cat([sink, prefill.sink + keep[compressed[l], h].nonzero().squeeze(1)])
            rows_k.append(k[h, idx])
            rows_v.append(v[h, idx])
            rows_p.append(idx.to(torch.int32))
            lengths.append(len(idx))
        layers.append(LayerEntries(torch.cat(rows_k), torch.cat(rows_v), torch.cat(rows_p),
                                   torch.tensor(lengths, dtype=torch.int64)))
    return layers
