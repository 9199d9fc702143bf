"""An independent reference for the loaded cache: the model's own full cache with evicted entries masked.

The full prefill runs through transformers' SDPA path into an ordinary ``DynamicCache``; question tokens are then
fed with a test-only attention function that computes softmax attention eagerly with a per-(layer, KV head)
visibility mask built from the pack's kept positions. It shares no code with ``kvpack.cache`` or
``kvpack.attention``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache

_MASKS: dict[int, torch.Tensor] = {}
_NAME = "kvpack_test_reference"


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    visible = _MASKS[module.layer_idx]  # [kv_heads, q, all positions]
    visible = visible[..., visible.shape[-1] - key.shape[2] :]  # a sliding layer's cache holds only its window
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1).double()
    v = value.repeat_interleave(group, dim=1).double()
    logits = query.double() @ k.transpose(-1, -2) * scaling
    logits = logits.masked_fill(~visible.repeat_interleave(group, dim=0)[None], float("-inf"))
    out = logits.softmax(-1) @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(_NAME, _reference_attention)


@torch.no_grad()
def masked_reference_logits(model, token_ids: list[int], question_ids: list[int],
                            kept: list[list[set[int]] | None], windows: list[int | None]) -> torch.Tensor:
    """Logits ``[q, vocab]`` for ``question_ids`` after ``token_ids``, each head seeing only its kept positions.

    ``kept[l][h]``: positions kept by head h of layer l (``None`` for a layer kept whole); ``windows[l]``: the
    layer's sliding window or ``None``.
    """
    n, q = len(token_ids), len(question_ids)
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
    heads = model.config.num_key_value_heads
    total = n + q
    qpos = torch.arange(n, total)[:, None]
    kpos = torch.arange(total)[None, :]
    for l in range(model.config.num_hidden_layers):
        vis = torch.zeros(heads, q, total, dtype=torch.bool)
        for h in range(heads):
            allowed = torch.zeros(total, dtype=torch.bool)
            if kept[l] is None:
                allowed[:n] = True
            else:
                allowed[sorted(kept[l][h])] = True
            allowed[n:] = True
            vis[h] = allowed[None, :] & (kpos <= qpos)
            if windows[l] is not None:
                vis[h] &= (qpos - kpos) < windows[l]
        _MASKS[l] = vis
    model.set_attn_implementation(_NAME)
    try:
        out = model(input_ids=torch.tensor([question_ids]), past_key_values=cache, use_cache=True)
    finally:
        model.set_attn_implementation(impl)
    return out.logits[0].float()
