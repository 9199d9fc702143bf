"""Attention of new tokens over a ``PackedLayer``: each KV head over its own packed rows plus the tail.

For query head ``j`` of KV head ``h = j // g`` (GQA group ``g``), query token ``i`` at logical position
``qpos_i`` and head ``h``'s kept rows ``k_n, v_n`` (original positions ``p_n``, biases ``beta_n``) followed by the
tail's rows ``t_m`` (logical positions ``original_length + m``):

    s_n = scale * q_ij . k_n + beta_n          (kept rows; hidden when qpos_i - p_n >= window)
    s_m = scale * q_ij . t_m                   (tail rows; hidden when after qpos_i, or qpos_i - pos_m >= window)
    out_ij = softmax([s_n ; s_m]) @ [v_n ; tail values]

(Attention Matching, arXiv 2602.16284, adds ``beta`` to each compacted entry's logit; new tokens have none.)
No row is copied and nothing is padded:

* CUDA, one query token, no sliding window, triton installed: the Triton varlen decode kernel
  (``kvpack.kernels.varlen_decode_triton``), one program per KV head (and split) over its rows and the tail.
* CPU, no sliding window: torch's fused CPU flash kernel with each KV head's group of queries folded into one
  ``[g x q, head_dim]`` block (``kvpack.attention_math.flash_folded``), over views of the packed rows (``beta`` as
  the additive mask): one call for all heads when every head keeps the same entries (``PackedLayer.dense``: a
  ``none`` pack, KVzip's prefill views), else one call per KV head. The tail is one folded flash call (one token)
  or a flash call over the earlier tail plus a causal one over the queries' own keys; the two parts are merged
  exactly through their log-sum-exps (``attention_math.merge_partials``). On CPU this beats masked SDPA over
  padded heads, plain per-head products, nested-jagged SDPA and compiled flex_attention (BENCHMARKS.md, "Packed
  cache").
* a layer that keeps its quantized codes (``kvpack.compact_cache.CompactLayer``, ``dequantize="on-the-fly"``):
  ``kvpack.kernels.compact_decode_triton`` once per query token where Triton runs and there is no window, else the
  layer dequantized for this call and one of the paths here.
* otherwise (a sliding window, or question prefill on a GPU): per KV head, one product of the group's queries
  with the head's rows, the head's slice of the tail's logits (one batched product for all heads), one softmax
  over both, and two products with the values, in float32 (other dtypes are upcast per head).
"""

from __future__ import annotations

import torch

from .attention_math import attention_past_and_causal, flash_folded, merge_partials

__all__ = ["packed_attention", "use_triton_for", "triton_decode"]

#: Logit elements of one head's block of queries (bounds memory for long continuations: 16M floats, 64 MB).
LOGIT_BLOCK = 2**24


def use_triton_for(query: torch.Tensor, window: int | None) -> bool:
    """Whether ``packed_attention`` takes the Triton kernel for ``query`` ``[1, heads, q, head_dim]``: CUDA, one
    token, no window, and ``kvpack.kernels`` imports with triton."""
    if not query.is_cuda or query.shape[2] != 1 or window is not None:
        return False
    from . import kernels

    return kernels.HAS_TRITON


def packed_attention(query: torch.Tensor, layer, scaling: float, window: int | None = None) -> torch.Tensor:
    """Attention of the last ``q`` tail tokens of ``layer`` over each head's kept rows and the tail (module doc).

    Args:
        query: ``[1, heads, q, head_dim]``, the queries of the layer's last ``q`` tail tokens (``heads`` a multiple
            of the layer's KV heads).
        layer: a ``kvpack.cache.PackedLayer`` whose tail already holds the ``q`` tokens' keys and values.
        scaling: softmax temperature applied to ``q . k``.
        window: sliding window in tokens (a query sees the entries less than ``window`` positions behind it), or
            ``None``.

    Returns:
        ``[1, q, heads, head_dim_v]`` in the query's dtype (the layout transformers expects).
    """
    if getattr(layer, "compact", None) is not None:  # kvpack.compact_cache.CompactLayer: codes as stored
        if layer.reads_codes(query.device, window):
            return layer.compact_attention(query, scaling)
        layer = layer.materialized()
    if use_triton_for(query, window):
        return triton_decode(query, layer, scaling)
    if query.device.type == "cpu" and window is None:
        return _packed_attention_flash(query, layer, scaling)
    return _packed_attention_torch(query, layer, scaling, window)


def _packed_attention_flash(query, layer, scaling):
    """``packed_attention`` on CPU without a window: fused flash calls (one for every head's rows when the layer is
    ``dense``, else one per KV head) and one or two for the tail, merged through their log-sum-exps."""
    _, heads, q_len, dim = query.shape
    tail = layer.tail_length
    if q_len == 1:
        out_t, lse_t = flash_folded(query, layer.keys, layer.values, scaling)
    else:
        out_t, lse_t = attention_past_and_causal(query, layer.keys, layer.values, tail - q_len, scaling)
    if layer.kept == 0:  # no kept entry at all: the tail alone
        return out_t.transpose(1, 2).contiguous()
    dense = layer.dense_views()
    if dense is not None:
        keys, values, beta = dense
        mask = None if beta is None else beta.expand(1, -1, (heads // layer.num_kv_heads) * q_len, -1)
        out_c, lse_c = flash_folded(query, keys, values, scaling, mask)
    else:
        out_c, lse_c = _per_head_flash(query, layer, scaling)
    out, _ = merge_partials(out_c, lse_c, out_t, lse_t)
    return out.transpose(1, 2).contiguous()


def _per_head_flash(query, layer, scaling):
    """Each KV head's kept rows (views) through one folded flash call of its own: ``out`` ``[1, heads, q, d_v]`` and
    ``lse`` ``[1, heads, q]`` float32 (zeros and ``-inf`` for a head with no rows)."""
    _, heads, q_len, dim = query.shape
    group = heads // layer.num_kv_heads
    outs, lses = [], []
    for h, (k, v, beta) in enumerate(layer.head_views()):
        n = k.shape[2]
        if n == 0:
            outs.append(query.new_zeros(1, group, q_len, v.shape[-1]))
            lses.append(query.new_full((1, group, q_len), float("-inf"), dtype=torch.float32))
            continue
        mask = None if beta is None else beta.expand(1, 1, group * q_len, n)
        o, lse = flash_folded(query[:, h * group : (h + 1) * group], k, v, scaling, mask)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def triton_decode(query: torch.Tensor, layer, scaling: float, validate: bool = False) -> torch.Tensor:
    """One decode token through the Triton varlen kernel (``kvpack.kernels.varlen_decode_triton``): the layer's packed
    rows are its full-precision segment (offsets ``layer.offsets``, biases ``layer.biases``), the tail its dense
    segment. ``query``: ``[1, heads, 1, head_dim]``; returns ``[1, 1, heads, head_dim_v]``. Raises what the
    launcher raises for shapes or dtypes it cannot take (``ValueError``, ``TypeError``)."""
    from .kernels import varlen_decode_triton

    out = varlen_decode_triton(query[0, :, 0], layer.kept_keys, layer.kept_values, layer.offsets, layer.keys[0],
                               layer.values[0], scaling, fp_biases=layer.biases, validate=validate)
    return out.view(1, 1, *out.shape)


def _tail_visibility(q_len: int, tail: int, window: int | None, device) -> torch.Tensor | None:
    """``[q, tail]`` bool: query ``i`` (tail row ``tail - q + i``) sees tail row ``m``; ``None`` when all do."""
    if q_len == 1 and (window is None or tail <= window):
        return None
    qi = torch.arange(tail - q_len, tail, device=device)[:, None]
    m = torch.arange(tail, device=device)[None, :]
    visible = m <= qi
    if window is not None:
        visible &= (qi - m) < window
    return visible


def _packed_attention_torch(query, layer, scaling, window):
    """``packed_attention`` with torch products, per KV head, in float32, blocked over queries (``LOGIT_BLOCK``)."""
    _, heads, q_len, dim = query.shape
    kv_heads, tail = layer.num_kv_heads, layer.tail_length
    group = heads // kv_heads
    dv = layer.values.shape[-1]
    q = (query[0].float() * scaling).contiguous().view(kv_heads, group, q_len, dim)
    tail_k, tail_v = layer.keys[0].float(), layer.values[0].float()  # [kv_heads, tail, d]
    tail_logits = torch.matmul(q.view(kv_heads, group * q_len, dim), tail_k.transpose(1, 2))
    tail_logits = tail_logits.view(kv_heads, group, q_len, tail)
    hidden = _tail_visibility(q_len, tail, window, query.device)
    if hidden is not None:
        tail_logits.masked_fill_(~hidden, float("-inf"))
    qpos = None if window is None else layer.original_length + tail - q_len + torch.arange(q_len, device=query.device)
    out = query.new_empty(kv_heads, group, q_len, dv, dtype=torch.float32)
    for h in range(kv_heads):
        k, v, pos, beta = layer.head_rows(h)
        n = k.shape[0]
        if n == 0:
            out[h] = tail_logits[h].softmax(-1) @ tail_v[h]
            continue
        k, v = k.float(), v.float()  # no copy in float32
        block = max(1, LOGIT_BLOCK // max(1, group * (n + tail)))
        for s in range(0, q_len, block):
            qb = q[h, :, s : s + block]  # [g, b, d]
            b = qb.shape[1]
            logits = torch.matmul(qb.reshape(group * b, dim), k.T).view(group, b, n)
            if beta is not None:
                logits += beta
            if window is not None:
                logits.masked_fill_((qpos[s : s + b, None] - pos[None, :]) >= window, float("-inf"))
            probs = torch.cat([logits, tail_logits[h, :, s : s + b]], dim=-1).softmax(-1)
            o = torch.matmul(probs[..., :n], v)
            o += torch.matmul(probs[..., n:], tail_v[h])
            out[h, :, s : s + b] = o
    return out.view(heads, q_len, dv).transpose(0, 1).unsqueeze(0).to(query.dtype).contiguous()
