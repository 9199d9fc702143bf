"""A transformers cache for a batch of sequences that all continue one prefilled context, the context held once.

Attention Matching's self-study (``kvpack.methods.am_selfstudy``) answers several prompts about the same context
as one batch. With an ordinary ``DynamicCache`` each row needs its own copy of the context's KV, and every decode
step concatenates the new token onto all the copies (on SmolLM2 at 2K tokens and 4 prompts, 377 MB copied per step).
Here each layer keeps the context's keys and values once (``[1, kv_heads, context, head_dim]``, views of the
prefill's tensors) and a preallocated suffix per row (``[batch, kv_heads, capacity, head_dim]``) that the fed tokens
are written into; the ``"kvpack"`` attention (``kvpack.attention``) attends over both with
``kvpack.attention_math.shared_prefix_attention``. It is the shared-prefix layout of prefix-sharing decoders
(vLLM's prefix caching, SGLang's RadixAttention) reduced to one prefix.

Positions are the caller's (``position_ids``); the cache only stores entries. Which suffix entries a row sees is
given at construction (``valid``: left padding; ``segments``: several sequences packed in one row) and by
causality. ``unpack_rows`` turns one packed row into a left-padded batch, so a batch of prompts of unequal lengths
is fed without computing its padding and then decoded a row per sequence.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["SharedContextLayer", "shared_context_cache", "unpack_rows"]


class SharedContextLayer(CacheLayerMixin):
    """One layer: the context's entries once, plus each row's suffix.

    Args:
        keys, values: ``[kv_heads, context, head_dim(_v)]`` the context's entries (post-RoPE), shared by every row
            (kept as views).
        valid: ``[batch, capacity]`` bool: suffix slots that hold a real token (``False``: left padding).
        segments: optional ``[batch, capacity]`` int64: with several sequences packed into one row, the sequence of
            each slot; a slot then sees only its own sequence's earlier slots (a block-diagonal causal mask).

    Attributes:
        context_keys, context_values: ``[1, kv_heads, context, head_dim(_v)]``.
        keys, values: ``[batch, kv_heads, capacity, head_dim(_v)]`` the suffix buffers, filled up to ``filled``.
        valid, segments, filled: as above; ``filled``: suffix slots written so far (tokens fed).

    ``update`` raises ``ValueError`` when more tokens are fed than ``capacity``.
    """

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                 segments: torch.Tensor | None = None):
        super().__init__()
        batch, capacity = valid.shape
        self.context_keys, self.context_values = keys[None], values[None]
        # zeros, not empty: a hidden slot (left padding) still enters the softmax's product with a zero weight, and
        # zero times uninitialised memory can be NaN
        self.keys = keys.new_zeros(batch, keys.shape[0], capacity, keys.shape[-1])
        self.values = values.new_zeros(batch, values.shape[0], capacity, values.shape[-1])
        self.valid, self.segments, self.filled = valid, segments, 0
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - always initialised
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[batch, kv_heads, new, head_dim]`` states into the next suffix slots; return the suffix so far,
        the keys tagged with this layer (``kvpack.attention`` then attends over the context as well)."""
        start, new = self.filled, key_states.shape[-2]
        if start + new > self.keys.shape[-2]:
            raise ValueError(f"shared-context cache: {start + new} tokens fed, capacity {self.keys.shape[-2]}")
        self.keys[:, :, start : start + new] = key_states
        self.values[:, :, start : start + new] = value_states
        self.filled = start + new
        keys = self.keys[:, :, : self.filled]
        keys._kvpack_shared = self
        return keys, self.values[:, :, : self.filled]

    def visible(self, q_len: int) -> torch.Tensor:
        """``[batch, q_len, filled]`` bool: the suffix entries each of the last ``q_len`` fed tokens sees (valid, not
        after it, and of its own sequence when ``segments`` packs several)."""
        n = self.filled
        slots = torch.arange(n, device=self.device)
        causal = slots[None, :] <= (n - q_len + torch.arange(q_len, device=self.device))[:, None]
        visible = self.valid[:, None, :n] & causal[None]
        if self.segments is not None:
            visible &= self.segments[:, None, :n] == self.segments[:, n - q_len : n, None]
        return visible

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Logical sizes (the ``"kvpack"`` attention builds its own visibility; no mask is read)."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Context tokens plus the suffix slots filled."""
        return self.context_keys.shape[-2] + self.filled

    def get_max_length(self) -> int:
        """No maximum (-1)."""
        return -1

    def reset(self) -> None:
        """Empty the suffix."""
        self.filled = 0


def shared_context_cache(keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor,
                         segments: torch.Tensor | None = None) -> Cache:
    """A ``transformers.Cache`` of ``SharedContextLayer``s, one per layer.

    Args:
        keys, values: per layer ``[kv_heads, context, head_dim(_v)]`` (a ``Prefill``'s ``keys`` / ``values``).
        valid: ``[batch, capacity]`` bool, the rows' real suffix slots (``SharedContextLayer``).
        segments: optional ``[batch, capacity]`` int64, the packed sequence of each slot (``SharedContextLayer``).

    Returns:
        The cache; the model must run the ``"kvpack"`` attention (``kvpack.attention.use_kvpack_attention``) and be
        given ``position_ids``. Raises nothing of its own.
    """
    return Cache(layers=[SharedContextLayer(k, v, valid, segments) for k, v in zip(keys, values)])


def unpack_rows(packed: Cache, lengths: list[int], valid: torch.Tensor, rows: list[int] | None = None) -> Cache:
    """The sequences packed one after another in the single row of ``packed`` (``lengths`` slots each, all filled),
    as a batch of one row per sequence (or per entry of ``rows``), each right-aligned at the batch's widest (left
    padding) and the rest of each row free for the tokens fed next.

    Args:
        packed: a ``shared_context_cache`` of batch 1 whose filled slots are the sequences, in order.
        lengths: ``[sequences]`` slots of each sequence (``>= 1``; they sum to the packed cache's filled slots).
        valid: ``[batch, capacity]`` bool of the new rows: ``True`` on row ``b``'s last ``lengths[rows[b]]`` slots
            before ``max(lengths)`` and on every slot from there (``SharedContextLayer``).
        rows: ``[batch]`` the sequence each row starts from (a sequence may start several rows, e.g. several sampled
            answers to one prompt); default one row per sequence, in order.

    Returns:
        The batch's cache, ``max(lengths)`` slots filled; the context's entries stay shared (the same views).
        Raises ``ValueError`` when the lengths do not add up to the packed slots.
    """
    width, layers = max(lengths), []
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = list(range(len(lengths))) if rows is None else rows
    for layer in packed.layers:
        if sum(lengths) != layer.filled:
            raise ValueError(f"unpack_rows: {sum(lengths)} slots asked for, {layer.filled} packed")
        out = SharedContextLayer(layer.context_keys[0], layer.context_values[0], valid)  # padding slots zero
        for b, i in enumerate(rows):
            start, n = starts[i], lengths[i]
            out.keys[b, :, width - n : width] = layer.keys[0, :, start : start + n]
            out.values[b, :, width - n : width] = layer.values[0, :, start : start + n]
        out.filled = width
        layers.append(out)
    return Cache(layers=layers)
