"""SnapKV: keep what an observation window attends to (Li et al., arXiv 2404.14469, §4, Listing 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..model import ModelSpec
from ..prefill import Prefill
from ..stats import AttentionRecorder
from .base import Method, context_stats
from .budgets import pool_context
from .params import SnapKVParams

__all__ = ["SnapKV"]


@dataclass
class SnapKV(SnapKVParams, Method):
    """Score each context entry by the attention the observation window pays it, pooled over neighbours.

    The observation window is the last ``window`` context tokens (query-agnostic) or, when ``question`` is given,
    that question laid out after the context (query-aware; its KV entries are not stored). ``score[l, h, j]`` is
    the window's attention to key ``j`` summed over the window's queries and averaged over the query heads of the
    GQA group of KV head ``h``, then pooled along the context with a ``kernel``-wide ``pooling`` filter
    (arXiv 2404.14469, §4, Listing 1). Without a question the window's own tokens score ``+inf`` (always kept,
    counted in the budget), as in the paper. The window's attention is recorded during the one prefill, from the
    chunk(s) holding the window's queries only.

    Parameters (declared in ``kvpack.methods.params``):
        window: observation-window tokens (official code: 64; ignored when ``question`` is given).
        kernel: pooling width in tokens, odd (official code: 5).
        pooling: ``avg`` or ``max`` (official code: ``avg``).
        question: a question to observe instead of the context's tail (default ``None``).
        budget: top-k scope, ``global``, ``layer`` or ``head`` (paper: per head; default).
    """

    def recorder(self, spec: ModelSpec, tokens: int, device) -> AttentionRecorder:
        start = tokens if self.question is not None else max(0, tokens - self.window)
        return AttentionRecorder(spec, tokens, window_start=start, device=device)

    def observed_ids(self, tokenizer, layout) -> list[int]:
        return layout.question_ids(tokenizer, self.question) if self.question is not None else []

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        sums = context_stats(prefill, "window_sums")  # [layers, kv_heads, context]
        layers, heads, n = sums.shape
        w = 0 if self.question is not None else min(self.window, n)
        scores = torch.full_like(sums, float("inf"))
        if n > w:
            scores[..., : n - w] = pool_context(sums[..., : n - w], self.kernel, self.pooling)
        return scores
