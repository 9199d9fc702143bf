"""Random eviction: the floor every scoring method must beat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..prefill import Prefill
from .base import Method
from .params import RandomScoresParams

__all__ = ["RandomScores"]


@dataclass
class RandomScores(RandomScoresParams, Method):
    """Score every context entry uniformly at random (seeded: the same text gives the same pack).

    The usual baseline of KV-cache eviction studies (e.g. kvpress's ``random`` press).

    Parameters (declared in ``kvpack.methods.params``):
        seed: seed of the CPU random generator (default 0).
        budget: top-k scope, ``global``, ``layer`` or ``head`` (default ``head``).
    """

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        spec = prefill.spec
        gen = torch.Generator().manual_seed(self.seed)
        return torch.rand(len(spec.compressed_layers), spec.num_kv_heads, prefill.context_tokens, generator=gen)
