"""``kvpack.generate``: ask a question of a loaded context and return the answer text."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import KvpackCache
from .errors import InputError
from .layout import ChatLayout

__all__ = ["generate", "answer", "Answer", "question_input_ids"]


def question_input_ids(tokenizer, cache: KvpackCache, question: str) -> torch.Tensor:
    """``[1, tokens + question_tokens]`` ids to pass to ``model.generate`` with ``past_key_values=cache``.

    The context's ids come first (transformers skips them, as they are cached); the question is laid out as the
    pack's chat layout says (same user turn, then the assistant header).
    """
    layout = ChatLayout.from_dict(cache.metadata["layout"])
    q = torch.tensor([layout.question_ids(tokenizer, question)], dtype=torch.long)
    return torch.cat([cache.context_ids, q.to(cache.context_ids.device)], dim=-1)


@dataclass(frozen=True)
class Answer:
    """One answer of ``answer``.

    Attributes:
        text: the decoded answer, special tokens removed, stripped.
        tokens: tokens generated (the end-of-turn token included when it was reached).
        seconds: wall time of the generation (prefill of the question + decode), in seconds.
    """

    text: str
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of ``seconds``."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@torch.inference_mode()
def answer(model, tokenizer, cache: KvpackCache, question: str, *, max_new_tokens: int = 64,
           temperature: float = 0.0, seed: int | None = None) -> Answer:
    """Answer ``question`` from a loaded cache: greedy by default, sampled when ``temperature > 0``.

    The cache is rewound before and after, so one loaded cache answers any number of questions and each answer
    equals the one a freshly loaded cache would give (with sampling: for the same ``seed``).

    Args:
        max_new_tokens: upper bound on generated tokens (stops earlier at the end-of-turn token).
        temperature: 0 (default) decodes greedily; above 0 samples from the softmax at this temperature.
        seed: seeds torch's generator before sampling (``None``: not seeded).

    Raises:
        InputError: ``max_new_tokens < 1``, a negative ``temperature``.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive number of tokens, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise InputError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    ids = question_input_ids(tokenizer, cache, question)
    cache.rewind()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    sampling = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
    finally:
        cache.rewind()
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    return Answer(tokenizer.decode(new, skip_special_tokens=True).strip(), int(new.shape[0]), seconds)


def generate(model, tokenizer, cache: KvpackCache, question: str, *, max_new_tokens: int = 64,
             temperature: float = 0.0, seed: int | None = None) -> str:
    """The text of ``answer(...)``: greedy-decode (or sample, ``temperature > 0``) an answer to ``question``.

    The cache is rewound before and after, so one loaded cache answers any number of questions and each answer
    equals the one a freshly loaded cache would give.

    Returns:
        The decoded answer, special tokens removed, stripped of surrounding whitespace.
    """
    return answer(model, tokenizer, cache, question, max_new_tokens=max_new_tokens, temperature=temperature,
                  seed=seed).text
