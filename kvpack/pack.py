"""The in-memory compressed cache: what ``kvpack.compress`` returns, ``kvpack.save`` writes and the reader returns.

Layout (per-head variable length, "ragged"): for every layer ``l`` the kept entries of all KV heads are stored
back to back, head 0 first; within a head they are in increasing original position. ``head_lengths[l, h]`` says
how many entries head ``h`` of layer ``l`` kept, so head ``h`` occupies rows
``offsets[h] : offsets[h] + head_lengths[l, h]`` with ``offsets = [0, cumsum(head_lengths[l])]``. A head may keep
zero entries. Keys are stored as cached, i.e. after RoPE at their original positions.

A quantized layer (``LayerEntries.quant`` set) keeps the same ``positions`` and ``head_lengths`` but splits each
head's rows: the sink rows (and the rows of a head too short to fill a group) stay in ``keys``/``values`` (full
precision), the body rows are in ``quant`` as int8/int4 codes with their group parameters (``QuantizedRows``, the
compact layout of ``format/SPEC.md`` §5.4; the codec is ``kvpack.compact``). ``LayerEntries.dequantized`` (and
``dequantize_bodies`` for several layers at once) gives the rows back in full precision.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import constants as C
from .compact import dequantize_compact_layers

__all__ = ["QuantizedRows", "LayerEntries", "Pack", "head_row_pieces", "DequantizedBodies", "dequantize_bodies",
           "dequantize_layer"]


@dataclass
class QuantizedRows:
    """The quantized "body" rows of one layer in the compact layout (``format/SPEC.md`` §5.4, ``kvpack.compact``).

    Head ``h`` of the layer has ``n_h`` entries in position order: ``sink_lengths[h]`` sink rows (position below
    the pack's ``sink_tokens``), then ``body_lengths[h]`` quantized rows: every non-sink row when there are at
    least ``G`` of them, else 0 (the head then stays in full precision). The body rows of all heads, head 0 first,
    give ``Q = body_lengths.sum()`` rows. Keys are quantized per channel over groups of ``G`` consecutive body rows
    of one head (a head's last group may be shorter), values per row over groups of ``Gv = min(G, head_dim_v)``
    channels (KIVI's grouping, arXiv 2402.02750 §3).

    Attributes:
        qtype: ``"int8"`` or ``"int4"`` (``constants.QUANT_TYPES``).
        group_size: ``G``.
        sink_lengths: ``[kv_heads]`` int64 unquantized leading sink rows per head.
        body_lengths: ``[kv_heads]`` int64 quantized rows per head.
        key_codes: ``[Q, head_dim x bits / 8]`` uint8, each row a little-endian bit string of its channels' codes of
            ``key_bits`` widths.
        value_codes: ``[Q, head_dim_v x bits / 8]`` uint8 (int4: even channel in the low nibble).
        key_bits: ``[kv_heads, head_dim]`` uint8 code width of each head's channels, summing to ``bits x head_dim``.
        key_params: ``[2, K, head_dim]`` uint8 min and scale codes of the ``K = sum_h ceil(body_h / G)`` key groups.
        value_params: ``[2, Q, head_dim_v / Gv]`` uint8 min and scale codes of the value groups.
        quant_grid: ``[3, head_dim + head_dim_v / Gv]`` float32: per parameter column (the key channels, then the
            value groups) the min base, the min step and the scale base.
    """

    qtype: str
    group_size: int
    sink_lengths: torch.Tensor
    body_lengths: torch.Tensor
    key_codes: torch.Tensor
    value_codes: torch.Tensor
    key_bits: torch.Tensor
    key_params: torch.Tensor
    value_params: torch.Tensor
    quant_grid: torch.Tensor

    #: The one quantized layout (kept so that callers can name it).
    layout = C.QUANT_LAYOUT_COMPACT

    @property
    def rows(self) -> int:
        """``Q``, the quantized rows of the layer over all heads."""
        return int(self.key_codes.shape[0])

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors a file stores for this layer's quantized rows, by part name (``constants.COMPACT_PARTS``)."""
        return {name: getattr(self, name) for name in C.COMPACT_PARTS}


@dataclass
class LayerEntries:
    """The kept KV entries of one layer.

    Attributes:
        keys: ``[entries, head_dim]`` post-RoPE keys, heads back to back in head order.
        values: ``[entries, head_dim_v]`` values, same order.
        positions: ``[entries]`` int32 original token positions (RoPE positions), increasing within a head.
        head_lengths: ``[kv_heads]`` int64 entries kept per KV head; sums to ``entries``.
        quant: ``None`` (keys and values hold all ``entries`` rows), or the quantized body rows; then ``keys`` and
            ``values`` hold only the full-precision rows (per head: its sink rows, or all its rows if it has fewer
            than ``G`` non-sink rows), and ``dequantized()`` gives back all rows.
        biases: ``None`` (all zero), or ``[entries]`` float32: the additive attention-logit bias beta of each kept
            entry (Attention Matching, arXiv 2602.16284), in the row order of ``positions``; added to the logit
            ``q . k / sqrt(d)`` of the entry. Never quantized; finite, within ``[-MAX_ATTN_BIAS, MAX_ATTN_BIAS]``.
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

        Quantized rows are dequantized as ``code x scale + min`` in float32 (``kvpack.compact``), then cast to
        ``dtype`` (default: the dtype of ``keys``). ``biases`` are kept.
        """
        if self.quant is None:
            if dtype is None:
                return self
            return LayerEntries(self.keys.to(dtype), self.values.to(dtype), self.positions, self.head_lengths,
                                biases=self.biases)
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

    def with_kv_dtype(self, dtype: torch.dtype) -> "Pack":
        """This pack with its full-precision keys and values (``LayerEntries.keys``/``values``) cast to ``dtype``,
        the dtype a file stores them in.

        Quantized rows (codes and their group parameters), positions, Attention Matching's float32 biases and the
        metadata (whose fingerprint records the dtype the model computed in) are kept as they are. Returns ``self``
        when nothing changes; ``self`` is never modified.
        """
        if all(layer.keys.dtype == dtype and layer.values.dtype == dtype for layer in self.layers):
            return self
        layers = [LayerEntries(l.keys.to(dtype), l.values.to(dtype), l.positions, l.head_lengths, l.quant, l.biases)
                  for l in self.layers]
        return Pack(self.token_ids, layers, self.sink_tokens, self.metadata)


def head_row_pieces(entries: LayerEntries, dtype: torch.dtype | None = None,
                    bodies: tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None = None
                    ) -> tuple[list[int], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each head's keys and values in full precision, as lists of row blocks to concatenate (no copy yet).

    For an unquantized layer head ``h`` is one block of ``keys`` / ``values``. For a quantized one it is up to three
    blocks in position order: its sink rows (full precision), its body rows (dequantized, float32) and, in a head
    too short to quantize, its other rows (full precision). Blocks are cast to ``dtype`` (default:
    the dtype of ``entries.keys``); empty blocks are left out. ``bodies``: the layer's body rows already
    dequantized, ``(keys, values, key_starts, value_starts)`` with head ``h``'s body rows at rows ``key_starts[h]``
    and ``value_starts[h]`` onwards (``dequantize_bodies``, with the layer's rows of its starts as lists);
    dequantized here when ``None``.

    Returns:
        ``(lengths, key_blocks, value_blocks)``: ``lengths[h]`` rows of head ``h`` (Python ints, ``kv_heads`` of
        them); ``key_blocks[h]`` views ``[rows, head_dim]`` and ``value_blocks[h]`` views ``[rows, head_dim_v]``
        whose row counts add up to ``lengths[h]``. The views may share memory with ``entries``.
    """
    dt = dtype or entries.keys.dtype
    keys, values = entries.keys.to(dt), entries.values.to(dt)
    lengths = entries.head_lengths.tolist()
    qr = entries.quant
    if qr is None:
        key_blocks, value_blocks, start = [], [], 0
        for n in lengths:
            key_blocks.append([keys[start : start + n]] if n else [])
            value_blocks.append([values[start : start + n]] if n else [])
            start += n
        return lengths, key_blocks, value_blocks
    if bodies is None:
        body_keys, body_values, key_starts, value_starts = dequantize_bodies([qr])
        key_starts, value_starts = key_starts[0].tolist(), value_starts[0].tolist()
    else:
        body_keys, body_values, key_starts, value_starts = bodies
    body_keys, body_values = body_keys.to(dt), body_values.to(dt)
    key_blocks, value_blocks = [], []
    fp = 0  # next full-precision row
    for n, s, b, kq, vq in zip(lengths, qr.sink_lengths.tolist(), qr.body_lengths.tolist(), key_starts, value_starts):
        r = n - s - b
        # (first row, rows) of the sink, body and residual blocks of this head, in their sources
        key_blocks.append([x[a : a + m] for x, a, m in ((keys, fp, s), (body_keys, kq, b), (keys, fp + s, r)) if m])
        value_blocks.append([x[a : a + m] for x, a, m in ((values, fp, s), (body_values, vq, b), (values, fp + s, r))
                             if m])
        fp += s + r
    return lengths, key_blocks, value_blocks


class DequantizedBodies(NamedTuple):
    """The body rows of several quantized layers in full precision (``dequantize_bodies``; KIVI's grouping,
    arXiv 2402.02750 §3, in the compact layout).

    ``keys`` float32 ``[key rows, head_dim]`` and ``values`` float32 ``[value rows, head_dim_v]``; the body rows of
    head ``h`` of layer ``l`` are rows ``key_starts[l, h]`` (of ``keys``) and ``value_starts[l, h]`` (of ``values``)
    onwards, ``body_lengths[h]`` of them, in order (``key_starts``, ``value_starts``: int64 ``[layers, kv_heads]``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_starts: torch.Tensor
    value_starts: torch.Tensor


def dequantize_bodies(quants: list[QuantizedRows]) -> DequantizedBodies:
    """The body rows of several layers dequantized together (``compact.dequantize_compact_layers``: the key rows are
    padded so that each key group is ``G`` aligned rows; no errors raised beyond torch's for mismatched shapes).

    Args:
        quants: the layers' ``QuantizedRows``, all with the same ``qtype``, ``group_size`` and head sizes (each layer
            uses its own grids and widths).
    """
    body = [b for q in quants for b in q.body_lengths.tolist()]
    back_to_back = torch.tensor(list(itertools.accumulate([0] + body[:-1])), dtype=torch.int64).view(len(quants), -1)
    keys, values, key_starts = dequantize_compact_layers(quants)
    return DequantizedBodies(keys, values, key_starts, back_to_back)


def dequantize_layer(entries: LayerEntries, dtype: torch.dtype | None = None) -> LayerEntries:
    """All rows of a quantized layer in full precision (``LayerEntries.dequantized`` calls this).

    Body rows are dequantized in float32 (``dequantize_bodies``) and cast to ``dtype`` (default: the dtype of
    ``entries.keys``); full-precision rows are copied. Returns an unquantized ``LayerEntries`` with the same
    positions, head lengths and biases: keys ``[entries, head_dim]``, values ``[entries, head_dim_v]``.
    """
    if entries.quant is None:
        return entries.dequantized(dtype)
    dt = dtype or entries.keys.dtype
    _, key_blocks, value_blocks = head_row_pieces(entries, dt)
    keys = [block for blocks in key_blocks for block in blocks]
    values = [block for blocks in value_blocks for block in blocks]
    n = entries.num_entries
    keys = torch.cat(keys) if keys else torch.empty(n, entries.keys.shape[1], dtype=dt)
    values = torch.cat(values) if values else torch.empty(n, entries.values.shape[1], dtype=dt)
    return LayerEntries(keys, values, entries.positions, entries.head_lengths, biases=entries.biases)
