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
* CPU, no sliding window: per KV head one call of torch's fused CPU flash kernel with the group's queries folded
  into one ``[g x q, head_dim]`` block over the head's rows (a view of the packed tensor; ``beta`` as its additive
  mask), and for the tail one folded flash call (one token) or a flash call over the earlier tail plus a causal
  one over the queries' own keys; the parts are merged through their log-sum-exps. On CPU this beats masked SDPA
  over padded heads, plain per-head products, nested-jagged SDPA and compiled flex_attention (BENCHMARKS.md,
  "Packed cache").
* a layer that keeps its quantized codes (``kvpack.compact_cache.CompactLayer``, ``dequantize="on-the-fly"``):
  ``kvpack.kernels.compact_decode_triton`` once per query token where Triton runs and there is no window, else the
  layer dequantized for this call and one of the paths here.
* otherwise (a sliding window, or question prefill on a GPU): per KV head, one product of the group's queries
  with the head's rows, the head's slice of the tail's logits (one batched product for all heads), one softmax
  over both, and two products with the values, in float32 (other dtypes are upcast per head).
"""

from __future__ import annotations

import torch

__all__ = ["packed_attention", "use_triton_for", "triton_decode", "compact_kernel_args"]

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
        from .compact_cache import kernel_runs_on

        if window is None and layer.kernel_problem is None and kernel_runs_on(query.device):
            return layer.compact_attention(query, scaling)
        layer = layer.materialized()
    if use_triton_for(query, window):
        return triton_decode(query, layer, scaling)
    if query.device.type == "cpu" and window is None:
        return _packed_attention_flash(query, layer, scaling)
    return _packed_attention_torch(query, layer, scaling, window)


def _packed_attention_flash(query, layer, scaling):
    """``packed_attention`` on CPU without a window: fused flash calls per KV head and for the tail, merged through
    their log-sum-exps."""
    from .attention import _attention_past_and_causal, _flash_folded

    _, heads, q_len, dim = query.shape
    kv_heads, tail = layer.num_kv_heads, layer.tail_length
    group = heads // kv_heads
    if q_len == 1:
        out_t, lse_t = _flash_folded(query, layer.keys, layer.values, scaling)
    else:
        out_t, lse_t = _attention_past_and_causal(query, layer.keys, layer.values, tail - q_len, scaling)
    outs, lses = [], []
    for h, (k, v, beta) in enumerate(layer.head_views()):
        n = k.shape[2]
        if n == 0:
            outs.append(out_t.new_zeros(1, group, q_len, v.shape[-1]))
            lses.append(lse_t.new_full((1, group, q_len), float("-inf")))
            continue
        qh = query[:, h * group : (h + 1) * group].reshape(1, 1, group * q_len, dim)
        mask = None if beta is None else beta.expand(1, 1, group * q_len, n)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, k, v, attn_mask=mask, scale=scaling)
        outs.append(o.view(1, group, q_len, -1))
        lses.append(lse.view(1, group, q_len))
    out_c, lse_c = torch.cat(outs, dim=1), torch.cat(lses, dim=1)
    total = torch.logaddexp(lse_c, lse_t)
    if query.dtype != torch.float32:
        out_c, out_t = out_c.float(), out_t.float()
    out = out_c * (lse_c - total).exp_().unsqueeze_(-1)
    out += out_t * (lse_t - total).exp_().unsqueeze_(-1)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def triton_decode(query: torch.Tensor, layer, scaling: float, validate: bool = False) -> torch.Tensor:
    """One decode token through the Triton varlen kernel (``kvpack.kernels.varlen_decode_triton``): the layer's packed
    rows are its full-precision segment (offsets ``layer.offsets``, biases ``layer.biases``), the tail its dense
    segment. ``query``: ``[1, heads, 1, head_dim]``; returns ``[1, 1, heads, head_dim_v]``. Raises what the
    launcher raises for shapes or dtypes it cannot take (``ValueError``, ``TypeError``)."""
    from .kernels import varlen_decode_triton

    out = varlen_decode_triton(query[0, :, 0], layer.kept_keys, layer.kept_values, layer.offsets, layer.keys[0],
                               layer.values[0], scaling, fp_biases=layer.biases, validate=validate)
    return out.view(1, 1, *out.shape)


def compact_kernel_args(entries, dtype: torch.dtype, device) -> dict:
    """The arguments of ``kvpack.kernels.compact_decode_triton`` for one compact-layout layer (``format/SPEC.md``
    §5.6), except ``q``, the tail and ``scale``: its full-precision rows (``entries.keys`` / ``values`` in
    ``dtype``, with per-head offsets), its body rows' codes and parameters as stored (no dequantization), the
    per-head body row and key group offsets, and its biases split between the two (``fp_biases``, ``q_biases``).

    Raises ``InputError`` if the layer is not in the compact layout.
    """
    from .errors import InputError
    from .quant import body_row_mask, quant_type

    qr = entries.quant
    if qr is None or qr.layout != "compact":
        raise InputError("compact_kernel_args needs a layer quantized in the compact layout (kvpack build --quant)")
    lengths, body = entries.head_lengths.long(), qr.body_lengths.long()
    zero = torch.zeros(1, dtype=torch.int64)
    groups = (body + qr.group_size - 1) // qr.group_size
    args = dict(fp_keys=entries.keys.to(dtype), fp_values=entries.values.to(dtype),
                fp_offsets=torch.cat([zero, (lengths - body).cumsum(0)]), key_codes=qr.key_codes,
                key_bits=qr.key_bits, key_params=qr.key_params, value_codes=qr.value_codes,
                value_params=qr.value_params, quant_grid=qr.quant_grid, q_offsets=torch.cat([zero, body.cumsum(0)]),
                group_offsets=torch.cat([zero, groups.cumsum(0)]), group_size=qr.group_size,
                bits=quant_type(qr.qtype).bits)
    if entries.biases is not None:
        in_body = body_row_mask(entries.head_lengths, qr.sink_lengths, qr.body_lengths)
        args.update(fp_biases=entries.biases[~in_body].float(), q_biases=entries.biases[in_body].float())
    return {k: v.to(device).contiguous() if torch.is_tensor(v) else v for k, v in args.items()}


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
