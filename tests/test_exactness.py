"""The loaded cache computes exactly what the full cache computes (ratio 1) or what masking evicted entries in
the full cache computes (ratio < 1), on every supported architecture."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack.generation import question_input_ids
from kvpack.loading import cache_from_pack
from kvpack.model import model_spec

from .reference import masked_reference_logits
from .tiny import ARCHITECTURES, TEXT, tiny_model


def _question_logits(model, cache, q_ids):
    out = model(input_ids=torch.tensor([q_ids]), past_key_values=cache, use_cache=True)
    return out.logits[0].float()


def _pack_and_cache(arch, ratio, tmp_path, chunk_size=32):
    """Compress, save to a file and load it back: the path users take."""
    model, tok = tiny_model(arch)
    pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", ratio=ratio, chunk_size=chunk_size)
    kvpack.save(pack, tmp_path / f"{arch}.kvpack")
    cache = kvpack.load(tmp_path / f"{arch}.kvpack", model, tokenizer=tok)
    ids = question_input_ids(tok, cache, "What is the secret code of Alice?")[0].tolist()
    return model, pack, cache, ids[pack.original_tokens:]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ratio_one_equals_full_prefill(arch, tmp_path):
    model, pack, cache, q_ids = _pack_and_cache(arch, 1.0, tmp_path)
    got = _question_logits(model, cache, q_ids)
    full = model(input_ids=torch.tensor([pack.token_ids.tolist() + q_ids])).logits[0, -len(q_ids):].float()
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_evicted_entries_equal_masked_full_cache(arch, tmp_path):
    model, pack, cache, q_ids = _pack_and_cache(arch, 0.3, tmp_path)
    spec = model_spec(model)
    kept = []
    for l, layer in enumerate(pack.layers):
        if l in spec.sliding_layers:
            kept.append(None)
        else:
            kept.append([set(layer.head(h)[2].tolist()) for h in range(pack.kv_heads)])
    # hybrid models: the window applies to sliding layers; all-sliding models: to every layer
    windows = [spec.sliding_window if (l in spec.sliding_layers or not spec.sliding_layers) else None
               for l in range(spec.num_layers)]
    ref = masked_reference_logits(model, pack.token_ids.tolist(), q_ids, kept, windows)
    got = _question_logits(model, cache, q_ids)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    # the compression really changed something: the logits differ from the full cache's
    full = model(input_ids=torch.tensor([pack.token_ids.tolist() + q_ids])).logits[0, -len(q_ids):].float()
    assert (got - full).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_budget_is_exact_and_sink_is_kept(arch, tmp_path):
    model, pack, _, _ = _pack_and_cache(arch, 0.3, tmp_path)
    spec = model_spec(model)
    stats = pack.metadata["stats"]
    assert stats["context_entries_kept"] == round(0.3 * stats["context_entries"])
    kept = sum(pack.layers[l].num_entries - pack.sink_tokens * pack.kv_heads for l in spec.compressed_layers)
    assert kept == stats["context_entries_kept"]
    for l in spec.compressed_layers:
        for h in range(pack.kv_heads):
            pos = pack.layers[l].head(h)[2]
            assert pos[: pack.sink_tokens].tolist() == list(range(pack.sink_tokens))
    lengths = pack.head_lengths()[list(spec.compressed_layers)]
    assert lengths.min() != lengths.max(), "global top-k should give heads different budgets"


def test_zero_entry_head_gives_no_nan():
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", ratio=1.0, chunk_size=32)
    # empty head 0 of layer 1 entirely (not even the sink)
    layer = pack.layers[1]
    n0 = int(layer.head_lengths[0])
    layer.keys, layer.values, layer.positions = layer.keys[n0:], layer.values[n0:], layer.positions[n0:]
    layer.head_lengths[0] = 0
    cache = cache_from_pack(pack, model, tok)
    q_ids = question_input_ids(tok, cache, "Who?")[0, pack.original_tokens:].tolist()
    logits = _question_logits(model, cache, q_ids)
    assert torch.isfinite(logits).all()
    ref = masked_reference_logits(
        model, pack.token_ids.tolist(), q_ids,
        [None, [set(), set(layer.head(1)[2].tolist())]], [None, None])
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
