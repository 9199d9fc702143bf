"""The in-memory compressed cache: what ``kvpack.compress`` returns, ``kvpack.save`` writes and the reader returns.

Layout (per-head variable length, "ragged"): for every layer ``l`` the kept entries of all KV heads are stored
back to back, head 0 first; within a head they are in increasing original position. ``head_lengths[l, h]`` says
how many entries head ``h`` of layer ``l`` kept, so head ``h`` occupies rows
``offsets[h] : offsets[h] + head_lengths[l, h]`` with ``offsets = [0, cumsum(head_lengths[l])]``. A head may keep
zero entries. Keys are stored as cached, i.e. after RoPE at their original positions.

A quantized layer (``LayerEntries.quant`` set, ``kvpack.quant``) keeps the same ``positions`` and ``head_lengths``
but splits each head's rows: the sink rows and the trailing residual rows stay in ``keys``/``values`` (full
precision), the body rows in between are in ``quant`` as int8/int4 codes with their group parameters
(``QuantizedRows``: the KIVI layout of format versions 2-3, or the compact layout of versions 4 and 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["QuantizedRows", "LayerEntries", "Pack"]


@dataclass
class QuantizedRows:
    """The quantized "body" rows of one layer, in one of two layouts (``format/SPEC.md`` §5.4 and §5.6).

    Head ``h`` of the layer has ``n_h`` entries in position order: ``sink_lengths[h]`` sink rows (position below
    the pack's ``sink_tokens``), then ``body_lengths[h]`` quantized rows, then the residual rows (full precision).
    The body rows of all heads, head 0 first, give ``Q = body_lengths.sum()`` rows. Keys are quantized per channel
    over groups of ``G`` consecutive body rows of one head, values per row over groups of ``Gv = min(G,
    head_dim_v)`` channels (KIVI, arXiv 2402.02750 §3).

    ``layout == "kivi"`` (format versions 2 and 3, ``kvpack.quant``): ``body_lengths[h]`` is a multiple of ``G``
    (as many rows as fit); one code width (``qtype``'s bits); float16 scales and mins.

    ``layout == "compact"`` (format versions 4 and 5, ``kvpack.compact``): ``body_lengths[h]`` is every non-sink
    row when there are at least ``G`` of them (else 0), so a head's last key group may be shorter than ``G``; each
    head's key channels have their own code widths; scales and mins are 8-bit codes on per-layer grids.

    Attributes:
        qtype: ``"int8"`` or ``"int4"`` (``constants.QUANT_TYPES``).
        group_size: ``G``.
        sink_lengths: ``[kv_heads]`` int64 unquantized leading sink rows per head.
        body_lengths: ``[kv_heads]`` int64 quantized rows per head.
        key_codes: ``[Q, head_dim x bits / 8]`` uint8. KIVI: codes packed ``codes_per_byte`` to a byte (even channel
            in the low nibble for int4). Compact: each row a little-endian bit string of its channels' codes of
            ``key_bits`` widths (all widths equal to ``bits``: the same bytes as KIVI).
        key_scales, key_mins: KIVI: ``[Q / G, head_dim]`` float16. Compact: ``None``.
        value_codes: ``[Q, head_dim_v / codes_per_byte]`` uint8 (both layouts).
        value_scales, value_mins: KIVI: ``[Q, head_dim_v / Gv]`` float16. Compact: ``None``.
        layout: ``"kivi"`` or ``"compact"`` (``constants.QUANT_LAYOUTS``).
        key_bits: compact: ``[kv_heads, head_dim]`` uint8 code width of each head's channels, summing to
            ``bits x head_dim`` per head.
        key_params: compact: ``[2, K, head_dim]`` uint8 min and scale codes of the ``K = sum_h ceil(body_h / G)``
            key groups, head 0's first.
        value_params: compact: ``[2, Q, head_dim_v / Gv]`` uint8 min and scale codes of the value groups.
        quant_grid: compact: ``[3, head_dim + head_dim_v / Gv]`` float32: per parameter column (the key channels,
            then the value groups) the min base, the min step and the scale base.
    """

    qtype: str
    group_size: int
    sink_lengths: torch.Tensor
    body_lengths: torch.Tensor
    key_codes: torch.Tensor
    key_scales: torch.Tensor | None
    key_mins: torch.Tensor | None
    value_codes: torch.Tensor
    value_scales: torch.Tensor | None
    value_mins: torch.Tensor | None
    layout: str = "kivi"
    key_bits: torch.Tensor | None = None
    key_params: torch.Tensor | None = None
    value_params: torch.Tensor | None = None
    quant_grid: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """``Q``, the quantized rows of the layer over all heads."""
        return int(self.key_codes.shape[0])

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors a file stores for this layer's quantized rows, by part name (``constants.QUANT_PARTS`` for
        the KIVI layout, ``constants.COMPACT_PARTS`` for the compact one)."""
        from . import constants as C

        names = C.COMPACT_PARTS if self.layout == C.QUANT_LAYOUT_COMPACT else C.QUANT_PARTS
        return {name: getattr(self, name) for name in names}


@dataclass
class LayerEntries:
    """The kept KV entries of one layer.

    Attributes:
        keys: ``[entries, head_dim]`` post-RoPE keys, heads back to back in head order.
        values: ``[entries, head_dim_v]`` values, same order.
        positions: ``[entries]`` int32 original token positions (RoPE positions), increasing within a head.
        head_lengths: ``[kv_heads]`` int64 entries kept per KV head; sums to ``entries``.
        quant: ``None`` (keys and values hold all ``entries`` rows), or the quantized body rows; then ``keys`` and
            ``values`` hold only the full-precision rows (per head: sink rows, then residual rows), and
            ``dequantized()`` gives back all rows.
        biases: ``[entries]`` float32 additive attention-logit bias of each entry (Attention Matching's beta), in
            the row order of ``positions``; ``None`` means zeros. Never quantized.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    head_lengths: torch.Tensor
    quant: QuantizedRows | None = None
    biases: torch.Tensor | None = None

    def head_offsets(self) -> torch.Tensor:
        """``[kv_heads + 1]`` int64 row offsets of each head's entries (exclusive prefix sum of ``head_lengths``)."""
        return torch.cat([self.head_lengths.new_zeros(1), self.head_lengths.cumsum(0)])

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys ``[n, head_dim]``, values ``[n, head_dim_v]`` and positions ``[n]`` of KV head ``h``.

        For a quantized layer the keys and values are dequantized (float32 arithmetic, then the keys' dtype).
        """
        if self.quant is not None:
            return self.dequantized().head(h)
        off = self.head_offsets()
        s, e = int(off[h]), int(off[h + 1])
        return self.keys[s:e], self.values[s:e], self.positions[s:e]

    @property
    def num_entries(self) -> int:
        """Entries kept in this layer over all heads (quantized ones included)."""
        return int(self.positions.shape[0])

    def dequantized(self, dtype: torch.dtype | None = None) -> "LayerEntries":
        """This layer with every row in full precision (itself, cast to ``dtype`` if given, when not quantized).

        Quantized rows are dequantized as ``code x scale + min`` in float32 (``kvpack.quant``), then cast to
        ``dtype`` (default: the dtype of ``keys``).
        """
        if self.quant is None:
            if dtype is None:
                return self
            return LayerEntries(self.keys.to(dtype), self.values.to(dtype), self.positions, self.head_lengths,
                                biases=self.biases)
        from .quant import dequantize_layer

        return dequantize_layer(self, dtype)


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
