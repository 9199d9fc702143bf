"""Prefill attention statistics, recorded chunk by chunk while the context is prefilled (one pass).

Methods that score by the attention the context itself pays (H2O, arXiv 2306.14048; D2O, arXiv 2406.13035;
SnapKV, PyramidKV) give ``prefill`` an ``AttentionRecorder``. For every chunk and every compressed layer the
``"kvpack"`` attention function hands the recorder what it needs. With ``p_h[i, j]`` the attention probability of
query ``i`` over key ``j`` in query head ``h``, two statistics are kept, per compressed layer and per query head,
over the key positions ``0 .. tokens - 1``:

    column_sums[h, j] = sum over every query i of the context of p_h[i, j]    (the attention key j receives)
    window_sums[h, j] = sum over the observation-window queries of p_h[i, j] (SnapKV, arXiv 2404.14469 §4)

No tokens x tokens matrix is built. On CPU in float32, when no sliding window cuts the chunk's keys, the chunk's
attention output and its column sums come from one explicit pass (``attention_with_column_sums``): blocks of
queries, each block's probabilities (4 MB, in cache) computed once and used both for ``p @ v`` and for the column
sums. At the reference model's shapes on 2 CPU cores this costs about 1.1x the fused flash kernel alone; flash for
the output plus a second flash call on the transposed problem for the column sums costs 2x. Elsewhere (other
devices, other dtypes, a sliding window cutting the chunk) the attention comes from
``kvpack.attention.attention_with_lse`` (flash or SDPA, with each query's log-sum-exp ``lse``) and ``column_sums``
recomputes ``p[i, j] = exp(q_i . k_j * scaling - lse_i)``: on CPU through that transposed flash call (keys as
queries, ``-lse_i`` as a bias on column ``i``, whose log-sum-exp is the log column sum), otherwise summed
explicitly over blocks of queries. Window sums need only the window's few queries: their probabilities are
computed explicitly (``w x tokens``) and the chunk's attention itself stays plain.

The recorder can also keep each layer's query energy (``track_query_energy``: the sum of ``q_c**2`` per KV head and
channel over the context's queries after RoPE), from which the compact quantized layout chooses its key code widths
(``kvpack.compact``).
"""

from __future__ import annotations

import torch

from .attention_math import flash
from .model import ModelSpec

__all__ = ["AttentionRecorder", "ContextAttention", "attention_with_column_sums", "one_pass_attention",
           "one_pass_applies", "column_sums", "window_sums", "visible_mask", "SUM_BLOCK_ELEMENTS",
           "ONE_PASS_BLOCK_ELEMENTS"]

#: Entries of one block of probabilities when column sums are summed explicitly (64 MB of float32).
SUM_BLOCK_ELEMENTS = 16 * 2**20
#: Entries of one block of probabilities in ``attention_with_column_sums`` (4 MB of float32, in cache from the
#: product with the keys to the product with the values and the column sum). On the 2-core development machine,
#: at the reference model's shapes: 1.08x the flash kernel alone with 4 MB, 1.05x with 8 MB, 1.13x with 2 MB,
#: 1.8x with 32 MB; with another process busy on one core 4 MB stayed best (1.2x).
ONE_PASS_BLOCK_ELEMENTS = 2**20


def visible_mask(q_len: int, kv_len: int, window: int | None, device=None, first: int = 0) -> torch.Tensor:
    """``[q_len - first, kv_len]`` bool causal visibility of a prefill chunk's queries ``first ..`` (the chunk's
    queries are the last ``q_len`` of the keys): query i sees key j when ``pos_j <= pos_i`` (and
    ``pos_i - pos_j < window`` for a sliding window)."""
    kpos = torch.arange(kv_len, device=device)[None, :]
    qpos = torch.arange(kv_len - q_len + first, kv_len, device=device)[:, None]
    visible = kpos <= qpos
    if window is not None:
        visible &= (qpos - kpos) < window
    return visible


def column_sums(query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, scaling: float,
                window: int | None = None) -> torch.Tensor:
    """Attention each key receives from the chunk's queries: ``[heads, kv]`` float32.

    Args:
        query: ``[1, heads, q, head_dim]``, the last ``q`` positions of the keys (a prefill chunk).
        key: ``[1, kv_heads, kv, head_dim]``; ``heads`` is a multiple of ``kv_heads`` (GQA: query head ``h``
            reads KV head ``h // (heads // kv_heads)``).
        lse: ``[1, heads, q]`` log-sum-exp of each query's attention logits (``q . k * scaling``, masked).
        scaling: the softmax temperature.
        window: the layer's sliding window in tokens, or ``None``.

    Returns:
        ``out[h, j] = sum_i exp(q_i . k_j * scaling - lse_i)`` over the queries ``i`` that see key ``j``.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if query.device.type == "cpu" and (window is None or kv_len <= window):
        return _column_sums_flash(query, key, lse, scaling)
    return _column_sums_explicit(query, key, lse, scaling, visible_mask(q_len, kv_len, window, query.device))


def one_pass_applies(query: torch.Tensor, kv_len: int, window: int | None) -> bool:
    """Whether ``attention_with_column_sums`` is the way to get a chunk's attention and column sums: on CPU, in
    float32, when no sliding window cuts the chunk's ``kv_len`` keys (where it was measured faster than
    ``attention_with_lse`` followed by ``column_sums``)."""
    return query.device.type == "cpu" and query.dtype == torch.float32 and (window is None or kv_len <= window)


def attention_with_column_sums(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill chunk and the attention each key receives, from the same probabilities
    (the statistic of H2O, arXiv 2306.14048 §3, and D2O, arXiv 2406.13035 §3.1; ``one_pass_attention`` with
    ``column_sums=True``).

    Args:
        query: ``[1, heads, q, head_dim]``, the last ``q`` positions of the keys (a prefill chunk).
        key, value: ``[1, kv_heads, kv, head_dim]``, ``kv >= q``; ``heads`` is a multiple of ``kv_heads`` (GQA:
            query head ``h`` reads KV head ``h // (heads // kv_heads)``).
        scaling: the softmax temperature applied to ``q . k``.

    Returns:
        ``(out, sums)``: ``out`` ``[1, q, heads, head_dim_v]`` in the query's dtype (the layout transformers
        expects), equal to causal SDPA; ``sums`` ``[heads, kv]`` float32, ``sums[h, j] = sum_i p_h[i, j]`` over
        the chunk's queries ``i`` (query ``i`` sees the keys ``j <= kv - q + i``).
    """
    return one_pass_attention(query, key, value, scaling, column_sums=True)


class ContextAttention:
    """What ``one_pass_attention`` also computes, when given one, of its queries' attention restricted to a range of
    keys ``start .. stop - 1`` that every query sees (a context): the softmax over those keys alone, from the same
    probabilities. Attention Matching's RMS selection and fit need exactly this of KVzip's repeat-pass queries over
    the context (arXiv 2602.16284's ``score_method="rms"``; ``kvpack.methods.am``), so a repeat pass that sees the
    whole context gives it without a second pass over the context.

    Args:
        start, stop: the key range (``0 <= start < stop``; it must lie before the queries' own keys).
        rows: optional ``[m]`` int64, the query rows whose ``output`` and ``lse`` are kept, as indices into the
            ``group x q`` rows of a KV head (row ``g x q + i`` is query ``i`` of group member ``g``, the order of
            ``query.reshape(kv_heads, group * q, d)``); ``None``: all. ``square_sums`` always counts every row.

    Attributes (after the call; GQA group ``g`` of KV head ``h`` is query head ``h x group + g``):
        output: ``[kv_heads, group, q, dv]`` float32, ``softmax(q . k[start:stop] * scaling) @ v[start:stop]``;
            with ``rows``, ``[kv_heads, m, dv]``, those rows alone.
        lse: ``[kv_heads, group, q]`` float32, ``logsumexp(q . k[start:stop] * scaling)``; with ``rows``
            ``[kv_heads, m]``.
        square_sums: ``[kv_heads, stop - start]`` float32, per key the sum over the queries and the group of that
            softmax's probability squared (``rms = sqrt(square_sums / count)``).
        count: the rows ``square_sums`` sums over, ``group x q``.
        resolved: ``False`` while not computed, or when some query's probability mass on the range was too small
            (below ``MIN_MASS``) for the restricted softmax to keep float32's precision; use neither then.
    """

    #: Least share of a query's attention the range may hold for its restricted softmax to be taken from the whole
    #: softmax's probabilities (below it those probabilities have lost most of their float32 digits).
    MIN_MASS = 1e-20

    def __init__(self, start: int, stop: int, rows: torch.Tensor | None = None):
        if not 0 <= start < stop:
            raise ValueError(f"ContextAttention: need 0 <= start < stop, got {start}, {stop}")
        self.start, self.stop, self.rows = int(start), int(stop), rows
        self.output = self.lse = self.square_sums = None
        self.count = 0
        self.resolved = False


def one_pass_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, *,
                       column_sums: bool = False, max_scores: torch.Tensor | None = None,
                       context: ContextAttention | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of queries that are the last ``q`` of the keys, with statistics of its probabilities taken
    from the same blocks: column sums (H2O, arXiv 2306.14048 §3; D2O, arXiv 2406.13035 §3.1) and/or the running
    maximum over queries and GQA group (KVzip's entry score, arXiv 2505.23416 §3.2, Eq. 2).

    Args:
        query: ``[1, heads, q, head_dim]``; key, value: ``[1, kv_heads, kv, head_dim]``, ``kv >= q``, ``heads`` a
            multiple of ``kv_heads``. Query ``i`` sees the keys ``j <= kv - q + i``.
        scaling: the softmax temperature applied to ``q . k``.
        column_sums: also return ``sums`` ``[heads, kv]`` float32, ``sums[h, j] = sum_i p_h[i, j]``.
        max_scores: optional ``[kv_heads, n]`` float32 (``n <= kv``), updated in place to
            ``max(max_scores, max over queries i and the query heads of the GQA group of p[i, j])`` for the
            first ``n`` keys.
        context: optional ``ContextAttention`` filled in from the same probabilities (its range must end at or
            before ``kv - q``, else ``ValueError``); each row's log-sum-exp is then taken from its peak logit and
            its peak probability (``lse = peak - log p_max``, as ``p_max = 1 / sum exp(. - peak)``), so the fused
            softmax stays. With ``context.rows`` its output and log-sum-exp keep those query rows alone, its square
            sums every row.

    Returns:
        ``(out, sums)``: ``out`` ``[1, q, heads, head_dim_v]`` in the query's dtype (the layout transformers
        expects); ``sums`` as above, or ``None`` without ``column_sums``.

    Queries go in blocks of ``b`` (about ``ONE_PASS_BLOCK_ELEMENTS`` probabilities a block, so that a block stays
    in cache). A block whose last query is at ``s + b - 1`` sees only the first ``n = kv - q + s + b`` keys, so the
    rest are skipped (the causal triangle costs half). With the GQA group folded into the rows of one product per
    KV head (keys are not copied), in float32:

        p = softmax(q_block @ k[:n]^T * scaling, causally masked)   [kv_heads, group, b, n]
        out_block = p @ v[:n];   sums[:, :n] += p summed over the block's b queries;
        max_scores = max(max_scores, p[..., :n_scores] maximised over the group and the block's queries)
    """
    _, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    past = kv_len - q_len
    q = (query[0].float() * scaling).view(kv_heads, group, q_len, dim)
    k, v = key[0].float(), value[0].float()  # [kv_heads, kv, d]
    out = q.new_empty(kv_heads, group, q_len, v.shape[-1])
    sums = q.new_zeros(kv_heads, group, kv_len) if column_sums else None
    n_scores = 0 if max_scores is None else max_scores.shape[1]
    block = min(q_len, max(1, ONE_PASS_BLOCK_ELEMENTS // (heads * kv_len)))  # queries a block
    hidden = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)  # key after query, in a block
    buffer = q.new_empty(heads * block * kv_len)  # one block's probabilities, reused (no allocation per block)
    if context is not None:
        if context.stop > past:
            raise ValueError(f"one_pass_attention: the context range ends at {context.stop}, after the {past} "
                             "entries every query sees")
        a, z = context.start, context.stop
        context.output = q.new_empty(kv_heads, group, q_len, v.shape[-1])
        context.lse = q.new_empty(kv_heads, group, q_len)
        context.square_sums = q.new_zeros(kv_heads, z - a)
        least_mass = float("inf")
    for s in range(0, q_len, block):
        e = min(q_len, s + block)
        b, n = e - s, past + e
        p = buffer[: heads * b * n].view(kv_heads, group * b, n)
        torch.bmm(q[:, :, s:e].reshape(kv_heads, group * b, dim), k[:, :n].transpose(1, 2), out=p)  # logits
        p.view(kv_heads, group, b, n)[..., past + s :].masked_fill_(hidden[:b, :b], float("-inf"))
        if context is None:
            torch.softmax(p, dim=-1, out=p)
            out[:, :, s:e] = torch.bmm(p, v[:, :n]).view(kv_heads, group, b, -1)
        else:  # also each row's log-sum-exp: peak + log(total)
            peak = p.amax(dim=-1, keepdim=True)
            torch.softmax(p, dim=-1, out=p)  # fused: faster than writing out exp and sum
            log_total = p.amax(dim=-1, keepdim=True).log_().neg_()  # the peak's probability, 1 / sum exp(. - peak)
            inside = p[..., a:z]  # [kv_heads, group * b, z - a]
            mass = inside.sum(dim=-1, keepdim=True)  # each row's share of attention on the context
            least_mass = min(least_mass, float(mass.min()))
            raw = torch.bmm(inside, v[:, a:z])
            out[:, :, s:e] = (raw + torch.bmm(p[..., :a], v[:, :a]) + torch.bmm(p[..., z:n], v[:, z:n])
                              ).view(kv_heads, group, b, -1)
            context.output[:, :, s:e] = (raw / mass).view(kv_heads, group, b, -1)
            context.lse[:, :, s:e] = (peak + log_total + mass.log()).view(kv_heads, group, b)
        if sums is not None:
            sums[..., :n] += p.view(kv_heads, group, b, n).sum(dim=2)
        if n_scores:
            m = min(n_scores, n)
            max_scores[:, :m] = torch.maximum(max_scores[:, :m], p[:, :, :m].amax(dim=1))
        if context is not None:  # last: the block's probabilities on the context are squared in place
            context.square_sums += torch.bmm(mass.square().reciprocal_().transpose(1, 2), inside.square_())[:, 0]
    if context is not None:
        context.resolved = least_mass >= ContextAttention.MIN_MASS
        context.count = group * q_len
        if context.rows is not None:  # the kept rows alone (the others counted in square_sums only)
            rows = context.rows.to(q.device)
            context.output = context.output.reshape(kv_heads, group * q_len, -1)[:, rows]
            context.lse = context.lse.reshape(kv_heads, group * q_len)[:, rows]
    out = out.view(1, heads, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)
    return out, None if sums is None else sums.view(heads, kv_len)


def _augment(query, key, lse, scaling):
    """``[q * scaling, -lse]`` ``[heads, q, d + 1]`` and ``[k, 1]`` ``[heads, kv, d + 1]`` float32 (keys repeated
    per GQA group), so that ``q_aug . k_aug = q . k * scaling - lse = log p``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    q_aug = torch.cat([query[0].float() * scaling, -lse[0].float().unsqueeze(-1)], dim=-1)
    k = key[0].float().repeat_interleave(heads // kv_heads, dim=0)
    k_aug = torch.cat([k, k.new_ones(k.shape[0], k.shape[1], 1)], dim=-1)
    return q_aug, k_aug


def _column_sums_flash(query, key, lse, scaling):
    """CPU: the log-sum-exp of the transposed attention (keys attend to queries, with ``-lse`` of each query as an
    additive bias broadcast over the keys) is the log column sum.

    Reversing both sequences turns "key j is seen by queries i >= j - (kv - q)" into the fused kernel's top-left
    causal mask ("row j' sees columns i' <= j'"), so no mask matrix is built and hidden blocks are skipped.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    rows = key.float().repeat_interleave(heads // kv_heads, dim=1).flip(2)  # [1, heads, kv, d], last key first
    cols = query.float().flip(2)  # [1, heads, q, d], last query first
    bias = (-lse.float()).flip(-1).unsqueeze(2).contiguous()  # [1, heads, 1, q]
    _, log_sums = flash(rows, cols, cols, scaling, causal=True, mask=bias)
    return log_sums[0].flip(-1).exp()


def _column_sums_explicit(query, key, lse, scaling, visible):
    """Any device: sum ``exp(log p)`` over blocks of queries. ``visible``: ``[q, kv]`` bool."""
    q_aug, k_aug = _augment(query, key, lse, scaling)
    heads, q_len, kv_len = q_aug.shape[0], q_aug.shape[1], k_aug.shape[1]
    out = torch.zeros(heads, kv_len, dtype=torch.float32, device=query.device)
    block = max(1, SUM_BLOCK_ELEMENTS // max(1, heads * kv_len))
    for s in range(0, q_len, block):
        log_p = torch.bmm(q_aug[:, s : s + block], k_aug.transpose(1, 2))  # [heads, b, kv]
        log_p.masked_fill_(~visible[None, s : s + block], float("-inf"))
        out += log_p.exp_().sum(dim=1)
    return out


def window_sums(query: torch.Tensor, key: torch.Tensor, scaling: float, visible: torch.Tensor) -> torch.Tensor:
    """Attention each key receives from a few (observation-window) queries: ``[heads, kv]`` float32.

    Args:
        query: ``[1, heads, w, head_dim]``; key: ``[1, kv_heads, kv, head_dim]`` (GQA allowed).
        scaling: the softmax temperature.
        visible: ``[w, kv]`` bool, which keys each query sees (every row at least one).

    The ``w x kv`` probabilities are computed explicitly (``w`` is small: SnapKV's window or a question).
    """
    group = query.shape[1] // key.shape[1]
    k = key[0].float().repeat_interleave(group, dim=0)
    logits = torch.bmm(query[0].float() * scaling, k.transpose(1, 2)).masked_fill_(~visible[None], float("-inf"))
    return logits.softmax(dim=-1).sum(dim=1)


class AttentionRecorder:
    """Accumulates prefill attention statistics of the compressed layers, chunk by chunk.

    Args:
        spec: the model's attention shape; statistics are kept for ``spec.compressed_layers``.
        tokens: length of the cached sequence (prefix + context); keys at positions ``>= tokens`` (an
            observation question fed after the context) are not recorded.
        column_sums: keep ``column_sums`` (every context query).
        window_start: keep ``window_sums`` over the queries at positions ``>= window_start`` (``None``: none).
        device: where the statistics live (the model's device).

    Attributes (after the prefill), one tensor per compressed layer, in ``spec.compressed_layers`` order:
        column_sums: ``[heads, tokens]`` float32, or ``None`` when not asked for.
        window_sums: ``[heads, tokens]`` float32, or ``None`` when not asked for.
    and, after ``track_query_energy``, one per layer of the model:
        query_energy: ``[kv_heads, head_dim]`` float64 sums of ``q_c**2`` (``mean_query_energy`` averages them).
    """

    def __init__(self, spec: ModelSpec, tokens: int, *, column_sums: bool = False, window_start: int | None = None,
                 device: torch.device | str = "cpu"):
        self.tokens = int(tokens)
        self.window_start = window_start
        self.index = {l: i for i, l in enumerate(spec.compressed_layers)}

        def zeros():
            return [torch.zeros(spec.num_heads, self.tokens, dtype=torch.float32, device=device)
                    for _ in spec.compressed_layers]

        self.column_sums = zeros() if column_sums else None
        self.window_sums = zeros() if window_start is not None else None
        self.query_energy: list[torch.Tensor] | None = None
        self._energy_shape = (spec.num_layers, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim)
        self._energy_device = device

    def track_query_energy(self) -> None:
        """Also keep ``query_energy`` for every layer (not only the compressed ones): per KV head and channel, the
        sum of ``q_c**2`` over the context's queries (after RoPE) of the query heads of its GQA group, in float64.
        ``mean_query_energy`` divides it by the number of query rows; the compact quantized layout uses it to
        choose key code widths (``kvpack.compact``)."""
        layers, kv_heads, _, dim = self._energy_shape
        self.query_energy = [torch.zeros(kv_heads, dim, dtype=torch.float64, device=self._energy_device)
                             for _ in range(layers)]

    def wants_queries(self, layer_idx: int, q_start: int) -> bool:
        """Whether the chunk of layer ``layer_idx`` whose first query is at ``q_start`` adds to ``query_energy``."""
        return self.query_energy is not None and q_start < self.tokens

    def record_queries(self, layer_idx: int, query: torch.Tensor, q_start: int, scaling: float | None = None) -> None:
        """Add a chunk's queries ``[1, heads, q, head_dim]`` (at positions ``q_start ..``, after RoPE; those at
        positions ``>= tokens`` are left out) to ``query_energy``. ``scaling``, the layer's attention scaling, is
        for subclasses that keep the queries themselves (``kvpack.methods.am_prefill``)."""
        _, kv_heads, group, dim = self._energy_shape
        q = query[0, :, : max(0, self.tokens - q_start)].double()
        self.query_energy[layer_idx] += q.pow(2).sum(dim=1).view(kv_heads, group, dim).sum(dim=1)

    def mean_query_energy(self) -> list[torch.Tensor] | None:
        """Per layer ``[kv_heads, head_dim]`` float64 on CPU: ``query_energy`` over its query rows (every context
        position once per query head of the group: the mean of ``q_c**2``), or ``None`` when not tracked."""
        if self.query_energy is None:
            return None
        rows = max(1, self.tokens * self._energy_shape[2])
        return [e.cpu() / rows for e in self.query_energy]

    def wants_columns(self, layer_idx: int, q_start: int) -> bool:
        """Whether the chunk of layer ``layer_idx`` whose first query is at position ``q_start`` adds to
        ``column_sums`` (it then needs the chunk's column sums or its queries' log-sum-exp, see ``record``)."""
        return self.column_sums is not None and layer_idx in self.index and q_start < self.tokens

    def wants_window(self, layer_idx: int, q_start: int, q_len: int) -> bool:
        """Whether the chunk of queries ``q_start .. q_start + q_len - 1`` of layer ``layer_idx`` holds
        observation-window queries."""
        return self.window_sums is not None and layer_idx in self.index and q_start + q_len > self.window_start

    def record(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float, key_start: int,
               window: int | None, lse: torch.Tensor | None = None, sums: torch.Tensor | None = None) -> None:
        """Add one chunk's attention of layer ``layer_idx`` to the statistics that want it.

        Args:
            query: ``[1, heads, q, head_dim]``, the last ``q`` positions of the keys.
            key: ``[1, kv_heads, kv, head_dim]`` at positions ``key_start .. key_start + kv - 1``.
            scaling: the softmax temperature.
            window: the sliding window in tokens, or ``None``.
            lse: ``[1, heads, q]`` float32 log-sum-exp of the queries' attention logits, from which the column
                sums are computed (``column_sums``) when ``wants_columns``.
            sums: ``[heads, kv]`` float32, the chunk's column sums already computed with its attention
                (``attention_with_column_sums``); used instead of ``lse``. Without either, column sums are skipped.

        Raises:
            ValueError: a chunk mixes context queries and observation queries (``prefill`` never does).
        """
        i = self.index[layer_idx]
        q_len, kv_len = query.shape[2], key.shape[2]
        q_start = key_start + kv_len - q_len
        stop = min(kv_len, self.tokens - key_start)  # keys inside the cached sequence
        if (lse is not None or sums is not None) and self.wants_columns(layer_idx, q_start):
            if q_start + q_len > self.tokens:
                raise ValueError("a prefill chunk must not mix context queries and observation queries")
            if sums is None:
                sums = column_sums(query, key, lse, scaling, window)
            self.column_sums[i][:, key_start : key_start + stop] += sums[:, :stop]
        if self.wants_window(layer_idx, q_start, q_len):
            first = max(0, self.window_start - q_start)
            visible = visible_mask(q_len, kv_len, window, query.device, first)
            observed = window_sums(query[:, :, first:], key, scaling, visible)
            self.window_sums[i][:, key_start : key_start + stop] += observed[:, :stop]
