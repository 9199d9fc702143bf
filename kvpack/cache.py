"""The loaded cache: a ``transformers.Cache`` whose layers hold per-head variable-length kept entries.

Each layer stores its kept entries padded to the longest head, ``[1, kv_heads, max_kept, head_dim]``, with the
entries' original RoPE positions ``[kv_heads, max_kept]`` (``-1`` marks padding). New tokens are appended after
them (the "tail") at logical positions ``original_length, original_length + 1, ...``: ``get_seq_length()``
reports the original context length plus the tail, so transformers gives new tokens the RoPE positions they
would have had after the full context. The ``"kvpack"`` attention function (``kvpack.attention``) masks each
head to its own kept entries plus the tail, adding each kept entry's logit bias when the pack has biases
(``LayerEntries.biases``, Attention Matching); the tail's bias is 0.

Reuse across questions: ``rewind()`` drops the tail and restores the cache exactly as loaded.
``kvpack.generate`` calls it before and after every answer, so asking question 2 after question 1 gives exactly
what question 2 gets from a fresh load.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import InputError
from .pack import LayerEntries, Pack
from .quant import dequantize_bodies, head_row_pieces

__all__ = ["PackedLayer", "KvpackCache"]


class PackedLayer(CacheLayerMixin):
    """One layer of a ``KvpackCache``.

    Args:
        keys: ``[1, kv_heads, kept, head_dim]`` kept keys (post-RoPE), padded per head.
        values: ``[1, kv_heads, kept, head_dim_v]`` kept values, padded per head.
        positions: ``[kv_heads, kept]`` int64 original positions, ``-1`` for padding.
        original_length: tokens in the original context (the logical length before any new token).
        sliding: whether this is a sliding-window layer kept intact (informational; the window itself comes from
            the model's attention call).
        dense: whether no head is padded (``positions`` has no ``-1``); computed from ``positions`` if ``None``.
        biases: ``[kv_heads, kept]`` float32 additive attention-logit bias of each kept entry (Attention Matching,
            arXiv 2602.16284 §3; 0 on padding), or ``None`` (all zero). New tokens have bias 0.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, original_length: int,
                 sliding: bool = False, dense: bool | None = None, biases: torch.Tensor | None = None):
        super().__init__()
        self.keys, self.values = keys, values
        self.positions = positions
        self.kept = int(keys.shape[-2])
        self.original_length = int(original_length)
        self.is_sliding = sliding
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        #: ``[kv_heads, kept]`` float32 buffer set while KVzip scores; ``None`` otherwise.
        self.scores: torch.Tensor | None = None
        #: KVzip+'s ``(entry, query)`` weights of those scores (``kvpack.attention.masked_attention``), or ``None``.
        self.score_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        #: every head holds all ``kept`` entries (no padding), so masks reduce to causality among new tokens
        self.dense = bool((positions >= 0).all()) if dense is None else bool(dense)
        self.biases = biases
        #: a list while Attention Matching records reference queries (``kvpack.methods.am``): the attention
        #: function appends ``(query [heads, q, head_dim], scaling)`` of every call; ``None`` otherwise.
        self.queries: list | None = None

    def logit_bias(self) -> torch.Tensor | None:
        """``[kv_heads, kv]`` float32 additive logit bias of every entry (kept entries' ``biases``, then 0 for the
        tail), or ``None`` when the layer has no biases."""
        if self.biases is None:
            return None
        tail = self.biases.new_zeros(self.biases.shape[0], self.tail_length)
        return torch.cat([self.biases, tail], dim=1)

    @property
    def tail_length(self) -> int:
        """Tokens appended after the kept entries (question and generated tokens)."""
        return int(self.keys.shape[-2]) - self.kept

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - always initialised
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[1, kv_heads, new, head_dim]`` states; return all keys/values, the keys tagged for attention."""
        new = key_states.shape[-2]
        start = self.original_length + self.tail_length
        pos = torch.arange(start, start + new, device=self.positions.device).expand(self.positions.shape[0], new)
        self.keys = torch.cat([self.keys, key_states.to(self.dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.dtype)], dim=-2)
        self.positions = torch.cat([self.positions, pos], dim=-1)
        self.keys._kvpack_layer = self  # read by kvpack.attention
        return self.keys, self.values

    def visibility(self, q_len: int, sliding_window: int | None) -> torch.Tensor:
        """``[kv_heads, q_len, kv]`` bool: which entries each of the last ``q_len`` tokens may attend to."""
        kpos = self.positions[:, None, :]
        qpos = self.positions[0, -q_len:][None, :, None]
        visible = (kpos >= 0) & (kpos <= qpos)
        if sliding_window is not None:
            visible &= (qpos - kpos) < sliding_window
        return visible

    def rewind(self) -> None:
        """Drop the tail: back to the entries as loaded."""
        self.keys = self.keys[..., : self.kept, :]
        self.values = self.values[..., : self.kept, :]
        self.positions = self.positions[:, : self.kept]

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


class KvpackCache(Cache):
    """A compressed context loaded into a model, ready for ``generate()``.

    Build it with ``kvpack.load(path, model)`` (or ``KvpackCache.from_pack``). To use it with plain
    ``model.generate``, pass the context's token ids followed by the question's as ``input_ids`` and the cache as
    ``past_key_values``; transformers feeds only the tokens after the context::

        ids = torch.cat([cache.context_ids, question_ids], dim=-1)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

    The model must use the ``"kvpack"`` attention (``kvpack.load`` switches it, and hooks ``generate`` so that each
    call checks its input and rewinds the cache first: ``prepare_generate``). Batch size 1.

    Attributes:
        token_ids: ``[tokens]`` int64 ids of the original cached sequence (prefix + context), on CPU.
        metadata: the pack's metadata (method, ratio, fingerprint, layout, ...).
    """

    def __init__(self, layers: list[PackedLayer], token_ids: torch.Tensor, metadata: dict[str, Any]):
        super().__init__(layers=layers)
        self.token_ids = token_ids
        self.metadata = metadata

    @property
    def context_ids(self) -> torch.Tensor:
        """``[1, tokens]`` int64 ids of the cached sequence on the cache's device."""
        return self.token_ids.unsqueeze(0).to(self.layers[0].device)

    @property
    def original_length(self) -> int:
        """Tokens of the original cached sequence."""
        return int(self.token_ids.shape[0])

    def rewind(self) -> None:
        """Drop every token appended since loading (question and answer), restoring the loaded state exactly."""
        for layer in self.layers:
            layer.rewind()

    def prepare_generate(self, input_ids: torch.Tensor) -> None:
        """Called (by the hook ``kvpack.load`` installs) when ``model.generate`` starts on this cache: check that
        ``input_ids`` ``[1, tokens + question_tokens]`` start with the cached context, then ``rewind()``, so the
        tokens after the context are fed afresh. A cache reused without ``rewind()`` thus answers as a fresh one
        (a conversation continues by passing it whole).

        Raises:
            InputError: a batch larger than one; ``input_ids`` that do not start with the context's ids (e.g. only
                the question's); the message says what to pass.
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InputError(f"a loaded KvpackCache serves one sequence, got input_ids of shape {list(input_ids.shape)}"
                             "; call generate once per question (batch size 1), or load one cache per sequence")
        n = self.original_length
        if input_ids.shape[1] <= n or not torch.equal(input_ids[0, :n].cpu(), self.token_ids):
            raise InputError(f"input_ids ({input_ids.shape[1]} tokens) do not start with the cached context's {n} "
                             "token ids; pass the context's ids followed by the question's, "
                             "torch.cat([cache.context_ids, question_ids], dim=-1), which "
                             "kvpack.generation.question_input_ids(tokenizer, cache, question) builds")
        self.rewind()

    def kept_entries(self) -> torch.Tensor:
        """``[layers, kv_heads]`` int64 kept entries per head (padding excluded)."""
        return torch.stack([(layer.positions[:, : layer.kept] >= 0).sum(-1) for layer in self.layers]).cpu()

    @classmethod
    def from_pack(cls, pack: Pack, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  sliding_layers: tuple[int, ...] = ()) -> "KvpackCache":
        """Lay a ``Pack`` out as padded per-layer tensors on ``device`` (cast to ``dtype`` if given).

        A quantized layer is dequantized first (on CPU, ``kvpack.quant``: ``code x scale + min`` in float32, then
        ``dtype``), so the cache holds ordinary full-precision tensors. Without ``dtype`` each layer keeps the dtype
        of its keys (its values are cast to it).

        Raises ``InputError`` if the pack has no layers, or if a layer's tensors do not have the rows its head
        lengths (and, quantized, its sink and body lengths) call for.
        """
        if not pack.layers:
            raise InputError("the pack has no layers")
        n = pack.original_tokens
        layers = [PackedLayer(keys, values, positions, n, sliding=idx in sliding_layers, dense=dense,
                              biases=_padded_biases(pack.layers[idx], keys.shape[2], keys.device))
                  for idx, (keys, values, positions, dense) in enumerate(_laid_out(pack.layers, dtype, device))]
        return cls(layers, pack.token_ids.long().cpu(), dict(pack.metadata))


def _padded_biases(entries: LayerEntries, longest: int, device) -> torch.Tensor | None:
    """``entries.biases`` (``[entries]``) laid out per head as ``[kv_heads, longest]`` float32 on ``device``, 0 after
    each head's rows; ``None`` if the layer has no biases. Raises ``InputError`` if it does not have one value per
    entry."""
    if entries.biases is None:
        return None
    b = entries.biases
    if b.dim() != 1 or b.shape[0] != entries.num_entries:
        raise InputError(f"a layer's biases have shape {list(b.shape)}, expected [{entries.num_entries}] (one per "
                         "entry); build the pack again with kvpack.compress")
    lengths = entries.head_lengths.to(torch.int64)
    row = torch.arange(longest)[None, :]
    inside = row < lengths[:, None]  # [kv_heads, longest]
    out = torch.zeros(inside.shape, dtype=torch.float32)
    out[inside] = b.float().cpu()  # row-major: head 0's rows first, as in the pack
    return out.to(device)


def _laid_out(layers: list[LayerEntries], dtype: torch.dtype | None, device: torch.device | str
              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """Every layer of a pack padded per head: ``(keys, values, positions, dense)`` in layer order.

    ``keys`` ``[1, kv_heads, longest, head_dim]`` and ``values`` ``[1, kv_heads, longest, head_dim_v]`` in ``dtype``
    (default: the layer's keys' dtype), zeros after each head's rows; ``positions`` ``[kv_heads, longest]`` int64,
    ``-1`` after each head's rows; ``dense``: no head is padded. ``longest`` is the layer's longest head.

    Layers that share the target dtype, head sizes, head count and quantization setting (all layers of a normal
    pack) are laid out together by ``_laid_out_group``: one dequantization and one concatenation for all of them.
    """
    groups: dict[tuple, list[int]] = {}
    for idx, entries in enumerate(layers):
        q = entries.quant
        key = (dtype or entries.keys.dtype, entries.keys.shape[1], entries.values.shape[1],
               entries.head_lengths.shape[0], None if q is None else (q.qtype, q.group_size))
        groups.setdefault(key, []).append(idx)
    out: list = [None] * len(layers)
    for key, members in groups.items():
        for idx, laid in zip(members, _laid_out_group([layers[i] for i in members], key[0], device)):
            out[idx] = laid
    return out


def _laid_out_group(layers: list[LayerEntries], dt: torch.dtype, device: torch.device | str
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """``_laid_out`` for layers with one dtype ``dt``, head sizes, head count and quantization setting.

    The quantized body rows of all the layers are dequantized at once (``dequantize_bodies``, float32, then ``dt``).
    Head ``h`` of a layer is then up to four row blocks, its sink rows (full precision), its body rows, its residual
    rows (full precision) and padding; the blocks of every head of every layer go into one concatenation (one copy)
    per tensor kind, moved to ``device`` in one transfer, and each layer's tensors are views of it.
    An unquantized layer is one block per head (sink rows = all rows, no body).
    """
    d, dv = layers[0].keys.shape[1], layers[0].values.shape[1]
    heads = layers[0].head_lengths.shape[0]
    lengths = [e.head_lengths.tolist() for e in layers]  # [layers][heads]
    body_keys = body_values = None
    if layers[0].quant is not None:
        body_keys, body_values, key_starts, value_starts = dequantize_bodies([e.quant for e in layers])
        body_keys, body_values = body_keys.to(dt), body_values.to(dt)
        key_starts, value_starts = key_starts.tolist(), value_starts.tolist()
        bodies = [e.quant.body_lengths.tolist() for e in layers]
    else:
        bodies = [[0] * heads] * len(layers)
    longest = [max(row) for row in lengths]
    most_pad = max(m - min(row) for m, row in zip(longest, lengths))
    pad_keys = torch.zeros(most_pad, d, dtype=dt)
    pad_values = pad_keys if dv == d else torch.zeros(most_pad, dv, dtype=dt)
    pad_positions = torch.full((most_pad,), -1, dtype=torch.int64)
    key_parts, value_parts, position_parts = [], [], []
    for l, (entries, ns, bs, m) in enumerate(zip(layers, lengths, bodies, longest)):
        body = sum(bs)
        fp = sum(ns) - body  # full-precision rows
        if entries.keys.shape[0] != fp or entries.values.shape[0] != fp or entries.positions.shape[0] != sum(ns) or (
                body_keys is not None and entries.quant.key_codes.shape[0] != body):
            raise InputError(f"layer {l} of the group: its tensors' rows do not match its head lengths {ns}; "
                             "build the pack again with kvpack.compress or load it from a file")
        layer_bodies = None if body_keys is None else (body_keys, body_values, key_starts[l], value_starts[l])
        _, key_blocks, value_blocks = head_row_pieces(entries, dt, layer_bodies)
        p = 0  # next position of this layer
        for n, kb, vb in zip(ns, key_blocks, value_blocks):
            key_parts += kb
            value_parts += vb
            if n:
                position_parts.append(entries.positions[p : p + n])
            if n < m:
                key_parts.append(pad_keys[: m - n])
                value_parts.append(pad_values[: m - n])
                position_parts.append(pad_positions[: m - n])
            p += n
    total = heads * sum(longest)
    all_keys = torch.cat(key_parts) if key_parts else torch.empty(0, d, dtype=dt)
    all_values = torch.cat(value_parts) if value_parts else torch.empty(0, dv, dtype=dt)
    all_positions = torch.empty(total, dtype=torch.int64)
    if position_parts:
        torch.cat(position_parts, out=all_positions)  # int32 positions are widened by the copy
    all_keys, all_values, all_positions = all_keys.to(device), all_values.to(device), all_positions.to(device)
    out, start = [], 0
    for ns, m in zip(lengths, longest):
        end = start + heads * m
        out.append((all_keys[start:end].view(1, heads, m, d), all_values[start:end].view(1, heads, m, dv),
                    all_positions[start:end].view(heads, m), min(ns) == m))
        start = end
    return out
