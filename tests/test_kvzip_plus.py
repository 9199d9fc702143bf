"""KVzip+ (kvpress ``KVzipPress(kvzip_plus_normalization=True)``): entry scores weighted by ||W_o v|| / ||x_t||,
checked against a hand computation from eager attention probabilities, hidden states and values."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvpack import tasks
from kvpack.attention import masked_attention
from kvpack.layout import chat_layout
from kvpack.methods.kvzip import KVzip
from kvpack.methods.kvzip_plus import value_output_norms
from kvpack.model import model_spec
from kvpack.prefill import prefill

from .tiny import TEXT, tiny_model


def test_value_output_norms_match_the_projection_of_each_value():
    torch.manual_seed(1)
    kv, group, n, d, hidden = 2, 3, 5, 4, 7
    values = torch.randn(kv, n, d)
    weight = torch.randn(hidden, kv * group * d)  # nn.Linear(heads x d -> hidden).weight
    got = value_output_norms(values, weight)
    for h in range(kv):
        for g in range(group):
            j = h * group + g
            w = weight[:, j * d : (j + 1) * d]  # the columns query head j feeds
            for i in range(n):
                assert float(got[h, g, i]) == pytest.approx(float((w @ values[h, i]).norm()), rel=1e-5)


@pytest.mark.parametrize("shared", [False, True])  # per-head visibility (explicit path) or shared (fused, CPU)
def test_masked_attention_weights_the_probabilities_before_the_max(shared):
    torch.manual_seed(2)
    kv, group, q, keys, d, n = 2, 2, 6, 9, 8, 5
    query = torch.randn(1, kv * group, q, d)
    key, value = torch.randn(1, kv, keys, d), torch.randn(1, kv, keys, d)
    visible = torch.rand(kv, q, keys) > 0.3
    visible[:, :, 0] = True
    if shared:
        visible[:] = visible[0]
    entry_w, query_w = torch.rand(kv, group, n) + 0.1, torch.rand(q) + 0.1
    scores = torch.zeros(kv, n)
    out = masked_attention(query, key, value, visible, 0.5, scores=scores, query_block=4,
                           score_weights=(entry_w, query_w))
    logits = torch.einsum("hgqd,hkd->hgqk", query[0].view(kv, group, q, d), key[0]) * 0.5
    probs = logits.masked_fill(~visible[:, None], float("-inf")).softmax(-1)  # [kv, group, q, keys]
    want = (probs[..., :n] * entry_w[:, :, None, :] * query_w[None, None, :, None]).amax(dim=(1, 2))
    torch.testing.assert_close(scores, want)
    ref = torch.einsum("hgqk,hkd->hgqd", probs, value[0]).reshape(1, kv * group, q, d).transpose(1, 2)
    torch.testing.assert_close(out, ref)  # the output is plain attention


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_kvzip_plus_scores_match_a_hand_computation(arch):
    """One chunk covering the context: the repeat pass is the model fed the repeat input after the full prefill,
    so eager attention probabilities, the attention inputs and the cached values give the scores by hand."""
    model, tok = tiny_model(arch)
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    context = layout.encode(tok, TEXT)
    full = prefill(model, prefix + context, len(prefix), layout, spec, 512)
    got = KVzip(chunk_size=4096, scoring="plus").score(model, tok, full)
    plain = KVzip(chunk_size=4096).score(model, tok, full)

    repeat = layout.encode(tok, layout.separator + tasks.REPEAT_PROMPT + layout.turn_end) + context
    cache = DynamicCache(config=model.config)
    for l in range(spec.num_layers):
        cache.update(full.keys[l][None], full.values[l][None], l)
    hidden = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw, l=l: hidden.__setitem__(l, kw["hidden_states"][0]), with_kwargs=True)
        for l, layer in enumerate(model.base_model.layers)]
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model.base_model(input_ids=torch.tensor([repeat]), past_key_values=cache, use_cache=True,
                               output_attentions=True)
    finally:
        model.set_attn_implementation(before)
        for h in hooks:
            h.remove()
    kv, d, sink, n = spec.num_kv_heads, spec.head_dim, full.sink, full.tokens
    group = spec.num_heads // kv
    for i, l in enumerate(spec.compressed_layers):
        probs = out.attentions[l][0, :, :, :n].view(kv, group, len(repeat), n)  # [kv, g, q, cached entries]
        weight = model.base_model.layers[l].self_attn.o_proj.weight
        wov = torch.stack([torch.stack([(weight[:, (h * group + g) * d : (h * group + g + 1) * d]
                                         @ full.values[l][h].T).norm(dim=0) for g in range(group)])
                           for h in range(kv)])  # [kv, g, n]
        x = hidden[l].norm(dim=-1)  # [q]
        want = (probs * wov[:, :, None, :] / x[None, None, :, None]).amax(dim=(1, 2))[:, sink:]
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(plain[i], probs.amax(dim=(1, 2))[:, sink:], rtol=1e-4, atol=1e-6)
        assert not torch.allclose(got[i] / got[i].max(), plain[i] / plain[i].max())  # the weighting matters
