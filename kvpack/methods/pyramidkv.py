"""PyramidKV: SnapKV scores with layer budgets shrinking with depth (Cai et al., arXiv 2406.02069, §3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..prefill import Prefill
from .base import fit_budgets
from .params import PyramidKVParams
from .snapkv import SnapKV

__all__ = ["PyramidKV"]


@dataclass
class PyramidKV(PyramidKVParams, SnapKV):
    """SnapKV's scores (same parameters) with a pyramid of layer budgets: lower layers keep more.

    With ``L`` compressed layers and a total budget ``T`` (entries), the top layer gets ``k_top = T / (beta L)``,
    the bottom layer ``k_0 = 2 T / L - k_top``, and the layers between are interpolated linearly (arXiv 2406.02069,
    §3, the arithmetic budget schedule); budgets are clamped to each layer's size and rounded so that they sum
    to ``T`` exactly (``fit_budgets``). Within a layer, the budget is split per KV head (``head``, the paper) or
    taken over the layer's heads together (``layer``).

    Parameters (declared in ``kvpack.methods.params``):
        beta: steepness, >= 1; 1 gives equal layers (paper: 20).
        window, kernel, pooling, question: as for ``snapkv``.
        budget: ``layer`` or ``head`` (default).
    """

    def layer_budgets(self, prefill: Prefill | None, scores: torch.Tensor, total: int) -> torch.Tensor:
        layers, heads, n = scores.shape
        top = total / (self.beta * layers)
        bottom = 2 * total / layers - top
        depth = torch.arange(layers, dtype=torch.float64) / max(1, layers - 1)
        weights = bottom - (bottom - top) * depth
        return fit_budgets(weights, total, torch.zeros(layers, dtype=torch.int64),
                           torch.full((layers,), heads * n, dtype=torch.int64))
