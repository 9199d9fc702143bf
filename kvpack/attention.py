"""kvpack's attention function, registered with transformers' ``AttentionInterface`` as ``"kvpack"``.

A ``PackedLayer`` (see ``kvpack.cache``) returns its tail's keys tagged with a reference to the layer; for those
keys this function attends every KV head over its own packed kept entries (with their attention-logit biases)
plus the tail (``kvpack.varlen.packed_attention``). For any other keys it is exactly transformers' SDPA
attention, so a model switched to ``"kvpack"`` behaves as before with ordinary caches.

While KVzip scores (arXiv 2505.23416 §3.2, Eq. 2) the layer also carries a score buffer (shape
``[kv_heads, kept_entries]``) into which ``max`` over queries and over the query heads of each GQA group of the
attention probabilities is folded; the layer's entries are then laid out on one ``[kv_heads, kept + tail]`` grid
(``PackedLayer.padded``: a view when every head holds the same entries, as in KVzip's prefill views), each head
masked to its own entries: ``visible[h, i, j] = pos[h, j] >= 0 and pos[h, j] <= qpos[i]`` (and
``qpos[i] - pos[h, j] < window`` when sliding), ``pos = -1`` marking padding. On CPU, when every head sees all
its entries (KVzip's repeat pass), float32 takes one explicit blocked pass that gives the output and the scores
from the same probabilities (``kvpack.stats.one_pass_attention``); other CPU cases take the fused flash kernel
for the output and each query's log-sum-exp, then one blocked product for the probabilities
(``update_max_scores``); elsewhere the
softmax is computed explicitly in query blocks.

While a context is prefilled for a method that scores by prefill attention (H2O, D2O, SnapKV, PyramidKV),
``kvpack.prefill`` tags each compressed layer's keys with an ``AttentionRecorder`` (``kvpack.stats``): for column
sums the function computes the chunk's causal attention together with its column sums in one pass where that is
faster (``kvpack.stats.attention_with_column_sums``: CPU, float32, no sliding window cutting the chunk), elsewhere
together with each query's log-sum-exp (``attention_with_lse``), and hands them to the recorder; for an
observation window it hands the recorder the chunk's queries and keys and computes the attention as plain SDPA.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from .attention_math import attention_past_and_causal, flash, shared_prefix_attention
from .errors import UnsupportedModelError
from .stats import attention_with_column_sums, one_pass_applies, one_pass_attention, visible_mask
from .varlen import packed_attention

__all__ = ["ATTN_IMPLEMENTATION", "register", "use_kvpack_attention", "masks_unused", "masked_attention", "logit_mask",
           "scored_attention_dense", "update_max_scores", "attention_with_lse", "QUERY_BLOCK"]

ATTN_IMPLEMENTATION = "kvpack"
#: Queries processed at once when attention probabilities are materialised (bounds memory while scoring).
QUERY_BLOCK = 512
#: Entries of one block of log-probabilities while scoring on CPU (4 MB of float32: it stays in cache between
#: the product and the max; 64 MB blocks made scoring 2x slower on the development machine).
SCORE_BLOCK_ELEMENTS = 2**20
_registered = False
#: True while ``masks_unused`` is active: the ``"kvpack"`` mask function then builds no mask.
_MASKS_UNUSED = contextvars.ContextVar("kvpack_masks_unused", default=False)
#: ``queries_to``'s sink, or ``None``.
_QUERY_SINK: contextvars.ContextVar = contextvars.ContextVar("kvpack_query_sink", default=None)


def masked_attention(query, key, value, visible, scaling, scores=None, query_block: int = QUERY_BLOCK, bias=None,
                     score_weights=None):
    """Attention with a per-KV-head visibility mask and optional per-entry logit biases.

    Args:
        query: ``[1, heads, q, head_dim]``.
        key, value: ``[1, kv_heads, kv, head_dim]``; ``heads`` is a multiple of ``kv_heads`` (GQA).
        visible: ``[kv_heads, q, kv]`` bool; every query row must see at least one entry.
        scaling: softmax temperature applied to ``q . k``.
        scores: optional ``[kv_heads, n]`` float32 buffer (``n <= kv``); if given, updated in place with
            ``max`` over queries and GQA group of the attention probabilities of the first ``n`` entries.
        bias: optional ``[kv_heads, kv]`` float32 added to every query's logit of each entry (Attention Matching's
            beta, arXiv 2602.16284 §3): ``softmax(q . k * scaling + bias)`` (``logit_mask``).
        score_weights: optional ``(entry, query)`` weights of those probabilities before the max (KVzip+,
            ``kvpack.methods.kvzip_plus``): ``entry`` ``[kv_heads, group, n]`` per query head and entry, ``query``
            ``[q]`` per query; the scores are then ``max_{g, t} p[h, g, t, i] * entry[h, g, i] * query[t]``.

    Returns:
        ``[1, q, heads, head_dim_v]`` attention output (the layout transformers expects).
    """
    b, heads, q_len, _ = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if scores is None:
        mask = visible if bias is None else logit_mask(visible, bias, query.dtype)
        mask = mask.repeat_interleave(group, dim=0).unsqueeze(0)  # [1, heads, q, kv]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    if bias is None and query.device.type == "cpu" and bool((visible == visible[:1]).all()):
        return _scored_attention_fused(query, key, value, visible[0], scaling, scores, score_weights)
    return _scored_attention_explicit(query, key, value, visible, scaling, scores, query_block, bias, score_weights)


def logit_mask(visible: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one place per-entry biases become an additive attention term: ``[kv_heads, q, kv]`` in ``dtype``,
    ``bias[h, j]`` where ``visible[h, i, j]``, ``-inf`` elsewhere (``visible``: ``[kv_heads, q, kv]`` bool;
    ``bias``: ``[kv_heads, kv]`` float32). In a reduced-precision ``dtype`` the bias is rounded to it, as SDPA
    adds masks in the query's dtype."""
    return torch.where(visible, bias[:, None, :].float(), float("-inf")).to(dtype)


def scored_attention_dense(query, key, value, past: int, scaling, scores, context=None):
    """KVzip's repeat pass on CPU when every head sees all ``past`` cached entries (no padding, no window).

    The queries are the last ``q`` of the keys: they see the ``past`` entries and, causally, each other. The
    score of each of the first ``n = scores.shape[1]`` entries is the maximum of its attention probability over the
    queries and the query heads of its GQA group (arXiv 2505.23416, §3.2, Eq. 2). In float32 one explicit blocked
    pass (``kvpack.stats.one_pass_attention``) gives the output and the scores from the same probabilities, so
    each ``q . k`` is computed once; in other dtypes ``_scored_attention_flash`` computes them twice.

    Args:
        query: ``[1, heads, q, head_dim]``; key, value: ``[1, kv_heads, past + q, head_dim]``.
        past: cached entries before the queries' own keys (``>= n``).
        scaling: softmax temperature; scores: ``[kv_heads, n]`` float32, updated in place.
        context: optional ``kvpack.stats.ContextAttention`` (Attention Matching's RMS selection), filled in by the
            float32 pass from the same probabilities; in other dtypes it is left unresolved.

    Returns:
        ``[1, q, heads, head_dim_v]`` attention output.
    """
    if query.dtype == torch.float32:
        return one_pass_attention(query, key, value, scaling, max_scores=scores, context=context)[0]
    return _scored_attention_flash(query, key, value, past, scaling, scores)


def _scored_attention_flash(query, key, value, past: int, scaling, scores):
    """``scored_attention_dense`` with two unmasked flash calls (the past with the GQA group folded into the
    queries, so no key is copied; then the new keys causally) for the output and each query's log-sum-exp ``lse``,
    then the scores ``max_q exp(q . k * scaling - lse_q)`` (``update_max_scores``)."""
    out, lse = attention_past_and_causal(query, key, value, past, scaling)
    update_max_scores(scores, query, key, lse, scaling)
    return out.transpose(1, 2).contiguous()


def update_max_scores(scores, query, key, lse, scaling, hidden=None, weights=None):
    """Fold ``max`` over queries and GQA group of ``p = exp(q . k * scaling - lse)`` into ``scores`` (KVzip's
    entry score, arXiv 2505.23416 §3.2, Eq. 2).

    Args:
        scores: ``[kv_heads, n]`` float32, updated in place for the first ``n`` keys.
        query: ``[1, heads, q, d]``; key: ``[1, kv_heads, >= n, d]``; lse: ``[1, heads, q]``.
        hidden: optional ``[q, n]`` bool, the (query, entry) pairs that must not count.
        weights: optional KVzip+ ``(entry [kv_heads, group, n], query [q])`` weights (``masked_attention``): the
            query weight enters as ``+ log w_t`` beside ``-lse``, the max over queries is taken per query head, then
            multiplied by the entry weight before the max over the group.

    ``log p = [q * scaling, -lse] . [k, 1]`` is one ``[kv_heads, n, d + 1] x [kv_heads, d + 1, q x group]``
    product, so that the max over queries runs along memory; it is done in blocks of about
    ``SCORE_BLOCK_ELEMENTS`` outputs (a few MB: the block stays in cache between the product and the max).
    """
    _, heads, q_len, dim = query.shape
    kv_heads, n = scores.shape
    group = heads // kv_heads
    k_aug = torch.cat([key[0, :, :n].float(), key.new_ones(kv_heads, n, 1, dtype=torch.float32)], dim=-1)
    offset = -lse.reshape(heads, q_len, 1).float()
    if weights is not None:
        entry_w, query_w = weights
        offset = offset + query_w.float().log().reshape(1, q_len, 1)
        entry_w = entry_w.float().permute(0, 2, 1)  # [kv_heads, n, group]
    q_aug = torch.cat([query[0].float() * scaling, offset], dim=-1)
    q_aug = q_aug.view(kv_heads, group, q_len, dim + 1).permute(0, 3, 2, 1).contiguous()  # [kv, d+1, q, g]
    block = max(1, SCORE_BLOCK_ELEMENTS // max(1, kv_heads * n * group))
    for s in range(0, q_len, block):
        qb = q_aug[:, :, s : s + block]
        b = qb.shape[2]
        log_probs = torch.bmm(k_aug, qb.reshape(kv_heads, dim + 1, b * group))  # [kv_heads, n, b * group]
        if hidden is not None:
            log_probs.view(kv_heads, n, b, group).masked_fill_(hidden[s : s + block].T[None, :, :, None],
                                                               float("-inf"))
        if weights is None:
            torch.maximum(scores, log_probs.amax(dim=-1).exp_(), out=scores)
        else:
            per_head = log_probs.view(kv_heads, n, b, group).amax(dim=2).exp_()  # [kv_heads, n, group]
            torch.maximum(scores, (per_head * entry_w).amax(dim=-1), out=scores)


def _scored_attention_fused(query, key, value, visible, scaling, scores, weights=None):
    """CPU, any visibility shared by all heads: the fused flash kernel with a bias mask gives the output and each
    query's log-sum-exp, then ``update_max_scores`` (with KVzip+'s ``weights``, if given). ``visible``: ``[q, kv]``,
    the same for every head."""
    heads = query.shape[1]
    group = heads // key.shape[1]
    bias = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill_(~visible, float("-inf"))
    out, lse = flash(query, key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1), scaling,
                     mask=bias[None, None])
    hidden = ~visible[:, : scores.shape[1]]
    update_max_scores(scores, query, key, lse, scaling, hidden if bool(hidden.any()) else None, weights)
    return out.transpose(1, 2).contiguous()


def _scored_attention_explicit(query, key, value, visible, scaling, scores, query_block, bias=None,
                               score_weights=None):
    """Any device: materialise the probabilities block by block. ``visible``: ``[kv_heads, q, kv]``; ``bias``:
    optional ``[kv_heads, kv]`` float32 logit biases; ``score_weights``: see ``masked_attention``."""
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
        if bias is not None:
            logits += bias[:, None, None, :].float()
        logits.masked_fill_(~visible[:, None, s : s + query_block], float("-inf"))
        probs = logits.softmax(dim=-1)  # [kv_heads, group, qb, kv]
        scored = probs[..., :n]
        if score_weights is not None:
            entry_w, query_w = score_weights
            scored = scored * entry_w[:, :, None, :] * query_w[s : s + query_block].float()[None, None, :, None]
        torch.maximum(scores, scored.amax(dim=(1, 2)), out=scores)
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
    (all visible; the GQA group folded into the queries) and one causal over the chunk's own keys, combined through
    their log-sum-exps; no mask is built.
    """
    _, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    group = heads // key.shape[1]
    if query.device.type == "cpu" and (window is None or kv_len <= window):
        out, lse = attention_past_and_causal(query, key, value, kv_len - q_len, scaling)
        return out.transpose(1, 2).contiguous(), lse
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    visible = visible_mask(q_len, kv_len, window, query.device)
    if query.device.type == "cpu":
        bias = torch.zeros(visible.shape, dtype=query.dtype).masked_fill_(~visible, float("-inf"))
        out, lse = flash(query, k, v, scaling, mask=bias[None, None])
        return out.transpose(1, 2).contiguous(), lse
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


def _refuse_softcap_and_sinks(kwargs: dict) -> None:
    """``UnsupportedModelError`` for attention soft-capping or learned attention sinks, which kvpack does not do."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModelError("attention soft-capping and attention sinks are not supported by kvpack")


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
        if recorder is not None and recorder.wants_queries(layer_idx, q_start):
            recorder.record_queries(layer_idx, query, q_start, scale)
        if recorder is not None and recorder.wants_columns(layer_idx, q_start):
            if one_pass_applies(query, key.shape[2], window):
                out, sums = attention_with_column_sums(query, key, value, scale)
                recorder.record(layer_idx, query, key, scale, key_start, window, sums=sums)
            else:
                out, lse = attention_with_lse(query, key, value, scale, window)
                recorder.record(layer_idx, query, key, scale, key_start, window, lse=lse)
            return out, None
        if recorder is not None and recorder.wants_window(layer_idx, q_start, query.shape[2]):
            recorder.record(layer_idx, query, key, scale, key_start, window)
        if query.device.type == "cpu":  # unmasked flash calls; elsewhere transformers' SDPA below
            return attention_with_lse(query, key, value, scale, window)[0], None
    shared = getattr(key, "_kvpack_shared", None)
    if shared is not None:  # a batch continuing one context held once (kvpack.shared_context)
        _refuse_softcap_and_sinks(kwargs)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        sink = _QUERY_SINK.get()
        if sink is not None:
            sink(getattr(module, "layer_idx", None), query, scale)
        out = shared_prefix_attention(query, shared.context_keys, shared.context_values, key, value,
                                      shared.visible(query.shape[2]), scale)
        return out.transpose(1, 2).contiguous(), None
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    _refuse_softcap_and_sinks(kwargs)
    if query.shape[0] != 1:
        raise UnsupportedModelError("a kvpack cache serves one sequence at a time (batch size 1)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    reservoir = layer.queries
    if reservoir is not None:  # Attention Matching's reference queries (post q-norm and RoPE)
        # its on-policy sweep (kvpack.methods.am_sweep) returns the compacted layer this call attends to instead
        layer = reservoir.append((query[0].detach(), float(scaling))) or layer
    window = kwargs.get("sliding_window")
    if layer.scores is None:
        return packed_attention(query, layer, scaling, window), None
    # KVzip's repeat pass (kvpack.methods.kvzip) over a prefill view: one [kv_heads, kept + tail] grid; biases
    # appear here only in Attention Matching's on-policy passes (earlier layers already compacted)
    key, value, positions, bias = layer.padded()
    weights = layer.score_weights  # KVzip+ (kvpack.methods.kvzip_plus)
    if (bias is None and weights is None and query.device.type == "cpu" and layer.dense and window is None
            and layer.tail_length == query.shape[2]):
        # the reservoir may ask for these queries' attention over the context too (AM's RMS selection)
        wants = getattr(reservoir, "context_attention", None)
        context = wants(layer.kept) if wants is not None else None
        return scored_attention_dense(query, key, value, layer.kept, scaling, layer.scores, context), None
    visible = _visibility(positions, query.shape[2], window)
    return masked_attention(query, key, value, visible, scaling, scores=layer.scores, bias=bias,
                            score_weights=weights), None


def _visibility(positions: torch.Tensor, q_len: int, sliding_window: int | None) -> torch.Tensor:
    """``[kv_heads, q_len, kv]`` bool: which entries (``positions`` ``[kv_heads, kv]``, ``-1`` for padding) each of
    the last ``q_len`` entries may attend to."""
    kpos = positions[:, None, :]
    qpos = positions[0, -q_len:][None, :, None]
    visible = (kpos >= 0) & (kpos <= qpos)
    if sliding_window is not None:
        visible &= (qpos - kpos) < sliding_window
    return visible


@contextlib.contextmanager
def queries_to(sink):
    """Within this context every attention call over a shared-context cache (``kvpack.shared_context``) first hands
    ``sink(layer_idx, query, scaling)`` its queries, ``query`` ``[batch, heads, q, head_dim]`` after q-norm and
    RoPE (``layer_idx`` is the attention module's, or ``None``). Attention Matching's batched self-study records
    its reference queries this way (``kvpack.methods.am_selfstudy``)."""
    token = _QUERY_SINK.set(sink)
    try:
        yield
    finally:
        _QUERY_SINK.reset(token)


@contextlib.contextmanager
def masks_unused():
    """Within this context the ``"kvpack"`` mask function returns ``None`` instead of transformers' SDPA mask.

    ``kvpack.prefill`` uses it on CPU, where every chunk's attention is computed by this module's own causal
    kernels and never reads the mask: building each chunk's ``[q, kv]`` boolean mask would be wasted work.
    """
    token = _MASKS_UNUSED.set(True)
    try:
        yield
    finally:
        _MASKS_UNUSED.reset(token)


def _kvpack_mask(*args, **kwargs):
    """The mask function registered as ``"kvpack"``: transformers' ``sdpa_mask``, or ``None`` inside
    ``masks_unused``."""
    if _MASKS_UNUSED.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"kvpack"`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpack_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _kvpack_mask)
    _registered = True


def use_kvpack_attention(model) -> None:
    """Switch ``model`` to the ``"kvpack"`` attention (SDPA-equivalent for ordinary caches)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
