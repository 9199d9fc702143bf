"""Chunked prefill: run a context through the model once and keep its full KV cache for scoring and gathering."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from .attention import masks_unused, use_kvpack_attention
from .cache import KvpackCache, PackedLayer
from .layout import ChatLayout
from .model import ModelSpec
from .stats import AttentionRecorder

__all__ = ["Prefill", "prefill"]


@dataclass
class Prefill:
    """The full KV cache of ``prefix + context``.

    Attributes:
        token_ids: ``[tokens]`` int64 ids (prefix then context).
        sink: tokens of the prefix (the attention sink); context positions are ``sink .. tokens - 1``.
        keys, values: per layer ``[kv_heads, n_l, head_dim]``; ``n_l = tokens`` for full-attention layers, the
            window kept by the model's own cache for sliding-window layers.
        positions: per layer ``[n_l]`` int64 RoPE positions of those entries.
        layout: how the context was laid out (for KVzip's repeat prompts and for later questions).
        spec: the model's attention shape.
        stats: the ``AttentionRecorder`` given to ``prefill`` (its prefill attention statistics), or ``None``.
    """

    token_ids: torch.Tensor
    sink: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    layout: ChatLayout
    spec: ModelSpec
    stats: AttentionRecorder | None = None

    @property
    def tokens(self) -> int:
        """Length of the cached sequence in tokens."""
        return int(self.token_ids.shape[0])

    @property
    def context_tokens(self) -> int:
        """Tokens after the sink (the ones that are scored and may be evicted)."""
        return self.tokens - self.sink

    def view_cache(self, context_slice: slice | None = None) -> KvpackCache:
        """A cache holding the sink plus ``context_slice`` of the context in full-attention layers.

        Sliding layers hold their intact window. The cache's logical length is the full ``tokens``, so anything
        fed next sits at positions after the whole context (as KVzip's repeat pass does). Slices are views, not
        copies, except for the concatenation with the sink (and the rows of a non-contiguous layer).
        """
        layers = []
        for l, (k, v, pos) in enumerate(zip(self.keys, self.values, self.positions)):
            if l in self.spec.sliding_layers or context_slice is None:
                idx_k, idx_v, idx_p = k, v, pos
            else:
                s, e = self.sink + context_slice.start, self.sink + context_slice.stop
                idx_k = torch.cat([k[:, : self.sink], k[:, s:e]], dim=1)
                idx_v = torch.cat([v[:, : self.sink], v[:, s:e]], dim=1)
                idx_p = torch.cat([pos[: self.sink], pos[s:e]])
            heads, n = idx_k.shape[0], idx_k.shape[1]
            layers.append(PackedLayer(idx_k.reshape(heads * n, -1), idx_v.reshape(heads * n, -1),
                                      idx_p.repeat(heads), [n] * heads, self.tokens,
                                      sliding=l in self.spec.sliding_layers))
        return KvpackCache(layers, self.token_ids, {})


class _RecordingCache(DynamicCache):
    """A ``DynamicCache`` that tags the keys it returns with ``(recorder, layer index, position of the first
    returned key)``, which the ``"kvpack"`` attention function reads to feed the recorder."""

    def __init__(self, config, recorder: AttentionRecorder | None):
        super().__init__(config=config)
        self.recorder = recorder

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        seen = self.get_seq_length(layer_idx) if layer_idx < len(self.layers) else 0
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        keys._kvpack_recording = (self.recorder, layer_idx, seen + key_states.shape[-2] - keys.shape[-2])
        return keys, values


@torch.inference_mode()
def prefill(model, token_ids: list[int], sink: int, layout: ChatLayout, spec: ModelSpec, chunk_size: int,
            progress: Callable[[int], None] | None = None, recorder: AttentionRecorder | None = None,
            observed_ids: list[int] | None = None) -> Prefill:
    """Prefill ``token_ids`` in chunks of ``chunk_size`` tokens through the model's own attention.

    Memory: the KV cache (linear in tokens) plus one chunk's activations; attention of a chunk over the cache is
    computed by SDPA. ``progress(n)`` is called with the tokens done after each chunk.

    Args:
        recorder: if given, the model is switched to the ``"kvpack"`` attention (SDPA for ordinary caches) and
            the recorder receives every chunk's attention of the compressed layers (``kvpack.stats``); the
            result's ``stats`` is the recorder.
        observed_ids: tokens fed after the context, in chunks, only so that ``recorder`` sees their attention
            (SnapKV's question); their KV entries are not part of the result.
    """
    device = next(model.parameters()).device
    ids = torch.tensor(token_ids, dtype=torch.long)
    if recorder is not None or device.type == "cpu":
        # on CPU the "kvpack" attention also runs later chunks as two unmasked flash calls (past keys, then the
        # chunk causally) instead of one masked call, so chunked prefill costs what a single pass costs
        use_kvpack_attention(model)
        cache = _RecordingCache(model.config, recorder)
    else:
        cache = DynamicCache(config=model.config)
    body = model.base_model
    keys, values, positions = [], [], []
    n = len(token_ids)
    extra = torch.tensor(list(observed_ids or ()), dtype=torch.long)
    # on CPU every chunk's attention is kvpack's own causal kernel: transformers' masks would go unread
    with masks_unused() if device.type == "cpu" else contextlib.nullcontext():
        for start in range(0, n, chunk_size):
            chunk = ids[start : start + chunk_size].unsqueeze(0).to(device)
            body(input_ids=chunk, past_key_values=cache, use_cache=True)
            if progress:
                progress(min(n, start + chunk_size))
        for layer in cache.layers:
            k, v = layer.keys[0], layer.values[0]  # [kv_heads, n_l, d]; later updates make new tensors
            keys.append(k)
            values.append(v)
            positions.append(torch.arange(n - k.shape[1], n, device=k.device))
        for start in range(0, len(extra), chunk_size):
            body(input_ids=extra[start : start + chunk_size].unsqueeze(0).to(device), past_key_values=cache,
                 use_cache=True)
    return Prefill(ids, sink, keys, values, positions, layout, spec, recorder)
