"""Real sizes: a model whose tensors exceed 2^24 elements (every real model's embedding does) goes through the whole
main job. Until the fingerprint sampled weights in float32, a 28,311,552-element embedding raised ``IndexError``
before anything was written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import kvpack
from kvpack.fingerprint import _sample_indices, weights_sha256
from kvpack.generation import question_input_ids
from kvpack.model import REFERENCE_MODEL_DIR

from .tiny import TEXT

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("numel", [1, 2, 64, 65, 1 << 24, (1 << 24) + 1, 28_311_552, 151_936 * 896,
                                   (1 << 31) + 7, 1 << 33])
def test_weight_samples_stay_inside_every_tensor_size(numel):
    idx = _sample_indices(numel)
    assert idx.dtype == torch.int64 and len(idx) == min(64, numel)
    assert int(idx[0]) == 0 and int(idx[-1]) == numel - 1  # float32 rounded the last one past the end
    assert bool((idx[1:] > idx[:-1]).all())


def test_weight_samples_below_2_24_are_the_ones_packs_already_record():
    """Packs written before the fix hash float32 linspace's indices; a change would refuse every one of them."""
    for numel in (148, 575, 4096 * 128, (1 << 24) - 3):
        assert torch.equal(_sample_indices(numel), torch.linspace(0, numel - 1, 64).long())


@pytest.fixture(scope="module")
def qwen_vocab_model():
    """Qwen2.5-0.5B's shape with its real 151,936-token vocabulary (a [151936, 896] tied embedding, 136M
    elements), 2 decoder layers, random weights, and kvpack's reference tokenizer (ids below 4,096)."""
    spec = importlib.util.spec_from_file_location("make_shape_model", ROOT / "tools" / "make_shape_model.py")
    msm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(msm)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = msm.shape_config("qwen2.5-0.5b", layers=2, vocab="real")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL_DIR)
    return model, tokenizer


def test_a_151936_token_vocabulary_compresses_saves_loads_and_answers_as_plain_transformers(qwen_vocab_model,
                                                                                             tmp_path):
    model, tok = qwen_vocab_model
    assert model.get_input_embeddings().weight.numel() == 151_936 * 896 > 1 << 24
    assert len(weights_sha256(model)) == 64
    pack = kvpack.compress(model, tok, TEXT * 4, method="none", kv_dtype="float32")
    kvpack.save(pack, tmp_path / "big.kvpack")
    cache = kvpack.load(tmp_path / "big.kvpack", model)
    ids = question_input_ids(tok, cache, "Who wrote in the log?")
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert kvpack.generate(model, tok, cache, "Who wrote in the log?", max_new_tokens=6) == \
        tok.decode(plain, skip_special_tokens=True).strip()
    packed = kvpack.compress(model, tok, TEXT * 4, method="kvzip", ratio=0.3)
    assert packed.layers[0].keys.dtype == torch.float16  # a float32 checkpoint's packs store float16 by default
    kvpack.save(packed, tmp_path / "kvzip.kvpack")
    assert isinstance(kvpack.generate(model, tok, kvpack.load(tmp_path / "kvzip.kvpack", model), "Who?",
                                      max_new_tokens=3), str)
