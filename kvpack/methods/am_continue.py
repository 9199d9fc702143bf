"""Attention Matching's self-continuation reference queries: the queries of text the model itself samples after
the context, over the whole prefilled cache. A self-study source in the spirit of arXiv 2602.16284 §4.1 (the paper
has the model generate conversations about the context; here it simply continues the document), whose queries
look like those of later tokens that continue the text, where the repeat pass's look like a reader's re-reading
it (BENCHMARKS.md, "Attention Matching", compares both sources).

Sequences of at most ``CONTINUE_LENGTH`` tokens are sampled at temperature 1 from a seeded generator, each
starting with a line break after the context (the context's last token for a tokenizer that has none) and ending
early at the end-of-sequence token, until ``tokens`` tokens in all have been fed. Costs one decode step per token
over the full cache (on the reference model at 4K tokens, 512 tokens take 4.5 s against the repeat pass's 1.8 s).
"""

from __future__ import annotations

import torch

from ..attention import use_kvpack_attention
from ..prefill import Prefill

__all__ = ["CONTINUE_LENGTH", "continuation_queries", "recording_cache"]

#: Tokens of one sampled continuation at most.
CONTINUE_LENGTH = 256


@torch.inference_mode()
def continuation_queries(model, tokenizer, prefill: Prefill, reservoirs: list, tokens: int, seed: int = 0,
                         fed: list | None = None) -> list:
    """Feed ``tokens`` sampled tokens after the context and add each compressed layer's queries to its reservoir.

    Args:
        model: the causal LM whose ``prefill`` this is.
        tokenizer: its tokenizer (the line break that starts each sequence; the end-of-sequence token).
        prefill: the full prefill (``kvpack.prefill``); nothing in it is changed.
        reservoirs: one ``QueryReservoir`` per compressed layer, in ``prefill.spec.compressed_layers`` order.
        tokens: sampled tokens in all, ``>= 1``.
        seed: seed of the sampling generator (the same tokens for the same prefill and seed).
        fed: if given, each sequence's token ids as fed after the context are appended to it as a list of ints, for
            replaying them (``am_policy.replayed_queries``).

    Returns:
        ``reservoirs``, filled. Raises nothing of its own.
    """
    cache, device = recording_cache(model, prefill, reservoirs)
    generator = torch.Generator(device=device).manual_seed(seed)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    start = newline[-1] if newline else int(prefill.token_ids[-1])  # a tokenizer without one: the last token
    eos = tokenizer.eos_token_id
    count = 0
    while count < tokens:
        cache.rewind()
        x = torch.tensor([[start]], device=device)
        sequence = []
        for _ in range(min(CONTINUE_LENGTH, tokens - count)):
            sequence.append(int(x))
            logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1].float()
            count += 1
            x = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).view(1, 1)
            if eos is not None and int(x) == eos:
                break
        if fed is not None:
            fed.append(sequence)
    cache.rewind()
    return reservoirs


def recording_cache(model, prefill: Prefill, reservoirs: list):
    """``(cache, device)``: a view of the whole prefilled cache (``Prefill.view_cache``) whose compressed layers
    add the queries of every token fed after the context to ``reservoirs`` (one ``QueryReservoir`` per compressed
    layer), with kvpack's attention installed on ``model``. ``cache.rewind()`` drops the fed tokens."""
    use_kvpack_attention(model)
    cache = prefill.view_cache()
    for i, l in enumerate(prefill.spec.compressed_layers):
        cache.layers[l].queries = reservoirs[i]
    return cache, prefill.keys[0].device
