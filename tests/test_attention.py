"""The scored attention paths agree with each other and with plain softmax attention."""

from __future__ import annotations

import pytest
import torch

from kvpack.attention import (ATTN_IMPLEMENTATION, _scored_attention_explicit, _scored_attention_flash,
                              _scored_attention_fused, masks_unused, register,
                              attention_with_lse, masked_attention, scored_attention_dense)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_elements", [100, 16 * 2**20])
def test_fused_and_explicit_scoring_agree_with_softmax(group, block_elements, monkeypatch):
    monkeypatch.setattr("kvpack.attention.SCORE_BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    kv_heads, q_len, kept, dim = 2, 37, 29, 16
    heads = kv_heads * group
    q = torch.randn(1, heads, q_len, dim)
    k = torch.randn(1, kv_heads, kept + q_len, dim)
    v = torch.randn(1, kv_heads, kept + q_len, dim)
    visible = torch.ones(q_len, kept + q_len, dtype=torch.bool)
    visible[:, kept:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    visible[:5, :3] = False  # some scored entries hidden from some queries (e.g. a sliding window)
    vis = visible.expand(kv_heads, -1, -1)
    s1 = torch.zeros(kv_heads, kept)
    s2 = torch.zeros(kv_heads, kept)
    o1 = _scored_attention_fused(q, k, v, visible, 0.25, s1)
    o2 = _scored_attention_explicit(q, k, v, vis, 0.25, s2, query_block=8)
    o3 = masked_attention(q, k, v, vis, 0.25)
    # reference: explicit softmax, max over queries and the GQA group
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = (q @ kr.transpose(-1, -2) * 0.25).masked_fill(~visible, float("-inf")).softmax(-1)
    ref_scores = probs[0, :, :, :kept].view(kv_heads, group, q_len, kept).amax(dim=(1, 2))
    ref_out = (probs @ vr).transpose(1, 2)
    for out in (o1, o2, o3):
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, ref_scores, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s2, ref_scores, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("path", ["one pass", "flash"])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("block_elements", [100, 2**20])
@pytest.mark.parametrize("kept", [0, 1, 29])
def test_dense_scoring_matches_softmax_over_past_and_causal_tail(path, group, block_elements, kept, monkeypatch):
    """KVzip's repeat pass: every query sees all cached entries and, causally, the repeat input's own keys.
    ``block_elements`` small makes both paths go over many blocks (some not dividing the queries)."""
    monkeypatch.setattr("kvpack.attention.SCORE_BLOCK_ELEMENTS", block_elements)
    monkeypatch.setattr("kvpack.stats.ONE_PASS_BLOCK_ELEMENTS", block_elements)
    scored = scored_attention_dense if path == "one pass" else _scored_attention_flash
    torch.manual_seed(1)
    kv_heads, q_len, dim = 2, 23, 16
    heads = kv_heads * group
    q = torch.randn(1, heads, q_len, dim).transpose(1, 2).contiguous().transpose(1, 2)  # strided like transformers
    k = torch.randn(1, kv_heads, kept + q_len, dim)
    v = torch.randn(1, kv_heads, kept + q_len, dim)
    n = min(kept, 20)  # scores for a prefix of the cached entries (KVzip skips none, but the API allows it)
    scores = torch.zeros(kv_heads, n)
    out = scored(q, k, v, kept, 0.3, scores)
    visible = torch.ones(q_len, kept + q_len, dtype=torch.bool)
    visible[:, kept:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~visible, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (probs @ vr).transpose(1, 2), atol=1e-5, rtol=1e-5)
    ref = probs[0, :, :, :n].reshape(kv_heads, group, q_len, n).amax(dim=(1, 2))
    torch.testing.assert_close(scores, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("past", [0, 17])
def test_attention_with_lse_matches_softmax(group, past):
    torch.manual_seed(2)
    kv_heads, q_len, dim = 2, 19, 8
    q = torch.randn(1, kv_heads * group, q_len, dim)
    k = torch.randn(1, kv_heads, past + q_len, dim)
    v = torch.randn(1, kv_heads, past + q_len, dim)
    out, lse = attention_with_lse(q, k, v, 0.5)
    visible = torch.ones(q_len, past + q_len, dtype=torch.bool)
    visible[:, past:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    logits = (q @ k.repeat_interleave(group, 1).transpose(-1, -2) * 0.5).masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(lse, logits.logsumexp(-1), atol=1e-5, rtol=1e-5)
    ref = logits.softmax(-1) @ v.repeat_interleave(group, 1)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_masks_unused_only_inside_its_context():
    """``kvpack.prefill`` skips transformers' masks on CPU (its attention never reads them); anywhere else the
    ``"kvpack"`` mask function is SDPA's, which a chunk over earlier keys needs (its mask is not plain causal)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

    register()
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
    args = dict(batch_size=1, q_length=3, kv_length=5, q_offset=2, kv_offset=0, mask_function=causal_mask_function,
                allow_is_causal_skip=False)  # a 3-token chunk after 2 cached tokens
    outside = mask_fn(**args)
    assert outside[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                      [True, True, True, True, True]]
    with masks_unused():
        assert mask_fn(**args) is None
        with pytest.raises(RuntimeError):
            with masks_unused():
                raise RuntimeError("boom")
        assert mask_fn(**args) is None  # the inner context's exit restored the outer one
    assert torch.equal(mask_fn(**args), outside)
