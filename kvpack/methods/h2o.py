"""H2O, Heavy-Hitter Oracle: keep the entries that received the most prefill attention (Zhang et al.,
arXiv 2306.14048, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..model import ModelSpec
from ..prefill import Prefill
from ..stats import AttentionRecorder
from .base import Method, context_stats
from .params import H2OParams

__all__ = ["H2O"]


@dataclass
class H2O(H2OParams, Method):
    """Score each context entry by the attention it accumulated during the prefill, per visible query.

    ``score[l, h, j] = (sum over queries i of p[i, j]) / (tokens - pos_j)``: the column sum of layer ``l``'s
    prefill attention (arXiv 2306.14048, Algorithm 1: the accumulated attention of heavy hitters), divided by the number
    of queries that can see key ``j`` under the causal mask, so early tokens are not favoured just for being
    seen more often. The query heads of a GQA group are averaged. Recorded chunk by chunk during the one prefill
    (``kvpack.stats``). The paper's recent-token half is not added (see ``streaming`` for recency).

    Parameters (declared in ``kvpack.methods.params``):
        budget: top-k scope, ``global`` (non-uniform heads), ``layer`` or ``head`` (paper: per head; default).
    """

    def recorder(self, spec: ModelSpec, tokens: int, device) -> AttentionRecorder:
        return AttentionRecorder(spec, tokens, column_sums=True, device=device)

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        sums = context_stats(prefill, "column_sums")  # [layers, kv_heads, context]
        seen_by = prefill.tokens - torch.arange(prefill.sink, prefill.tokens, device=sums.device)
        return sums / seen_by.float()
