"""Attention Matching's on-policy reference queries (arXiv 2602.16284 §3.3): layer ``l``'s queries come from
KVzip's repeat pass (``on_policy_queries``), or from the token sequences a query source fed after the context
(self-study answers, sampled continuations: ``replayed_queries``), run again with the compressed layers before ``l``
already compacted, so they are the queries the layer will see once the earlier layers' errors are in the cache
(the paper's code regenerates every source's queries so, ``ss-plus-repeat`` included).

These compute one layer's queries at a time: one forward call per pass *and* layer. ``AttentionMatching`` gets the
same queries from ``am_sweep``'s single sweep (every pass once, all in step); these functions are the reference
it is tested against (``tests/test_am.py``)."""

from __future__ import annotations

import torch

from ..cache import PackedLayer
from ..pack import LayerEntries
from ..prefill import Prefill
from .kvzip import stop_after_attention

__all__ = ["on_policy_queries", "replayed_queries", "compacted_chunk_layer"]


@torch.inference_mode()
def on_policy_queries(method, model, tokenizer, prefill: Prefill, layers: list[LayerEntries], i: int, reservoir):
    """Fill ``reservoir`` (a ``QueryReservoir``) with compressed layer ``i``'s queries of every repeat chunk
    (``method.repeat_inputs``), layers ``spec.compressed_layers[:i]`` holding their compacted ``layers`` entries
    (``compacted_chunk_layer``), the others as in KVzip's pass; each pass ends after the attention of layer
    ``spec.compressed_layers[i]`` (``kvzip.stop_after_attention``). Returns ``reservoir``."""
    spec, sink = prefill.spec, prefill.sink
    device = prefill.keys[0].device
    done = spec.compressed_layers[:i]
    for start, stop, repeat_ids in method.repeat_inputs(tokenizer, prefill):
        cache = prefill.view_cache(slice(start, stop))
        for l in done:
            cache.layers[l] = compacted_chunk_layer(layers[l], sink, sink + start, sink + stop, prefill.tokens,
                                                    device)
        cache.layers[spec.compressed_layers[i]].queries = reservoir
        with stop_after_attention(model.base_model, spec.compressed_layers[i]):  # later layers are not needed
            model.base_model(input_ids=torch.tensor([repeat_ids], device=device), past_key_values=cache,
                             use_cache=True)
    return reservoir


@torch.inference_mode()
def replayed_queries(model, prefill: Prefill, layers: list[LayerEntries], i: int, sequences: list[list[int]],
                     reservoir):
    """Fill ``reservoir`` (a ``QueryReservoir``) with compressed layer ``i``'s queries of ``sequences`` (token id
    lists, each fed after the whole context as its source fed it: ``self_study_queries``' or
    ``continuation_queries``' ``fed``), teacher-forced in one forward call each, layers ``spec.compressed_layers[:i]``
    holding their compacted ``layers`` entries (``compacted_chunk_layer``) and the others the full prefill; each
    call ends after the attention of layer ``spec.compressed_layers[i]``. With ``i = 0`` (nothing compacted) the
    queries are the source's own. Returns ``reservoir``."""
    spec, sink = prefill.spec, prefill.sink
    device = prefill.keys[0].device
    for sequence in sequences:
        cache = prefill.view_cache()
        for l in spec.compressed_layers[:i]:
            cache.layers[l] = compacted_chunk_layer(layers[l], sink, sink, prefill.tokens, prefill.tokens, device)
        cache.layers[spec.compressed_layers[i]].queries = reservoir
        with stop_after_attention(model.base_model, spec.compressed_layers[i]):
            model.base_model(input_ids=torch.tensor([sequence], device=device), past_key_values=cache,
                             use_cache=True)
    return reservoir


def compacted_chunk_layer(entries: LayerEntries, sink: int, lo: int, hi: int, tokens: int, device) -> PackedLayer:
    """A ``PackedLayer`` of the compacted entries of one layer at positions ``< sink`` or in ``[lo, hi)``, packed per
    head (rows back to back, each head's own length), with their biases. ``entries``: unquantized, biases set or
    ``None``; ``tokens``: the cached sequence's length (the layer's logical length)."""
    pos = entries.positions.to(torch.int64)
    wanted = (pos < sink) | ((pos >= lo) & (pos < hi))  # [entries]
    head_of_row = torch.repeat_interleave(torch.arange(entries.head_lengths.shape[0]), entries.head_lengths)
    lengths = torch.bincount(head_of_row[wanted], minlength=entries.head_lengths.shape[0])
    biases = None if entries.biases is None else entries.biases[wanted].float().to(device)
    return PackedLayer(entries.keys[wanted].to(device), entries.values[wanted].to(device), pos[wanted].to(device),
                       lengths, tokens, biases=biases)
