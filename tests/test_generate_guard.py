"""Plain ``model.generate`` with a loaded cache: reuse without ``rewind()`` answers like a fresh cache; wrong
inputs (only the question's ids, a batch of two) raise a ``KvpackError`` saying what to pass."""

from __future__ import annotations

import pytest
import torch

import kvpack
import kvpack.fileformat
from kvpack.errors import InputError, KvpackError
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


def test_misused_api_arguments_are_input_errors_naming_the_fix():
    """Each misuse an adversarial review found raising deep inside torch, tokenizers or transformers (or passing
    silently) is an ``InputError`` before anything runs."""
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, ratio=0.5, chunk_size=32)
    cache = cache_from_pack(pack, model, tok)
    q = "What is the secret code of Alice?"
    cases = [
        (dict(question=None), "the question must be a str"),
        (dict(question=b"Who?"), "the question must be a str"),
        (dict(question="Who\udcff?"), "lone surrogate"),
        (dict(tokenizer=None), "tokenizer must be"),
        (dict(cache=None), "cache must be a KvpackCache"),
        (dict(temperature=float("nan")), "finite number"),
        (dict(temperature=float("inf")), "finite number"),
        (dict(seed=2**70), r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
        (dict(seed="1"), "seed must be"),
        (dict(question="word " * 5000), "leaving none for the answer"),
    ]
    for override, message in cases:
        kw = dict(tokenizer=tok, cache=cache, question=q)
        kw.update(override)
        extra = {k: kw.pop(k) for k in ("temperature", "seed", "max_new_tokens") if k in kw}
        with pytest.raises(InputError, match=message):
            kvpack.generate(model, kw["tokenizer"], kw["cache"], kw["question"], **extra)
    assert kvpack.generate(model, tok, cache, q, max_new_tokens=4, seed=-1)  # torch.manual_seed's range
    with pytest.raises(InputError, match="source_name must be a non-empty str"):
        kvpack.compress(model, tok, TEXT, source_name=None)
    with pytest.raises(InputError, match="lone surrogate"):
        kvpack.compress(model, tok, TEXT + "\udcff")
    with pytest.raises(InputError, match="ratio must be in"):
        kvpack.compress(model, tok, TEXT, ratio=True)
    with pytest.raises(InputError, match="model must be the transformers model"):
        cache_from_pack(pack, tok, tok)
    pack.metadata["source"] = {"name": 5}
    with pytest.raises(InputError, match="its metadata would be refused by every reader"):
        kvpack.fileformat.pack_to_bytes(pack)  # the writer applies the reader's metadata rules


def test_a_model_switched_or_cast_after_the_load_is_named_not_a_shape_error():
    model, tok = tiny_model.__wrapped__("llama")  # its own model: it is switched and cast below
    cache = cache_from_pack(kvpack.compress(model, tok, TEXT, ratio=0.5, chunk_size=32), model, tok)
    q = "What is the secret code of Alice?"
    want = kvpack.generate(model, tok, cache, q, max_new_tokens=6)
    model.set_attn_implementation("sdpa")
    ids = question_input_ids(tok, cache, q)
    with pytest.raises(InputError, match="'sdpa' attention, which cannot read a KvpackCache"):
        model.generate(ids, past_key_values=cache, max_new_tokens=6)
    assert kvpack.generate(model, tok, cache, q, max_new_tokens=6) == want  # kvpack.generate switches it back
    model.to(torch.bfloat16)
    with pytest.raises(InputError, match="the cache holds float32 entries but the model .*runs in bfloat16"):
        kvpack.generate(model, tok, cache, q, max_new_tokens=6)
    with pytest.raises(InputError, match="the model now runs in bfloat16"):
        model.generate(ids, past_key_values=cache, max_new_tokens=6)
