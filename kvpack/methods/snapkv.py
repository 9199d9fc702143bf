"""SnapKV: keep what an observation window attends to (Li et al., arXiv 2404.14469, §4, Listing 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..model import ModelSpec
from ..prefill import Prefill
from ..stats import AttentionRecorder
from .base import SCOPES, Method, check_choice, check_int, context_stats

__all__ = ["SnapKV"]


@dataclass
class SnapKV(Method):
    """Score each context entry by the attention the observation window pays it, pooled over neighbours.

    The observation window is the last ``window`` context tokens (query-agnostic) or, when ``question`` is given,
    that question laid out after the context (query-aware; its KV entries are not stored). ``score[l, h, j]`` is
    the window's attention to key ``j`` summed over the window's queries and averaged over the query heads of the
    GQA group of KV head ``h``, then pooled along the context with a ``kernel``-wide ``pooling`` filter
    (arXiv 2404.14469, §4, Listing 1). Without a question the window's own tokens score ``+inf`` (always kept,
    counted in the budget), as in the paper. The window's attention is recorded during the one prefill, from the
    chunk(s) holding the window's queries only.

    Parameters:
        window: observation-window tokens (official code: 64; ignored when ``question`` is given).
        kernel: pooling width in tokens, odd (official code: 5).
        pooling: ``avg`` or ``max`` (official code: ``avg``).
        question: a question to observe instead of the context's tail (default ``None``).
        budget: top-k scope, ``global``, ``layer`` or ``head`` (paper: per head; default).
    """

    name: ClassVar[str] = "snapkv"
    scopes: ClassVar[tuple[str, ...]] = SCOPES
    window: int = 64
    kernel: int = 5
    pooling: str = "avg"
    question: str | None = None
    budget: str = "head"

    def __post_init__(self):
        super().__post_init__()
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise InputError(f"{self.name}: kernel must be odd (the pooling keeps the length), got {self.kernel}")
        check_choice(self.name, "pooling", self.pooling, ("avg", "max"))
        if self.question is not None and (not isinstance(self.question, str) or not self.question.strip()):
            raise InputError(f"{self.name}: question must be a non-empty string or None, got {self.question!r}")

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
            body = sums[..., : n - w].reshape(layers * heads, 1, n - w)
            pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
            pooled = pool(body, self.kernel, stride=1, padding=self.kernel // 2)
            scores[..., : n - w] = pooled.view(layers, heads, n - w)
        return scores
