"""Plain ``model.generate`` with a loaded cache: reuse without ``rewind()`` answers like a fresh cache; wrong
inputs (only the question's ids, a batch of two) raise a ``KvpackError`` saying what to pass."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack.errors import KvpackError
from kvpack.generation import question_input_ids
from kvpack.loading import cache_from_pack

from .tiny import TEXT, tiny_model

_KW = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)


def _setup():
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, ratio=0.3, chunk_size=32)
    return model, tok, pack


def test_reuse_without_rewind_answers_like_a_fresh_cache():
    model, tok, pack = _setup()
    cache = cache_from_pack(pack, model, tok)
    questions = ["What is the secret code of Alice?", "When did the storm come?"]
    outs = []
    for q in questions:  # no rewind() between the calls
        ids = question_input_ids(tok, cache, q)
        outs.append(model.generate(ids, past_key_values=cache, pad_token_id=tok.pad_token_id, **_KW))
    assert cache.get_seq_length() > cache.original_length  # the second answer's tokens are still in the cache
    for q, out in zip(questions, outs):
        fresh = cache_from_pack(pack, model, tok)
        ids = question_input_ids(tok, fresh, q)
        assert torch.equal(out, model.generate(ids, past_key_values=fresh, pad_token_id=tok.pad_token_id, **_KW))
    # without the guard the second call would feed only the tokens past the stale tail: different logits
    cache.rewind()
    ids = question_input_ids(tok, cache, questions[1])
    first = model(input_ids=ids[:, cache.original_length:], past_key_values=cache).logits[0, -1]
    stale = model(input_ids=ids[:, cache.original_length + 3:], past_key_values=cache).logits[0, -1]
    assert not torch.allclose(first, stale)


def test_question_ids_alone_or_a_batch_raise_saying_what_to_pass():
    model, tok, pack = _setup()
    cache = cache_from_pack(pack, model, tok)
    ids = question_input_ids(tok, cache, "What is the secret code of Alice?")
    only_question = ids[:, cache.original_length:]
    with pytest.raises(KvpackError, match=r"do not start with the cached context's \d+ token ids; pass the "
                                          r"context's ids followed by the question's"):
        model.generate(only_question, past_key_values=cache, pad_token_id=tok.pad_token_id, **_KW)
    with pytest.raises(KvpackError, match=r"serves one sequence, got input_ids of shape \[2, \d+\]"):
        model.generate(ids.repeat(2, 1), past_key_values=cache, pad_token_id=tok.pad_token_id, **_KW)
    # the cache is untouched by the refused calls and still answers
    out = model.generate(ids, past_key_values=cache, pad_token_id=tok.pad_token_id, **_KW)
    assert out.shape == (1, ids.shape[1] + 10)
