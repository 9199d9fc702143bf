"""Architecture support, fingerprints and the refusal of packs built for another model."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack.errors import ModelMismatchError, UnsupportedModelError
from kvpack.fingerprint import model_fingerprint, weights_sha256
from kvpack.model import model_spec

from .tiny import TEXT, tiny_model, tiny_tokenizer


def test_unsupported_architecture_gets_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320))
    with pytest.raises(UnsupportedModelError, match="gpt2.*not supported.*llama"):
        model_spec(model)
    with pytest.raises(UnsupportedModelError):
        kvpack.compress(model, tiny_tokenizer(), TEXT)


def test_gemma3_sliding_layers_are_kept_intact():
    model, tok = tiny_model("gemma3_text")
    spec = model_spec(model)
    assert spec.sliding_layers == (0, 2) and spec.compressed_layers == (1,)
    pack = kvpack.compress(model, tok, TEXT, ratio=0.2, chunk_size=32)
    assert pack.metadata["layer_kinds"] == ["sliding_intact", "compressed", "sliding_intact"]
    for l in (0, 2):  # the window the model's own cache keeps, in every head
        lengths = pack.layers[l].head_lengths.tolist()
        assert lengths[0] == lengths[1] <= spec.sliding_window
        assert pack.layers[l].head(0)[2].tolist() == list(range(pack.original_tokens - lengths[0],
                                                                  pack.original_tokens))


def test_weights_hash_ignores_float32_vs_bfloat16_but_not_other_weights():
    model, _ = tiny_model("llama")
    same = weights_sha256(model)
    assert weights_sha256(tiny_model("llama", torch.bfloat16)[0]) == same
    assert weights_sha256(tiny_model("qwen2")[0]) != same


def test_loading_into_another_model_is_refused_naming_both(tmp_path):
    model, tok = tiny_model("llama")
    kvpack.save(kvpack.compress(model, tok, TEXT, ratio=0.5, chunk_size=32), tmp_path / "a.kvpack")
    other, _ = tiny_model("qwen2")
    with pytest.raises(ModelMismatchError, match="tiny-llama.*tiny-qwen2"):
        kvpack.load(tmp_path / "a.kvpack", other)


def test_fingerprint_records_shapes_and_rope():
    model, tok = tiny_model("qwen3")
    fp = model_fingerprint(model, tok)
    assert (fp["num_layers"], fp["num_heads"], fp["num_kv_heads"], fp["head_dim"]) == (2, 4, 2, 16)
    assert fp["rope"]["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert len(fp["tokenizer_sha256"]) == 64 and len(fp["weights_sha256"]) == 64
