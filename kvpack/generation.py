"""``kvpack.generate``: ask a question of a loaded context and return the answer text."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .attention import use_kvpack_attention
from .cache import KvpackCache, require_model
from .errors import InputError
from .layout import ChatLayout

__all__ = ["generate", "answer", "Answer", "question_input_ids", "check_text"]


def question_input_ids(tokenizer, cache: KvpackCache, question: str) -> torch.Tensor:
    """``[1, tokens + question_tokens]`` ids to pass to ``model.generate`` with ``past_key_values=cache``.

    The context's ids come first (transformers skips them, as they are cached); the question is laid out as the
    pack's chat layout says (same user turn, then the assistant header).

    Raises:
        InputError: ``cache`` is not a ``KvpackCache`` or records no chat layout; ``tokenizer`` is not a tokenizer;
            ``question`` is not text (``check_text``).
    """
    if not callable(getattr(tokenizer, "encode", None)):
        raise InputError(f"tokenizer must be the model's tokenizer (from kvpack.load_model), got "
                         f"{type(tokenizer).__name__}")
    if not isinstance(cache, KvpackCache):
        raise InputError(f"cache must be a KvpackCache (from kvpack.load), got {type(cache).__name__}")
    check_text(question, "the question")
    meta = cache.metadata.get("layout")
    if not isinstance(meta, dict):
        raise InputError("this cache's pack records no chat layout (metadata 'layout'), so a question cannot be "
                         "phrased after its context; rebuild it with `kvpack build`")
    layout = ChatLayout.from_dict(meta)
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
        max_new_tokens: upper bound on generated tokens (stops earlier at the end-of-turn token, and at the model's
            last position: ``max_position_embeddings`` minus the context and the question).
        temperature: 0 (default) decodes greedily; above 0 samples from the softmax at this temperature.
        seed: seeds torch's generator before sampling (``None``: not seeded).

    Raises:
        InputError: ``max_new_tokens < 1``; a ``temperature`` that is negative or not finite; a ``seed`` that is not
            an integer in ``[-2**63, 2**64)``; a question that is not text (or holds bytes that are not UTF-8); a
            ``model`` that is not a transformers model, a ``tokenizer`` that is not a tokenizer, a ``cache`` that
            is not a ``KvpackCache``; a model in another dtype than the cache (``kvpack.load`` casts to the model's
            dtype at load: load again after ``model.to(...)``); a context and question that leave the model no
            position for the answer.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive number of tokens, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
        raise InputError(f"seed must be an integer in [-2**63, 2**64) (torch.manual_seed's range), got {seed!r}")
    ids = question_input_ids(tokenizer, cache, question)
    max_new_tokens = min(max_new_tokens, _check_model(model, cache, ids.shape[1]))
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


def check_text(text, what: str) -> None:
    """Raise ``InputError`` unless ``text`` is a ``str`` that UTF-8 can encode (no lone surrogates: bytes that
    were not UTF-8, as Python decodes a command line or file names); ``what`` names it in the message."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} is not valid text: character {exc.start} is a lone surrogate (bytes that are "
                         "not UTF-8, e.g. from a terminal in another encoding); pass UTF-8 text") from None


def _check_model(model, cache: KvpackCache, positions: int) -> int:
    """Check that the model can generate from ``cache`` after a prompt of ``positions`` tokens (context and
    question): the ``"kvpack"`` attention (switched on if it was switched off), the cache's dtype, and the prompt
    within its position embeddings. Returns the positions left for new tokens (``>= 1``; unbounded when the model
    declares no ``max_position_embeddings``)."""
    require_model(model)
    use_kvpack_attention(model)
    cache.check_model(model)
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return 2**62
    if positions >= limit:
        raise InputError(f"the context and the question take {positions:,} positions, and the model has "
                         f"{limit:,}, leaving none for the answer; shorten the question")
    return limit - positions


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
