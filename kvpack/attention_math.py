"""The attention arithmetic the decode path and the prefill share: the bottom floor of kvpack's attention.

Nothing here knows about caches, layers or models: every function takes plain tensors and returns plain tensors, and
this module imports nothing from kvpack. Above it, ``kvpack.varlen`` attends over a loaded cache's packed rows,
``kvpack.stats`` records prefill statistics, and ``kvpack.attention`` (the function registered with transformers)
dispatches between them. A decode step reads down these floors, never back up.

Shapes: ``heads`` query heads, ``kv_heads`` KV heads (``heads`` a multiple of them: GQA group
``group = heads // kv_heads``), ``q`` query tokens, ``kv`` key rows, ``d`` / ``d_v`` key / value channels.
Log-sum-exps (``lse``) are natural-log ``log sum_j exp(q . k_j * scaling)`` in float32.

Every function here runs torch's fused CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
FlashAttention's online softmax, arXiv 2205.14135 §3.1), which returns the log-sum-exp beside the output; partial
results over disjoint key sets are combined exactly by ``merge_partials``.
"""

from __future__ import annotations

import torch

__all__ = ["flash", "flash_folded", "attention_past_and_causal", "shared_prefix_attention", "merge_partials"]


def flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, *, causal: bool = False,
          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of torch's fused CPU flash kernel: ``softmax(q . k * scaling + mask) v`` with each query's
    log-sum-exp.

    Args:
        query: ``[b, h, q, d]``; key, value: ``[b, h, kv, d(_v)]`` (no GQA: heads already matched).
        scaling: the softmax temperature.
        causal: top-left causal mask (query ``i`` sees keys ``j <= i``).
        mask: optional additive float mask broadcastable to ``[b, h, q, kv]`` (``-inf`` hides an entry).

    Returns:
        ``(out, lse)``: ``[b, h, q, d_v]`` in the query's dtype and ``[b, h, q]`` float32.
    """
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, is_causal=causal,
                                                                         attn_mask=mask, scale=scaling)
    return out, lse.float()


def flash_folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                 mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked (or additively masked) CPU flash attention with the GQA group folded into the queries: the keys are
    read once per KV head, never repeated.

    Args:
        query: ``[1, heads, q, d]``; key, value: ``[1, kv_heads, kv, d(_v)]``.
        scaling: the softmax temperature.
        mask: optional additive float mask broadcastable to ``[1, kv_heads, group x q, kv]`` (the same for every
            query of a KV head's group, e.g. per-entry biases ``[1, kv_heads, 1, kv]``).

    Returns:
        ``(out, lse)``: ``[1, heads, q, d_v]`` in the query's dtype and ``[1, heads, q]`` float32.
    """
    _, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(1, kv_heads, (heads // kv_heads) * q_len, dim)
    out, lse = flash(folded, key, value, scaling, mask=mask)
    return out.reshape(1, heads, q_len, -1), lse.reshape(1, heads, q_len)


def attention_past_and_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int,
                              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries that are the last ``q`` of the keys: ``past`` fully visible entries plus their own keys causally, as
    two flash calls (the past with the group folded, the new keys causally) merged through their log-sum-exps.

    Args:
        query: ``[1, heads, q, d]``; key, value: ``[1, kv_heads, past + q, d(_v)]``.
        past: entries before the queries' own keys (``>= 0``).
        scaling: the softmax temperature.

    Returns:
        ``(out, lse)``: ``[1, heads, q, d_v]`` in the query's dtype and ``[1, heads, q]`` float32.
    """
    group = query.shape[1] // key.shape[1]
    new_k = key[:, :, past:].repeat_interleave(group, dim=1)
    new_v = value[:, :, past:].repeat_interleave(group, dim=1)
    out, lse = flash(query, new_k, new_v, scaling, causal=True)
    if past > 0:
        out_past, lse_past = flash_folded(query, key[:, :, :past], value[:, :, :past], scaling)
        out, lse = merge_partials(out, lse, out_past, lse_past)
    return out, lse


def shared_prefix_attention(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float
                            ) -> torch.Tensor:
    """A batch of sequences that continue one shared prefix: every query attends over the prefix's entries (held
    once, not once per sequence) and over the visible entries of its own sequence's suffix.

    The prefix part is one flash call with the batch and the GQA group folded into the queries (the prefix is read
    once per KV head for the whole batch); the suffix part, short, is explicit; the two are merged through their
    log-sum-exps (``merge_partials``), which is exact.

    Args:
        query: ``[b, heads, q, d]``: the last ``q`` tokens of each sequence's suffix.
        prefix_key, prefix_value: ``[1, kv_heads, p, d(_v)]``, visible to every query.
        key, value: ``[b, kv_heads, s, d(_v)]``: each sequence's suffix so far, the queries' own tokens last.
        visible: ``[b, q, s]`` bool: which suffix entries each query sees (left padding and causality). A query
            may see none (a padding row): it then attends over the prefix alone.
        scaling: the softmax temperature.

    Returns:
        ``[b, heads, q, d_v]`` in the query's dtype. Raises nothing beyond torch's errors for mismatched shapes.
        The split into two partial softmaxes follows FlashAttention's (arXiv 2205.14135 §3.1).
    """
    b, heads, q_len, dim = query.shape
    kv_heads = prefix_key.shape[1]
    group = heads // kv_heads
    folded = query.reshape(b, kv_heads, group * q_len, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    out_p, lse_p = flash(folded, prefix_key, prefix_value, scaling)  # [1, kv_heads, b * group * q, d_v]
    out_p = out_p.reshape(kv_heads, b, group * q_len, -1).transpose(0, 1)
    lse_p = lse_p.reshape(kv_heads, b, group * q_len).transpose(0, 1)
    logits = torch.matmul(query.reshape(b, kv_heads, group * q_len, dim).float(), key.float().transpose(-1, -2))
    logits.mul_(scaling).masked_fill_(~visible.repeat(1, group, 1)[:, None], float("-inf"))
    lse_s = logits.logsumexp(dim=-1)  # [b, kv_heads, group * q]; -inf where a query sees no suffix entry
    probs = (logits - torch.where(torch.isfinite(lse_s), lse_s, 0.0)[..., None]).exp_()
    out_s = torch.matmul(probs, value.float())
    out, _ = merge_partials(out_p.float(), lse_p, out_s, lse_s)
    return out.reshape(b, heads, q_len, -1).to(query.dtype)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the attention over each (exact, not approximate).

    With ``w = exp(lse_b) / (exp(lse_a) + exp(lse_b)) = sigmoid(lse_b - lse_a)``, the softmax over both sets is
    ``out = out_a + w (out_b - out_a)`` and ``lse = logaddexp(lse_a, lse_b)``. A set with no visible key has
    ``lse = -inf`` and weight 0 (its ``out`` must then be finite, e.g. zeros).

    Args:
        out_a, out_b: ``[..., q, d_v]`` outputs over each set (any float dtype).
        lse_a, lse_b: ``[..., q]`` float32 log-sum-exps.

    Returns:
        ``(out, lse)``: ``out`` in ``out_a``'s dtype (computed in float32 when it is a reduced precision) and
        ``lse`` float32.
    """
    w = torch.sigmoid(lse_b - lse_a).unsqueeze_(-1)
    dtype = out_a.dtype
    if dtype != torch.float32:
        out = torch.lerp(out_a.float(), out_b.float(), w).to(dtype)
    else:
        out = torch.lerp(out_a, out_b, w)
    return out, torch.logaddexp(lse_a, lse_b)
