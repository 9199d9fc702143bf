"""The loaded cache: a ``transformers.Cache`` whose layers hold per-head variable-length kept entries.

Each layer stores its kept entries padded to the longest head, ``[1, kv_heads, max_kept, head_dim]``, with the
entries' original RoPE positions ``[kv_heads, max_kept]`` (``-1`` marks padding). New tokens are appended after
them (the "tail") at logical positions ``original_length, original_length + 1, ...``: ``get_seq_length()``
reports the original context length plus the tail, so transformers gives new tokens the RoPE positions they
would have had after the full context. The ``"kvpack"`` attention function (``kvpack.attention``) masks each
head to its own kept entries plus the tail.

Reuse across questions: ``rewind()`` drops the tail and restores the cache exactly as loaded.
``kvpack.generate`` calls it before and after every answer, so asking question 2 after question 1 gives exactly
what question 2 gets from a fresh load.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import InputError
from .pack import Pack
from .quant import head_row_pieces

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
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, original_length: int,
                 sliding: bool = False):
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
        #: every head holds all ``kept`` entries (no padding), so masks reduce to causality among new tokens
        self.dense = bool((positions >= 0).all())

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
        cache.rewind()  # before reusing the cache for another question

    The model must use the ``"kvpack"`` attention (``kvpack.load`` switches it). Batch size 1.

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

    def kept_entries(self) -> torch.Tensor:
        """``[layers, kv_heads]`` int64 kept entries per head (padding excluded)."""
        return torch.stack([(layer.positions[:, : layer.kept] >= 0).sum(-1) for layer in self.layers]).cpu()

    @classmethod
    def from_pack(cls, pack: Pack, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  sliding_layers: tuple[int, ...] = ()) -> "KvpackCache":
        """Lay a ``Pack`` out as padded per-layer tensors on ``device`` (cast to ``dtype`` if given).

        A quantized layer is dequantized first (on CPU, ``kvpack.quant``: ``code x scale + min`` in float32, then
        ``dtype``), so the cache holds ordinary full-precision tensors.

        Raises ``InputError`` if the pack has no layers.
        """
        if not pack.layers:
            raise InputError("the pack has no layers")
        layers = []
        n = pack.original_tokens
        for idx, entries in enumerate(pack.layers):
            # ragged rows -> [kv_heads, longest head, dim], shorter heads padded (position -1 marks padding)
            lengths, key_blocks, value_blocks = head_row_pieces(entries, dtype)
            longest = max(lengths)
            dt = dtype or entries.keys.dtype
            keys = _padded(key_blocks, lengths, longest, entries.keys.shape[1], 0, dt)
            values = _padded(value_blocks, lengths, longest, entries.values.shape[1], 0, dt)
            p, offsets = entries.positions, itertools.accumulate(lengths, initial=0)
            positions = _padded([[p[o : o + m]] if m else [] for o, m in zip(offsets, lengths)], lengths, longest,
                                None, -1, p.dtype).long()
            layers.append(PackedLayer(keys.unsqueeze(0).to(device), values.unsqueeze(0).to(device),
                                      positions.to(device), n, sliding=idx in sliding_layers))
        return cls(layers, pack.token_ids.long().cpu(), dict(pack.metadata))


def _padded(blocks: list[list[torch.Tensor]], lengths: list[int], longest: int, dim: int | None, fill: int,
            dtype: torch.dtype) -> torch.Tensor:
    """Heads' row blocks -> one padded tensor ``[heads, longest, dim]`` (``[heads, longest]`` if ``dim`` is None).

    ``blocks[h]`` are head ``h``'s blocks (``[rows, dim]`` or ``[rows]``, all of ``dtype``), ``lengths[h]`` their
    total rows; head ``h`` is followed by ``longest - lengths[h]`` rows of ``fill``. One concatenation (one copy),
    like ``pad_sequence`` over the heads but without splitting first. Needs at least one head.
    """
    tail = () if dim is None else (dim,)
    if longest == 0:  # every head is empty
        return torch.full((len(lengths), 0, *tail), fill, dtype=dtype)
    pad = torch.full((longest - min(lengths), *tail), fill, dtype=dtype)
    parts = []
    for head, n in zip(blocks, lengths):
        parts += head
        if n < longest:
            parts.append(pad[: longest - n])
    return torch.cat(parts).view(len(lengths), longest, *tail)
