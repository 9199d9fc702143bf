"""The scored attention paths agree with each other and with plain softmax attention."""

from __future__ import annotations

import pytest
import torch

from kvpack.attention import _scored_attention_explicit, _scored_attention_fused, masked_attention


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
