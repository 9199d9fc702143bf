"""``kvpack.generate``: ask a question of a loaded context and return the answer text."""

from __future__ import annotations

import torch

from .cache import KvpackCache
from .errors import InputError
from .layout import ChatLayout

__all__ = ["generate", "question_input_ids"]


def question_input_ids(tokenizer, cache: KvpackCache, question: str) -> torch.Tensor:
    """``[1, tokens + question_tokens]`` ids to pass to ``model.generate`` with ``past_key_values=cache``.

    The context's ids come first (transformers skips them, as they are cached); the question is laid out as the
    pack's chat layout says (same user turn, then the assistant header).
    """
    meta = cache.metadata.get("layout")
    if not isinstance(meta, dict):
        raise InputError("this cache's pack records no chat layout (metadata 'layout'), so a question cannot be "
                         "phrased after its context; rebuild it with `kvpack build`")
    layout = ChatLayout.from_dict(meta)
    q = torch.tensor([layout.question_ids(tokenizer, question)], dtype=torch.long)
    return torch.cat([cache.context_ids, q.to(cache.context_ids.device)], dim=-1)


@torch.inference_mode()
def generate(model, tokenizer, cache: KvpackCache, question: str, *, max_new_tokens: int = 64) -> str:
    """Greedy-decode an answer to ``question`` from a loaded cache.

    The cache is rewound before and after, so one loaded cache answers any number of questions and each answer
    equals the one a freshly loaded cache would give.

    Args:
        max_new_tokens: upper bound on generated tokens (stops earlier at the end-of-turn token).

    Returns:
        The decoded answer, special tokens removed, stripped of surrounding whitespace.
    """
    ids = question_input_ids(tokenizer, cache, question)
    cache.rewind()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    finally:
        cache.rewind()
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
