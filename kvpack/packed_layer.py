"""One layer of the loaded cache: each KV head's kept entries packed back to back, plus the tail of new tokens.

A ``PackedLayer`` stores its kept entries exactly as the pack does (``kvpack.pack``): the rows of all KV heads back
to back, head 0 first, ``kept_keys`` ``[entries, head_dim]`` and ``kept_values`` ``[entries, head_dim_v]``, with
``offsets`` ``[kv_heads + 1]`` (head ``h`` owns rows ``offsets[h] : offsets[h + 1]``), the entries' original RoPE
positions ``[entries]`` and, when the pack has them, per-entry attention-logit biases ``[entries]`` (Attention
Matching's beta, arXiv 2602.16284). Nothing is padded: the layer's tensors total its kept entries plus the tail, and
a head with zero entries costs nothing. New tokens are appended after them (the "tail", ``keys`` / ``values``
``[1, kv_heads, tail, head_dim]``, the tensors transformers sees) at logical positions ``original_length,
original_length + 1, ...``.

``lay_out`` turns a pack's ``LayerEntries`` (dequantizing quantized rows) into the tensors of such layers.

Floors: this module knows the rows, not how they are attended (``kvpack.varlen`` reads a layer's rows, and
``kvpack.attention`` calls it); ``kvpack.compact_cache`` specialises the layer for codes kept as stored, and
``kvpack.cache`` assembles layers into a ``transformers.Cache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .errors import InputError
from .pack import LayerEntries
from .quant import dequantize_bodies, head_row_pieces

__all__ = ["PackedLayer", "lay_out", "lay_out_group"]


class PackedLayer(CacheLayerMixin):
    """One layer of a ``KvpackCache``: per-head packed kept entries plus the tail of new tokens.

    Args:
        keys: ``[entries, head_dim]`` kept keys (post-RoPE), heads back to back in head order.
        values: ``[entries, head_dim_v]`` kept values, same order.
        positions: ``[entries]`` int64 original RoPE positions, increasing within a head.
        head_lengths: ``kv_heads`` entries per head (a list of ints or an int tensor), summing to ``entries``.
        original_length: tokens in the original context (the logical length before any new token).
        sliding: whether this is a sliding-window layer kept intact (informational; the window itself comes from
            the model's attention call).
        biases: ``[entries]`` float32 additive attention-logit biases (Attention Matching's beta), or ``None``
            (zeros). New tokens have none.

    Attributes:
        kept_keys, kept_values, kept_positions, biases: the tensors above, on the cache's device.
        offsets: ``[kv_heads + 1]`` int64 row offsets of the heads (on the cache's device); ``head_lengths``: the
            same as a Python list.
        keys, values: ``[1, kv_heads, tail, head_dim(_v)]`` the tail (question and generated tokens).
        kept: the longest head's entries (every head's when ``dense``).
        dense: every head holds the same number of entries (the rows are then a ``[kv_heads, kept, d]`` view).
        scores: ``[kv_heads, kept]`` float32 buffer set while KVzip scores (``kvpack.methods.kvzip``); ``None``
            otherwise.

    Raises ``InputError`` if the head lengths do not sum to the rows of ``keys``, ``values`` and ``positions`` (or
    of ``biases``).
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, head_lengths,
                 original_length: int, sliding: bool = False, biases: torch.Tensor | None = None):
        super().__init__()
        lengths = [int(n) for n in (head_lengths.tolist() if torch.is_tensor(head_lengths) else head_lengths)]
        n = sum(lengths)
        if not lengths or min(lengths) < 0 or any(t is not None and t.shape[0] != n
                                                  for t in (keys, values, positions, biases)):
            raise InputError(f"a cache layer's rows ({keys.shape[0]} keys, {values.shape[0]} values, "
                             f"{positions.shape[0]} positions) do not match its head lengths {lengths}; build the "
                             "pack again with kvpack.compress or load it from a file")
        # a pack straight from kvpack.compress holds inference-mode tensors, which a forward pass with autograd on
        # may not save: those rows are copied once into ordinary tensors
        keys, values, positions, biases = (t.clone() if t is not None and t.is_inference() and
                                           not torch.is_inference_mode_enabled() else t
                                           for t in (keys, values, positions, biases))
        self.kept_keys, self.kept_values, self.kept_positions = keys, values, positions.long()
        self.biases = None if biases is None else biases.float()
        self._index_heads(lengths, keys.device)
        heads = len(lengths)
        self.keys = keys.new_empty(1, heads, 0, keys.shape[-1])
        self.values = values.new_empty(1, heads, 0, values.shape[-1])
        self.original_length = int(original_length)
        self.is_sliding = sliding
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self.scores: torch.Tensor | None = None
        #: KVzip+'s ``(entry, query)`` weights of those scores (``kvpack.attention.masked_attention``), or ``None``.
        self.score_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        #: a list while Attention Matching records reference queries (``kvpack.methods.am``): the attention
        #: function appends ``(query [heads, q, head_dim], scaling)`` of every call, and attends to the layer an
        #: ``append`` returns, if any (the on-policy sweep, ``kvpack.methods.am_sweep``); ``None`` otherwise.
        self.queries: list | None = None
        self._head_views: list | None = None
        #: ``dense_views``'s views once made (``False``: the layer has none).
        self._dense_views: tuple | bool | None = None

    def _index_heads(self, lengths: list[int], device) -> None:
        """Set ``head_lengths``, ``row_starts``, ``offsets`` (on ``device``), ``kept`` and ``dense`` from the
        per-head entry counts."""
        starts = [0]
        for m in lengths:
            starts.append(starts[-1] + m)
        self.head_lengths, self.row_starts = lengths, starts
        self.offsets = torch.tensor(starts, dtype=torch.int64, device=device)
        self.kept = max(lengths)
        self.dense = min(lengths) == self.kept

    @property
    def tail_length(self) -> int:
        """Tokens appended after the kept entries (question and generated tokens)."""
        return int(self.keys.shape[-2])

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the layer."""
        return len(self.head_lengths)

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - always initialised
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[1, kv_heads, new, head_dim]`` states to the tail; return the tail's keys and values, the keys
        tagged with this layer (read by ``kvpack.attention``, which adds the kept rows)."""
        self.keys = torch.cat([self.keys, key_states.to(self.dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.dtype)], dim=-2)
        self.keys._kvpack_layer = self
        return self.keys, self.values

    def head_rows(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys ``[n_h, head_dim]``, values ``[n_h, head_dim_v]``, positions ``[n_h]`` and biases ``[n_h]`` (or
        ``None``) of KV head ``h``'s kept entries (views)."""
        s, e = self.row_starts[h], self.row_starts[h + 1]
        b = None if self.biases is None else self.biases[s:e]
        return self.kept_keys[s:e], self.kept_values[s:e], self.kept_positions[s:e], b

    def head_views(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per KV head: keys ``[1, 1, n_h, head_dim]``, values ``[1, 1, n_h, head_dim_v]`` and biases
        ``[1, 1, 1, n_h]`` (or ``None``), views of the packed rows made once (no memory of their own)."""
        if self._head_views is None:
            views = []
            for h in range(self.num_kv_heads):
                k, v, _, b = self.head_rows(h)
                views.append((k[None, None], v[None, None], None if b is None else b.view(1, 1, 1, -1)))
            self._head_views = views
        return self._head_views

    def dense_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """When every head keeps the same ``kept`` entries (``dense``): keys ``[1, kv_heads, kept, head_dim]``,
        values ``[1, kv_heads, kept, head_dim_v]`` and biases ``[1, kv_heads, 1, kept]`` (or ``None``), views of the
        packed rows made once, so one attention call covers every head; ``None`` for uneven heads (or rows that
        cannot be viewed so without a copy)."""
        if self._dense_views is None:
            views = False
            heads, m = self.num_kv_heads, self.kept
            if self.dense and self.kept_keys.is_contiguous() and self.kept_values.is_contiguous():
                b = None if self.biases is None else self.biases.reshape(1, heads, 1, m)
                views = (self.kept_keys.view(1, heads, m, self.kept_keys.shape[-1]),
                         self.kept_values.view(1, heads, m, self.kept_values.shape[-1]), b)
            self._dense_views = views
        return self._dense_views or None

    def tail_positions(self) -> torch.Tensor:
        """``[tail]`` int64 logical positions of the tail's tokens."""
        start = self.original_length
        return torch.arange(start, start + self.tail_length, device=self.device)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Kept entries and tail as per-head padded tensors, for the paths that need one ``[kv_heads, kv]`` grid
        (KVzip's scoring pass, ``kvpack.attention.masked_attention``): ``keys`` ``[1, kv_heads, kept + tail,
        head_dim]``, ``values``, ``positions`` ``[kv_heads, kept + tail]`` int64 (``-1`` marks padding) and
        ``biases`` ``[kv_heads, kept + tail]`` float32 (zeros for the tail and padding) or ``None``. A copy, made
        per call (a view of the rows when ``dense`` and the tail is empty)."""
        heads, m, t = self.num_kv_heads, self.kept, self.tail_length
        tail_pos = self.tail_positions().expand(heads, t)
        if self.dense:
            k = self.kept_keys.view(1, heads, m, self.kept_keys.shape[-1])
            v = self.kept_values.view(1, heads, m, self.kept_values.shape[-1])
            p = self.kept_positions.view(heads, m)
            b = None if self.biases is None else self.biases.view(heads, m)
        else:
            k = self.kept_keys.new_zeros(1, heads, m, self.kept_keys.shape[-1])
            v = self.kept_values.new_zeros(1, heads, m, self.kept_values.shape[-1])
            p = self.kept_positions.new_full((heads, m), -1)
            b = None if self.biases is None else self.biases.new_zeros(heads, m)
            for h in range(heads):
                hk, hv, hp, hb = self.head_rows(h)
                n = hk.shape[0]
                k[0, h, :n], v[0, h, :n], p[h, :n] = hk, hv, hp
                if b is not None:
                    b[h, :n] = hb
        if t:
            k, v = torch.cat([k, self.keys], dim=-2), torch.cat([v, self.values], dim=-2)
            p = torch.cat([p, tail_pos], dim=-1)
            b = None if b is None else torch.cat([b, b.new_zeros(heads, t)], dim=-1)
        return k, v, p, b

    def nbytes(self) -> int:
        """Bytes held by the layer's tensors: kept rows, positions, offsets, biases and the tail."""
        parts = (self.kept_keys, self.kept_values, self.kept_positions, self.offsets, self.biases, self.keys,
                 self.values)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def rewind(self) -> None:
        """Drop the tail: back to the entries as loaded."""
        self.keys = self.keys.new_empty(1, self.num_kv_heads, 0, self.keys.shape[-1])
        self.values = self.values.new_empty(1, self.num_kv_heads, 0, self.values.shape[-1])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Logical sizes (the mask transformers builds from them is not used by the ``"kvpack"`` attention)."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Logical length: original context tokens plus the tail."""
        return self.original_length + self.tail_length

    def get_max_length(self) -> int:
        """No maximum (-1)."""
        return -1

    def reset(self) -> None:
        """Same as ``rewind``: the kept entries are never discarded."""
        self.rewind()


def lay_out(layers: list[LayerEntries], dtype: torch.dtype | None, device: torch.device | str
              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Every layer of a pack in full precision, packed per head: ``(keys, values, positions, biases)`` per layer.

    ``keys`` ``[entries, head_dim]`` and ``values`` ``[entries, head_dim_v]`` in ``dtype`` (default: the layer's
    keys' dtype), heads back to back; ``positions`` ``[entries]`` int64; ``biases`` ``[entries]`` float32 or
    ``None``.

    Layers that share the target dtype, head sizes, head count and quantization setting (all layers of a normal
    pack) are laid out together by ``lay_out_group``: one dequantization and one concatenation for all of them.
    """
    groups: dict[tuple, list[int]] = {}
    for idx, entries in enumerate(layers):
        q = entries.quant
        key = (dtype or entries.keys.dtype, entries.keys.shape[1], entries.values.shape[1],
               entries.head_lengths.shape[0], None if q is None else (q.qtype, q.group_size, q.layout))
        groups.setdefault(key, []).append(idx)
    out: list = [None] * len(layers)
    for key, members in groups.items():
        for idx, laid in zip(members, lay_out_group([layers[i] for i in members], key[0], device)):
            out[idx] = laid
    return out


def lay_out_group(layers: list[LayerEntries], dt: torch.dtype, device: torch.device | str
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``lay_out`` for layers with one dtype ``dt``, head sizes, head count and quantization setting.

    The quantized body rows of all the layers are dequantized at once (``dequantize_bodies``, float32, then ``dt``).
    Head ``h`` of a layer is then up to three row blocks, its sink rows (full precision), its body rows and its
    residual rows (full precision); the blocks of every head of every layer go into one concatenation (one copy)
    per tensor kind, moved to ``device`` in one transfer, and each layer's tensors are views of it.
    An unquantized layer is one block per head.
    """
    d, dv = layers[0].keys.shape[1], layers[0].values.shape[1]
    body_keys = body_values = None
    if layers[0].quant is not None:
        body_keys, body_values, key_starts, value_starts = dequantize_bodies([e.quant for e in layers])
        body_keys, body_values = body_keys.to(dt), body_values.to(dt)
        key_starts, value_starts = key_starts.tolist(), value_starts.tolist()
    key_parts, value_parts, rows = [], [], []
    for l, entries in enumerate(layers):
        ns = entries.head_lengths.tolist()
        body = 0 if body_keys is None else sum(entries.quant.body_lengths.tolist())
        fp = sum(ns) - body  # full-precision rows
        if entries.keys.shape[0] != fp or entries.values.shape[0] != fp or entries.positions.shape[0] != sum(ns) or (
                body_keys is not None and entries.quant.key_codes.shape[0] != body) or (
                entries.biases is not None and entries.biases.shape[0] != sum(ns)):
            raise InputError(f"layer {l} of the group: its tensors' rows do not match its head lengths {ns}; "
                             "build the pack again with kvpack.compress or load it from a file")
        layer_bodies = None if body_keys is None else (body_keys, body_values, key_starts[l], value_starts[l])
        _, key_blocks, value_blocks = head_row_pieces(entries, dt, layer_bodies)
        key_parts += [b for blocks in key_blocks for b in blocks]
        value_parts += [b for blocks in value_blocks for b in blocks]
        rows.append(sum(ns))
    all_keys = torch.cat(key_parts) if key_parts else torch.empty(0, d, dtype=dt)
    all_values = torch.cat(value_parts) if value_parts else torch.empty(0, dv, dtype=dt)
    all_positions = torch.empty(sum(rows), dtype=torch.int64)
    if sum(rows):
        torch.cat([e.positions for e in layers], out=all_positions)  # int32 positions are widened by the copy
    all_keys, all_values, all_positions = all_keys.to(device), all_values.to(device), all_positions.to(device)
    out, start = [], 0
    for entries, n in zip(layers, rows):
        # (a copy: a loaded pack's biases are views of the file's memory map, which may change after the load)
        biases = None if entries.biases is None else entries.biases.to(device=device, dtype=torch.float32, copy=True)
        out.append((all_keys[start : start + n], all_values[start : start + n], all_positions[start : start + n],
                    biases))
        start += n
    return out
