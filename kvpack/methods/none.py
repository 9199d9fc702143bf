"""No compression: the full cache, stored in the same format (the reference every method is compared to)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..prefill import Prefill
from .base import Method
from .params import NoCompressionParams

__all__ = ["NoCompression"]


@dataclass
class NoCompression(NoCompressionParams, Method):
    """Keep every entry, whatever ratio is asked: the pack records ratio 1.0. No parameters."""

    def kept_ratio(self, ratio: float) -> float:
        return 1.0

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        spec = prefill.spec
        return torch.ones(len(spec.compressed_layers), spec.num_kv_heads, prefill.context_tokens)
