"""The embedded reference model: present, loadable offline, deterministic, and able to retrieve (small bar)."""

from __future__ import annotations

import functools

import kvpack
from kvpack.evaluation import full_cache_retrieval


@functools.lru_cache(maxsize=None)
def _reference():
    return kvpack.load_model()


def test_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = kvpack.load_model()
    assert model.config.model_type == "llama"
    assert model.config.num_attention_heads == 8 and model.config.num_key_value_heads == 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False).endswith("<|assistant|>\n")


def test_greedy_generation_is_deterministic():
    model, tok = _reference()
    a = full_cache_retrieval(model, tok, 512, 3, seed=7)
    b = full_cache_retrieval(model, tok, 512, 3, seed=7)
    assert a == b


def test_retrieves_facts_at_1k_tokens():
    """A small version of the model card's bar: >= 90% of 20 trials at 1K tokens, depths 0-100%."""
    model, tok = _reference()
    results = full_cache_retrieval(model, tok, 1024, 20, seed=0)
    accuracy = sum(ok for _, ok, _ in results) / len(results)
    assert accuracy >= 0.9, [answer for _, ok, answer in results if not ok]
