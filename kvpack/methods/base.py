"""What every compression method shares: the scoring interface, budget selection and gathering.

A method scores each cached context entry of every full-attention layer; the base keeps the top
``round(ratio x entries)`` of them (globally over layers x KV heads x positions, so budgets differ per head),
always keeps the attention sink (the chat-template prefix), and gathers the kept keys, values and positions into
a ``Pack``. Sliding-window layers of hybrid models are kept intact and are not counted in the budget.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, ClassVar

import torch

from ..pack import LayerEntries
from ..prefill import Prefill

__all__ = ["Method", "select_global", "gather"]


@dataclass
class Method:
    """Base class of compression methods. Subclasses are dataclasses whose fields are their parameters."""

    name: ClassVar[str] = ""

    def params(self) -> dict:
        """The method's parameters as stored in the pack's metadata."""
        return asdict(self)

    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        """Scores ``[compressed_layers, kv_heads, context_tokens]`` float32, higher = more worth keeping."""
        raise NotImplementedError


def select_global(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep mask ``[layers, kv_heads, tokens]`` bool of the top ``round(ratio * scores.numel())`` scores.

    Ties are broken by index (stable sort on CPU), so the selection is deterministic.
    """
    flat = scores.detach().float().cpu().reshape(-1)
    k = int(round(ratio * flat.numel()))
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    if k > 0:
        order = torch.sort(flat, descending=True, stable=True).indices[:k]
        keep[order] = True
    return keep.view(scores.shape)


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
