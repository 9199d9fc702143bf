"""kvpack's attention function, registered with transformers' ``AttentionInterface`` as ``"kvpack"``.

A ``PackedLayer`` (see ``kvpack.cache``) returns keys that carry a reference to the layer; for those keys this
function builds each KV head's visibility from the entries' original RoPE positions:

    visible[h, i, j] = pos[h, j] >= 0  and  pos[h, j] <= qpos[i]  (and qpos[i] - pos[h, j] < window when sliding)

(``pos = -1`` marks padding of shorter heads), so every head attends only to its kept entries plus the new tokens.
For any other keys it is exactly transformers' SDPA attention, so a model switched to ``"kvpack"`` behaves as
before with ordinary caches.

While KVzip scores (arXiv 2505.23416 §3.2, Eq. 2) the layer also carries a score buffer: the function then
computes the softmax explicitly, in query blocks, and folds ``max`` over queries and over the query heads of each
GQA group into the buffer (shape ``[kv_heads, kept_entries]``).

While a context is prefilled for a method that scores by prefill attention (H2O, D2O, SnapKV, PyramidKV),
``kvpack.prefill`` tags each compressed layer's keys with an ``AttentionRecorder`` (``kvpack.stats``): for column
sums the function computes the chunk's causal attention together with each query's log-sum-exp
(``attention_with_lse``) and hands both to the recorder; for an observation window it hands the recorder the
chunk's queries and keys and computes the attention as plain SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import UnsupportedModelError
from .stats import visible_mask

__all__ = ["ATTN_IMPLEMENTATION", "register", "use_kvpack_attention", "masked_attention", "attention_with_lse",
           "QUERY_BLOCK"]

ATTN_IMPLEMENTATION = "kvpack"
#: Queries processed at once when attention probabilities are materialised (bounds memory while scoring).
QUERY_BLOCK = 512
#: Entries of one block of log-probabilities while scoring on CPU (64 MB of float32).
SCORE_BLOCK_ELEMENTS = 16 * 2**20
_registered = False


def masked_attention(query, key, value, visible, scaling, scores=None, query_block: int = QUERY_BLOCK):
    """Attention with a per-KV-head visibility mask.

    Args:
        query: ``[1, heads, q, head_dim]``.
        key, value: ``[1, kv_heads, kv, head_dim]``; ``heads`` is a multiple of ``kv_heads`` (GQA).
        visible: ``[kv_heads, q, kv]`` bool; every query row must see at least one entry.
        scaling: softmax temperature applied to ``q . k``.
        scores: optional ``[kv_heads, n]`` float32 buffer (``n <= kv``); if given, updated in place with
            ``max`` over queries and GQA group of the attention probabilities of the first ``n`` entries.

    Returns:
        ``[1, q, heads, head_dim_v]`` attention output (the layout transformers expects).
    """
    b, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if scores is None:
        mask = visible.repeat_interleave(group, dim=0).unsqueeze(0)  # [1, heads, q, kv]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    if query.device.type == "cpu" and bool((visible == visible[:1]).all()):
        return _scored_attention_fused(query, key, value, visible[0], scaling, scores)
    return _scored_attention_explicit(query, key, value, visible, scaling, scores, query_block)


def _scored_attention_fused(query, key, value, visible, scaling, scores):
    """CPU: the fused flash kernel gives the output and each query's log-sum-exp; the scores then need only one
    matrix product over the first ``n`` entries, ``max_q exp(q . k * scaling - lse_q)``, done as
    ``[q * scaling, -lse] . [k, 1]``. ``visible``: ``[q, kv]``, the same for every head."""
    _, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    bias = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill_(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1),
        attn_mask=bias[None, None], scale=scaling)
    n = scores.shape[1]
    # log p = [q * scaling, -lse] . [k, 1], computed as [kv_heads, n, d + 1] x [kv_heads, d + 1, queries x group]
    # so that the max over queries runs along memory; queries in blocks of ~SCORE_BLOCK_ELEMENTS outputs
    k_aug = torch.cat([key[0, :, :n].float(), key.new_ones(kv_heads, n, 1, dtype=torch.float32)], dim=-1)
    q_aug = torch.cat([query[0].float() * scaling, -lse.reshape(heads, q_len, 1).float()], dim=-1)
    q_aug = q_aug.view(kv_heads, group, q_len, dim + 1).permute(0, 3, 2, 1).contiguous()  # [kv, d+1, q, g]
    hidden = ~visible[:, :n]
    any_hidden = bool(hidden.any())
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, kv_heads * n * group))
    for s in range(0, q_len, block):
        qb = q_aug[:, :, s : s + block]
        b = qb.shape[2]
        log_probs = torch.bmm(k_aug, qb.reshape(kv_heads, dim + 1, b * group))  # [kv_heads, n, b * group]
        if any_hidden:
            log_probs.view(kv_heads, n, b, group).masked_fill_(hidden[s : s + block].T[None, :, :, None],
                                                               float("-inf"))
        torch.maximum(scores, log_probs.amax(dim=-1).exp_(), out=scores)
    return out.transpose(1, 2).contiguous()


def _scored_attention_explicit(query, key, value, visible, scaling, scores, query_block):
    """Any device: materialise the probabilities block by block. ``visible``: ``[kv_heads, q, kv]``."""
    _, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    n = scores.shape[1]
    k = key[0].float()  # [kv_heads, kv, d]
    v = value[0].float()
    outs = []
    for s in range(0, q_len, query_block):
        qb = query[0, :, s : s + query_block].float().view(kv_heads, group, -1, query.shape[-1])
        logits = torch.einsum("hgqd,hkd->hgqk", qb, k) * scaling
        logits.masked_fill_(~visible[:, None, s : s + query_block], float("-inf"))
        probs = logits.softmax(dim=-1)  # [kv_heads, group, qb, kv]
        torch.maximum(scores, probs[..., :n].amax(dim=(1, 2)), out=scores)
        outs.append(torch.einsum("hgqk,hkd->hgqd", probs, v).reshape(heads, -1, v.shape[-1]))
    out = torch.cat(outs, dim=1).to(query.dtype)  # [heads, q, d]
    return out.unsqueeze(0).transpose(1, 2).contiguous()


def attention_with_lse(query, key, value, scaling, window=None):
    """Causal attention of a prefill chunk, with each query's log-sum-exp.

    Args:
        query: ``[1, heads, q, head_dim]``, the last ``q`` positions of the keys.
        key, value: ``[1, kv_heads, kv, head_dim]`` (GQA allowed), ``kv >= q``.
        scaling: softmax temperature applied to ``q . k``.
        window: sliding window in tokens (a query sees the keys less than ``window`` behind it), or ``None``.

    Returns:
        ``(out, lse)``: ``[1, q, heads, head_dim_v]`` in the query's dtype (the layout transformers expects) and
        ``[1, heads, q]`` float32 ``log sum_j exp(q . k_j * scaling)`` over the visible keys.

    On CPU without a biting window this is two calls of the fused flash kernel, one over the keys before the chunk
    (all visible) and one causal over the chunk's own keys, combined through their log-sum-exps; no mask is built.
    """
    _, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    group = heads // key.shape[1]
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if query.device.type == "cpu" and (window is None or kv_len <= window):
        past = kv_len - q_len
        out, lse = flash(query, k[:, :, past:], v[:, :, past:], is_causal=True, scale=scaling)
        if past > 0:
            out_past, lse_past = flash(query, k[:, :, :past], v[:, :, :past], scale=scaling)
            total = torch.logaddexp(lse, lse_past)
            out = out * (lse - total).exp().unsqueeze(-1).to(out.dtype) \
                + out_past * (lse_past - total).exp().unsqueeze(-1).to(out.dtype)
            lse = total
        return out.transpose(1, 2).contiguous(), lse.float()
    visible = visible_mask(q_len, kv_len, window, query.device)
    if query.device.type == "cpu":
        bias = torch.zeros(visible.shape, dtype=query.dtype).masked_fill_(~visible, float("-inf"))
        out, lse = flash(query, k, v, attn_mask=bias[None, None], scale=scaling)
        return out.transpose(1, 2).contiguous(), lse.float()
    return _attention_with_lse_explicit(query, k, v, visible, scaling)


def _attention_with_lse_explicit(query, k, v, visible, scaling, query_block: int = QUERY_BLOCK):
    """Any device: softmax in blocks of queries. ``k``, ``v``: ``[1, heads, kv, d]`` (already repeated per GQA
    group); ``visible``: ``[q, kv]``. Returns what ``attention_with_lse`` returns."""
    outs, lses = [], []
    for s in range(0, query.shape[2], query_block):
        logits = torch.matmul(query[0, :, s : s + query_block].float(), k[0].float().transpose(1, 2)) * scaling
        logits.masked_fill_(~visible[None, s : s + query_block], float("-inf"))
        lse = logits.logsumexp(dim=-1)  # [heads, b]
        outs.append(torch.matmul((logits - lse[..., None]).exp_(), v[0].float()))
        lses.append(lse)
    out = torch.cat(outs, dim=1).to(query.dtype).unsqueeze(0)
    return out.transpose(1, 2).contiguous(), torch.cat(lses, dim=1).unsqueeze(0)


def kvpack_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             **kwargs):
    """The function registered as ``"kvpack"``; signature of transformers' attention interface."""
    layer = getattr(key, "_kvpack_layer", None)
    recording = getattr(key, "_kvpack_recording", None)
    if recording is not None:  # a chunk of kvpack.prefill (batch size 1), with or without an AttentionRecorder
        recorder, layer_idx, key_start = recording
        q_start = key_start + key.shape[2] - query.shape[2]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        window = kwargs.get("sliding_window")
        if recorder is not None and recorder.wants_columns(layer_idx, q_start):
            out, lse = attention_with_lse(query, key, value, scale, window)
            recorder.record(layer_idx, query, key, scale, key_start, window, lse)
            return out, None
        if recorder is not None and recorder.wants_window(layer_idx, q_start, query.shape[2]):
            recorder.record(layer_idx, query, key, scale, key_start, window)
        if query.device.type == "cpu":  # unmasked flash calls; elsewhere transformers' SDPA below
            return attention_with_lse(query, key, value, scale, window)[0], None
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModelError("attention soft-capping and attention sinks are not supported by kvpack")
    if query.shape[0] != 1:
        raise UnsupportedModelError("a kvpack cache serves one sequence at a time (batch size 1)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    visible = layer.visibility(query.shape[2], kwargs.get("sliding_window"))
    return masked_attention(query, key, value, visible, scaling, scores=layer.scores), None


def register() -> None:
    """Register ``"kvpack"`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpack_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _registered = True


def use_kvpack_attention(model) -> None:
    """Switch ``model`` to the ``"kvpack"`` attention (SDPA-equivalent for ordinary caches)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
