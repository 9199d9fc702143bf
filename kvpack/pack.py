"""The in-memory compressed cache: what ``kvpack.compress`` returns, ``kvpack.save`` writes and the reader returns.

Layout (per-head variable length, "ragged"): for every layer ``l`` the kept entries of all KV heads are stored
back to back, head 0 first; within a head they are in increasing original position. ``head_lengths[l, h]`` says
how many entries head ``h`` of layer ``l`` kept, so head ``h`` occupies rows
``offsets[h] : offsets[h] + head_lengths[l, h]`` with ``offsets = [0, cumsum(head_lengths[l])]``. A head may keep
zero entries. Keys are stored as cached, i.e. after RoPE at their original positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerEntries", "Pack"]


@dataclass
class LayerEntries:
    """The kept KV entries of one layer.

    Attributes:
        keys: ``[entries, head_dim]`` post-RoPE keys, heads back to back in head order.
        values: ``[entries, head_dim_v]`` values, same order.
        positions: ``[entries]`` int32 original token positions (RoPE positions), increasing within a head.
        head_lengths: ``[kv_heads]`` int64 entries kept per KV head; sums to ``entries``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    head_lengths: torch.Tensor

    def head_offsets(self) -> torch.Tensor:
        """``[kv_heads + 1]`` int64 row offsets of each head's entries (exclusive prefix sum of ``head_lengths``)."""
        return torch.cat([self.head_lengths.new_zeros(1), self.head_lengths.cumsum(0)])

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``[n, head_dim]``, values ``[n, head_dim_v]`` and positions ``[n]`` of KV head ``h``."""
        off = self.head_offsets()
        s, e = int(off[h]), int(off[h + 1])
        return self.keys[s:e], self.values[s:e], self.positions[s:e]

    @property
    def num_entries(self) -> int:
        """Entries kept in this layer over all heads."""
        return int(self.keys.shape[0])


@dataclass
class Pack:
    """A compressed KV cache of one context, ready to be saved or loaded into a model.

    Attributes:
        token_ids: ``[tokens]`` int64 ids of the whole cached sequence (chat-template prefix + context). Its length
            is the original length; generation continues at RoPE position ``len(token_ids)``.
        layers: one ``LayerEntries`` per model layer.
        sink_tokens: number of leading tokens (the template prefix, the attention sink) kept in every head of
            every compressed layer and never scored.
        metadata: JSON-serialisable description: ``method``, ``method_params``, ``ratio``, ``fingerprint`` (the
            model's, see ``kvpack.fingerprint``), ``source`` (name and SHA-256 of the text), ``layout`` (how to
            phrase a question after the context), ``layer_kinds`` (``"compressed"`` or ``"sliding_intact"`` per
            layer), ``kvpack_version``, ``stats``.
    """

    token_ids: torch.Tensor
    layers: list[LayerEntries]
    sink_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def original_tokens(self) -> int:
        """Length of the cached sequence before compression, in tokens (prefix included)."""
        return int(self.token_ids.shape[0])

    @property
    def kv_heads(self) -> int:
        """Number of KV heads per layer."""
        return int(self.layers[0].head_lengths.shape[0])

    def head_lengths(self) -> torch.Tensor:
        """``[layers, kv_heads]`` int64 entries kept per (layer, KV head)."""
        return torch.stack([layer.head_lengths for layer in self.layers])

    def kept_entries(self) -> int:
        """Entries kept over all layers and heads (sink entries included)."""
        return sum(layer.num_entries for layer in self.layers)
