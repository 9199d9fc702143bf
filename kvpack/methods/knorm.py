"""Key norm: keep the entries whose keys have the smallest L2 norm (Devoto et al., arXiv 2406.11430)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..prefill import Prefill
from .base import Method
from .params import KNormParams

__all__ = ["KNorm"]


@dataclass
class KNorm(KNormParams, Method):
    """Score each context entry by minus the L2 norm of its key: low-norm keys draw high attention
    (arXiv 2406.11430, the key-norm / attention correlation). ``score[l, h, j] = -||k_{l,h,j}||_2``; RoPE rotates
    keys, so pre- and post-RoPE norms agree. No attention is needed: the build costs a plain prefill.

    Parameters (declared in ``kvpack.methods.params``):
        budget: top-k scope, ``global``, ``layer`` or ``head`` (paper: per head; default).
    """

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        return torch.stack([-prefill.keys[l][:, prefill.sink :].float().norm(dim=-1)
                            for l in prefill.spec.compressed_layers])
