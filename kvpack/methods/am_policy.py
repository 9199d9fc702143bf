"""Attention Matching's on-policy reference queries (arXiv 2602.16284 §3.3): layer ``l``'s queries come from
KVzip's repeat pass run with the compressed layers before ``l`` already compacted, so they are the queries the
layer will see once the earlier layers' errors are in the cache."""

from __future__ import annotations

import torch

from ..cache import PackedLayer
from ..pack import LayerEntries
from ..prefill import Prefill

__all__ = ["on_policy_queries", "compacted_chunk_layer"]


@torch.inference_mode()
def on_policy_queries(method, model, tokenizer, prefill: Prefill, layers: list[LayerEntries], i: int, reservoir):
    """Fill ``reservoir`` (a ``QueryReservoir``) with compressed layer ``i``'s queries of every repeat chunk
    (``method.repeat_inputs``), layers ``spec.compressed_layers[:i]`` holding their compacted ``layers`` entries
    (``compacted_chunk_layer``), the others as in KVzip's pass. Returns ``reservoir``."""
    spec, sink = prefill.spec, prefill.sink
    device = prefill.keys[0].device
    done = spec.compressed_layers[:i]
    for start, stop, repeat_ids in method.repeat_inputs(tokenizer, prefill):
        cache = prefill.view_cache(slice(start, stop))
        for l in done:
            cache.layers[l] = compacted_chunk_layer(layers[l], sink, sink + start, sink + stop, prefill.tokens,
                                                    device)
        cache.layers[spec.compressed_layers[i]].queries = reservoir
        model.base_model(input_ids=torch.tensor([repeat_ids], device=device), past_key_values=cache, use_cache=True)
    return reservoir


def compacted_chunk_layer(entries: LayerEntries, sink: int, lo: int, hi: int, tokens: int, device) -> PackedLayer:
    """A ``PackedLayer`` of the compacted entries of one layer at positions ``< sink`` or in ``[lo, hi)``, per
    head, padded to the longest head (positions ``-1``), with their biases. ``entries``: unquantized, biases set
    or ``None``; ``tokens``: the cached sequence's length (the layer's logical length)."""
    heads = entries.head_lengths.shape[0]
    offsets = entries.head_offsets().tolist()
    pos = entries.positions.to(torch.int64)
    wanted = (pos < sink) | ((pos >= lo) & (pos < hi))
    rows = [offsets[h] + wanted[offsets[h] : offsets[h + 1]].nonzero().squeeze(1) for h in range(heads)]
    longest = max(len(r) for r in rows)
    d, dv = entries.keys.shape[1], entries.values.shape[1]
    keys = entries.keys.new_zeros(1, heads, longest, d)
    values = entries.values.new_zeros(1, heads, longest, dv)
    positions = torch.full((heads, longest), -1, dtype=torch.int64)
    biases = torch.zeros(heads, longest, dtype=torch.float32)
    for h, r in enumerate(rows):
        n = len(r)
        keys[0, h, :n], values[0, h, :n], positions[h, :n] = entries.keys[r], entries.values[r], pos[r]
        if entries.biases is not None:
            biases[h, :n] = entries.biases[r]
    return PackedLayer(keys.to(device), values.to(device), positions.to(device), tokens, biases=biases.to(device))
