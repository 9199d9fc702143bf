"""Prefill attention statistics (kvpack.stats) and the recorded attention agree with brute-force softmax."""

from __future__ import annotations

import pytest
import torch

from kvpack.attention import _attention_with_lse_explicit, attention_with_lse
from kvpack.layout import chat_layout
from kvpack.model import model_spec
from kvpack.prefill import prefill
from kvpack.stats import (AttentionRecorder, _column_sums_explicit, attention_with_column_sums, column_sums,
                          one_pass_applies, visible_mask, window_sums)

from .tiny import TEXT, attention_implementation, tiny_model


def _brute(query, key, value, scaling, window=None):
    """Probabilities ``[heads, q, kv]`` and output ``[1, q, heads, d]`` of causal chunk attention, in float64."""
    group = query.shape[1] // key.shape[1]
    k = key[0].double().repeat_interleave(group, 0)
    v = value[0].double().repeat_interleave(group, 0)
    vis = visible_mask(query.shape[2], key.shape[2], window)
    logits = (query[0].double() @ k.transpose(1, 2) * scaling).masked_fill(~vis, float("-inf"))
    probs = logits.softmax(-1)
    return probs, (probs @ v).transpose(0, 1).unsqueeze(0), logits.logsumexp(-1)


def _chunk(heads=4, kv_heads=2, q_len=13, kv_len=31, dim=8, seed=0):
    torch.manual_seed(seed)
    return (torch.randn(1, heads, q_len, dim), torch.randn(1, kv_heads, kv_len, dim) * 2,
            torch.randn(1, kv_heads, kv_len, dim))


@pytest.mark.parametrize("q_len, kv_len, window", [(13, 31, None), (31, 31, None), (1, 9, None), (13, 31, 7)])
def test_attention_with_lse_matches_softmax(q_len, kv_len, window):
    q, k, v = _chunk(q_len=q_len, kv_len=kv_len)
    probs, ref_out, ref_lse = _brute(q, k, v, 0.3, window)
    vis = visible_mask(q_len, kv_len, window)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for out, lse in (attention_with_lse(q, k, v, 0.3, window),  # CPU: fused flash (split, or masked)
                     _attention_with_lse_explicit(q, kr, vr, vis, 0.3, query_block=5)):  # other devices
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse.unsqueeze(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len, kv_len, window", [(13, 31, None), (31, 31, None), (1, 9, None), (13, 31, 7)])
def test_column_sums_match_brute_force(q_len, kv_len, window, monkeypatch):
    q, k, v = _chunk(q_len=q_len, kv_len=kv_len)
    probs, _, _ = _brute(q, k, v, 0.3, window)
    _, lse = attention_with_lse(q, k, v, 0.3, window)
    ref = probs.sum(1)  # [heads, kv]
    torch.testing.assert_close(column_sums(q, k, lse, 0.3, window).double(), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr("kvpack.stats.SUM_BLOCK_ELEMENTS", 50)  # several query blocks
    vis = visible_mask(q_len, kv_len, window)
    torch.testing.assert_close(_column_sums_explicit(q, k, lse, 0.3, vis).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("q_len, kv_len", [(13, 31), (31, 31), (1, 9), (1, 1), (40, 41)])
@pytest.mark.parametrize("block", [None, 1, 3])  # queries per block (None: the default size, one block here)
def test_one_pass_attention_and_column_sums_match_softmax(group, q_len, kv_len, block, monkeypatch):
    """Output and column sums of the one-pass path against an explicit float64 softmax: GQA groups 1/4/7, odd
    head_dim, keys cached before the chunk (``kv > q``), blocks that do not divide the chunk."""
    q, k, v = _chunk(heads=3 * group, kv_heads=3, q_len=q_len, kv_len=kv_len, dim=5)
    if block is not None:
        monkeypatch.setattr("kvpack.stats.ONE_PASS_BLOCK_ELEMENTS", block * 3 * group * kv_len)
    probs, ref_out, _ = _brute(q, k, v, 0.3)
    out, sums = attention_with_column_sums(q, k, v, 0.3)
    assert out.shape == ref_out.shape and out.dtype == q.dtype and sums.shape == (3 * group, kv_len)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums.double(), probs.sum(1), atol=1e-5, rtol=1e-5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible_mask(q_len, kv_len, None), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_one_pass_applies_only_where_measured():
    q = torch.zeros(1, 4, 8, 16)
    assert one_pass_applies(q, 20, None) and one_pass_applies(q, 20, 20)
    assert not one_pass_applies(q, 20, 19)  # a sliding window cuts the chunk's keys
    assert not one_pass_applies(q.bfloat16(), 20, None)


def test_window_sums_match_brute_force():
    q, k, v = _chunk()
    probs, _, lse = _brute(q, k, v, 0.3)
    vis = visible_mask(13, 31, None)
    got = window_sums(q[:, :, 9:], k, 0.3, vis[9:])
    torch.testing.assert_close(got.double(), probs[:, 9:].sum(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("one_pass", [True, False])
def test_recorded_prefill_equals_brute_force_over_the_whole_sequence(one_pass, monkeypatch):
    """Chunked recording (odd chunk size, GQA) gives the column sums of the full causal attention matrix, and the
    window sums of its last rows, layer by layer; the KV cache is the one plain prefill gives. Both ways of
    computing column sums: in one pass with the attention, and from the queries' log-sum-exp."""
    if not one_pass:
        monkeypatch.setattr("kvpack.attention.one_pass_applies", lambda *args: False)
    model, tok = tiny_model("qwen3")
    layout = chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, TEXT[:200])
    spec = model_spec(model)
    n = len(ids)
    rec = AttentionRecorder(spec, n, column_sums=True, window_start=n - 5)
    got = prefill(model, ids, 3, layout, spec, chunk_size=17, recorder=rec)
    plain = prefill(model, ids, 3, layout, spec, chunk_size=n)
    for a, b in zip(got.keys + got.values, plain.keys + plain.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    with attention_implementation(model, "eager"):
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    for i, attn in enumerate(out.attentions):  # [1, heads, n, n]
        torch.testing.assert_close(rec.column_sums[i], attn[0].sum(1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(rec.window_sums[i], attn[0, :, n - 5 :].sum(1), atol=1e-5, rtol=1e-4)


def test_observed_question_is_recorded_but_not_cached():
    model, tok = tiny_model("llama")
    layout = chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, TEXT[:120])
    question = layout.question_ids(tok, "What is the code?")
    spec = model_spec(model)
    n = len(ids)
    rec = AttentionRecorder(spec, n, window_start=n)
    got = prefill(model, ids, 3, layout, spec, chunk_size=16, recorder=rec, observed_ids=question)
    assert all(k.shape[1] == n for k in got.keys)
    with attention_implementation(model, "eager"):
        attn = model(input_ids=torch.tensor([ids + question]), output_attentions=True).attentions
    for i, a in enumerate(attn):
        torch.testing.assert_close(rec.window_sums[i], a[0, :, n:, :n].sum(1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_visible_mask_of_the_last_queries_is_the_tail_of_the_full_mask(window):
    full = visible_mask(13, 31, window)
    for first in (0, 5, 12):
        assert torch.equal(visible_mask(13, 31, window, first=first), full[first:])


def test_one_pass_context_attention_is_the_softmax_over_the_context_alone():
    """``one_pass_attention(context=ContextAttention(a, z))``: the output is unchanged, and the context's restricted
    softmax (output, log-sum-exp, squared probabilities summed over the queries and GQA group) is
    ``am_fit.rms_attention``'s over keys ``a .. z - 1``; a range the queries cannot all see is refused."""
    from kvpack.methods.am_fit import rms_attention
    from kvpack.stats import ContextAttention, one_pass_attention

    g = torch.Generator().manual_seed(0)
    kv, group, q_len, past, d = 2, 3, 37, 50, 16
    query = torch.randn(1, kv * group, q_len, d, generator=g)
    key, value = (torch.randn(1, kv, past + q_len, d, generator=g) for _ in range(2))
    plain, _ = one_pass_attention(query, key, value, 0.3)
    context = ContextAttention(4, past)
    out, _ = one_pass_attention(query, key, value, 0.3, context=context)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-5)
    assert context.resolved
    for h in range(kv):
        rows = query[0, h * group : (h + 1) * group].reshape(-1, d)
        rms, output, lse = rms_attention(rows, key[0, h, 4:past], 0.3, values=value[0, h, 4:past])
        torch.testing.assert_close(context.output[h].reshape(-1, d), output, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(context.lse[h].reshape(-1), lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close((context.square_sums[h] / rows.shape[0]).sqrt(), rms, atol=1e-7, rtol=1e-5)
    with pytest.raises(ValueError, match="context range"):
        one_pass_attention(query, key, value, 0.3, context=ContextAttention(4, past + 1))
    # a context that holds (almost) none of the attention: not resolved, its softmax would have lost its digits
    key[0, :, :4] = query[0].reshape(kv, group * q_len, d).mean(dim=1, keepdim=True) * 1e3
    starved = ContextAttention(4, past)
    one_pass_attention(query, key, value, 0.3, context=starved)
    assert not starved.resolved
