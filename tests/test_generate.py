"""Generation from a loaded cache: reuse across questions, plain ``model.generate``, equality with full prefill."""

from __future__ import annotations

import torch

import kvpack
from kvpack.generation import question_input_ids
from kvpack.loading import cache_from_pack

from .tiny import TEXT, attention_implementation, tiny_model


def _pack(ratio):
    model, tok = tiny_model("llama")
    return model, tok, kvpack.compress(model, tok, TEXT, ratio=ratio, chunk_size=32)


def _next_token_logits(model, tok, cache, question):
    ids = question_input_ids(tok, cache, question)[:, cache.original_length:]
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
    cache.rewind()
    return logits


def test_one_cache_answers_many_questions_like_fresh_loads():
    model, tok, pack = _pack(0.3)
    questions = ["What is the secret code of Alice?", "When did the storm come?", "What arrived by boat?"]
    shared = cache_from_pack(pack, model, tok)
    answers = [kvpack.generate(model, tok, shared, q, max_new_tokens=12) for q in questions]
    fresh = [kvpack.generate(model, tok, cache_from_pack(pack, model, tok), q, max_new_tokens=12)
             for q in questions]
    assert answers == fresh
    # after answering, the shared cache scores a new question bit-for-bit like a fresh load
    after = _next_token_logits(model, tok, shared, questions[1])
    again = _next_token_logits(model, tok, cache_from_pack(pack, model, tok), questions[1])
    assert torch.equal(after, again)
    other = _next_token_logits(model, tok, shared, questions[2])
    assert not torch.equal(after, other)


def test_plain_model_generate_matches_kvpack_generate():
    model, tok, pack = _pack(0.3)
    cache = cache_from_pack(pack, model, tok)
    q = "What is the secret code of Alice?"
    ids = question_input_ids(tok, cache, q)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    plain = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    cache.rewind()
    assert plain == kvpack.generate(model, tok, cache, q, max_new_tokens=12)


def test_ratio_one_generation_equals_full_prefill_generation():
    model, tok, pack = _pack(1.0)
    cache = cache_from_pack(pack, model, tok)
    q = "What is the secret code of Alice?"
    ids = question_input_ids(tok, cache, q)
    ours = model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id)
    with attention_implementation(model, "sdpa"):
        full = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id)
    assert torch.equal(ours, full)
