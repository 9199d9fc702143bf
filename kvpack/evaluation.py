"""Needle-retrieval evaluation with the full cache (the reference model's bar; the benchmark builds on it).

Each trial plants one fact (``kvpack.tasks``) at a depth in a held-out passage, asks for it in the same user
turn, greedy-decodes, and scores exact match of the number (multi-key needle-in-a-haystack; RULER,
arXiv 2404.06654 §3.1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from . import tasks
from .layout import chat_layout

__all__ = ["NeedleTrial", "needle_trials", "full_cache_retrieval", "cache_logprobs", "target_nll"]


@dataclass(frozen=True)
class NeedleTrial:
    """One retrieval trial: the ``context`` text with ``fact`` planted at relative ``depth`` (0 = start)."""

    context: str
    fact: tasks.Fact
    depth: float


def needle_trials(tokenizer, length: int, trials: int, seed: int = 0) -> list[NeedleTrial]:
    """``trials`` seeded trials of about ``length`` context tokens, depths spread evenly over [0, 1]."""
    rng = random.Random(seed * 1_000_003 + length)
    out = []
    for t in range(trials):
        depth = t / max(1, trials - 1)
        fact = tasks.random_fact(rng)
        out.append(NeedleTrial(tasks.needle_context(tokenizer, length, [fact], [depth], rng), fact, depth))
    return out


@torch.inference_mode()
def full_cache_retrieval(model, tokenizer, length: int, trials: int, seed: int = 0,
                         max_new_tokens: int = tasks.ANSWER_MAX_NEW_TOKENS) -> list[tuple[float, bool, str]]:
    """Greedy answers with the ordinary full cache: ``[(depth, correct, answer)]`` per trial."""
    layout = chat_layout(tokenizer)
    results = []
    for trial in needle_trials(tokenizer, length, trials, seed):
        ids = layout.prefix_ids(tokenizer) + layout.encode_text(tokenizer, trial.context)
        ids += layout.question_ids(tokenizer, tasks.fact_question(trial.fact))
        x = torch.tensor([ids], device=model.device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        results.append((trial.depth, tasks.answer_matches(answer, trial.fact), answer))
    return results


@torch.inference_mode()
def cache_logprobs(model, cache, target_ids) -> torch.Tensor:
    """``[len(target_ids) - 1, vocab]`` float32 log-probabilities (on CPU) of teacher-forcing ``target_ids[:-1]``
    (token ids) through a loaded or compacted ``kvpack.cache.KvpackCache``; row ``i`` is the distribution of
    ``target_ids[i + 1]``. The cache's tail is dropped before and after (``rewind``), so it is left as given.
    Raises what the model's forward raises (e.g. ``IndexError`` for an id outside the vocabulary)."""
    cache.rewind()
    x = torch.tensor([list(target_ids[:-1])], device=cache.layers[0].device)
    try:
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0]
    finally:
        cache.rewind()
    return torch.nn.functional.log_softmax(logits.float(), dim=-1).cpu()


def target_nll(logprobs: torch.Tensor, target_ids) -> float:
    """Mean negative log-likelihood (nats/token) of ``target_ids[1:]`` under ``logprobs``
    (``[len(target_ids) - 1, vocab]``, as ``cache_logprobs`` returns)."""
    tgt = torch.tensor(list(target_ids[1:]))
    return float(-logprobs.gather(1, tgt[:, None]).mean())
