"""Attention Matching's self-study reference queries (arXiv 2602.16284 §4.1, "self-study"; the official code's
``compaction/query_generation/self_study.py`` with ``conversation_specs.py``): the model answers a few prompts about
the cached context, and the queries of the prompt and answer tokens are recorded.

Each prompt of ``PROMPTS`` (the official specs' conversation starters ``summarize``, ``aggregate`` and
``structure_json``, and the ``3_question`` seed prompt) is laid out as a question after the context
(``ChatLayout.question_ids``) and answered greedily for at most ``tokens`` tokens (stopping at end-of-sequence),
over the full prefilled cache. Greedy decoding makes the queries a function of the context alone: no seed is needed
and two builds record the same queries. The paper generates up to 2,048 answer tokens per prompt with thinking
enabled; kvpack bounds the cost to ``len(PROMPTS) x tokens`` decode steps (default 4 x 64) plus one prefill of each
prompt.
"""

from __future__ import annotations

import torch

from ..prefill import Prefill
from .am_continue import recording_cache

__all__ = ["PROMPTS", "self_study_queries"]

#: The paper code's self-study prompts (``conversation_specs.py``: summarize, aggregate, structure_json,
#: 3_question).
PROMPTS = (
    "Summarize the main points of the context.",
    "Aggregate all the key facts mentioned in the context.",
    "Structure the information in JSON form and include all important details like dates, times, names, and "
    "numerical values.",
    "Write 3 questions that test understanding of different parts of the context. Answer with just the 3 questions "
    "and options (do not say the correct answer), each one separated with 2 newlines.",
)


@torch.inference_mode()
def self_study_queries(model, tokenizer, prefill: Prefill, reservoirs: list, tokens: int,
                       prompts: tuple[str, ...] = PROMPTS) -> list:
    """Answer each prompt greedily for at most ``tokens`` tokens after the context and add each compressed layer's
    queries (prompt and answer tokens) to its reservoir.

    Args:
        model: the causal LM whose ``prefill`` this is; tokenizer: its tokenizer.
        prefill: the full prefill (``kvpack.prefill``); nothing in it is changed.
        reservoirs: one ``QueryReservoir`` per compressed layer, in ``prefill.spec.compressed_layers`` order.
        tokens: answer tokens per prompt at most, ``>= 1``.
        prompts: the prompts (default ``PROMPTS``).

    Returns:
        ``reservoirs``, filled. Raises nothing of its own.
    """
    cache, device = recording_cache(model, prefill, reservoirs)
    eos = tokenizer.eos_token_id
    limit = int(model.config.max_position_embeddings) if hasattr(model.config, "max_position_embeddings") else None
    for prompt in prompts:
        cache.rewind()
        ids = prefill.layout.question_ids(tokenizer, prompt)
        room = tokens if limit is None else min(tokens, limit - prefill.tokens - len(ids))
        if room < 0:
            break  # the context leaves no positions for this prompt
        x = torch.tensor([ids], device=device)
        for _ in range(room):
            logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
            nxt = int(logits.float().argmax())
            if eos is not None and nxt == eos:
                break
            x = torch.tensor([[nxt]], device=device)
    cache.rewind()
    return reservoirs
