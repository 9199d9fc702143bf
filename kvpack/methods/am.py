"""Attention Matching: a compacted cache of kept keys with fitted per-entry biases and values (Zweiger, Fu, Guo,
Kim, "Fast KV Compaction via Attention Matching", arXiv 2602.16284, §3; the fit itself is ``kvpack.methods.am_fit``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from .. import constants as C
from ..pack import LayerEntries
from ..prefill import Prefill
from ..stats import ContextAttention
from .am_fit import attention_output, context_attention, fit_head, max_attention, relative_error, rms_attention
from .am_validate import TAIL_TOKENS, causal_output, choose_fit
from .base import top_k_rows
from .budgets import pool_context, protect_recent, split
from .d2o import D2O, merge_plan, merge_rows
from .kvzip import KVzip
from .params import AttentionMatchingParams

__all__ = ["AttentionMatching", "QueryReservoir", "PooledContext", "HELD_OUT", "PREFILL_REFERENCES"]

#: Reference queries per KV head held out of the fit to measure it (at most; an eighth of a smaller pool).
HELD_OUT = 256
#: The ``reference`` sources that read the context's own prefill queries (``kvpack.methods.am_prefill``).
PREFILL_REFERENCES = ("prefill", "prefill+repeat")
#: The ``reference`` sources that pool KVzip's repeat pass's queries with another source's.
REFERENCES_WITH_REPEAT = ("repeat", "both", "self-study+repeat", "prefill+repeat")
#: The ``reference`` sources that take no query from KVzip's repeat pass (with ``score_queries="reference"`` the
#: pass is skipped).
REFERENCES_WITHOUT_REPEAT = ("continue", "self-study", "prefill")
#: Seed of the deterministic query subsampling.
QUERY_SEED = 0
#: Most bytes of context attention (output and log-sum-exp of each fit query) the RMS selection keeps for the fit
#: (``AttentionMatching._rms_scores``); heads beyond it are attended again by the fit.
CONTEXT_CACHE_BYTES = 512 << 20
class QueryReservoir:
    """Reference queries of one layer, pooled per KV head and subsampled deterministically.

    The attention function appends ``(query, scaling)`` for every call (``PackedLayer.queries``), ``query``
    ``[heads, q, head_dim]`` after q-norm and RoPE. The query heads of a GQA group are pooled (head ``j`` serves KV
    head ``j // group``), and each call keeps at most ``cap`` rows per KV head (a seeded random subset, the same
    rows for every KV head), so memory stays bounded on long contexts. ``split`` then takes ``cap`` rows of the
    whole pool (again seeded) and holds out a seeded random subset of them. The pool and the split are computed
    once per set of recorded parts (a new part, appended or extended, makes new ones), so the selection
    (``selection="rms"``) and the fit see the same split whatever the number of calls; the tensors ``split``
    returns are that cache: read them, do not modify them.

    Each row also keeps its query's position when the source says it (``first_position``: KVzip's repeat pass, fed
    after the whole context, which on a context near the model's window runs past it); ``fit_positions`` gives
    those of ``split``'s fit rows (the refinement's ``refine_queries="in-window"``).

    Args:
        kv_heads: KV heads of the layer; cap: most rows per KV head (``queries``); seed: the subsampling's seed.
        per_position: subsample stratified by query (``query_sample="per-position"``): a row of every query of a
            call (whichever head of the GQA group asked it) before a second of any (``strata``); else uniformly.

    A call whose rows were subsampled still gets a ``ContextAttention`` when ``context_range`` is set
    (``context_attention``): the output and log-sum-exp of the rows its part kept, the square sums of them all.
    """

    def __init__(self, kv_heads: int, cap: int, seed: int = QUERY_SEED, per_position: bool = False):
        self.kv_heads, self.cap, self.seed, self.per_position = kv_heads, cap, seed, per_position
        self.parts: list[torch.Tensor] = []
        self.scaling: float | None = None
        self.generator = torch.Generator().manual_seed(seed)
        # cached (number of parts, pool) and (held_out, (fit, held), (fit rows, held rows)) of that pool: see split
        self._pool: tuple[int, torch.Tensor] | None = None
        self._split: tuple[int, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        #: Key range ``(start, stop)`` of the context in the calls' keys, set while the calls are KVzip's repeat pass
        #: over the whole context: each such call is then also asked for its queries' attention over that range
        #: (``context_attention``), so the RMS selection need not attend over the context again.
        self.context_range: tuple[int, int] | None = None
        self.contexts: dict[int, ContextAttention] = {}  # part index -> its queries' attention over the context
        self._last_rows: torch.Tensor | None = None  # the last appended call's rows in its part (None: all)
        #: Position of the first query of each call appended from now on (a call's ``q`` queries sit at
        #: ``first_position + 0 .. q - 1``), or ``None``: positions unknown, recorded as -1. The sources other than
        #: the repeat pass stay within the model's positions (self-study and sampled continuations stop where
        #: they would leave it; the prefill is the context).
        self.first_position: int | None = None
        self.positions: list[torch.Tensor] = []  # per part: [rows] int64, each row's query position or -1
        self._pool_rows: torch.Tensor | None = None  # the pool's rows among the parts' when it is subsampled
        #: per part: [rows] int64, each row's query (a call's query i, whichever head of the GQA group asked it):
        #: with ``per_position`` the subsampling keeps one row of every query before a second of any
        self.strata: list[torch.Tensor] = []
        self._next_stratum = 0

    def append(self, item: tuple[torch.Tensor, float]) -> None:
        """Add one attention call's ``(query [heads, q, head_dim], scaling)``: its rows (``[kv_heads, group x q,
        head_dim]``, subsampled to ``cap``, stratified by query with ``per_position``), their positions and their
        queries' indices (``strata``)."""
        query, self.scaling = item
        heads, q, d = query.shape
        pooled = query.reshape(self.kv_heads, (heads // self.kv_heads) * q, d)  # rows: the group's heads, then q
        index = torch.arange(q).repeat(heads // self.kv_heads)  # each row's query within the call
        strata = self._next_stratum + index
        self._next_stratum += q
        positions = torch.full_like(index, -1) if self.first_position is None else self.first_position + index
        rows = self._last_rows = self._subsample_rows(pooled.shape[1], strata)
        self.strata.append(strata if rows is None else strata[rows])
        self.positions.append(positions if rows is None else positions[rows])
        self.parts.append((pooled if rows is None else pooled[:, rows.to(pooled.device)]).float())

    def extend(self, other: "QueryReservoir") -> None:
        """Pool ``other``'s recorded parts (and their positions and query indices, the latter offset past this
        reservoir's) after this reservoir's (one pool, subsampled to ``cap`` by ``split``). ``other``'s recorded
        ``ContextAttention`` are not carried over."""
        self.parts.extend(other.parts)
        self.positions.extend(other.positions)
        self.strata.extend(x + self._next_stratum for x in other.strata)
        self._next_stratum += other._next_stratum

    def context_attention(self, visible: int) -> ContextAttention | None:
        """For the attention call that just appended its queries, seeing its first ``visible`` keys: a
        ``ContextAttention`` over ``context_range`` for it to fill in (kept as that part's: the output and
        log-sum-exp of the rows the part kept, the square sums of all the call's rows), or ``None`` when no range
        is set or the range is not all visible."""
        if self.context_range is None or self.context_range[1] > visible:
            return None
        context = ContextAttention(*self.context_range, rows=self._last_rows)
        self.contexts[len(self.parts) - 1] = context
        return context

    def _usable_contexts(self) -> dict[int, ContextAttention]:
        """The parts' recorded ``ContextAttention`` that cover every row of their part, or none at all when
        one did not resolve."""
        if not self.contexts or not all(c.resolved for c in self.contexts.values()):
            return {}
        dv = next(iter(self.contexts.values())).output.shape[-1]
        return {i: c for i, c in self.contexts.items()
                if i < len(self.parts) and c.output.reshape(self.kv_heads, -1, dv).shape[1] == self.parts[i].shape[1]}

    def left_out(self, without_context: bool = False) -> torch.Tensor | None:
        """``[kv_heads, m, head_dim]`` float32: the recorded rows ``split``'s subsampling left out of the pool (in
        neither the fit nor the held-out rows; with ``without_context``, only those of parts without a recorded
        ``ContextAttention``), or ``None`` when there are none: what ``select_queries="all"`` adds to the RMS
        selection's mean (arXiv 2602.16284's ``score_method="rms"``). Raises ``RuntimeError`` if nothing was
        recorded."""
        rows = self._pooled()[1]
        if rows is None:
            return None
        out = torch.ones(sum(p.shape[1] for p in self.parts), dtype=torch.bool)
        out[rows] = False
        if without_context:
            start = 0
            contexts = self._usable_contexts()
            for index, part in enumerate(self.parts):
                if index in contexts:
                    out[start : start + part.shape[1]] = False
                start += part.shape[1]
        if not bool(out.any()):
            return None
        return torch.cat(self.parts, dim=1)[:, out.to(self.parts[0].device)]

    def context_statistics(self) -> "PooledContext | None":
        """The recorded ``ContextAttention`` of the pool's rows (``PooledContext``; after ``split``'s
        subsampling when the pool is over ``cap``), or ``None`` when there are none or one did not resolve."""
        contexts = self._usable_contexts()
        if not contexts:
            return None
        sizes = [p.shape[1] for p in self.parts]
        dv = next(iter(contexts.values())).output.shape[-1]
        has, output, lse, squares, count = torch.zeros(sum(sizes), dtype=torch.bool), [], [], None, 0
        start = 0
        for index, rows in enumerate(sizes):
            c = contexts.get(index)
            if c is None:
                output.append(torch.zeros(self.kv_heads, rows, dv))
                lse.append(torch.zeros(self.kv_heads, rows))
            else:
                has[start : start + rows] = True
                output.append(c.output.reshape(self.kv_heads, rows, dv).cpu())
                lse.append(c.lse.reshape(self.kv_heads, rows).cpu())
                squares = c.square_sums.cpu() if squares is None else squares + c.square_sums.cpu()
                count += c.count
            start += rows
        output, lse = torch.cat(output, dim=1), torch.cat(lse, dim=1)
        rows = self._pooled()[1]
        if rows is not None:
            has, output, lse = has[rows], output[:, rows], lse[:, rows]
        return PooledContext(has, output, lse, squares, count)

    def _subsample_rows(self, n: int, strata: torch.Tensor | None = None) -> torch.Tensor | None:
        """``cap`` of ``n`` rows, seeded and sorted (``[cap]`` int64), or ``None`` when ``n <= cap`` (all). Uniform,
        or with ``per_position`` and ``strata`` (``[n]`` int64, each row's query) stratified: a random row of every
        query first, then a second of every query, and so on, at random within the last round."""
        if n <= self.cap:
            return None
        if not self.per_position or strata is None or len(strata) != n:
            return torch.randperm(n, generator=self.generator)[: self.cap].sort().values
        order = torch.randperm(n, generator=self.generator)  # random within each stratum and round
        by_stratum = order[torch.sort(strata[order], stable=True).indices]
        counts = torch.unique_consecutive(strata[by_stratum], return_counts=True)[1]
        starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)  # each stratum's first place
        rank = torch.empty(n, dtype=torch.long)
        rank[by_stratum] = torch.arange(n) - starts  # each row's round: 0 for its query's first row
        key = rank.double() + torch.empty(n, dtype=torch.float64).uniform_(0, 1, generator=self.generator)
        return torch.topk(key, self.cap, largest=False).indices.sort().values

    def _pooled(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(pool, rows)``: the parts concatenated (``[kv_heads, N, head_dim]``), subsampled to ``cap`` rows once
        per set of parts, and the rows kept (``[cap]`` int64 into the concatenation, or ``None``: all). Raises
        ``RuntimeError`` if nothing was recorded."""
        if not self.parts:
            raise RuntimeError("no reference queries were recorded (the repeat pass did not run)")
        if self._pool is None or self._pool[0] != len(self.parts):  # subsampled once per set of parts
            pooled = torch.cat(self.parts, dim=1)
            strata = torch.cat(self.strata) if len(self.strata) == len(self.parts) else None
            self._pool_rows = rows = self._subsample_rows(pooled.shape[1], strata)
            self._pool = len(self.parts), pooled if rows is None else pooled[:, rows.to(pooled.device)]
            self._split = None
        return self._pool[1], self._pool_rows

    def split(self, held_out: int = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fit, held)``: ``[kv_heads, n_fit, head_dim]`` and ``[kv_heads, n_held, head_dim]`` float32, with
        ``n_fit + n_held <= cap`` and ``n_held = min(held_out, pool / 8)``. Raises ``RuntimeError`` if nothing
        was recorded."""
        pool = self._pooled()[0]
        if self._split is None or self._split[0] != held_out:
            n = pool.shape[1]
            held = min(held_out, n // 8)
            # held-out rows drawn at random (not the pool's first rows: those are one query head's first positions)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + 1)).to(pool.device)
            fit_rows, held_rows = order[held:].sort().values, order[:held].sort().values
            self._split = held_out, (pool[:, fit_rows], pool[:, held_rows]), (fit_rows.cpu(), held_rows.cpu())
        return self._split[1]

    def fit_positions(self, held_out: int = HELD_OUT) -> torch.Tensor:
        """``[n_fit]`` int64: the RoPE position (in tokens) of each of ``split``'s fit rows, ``-1`` where its source
        did not say (``first_position``): KVzip's repeat pass (arXiv 2505.23416 §3.2) runs from the context's end.
        Raises ``RuntimeError`` if nothing was recorded."""
        self.split(held_out)
        rows = sum(p.shape[1] for p in self.parts)
        positions = torch.cat(self.positions) if self.positions else None
        if positions is None or len(positions) != rows:  # parts added without positions: all unknown
            positions = torch.full((rows,), -1, dtype=torch.long)
        if self._pool_rows is not None:
            positions = positions[self._pool_rows]
        return positions[self._split[2][0]]

    def split_rows(self, held_out: int = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fit rows, held rows)``: int64 indices into the pool of ``split``'s two parts (the pool is the parts
        concatenated when it is not subsampled). Raises ``RuntimeError`` if nothing was recorded."""
        self.split(held_out)
        return self._split[2]


@dataclass
class PooledContext:
    """The repeat pass's attention over the context for a ``QueryReservoir``'s pool of ``N`` rows
    (``QueryReservoir.context_statistics``): ``has`` ``[N]`` bool, the rows that have it; ``output``
    ``[kv_heads, N, dv]`` and ``lse`` ``[kv_heads, N]`` float32 (zeros where ``has`` is false); ``square_sums``
    ``[kv_heads, context]`` float32, per context entry the sum of its probability squared over every row the
    recording calls attended (``kvpack.stats.ContextAttention``), ``count`` of them: the rows of the pool that
    have it, and, where the calls or the pool were subsampled to ``cap``, the rows left out too."""

    has: torch.Tensor
    output: torch.Tensor
    lse: torch.Tensor
    square_sums: torch.Tensor
    count: int


@dataclass
class AttentionMatching(AttentionMatchingParams, KVzip):
    """A per-head budget split over KVzip's scores and a selection within each head, then per KV head a closed-form
    fit of a bias ``beta`` per kept entry and of their values so that attention over the kept entries reproduces
    attention over the whole context (arXiv 2602.16284 §3).

    Defaults (BENCHMARKS.md, "Issue 28, twenty-sixth session" and "twenty-eighth session"): KVzip's uncapped
    budget split, the paper's ``ss-plus-repeat`` queries with short sampled self-study answers (two per prompt,
    16 tokens each; "twenty-ninth session"), RMS selection, 8,192 queries per KV head, and kvpack's validated
    per-head choice (``ridge_search``) in place of the paper's always-fit.

    Reference queries (§4.1, "repeat" queries): the queries of KVzip's repeat pass (arXiv 2505.23416 §3.2), which
    scoring runs anyway, recorded as each layer sees them (after q-norm and RoPE), the query heads of a GQA group
    pooled per KV head and subsampled deterministically to ``queries`` per KV head (``QueryReservoir``), of which
    up to ``HELD_OUT`` are held out of the fit to measure it.
    ``reference="continue"`` takes instead the queries of tokens the model samples after the context
    (``kvpack.methods.am_continue``), ``"both"`` pools the two sources; ``"self-study"`` takes the queries of the
    model's answers (by default two per prompt, sampled) to the paper's self-study prompts (§4.1,
    ``kvpack.methods.am_selfstudy``), and ``"self-study+repeat"`` pools them with the repeat pass's (the paper's
    ``ss-plus-repeat``); ``"prefill"`` takes the context's own prefill queries, recorded as the prefill runs (the
    paper's ``context-prefill``, ``kvpack.methods.am_prefill``; free when the prefill ran with this method's
    ``recorder``, one more prefill otherwise), and ``"prefill+repeat"`` pools them with the repeat pass's.

    When KVzip's repeat pass sees the whole context (one chunk, ``context_tokens <= chunk_size``) and the pass is the
    float32 one (``kvpack.stats.one_pass_attention``), it also gives the RMS selection its queries' attention over
    the context from the same probabilities (``QueryReservoir.context_attention``): only the reference rows
    without it (the self-study answers') are attended again. Otherwise the selection attends over the context
    itself; the results agree to float32 rounding (``tests/test_am.py``). Where the pass has more query rows than
    ``queries`` (a GQA group of ``g`` query heads gives ``g x`` the context's tokens per KV head, so on most models
    from 2K tokens), the fit still takes its targets from the pass, and the RMS counts the squares of every row the
    pass attended, scaled to the fit rows' count: the same mean over the queries, estimated from all of them rather
    than from the subsample (on the reference model at 2K tokens the selection went from about 0.55 s to 0.1 s and
    AM's loss fell by about a tenth over fifteen passages, BENCHMARKS.md, "Issue 28, thirty-sixth session").

    Kept keys: ``ratio`` is the share of all context entries kept, over every compressed layer and KV head, split
    per head by ``budgets`` (``kvpack.methods.budgets``) over KVzip's scores: ``"global"`` (default: KVzip's global
    top-k, uncapped), ``"global-capped"`` (the same with no head above ``max_head_ratio`` of its own entries, the
    paper's 0.75 cap; the default until issue 28's twenty-eighth session: on SmolLM2 it made AM continue worse
    than KVzip at keep 0.3, where the heads it caps are broad ones that are too large to be fitted, and changed
    nothing from keep 0.1 down, BENCHMARKS.md), ``"uniform"`` or ``"schedule"`` (a per-model fraction file,
    ``kvpack.schedule``, capped). Every head keeps its last ``recent``
    context tokens first (within its budget; kvpack's, not the paper's), and with ``"global"`` and
    ``"global-capped"`` its top ``head_floor`` x the even per-head share (``budgets.floor_entries``; the recent
    tokens count in it) before the global top-k splits the rest (Ada-KV's safeguard, arXiv 2407.11550, over every
    layer's heads; not in the AM paper: KVzip's global top-k left most SmolLM2
    heads their recent tokens alone at keep 0.05, and those held most of the loss; BENCHMARKS.md, "Issue 28,
    thirty-second session"). Within a head, KVzip's scores
    (``selection="kvzip"``), the highest RMS attention over the reference queries (``"rms"``, the default, the paper
    code's ``score_method="rms"``) or OMP (``"omp"``, the paper's AM-OMP, ``kvpack.methods.am_omp``; its beta is then
    the clamped least squares of ``am_fit.clamped_least_squares``, in ``[-27.6, 7]``, rather than the NNLS fit in
    ``[-3, 3]``, as the official OMP configuration has it).

    ``score_queries="reference"`` scores the entries for the split and the kept keys by KVzip's rule (each entry's
    largest attention within the context) over the reference queries instead of the repeat pass's
    (``max_attention``; kvpack's, not the paper's); with a source that has no repeat queries (``continue``,
    ``self-study``, ``prefill``) KVzip's repeat pass is then skipped.

    Fit (``kvpack.methods.am_fit.fit_head``), on the context entries of each head (the attention sink, the template
    prefix, stays exact: beta = 0, values copied): beta by mass matching (box NNLS, beta in ``am_fit.BETA_RANGE``),
    values by least squares in float32 (``values="fit"``), the selected values as they are (``"copy"``: beta only),
    or D2O's similarity-weighted merge of each evicted entry into its most similar kept entry's value, keys
    untouched (``"merge"``, arXiv 2406.13035 §3, with D2O's EMA threshold weight). The model's own attention
    scaling is used.

    ``on_policy``: layer ``l``'s reference queries are recomputed with the compressed layers before ``l`` already
    compacted (§3.3, on-policy queries): the repeat pass and the self-study answers or sampled continuations, as the
    reference has them, run once more, all in step, each layer fitted as soon as every pass has its queries
    (``kvpack.methods.am_sweep``: one extra forward call per pass in all); not with the prefill's own queries.

    Failed fits: the values' least squares always returns a fit (``am_fit.least_squares``: Cholesky of the
    normal equations, then the same with the smallest ridge ``1e-6 x 10^k x mean(diag)`` that factorises, then the
    SVD pseudo-inverse), as the paper does. One guard of kvpack's own (not in the paper, which fits with up to
    50,000 queries per head): a head keeping more than ``1 / queries_per_entry`` of its fit queries' count is
    not fitted (least squares would interpolate noise, at a cost of ``O(n t^2)``; nor is a head that keeps none or
    all of its context entries, where there is nothing to fit). ``held_out_check`` (on by default, though the paper
    has no such rule: without it SmolLM2 at keep 0.1 answered a planted-fact question with an empty string) keeps
    the selection (beta = 0, values copied) for a head whose fit is worse on the held-out queries. A fit whose values
    leave ``[-MAX_KV_ABS, MAX_KV_ABS]`` (an ill-conditioned system; ``kvpack.load`` would refuse the pack) is
    always rejected that way. Either way the head keeps its selected entries as they are.

    The pack's metadata gets ``stats["fit"]``: per compressed layer the mean relative error of the head outputs on
    the held-out queries (``relative_error``, the kept heads counted as kept), the same for KVzip's selection alone
    at the same budget (beta = 0, values copied: ``selection_error``; fitted heads only, as ``relative_error``),
    the mean relative mass error on the fit queries of the fitted heads, the heads left unfitted or rejected, and
    how many each rule rejected (``heads_rejected_by``: ``range``, ``value_bound``, ``held_out_check``,
    ``ridge_search``).

    Parameters (declared in ``kvpack.methods.params``):
        chunk_size, tail_tokens, scoring: KVzip's (its repeat pass; ``scoring="plus"`` selects by KVzip+).
        max_head_ratio: the per-head cap of ``"global-capped"`` and ``"schedule"``, in (0, 1] (default 0.75).
        budgets: ``"global"`` (default), ``"global-capped"``, ``"uniform"`` or ``"schedule"``.
        head_floor: the share of the even per-head budget every head keeps first under ``"global"`` and
            ``"global-capped"``, in [0, 1] (default 0.25; 0: none, as before issue 28's thirty-second session).
        schedule: the schedule file of ``budgets="schedule"`` (checked against the model); its SHA-256 is
            recorded as ``schedule_sha256``.
        recent: last context tokens every head keeps (in its budget), ``>= 0``.
        selection: ``"rms"`` (default), ``"kvzip"``, ``"kvzip+rms"`` or ``"omp"``.
        select_queries: ``"fit"`` (default) or ``"all"``: the RMS selection's mean over the fit's queries, or over
            every recorded query but the held-out ones (``QueryReservoir.left_out``: more attention where the
            sources recorded more than ``queries``; the same where they did not).
        select_pool: odd width in tokens, 1 .. 255 (default 1: none), of the max-pool over each head's selection
            scores before ``"rms"`` and ``"kvzip+rms"`` take their top entries (``budgets.pool_context``).
        unfitted_selection: ``"same"`` (default) or ``"kvzip"``: what a head the fit leaves as it is keeps, the
            entries ``selection`` chose or KVzip's (``reselect_within_heads``; inert under ``selection="kvzip"``,
            ``values`` other than ``"fit"`` and ``on_policy``).
        values: ``"fit"``, ``"copy"`` or ``"merge"``.
        queries: reference queries per KV head (fit + held out), ``16 .. 50,000`` (default 8,192).
        query_sample: ``"uniform"`` (default) or ``"per-position"``: how the recorded queries are subsampled to
            ``queries`` (``QueryReservoir``: uniformly over the rows, or a row of every query first, the heads of
            a GQA group asking at the same positions).
        queries_per_entry: a head is fitted only where its fit queries number at least this many times its kept
            entries (default 8, ``>= 1``; kvpack's guard, above).
        on_policy: recompute each layer's queries with the earlier layers compacted.
        held_out_check: keep the selection for a head whose fit does worse on held-out queries (default true:
            measured on SmolLM2, BENCHMARKS.md; unused under ``ridge_search``, the default).
        shift: the mass matching's per-query shift, ``"lse"`` (default) or ``"max"`` (``am_fit``'s docstring).
        reference: where the reference queries come from: ``"self-study+repeat"`` (default), ``"repeat"`` (KVzip's
            repeat pass),
            ``"continue"`` (``continue_tokens`` tokens the model samples after the context,
            ``kvpack.methods.am_continue``), ``"both"`` (one pool of the two), ``"self-study"`` or
            ``"self-study+repeat"``, ``"prefill"`` or ``"prefill+repeat"``.
        self_study_tokens: answer tokens per self-study prompt at most (default 16), ``>= 1``.
        self_study_temperature: the self-study answers are sampled at this temperature (default 0.7, the paper
            code's) with top-k 20 and top-p 0.8, as the paper's code samples them; ``0`` answers greedily (the
            default until issue 28's twenty-ninth session).
        self_study_seed: the sampled answers' seed, ``>= 0`` (``kvpack.methods.am_selfstudy``).
        self_study_samples: answers sampled per self-study prompt (default 2: BENCHMARKS.md, "Issue 28,
            twenty-ninth session"), each prompt computed and recorded once for all of them (off-policy:
            ``on_policy`` replays each answer after its prompt, so there the prompt's queries count once per
            answer); greedy answers (``self_study_temperature=0``) are one per prompt.
        continue_tokens: sampled tokens for ``"continue"`` and ``"both"`` (one decode step each), ``>= 1``.
        ridge: the values' least squares regularised by ``ridge x mean(diag(X^T X))`` (``am_fit.least_squares``),
            in ``[0, 1]``; 0 (default) is the paper's plain least squares. Plain least squares fits the repeat
            pass's queries with values far outside the data's range (on the reference model up to 1,140 where the
            context's values stay below 5), which other queries then amplify; BENCHMARKS.md measures the option.
        value_bound: a head whose fitted values leave ``value_bound x`` the largest |value| of its own context
            entries keeps its selection (beta = 0, values copied), counted as rejected; default 2 (unused under
            ``ridge_search``, the default), 0 turns it off
            (kvpack's, not the paper's: an unbounded fit lost +1.05 nats/token on a held-out SmolLM2 passage where
            KVzip lost +0.14, BENCHMARKS.md).
        ridge_to: what the ridge shrinks the fitted values toward: ``"zero"`` (default, a plain ridge) or
            ``"selected"`` (the kept entries' own values, so a large ridge tends to ``values="copy"``); needs
            ``ridge > 0``.
        ridge_search: each fitted head takes whichever of KVzip's entries as they are, the fitted biases with
            copied values, or the fitted biases with values by least squares with a ridge toward the copied values
            (``am_validate.RIDGE_GRID``, 0 included) gives the lowest error on the context's last
            ``am_validate.TAIL_TOKENS`` tokens' own prefill queries, replayed causally (kvpack's, not the paper's;
            the validation replaces ``value_bound`` and ``held_out_check``, and ``ridge``/``ridge_to`` are unused);
            the choices are counted in ``stats["fit"]["ridge_search"]``; default true (BENCHMARKS.md, "Issue 28,
            twenty-sixth session").
        refine_steps: Adam steps (default 30; 0: off) that move each validated head's kept keys (``refine_move``)
            from ``ridge_search``'s chosen candidate toward the full context's output over ``[sink, context]`` on the
            fit queries (``kvpack.methods.am_refine``; kvpack's, not the paper's, which keeps the selected keys as
            they are); the refined head is kept only where its error on the validation queries is lower than the
            chosen candidate's, and counted as ``refined`` in ``stats["fit"]["ridge_search"]``. Needs
            ``ridge_search`` and ``values="fit"``.
        refine_batch: reference queries per refinement step, a fresh slice of a fixed permutation each step
            (default 512; 0: all of them every step).
        refine_move: what the refinement moves (``am_refine.REFINE_MOVES``): ``"keys"`` (default; the biases and
            values stay the closed form's) or ``"keys+beta+values"`` (the thirty-first session's refinement).
        refine_lr: Adam's step (default 0.01), in units of the kept keys' (and values') RMS, in logits for beta.
        refine_queries: ``"in-window"`` (default) or ``"all"`` (``params.REFINE_QUERIES``): the refinement fits only
            the fit queries at positions below the model's ``max_position_embeddings`` (KVzip's repeat pass is fed
            after the whole context, so on a context near the window most of its queries sit past it), and refines
            a head only with at least ``queries_per_entry`` of them per kept entry; on shorter contexts every query
            is within the window and both settings are the same. Packs from before read as ``"all"``.
        weights: ``"uniform"`` (default, the paper's) or ``"share"``: each reference query's rows of the fit
            weighted by the share of its attention over ``[sink, context]`` that falls on the context
            (``am_fit.context_share``; kvpack's), so queries resting on the attention sink no longer drive it.
    """

    stats_key: ClassVar[str] = "fit"

    def __post_init__(self):
        super().__post_init__()
        self._reservoirs: list[QueryReservoir] | None = None
        self._context_range: tuple[int, int] | None = None  # the context's keys in a whole-context repeat pass
        self._sequences = None  # on_policy: the token sequences the reference source fed (replayed per layer)
        self._rerecorded = None  # (prefill, PrefillQueries) made by _prefill_queries for a prefill without them
        # (compressed layer, KV head) -> (fit queries, output, lse): the context attention the RMS selection computed
        # for a head it knows will be fitted, so the fit need not attend over the context again (_rms_scores)
        self._context_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._schedule = self._schedule_sha256 = None
        if self.schedule is not None:
            from .. import storage
            from ..schedule import load_schedule

            self._schedule = load_schedule(self.schedule)
            self._schedule_sha256 = hashlib.sha256(storage.read_bytes(self.schedule)).hexdigest()

    def params(self) -> dict:
        """The parameters, plus ``schedule_sha256`` (of the schedule file's bytes) with a schedule."""
        out = super().params()
        if self._schedule_sha256 is not None:
            out["schedule_sha256"] = self._schedule_sha256
        return out

    def recorder(self, spec, tokens: int, device):
        """With ``reference="prefill"`` or ``"prefill+repeat"``, or ``ridge_search``: a ``PrefillQueries`` recorder
        that keeps the prefill's own queries of the compressed layers (``kvpack.methods.am_prefill``): all of them
        as reference queries, the context's last ``am_validate.TAIL_TOKENS`` as validation queries; else ``None``."""
        if self.reference not in PREFILL_REFERENCES and not self.ridge_search:
            return None
        from .am_prefill import PrefillQueries

        reservoirs = ([self._reservoir(spec) for _ in spec.compressed_layers]
                      if self.reference in PREFILL_REFERENCES else None)
        return PrefillQueries(spec, tokens, reservoirs, TAIL_TOKENS if self.ridge_search else 0, device)

    def _prepare_repeat_pass(self, cache, start: int) -> None:
        spec = self._spec
        for i, l in enumerate(spec.compressed_layers):
            cache.layers[l].queries = self._reservoirs[i]
            self._reservoirs[i].context_range = self._context_range  # set only when one chunk is the whole context
            self._reservoirs[i].first_position = cache.get_seq_length()  # fed after the whole context

    @torch.inference_mode()
    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        self._spec = prefill.spec
        if self._schedule is not None:
            from ..schedule import check_schedule

            check_schedule(self._schedule, model, tokenizer, path=f"schedule file {self.schedule}")
        self._reservoirs = self._new_reservoirs(prefill)
        self._model, self._tokenizer = model, tokenizer
        # a repeat pass over the whole context (one chunk) also gives the RMS selection its attention over the
        # context (QueryReservoir.context_attention), from the same probabilities
        whole = prefill.context_tokens <= self.chunk_size and self.selection in ("rms", "kvzip+rms")
        self._context_range = (prefill.sink, prefill.sink + prefill.context_tokens) if whole else None
        # KVzip's repeat pass records the repeat queries and scores the entries: not needed when neither is used
        repeat_unused = self.score_queries == "reference" and self.reference in REFERENCES_WITHOUT_REPEAT
        scores = None if repeat_unused else super().score(model, tokenizer, prefill, progress)
        self._sequences = [] if self.on_policy else None  # the sources' fed tokens, replayed on-policy
        if self.reference in ("self-study", "self-study+repeat"):
            from .am_selfstudy import self_study_queries

            studied = self_study_queries(model, tokenizer, prefill, self._new_reservoirs(prefill),
                                         self.self_study_tokens, fed=self._sequences,
                                         temperature=self.self_study_temperature, seed=self.self_study_seed,
                                         samples=self.self_study_samples if self.self_study_temperature > 0 else 1)
            if self.reference == "self-study":
                self._reservoirs = studied
            else:  # one pool, subsampled to ``queries`` by ``QueryReservoir.split``
                for mine, theirs in zip(self._reservoirs, studied):
                    mine.extend(theirs)
        elif self.reference in PREFILL_REFERENCES:
            recorded = self._prefill_queries(model, prefill).reservoirs
            if self.reference == "prefill":
                self._reservoirs = recorded
            else:  # prefill+repeat: one pool, subsampled to ``queries`` by ``QueryReservoir.split``
                for mine, theirs in zip(self._reservoirs, recorded):
                    mine.extend(theirs)
        elif self.reference != "repeat":
            from .am_continue import continuation_queries

            sampled = continuation_queries(model, tokenizer, prefill, self._new_reservoirs(prefill),
                                           self.continue_tokens, QUERY_SEED, fed=self._sequences)
            if self.reference == "continue":
                self._reservoirs = sampled
            else:  # both: one pool, subsampled to ``queries`` by ``QueryReservoir.split``
                for mine, theirs in zip(self._reservoirs, sampled):
                    mine.extend(theirs)
        if self.ridge_search:
            rec = self._prefill_queries(model, prefill)
            self._validation = (rec.tail_queries, rec.tail_start, rec.scaling)
        if self.score_queries == "reference":
            layers = len(prefill.spec.compressed_layers)
            scores = torch.stack([self._reference_scores(prefill, i) for i in range(layers)])
            if progress and repeat_unused:
                progress(prefill.context_tokens)
        return scores

    def _prefill_queries(self, model, prefill: Prefill):
        """The ``PrefillQueries`` with what this method records (``recorder``): ``prefill.stats`` when the prefill
        ran with such a recorder, else one made by prefilling the same tokens again, once per prefill."""
        from .am_prefill import PrefillQueries, record_prefill_queries

        rec = prefill.stats
        needs_pool, needs_tail = self.reference in PREFILL_REFERENCES, TAIL_TOKENS if self.ridge_search else 0
        if isinstance(rec, PrefillQueries) and (rec.reservoirs is not None or not needs_pool) and \
                rec.tail >= needs_tail:
            return rec
        cached = self._rerecorded
        if cached is None or cached[0] is not prefill:
            want = self.recorder(prefill.spec, prefill.tokens, "cpu")
            cached = prefill, record_prefill_queries(model, prefill, self.chunk_size, want.reservoirs, want.tail)
            self._rerecorded = cached
        return cached[1]

    def _validation_queries(self, prefill: Prefill, i: int, h: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """KV head ``h`` of compressed layer ``i``: its GQA group's validation queries ``[group x n, d]``, their
        positions ``[group x n]`` and the layer's scaling (``ridge_search``)."""
        tails, start, scaling = self._validation
        group = prefill.spec.num_heads // prefill.spec.num_kv_heads
        q = tails[i][h * group : (h + 1) * group]  # [group, n, d]
        pos = torch.arange(start, start + q.shape[1]).repeat(group)
        return q.reshape(-1, q.shape[-1]), pos, scaling

    def _reservoir(self, spec) -> QueryReservoir:
        """An empty ``QueryReservoir`` of ``spec``'s KV heads, capped at ``queries`` per KV head, subsampled as
        ``query_sample`` says."""
        return QueryReservoir(spec.num_kv_heads, self.queries, per_position=self.query_sample == "per-position")

    def _new_reservoirs(self, prefill: Prefill) -> list[QueryReservoir]:
        """One empty ``QueryReservoir`` per compressed layer, capped at ``queries`` per KV head."""
        return [self._reservoir(prefill.spec) for _ in prefill.spec.compressed_layers]

    def _reference(self, i: int, reservoirs: list[QueryReservoir] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Fit and held-out queries of compressed layer ``i`` and the layer's attention scaling (from
        ``reservoirs``, default: the repeat pass's)."""
        if self._reservoirs is None:
            raise RuntimeError("am: score() must run before select() and update_entries()")
        reservoir = (reservoirs or self._reservoirs)[i]
        fit, held = reservoir.split()
        return fit, held, float(reservoir.scaling)

    def select(self, scores: torch.Tensor, ratio: float, prefill: Prefill | None = None) -> torch.Tensor:
        """Keep mask ``[compressed layers, kv_heads, context]`` bool with ``round(ratio x entries)`` entries: the
        per-head budgets of ``budgets`` (``kvpack.methods.budgets.split``: ``global``, ``global-capped`` and
        ``schedule`` capped at ``max_head_ratio``, ``uniform``) over KVzip's scores with the last ``recent``
        tokens of every head first, then within each head KVzip's top scores, or ``reselect_within_heads``."""
        scores = protect_recent(scores.detach().float().cpu().nan_to_num(nan=float("-inf")), self.recent)
        fractions = None if self._schedule is None else self._schedule.fractions
        keep = split(scores, int(round(ratio * scores.numel())), self.budgets, self.max_head_ratio, fractions,
                     self.head_floor)
        return keep if self.selection == "kvzip" else self.reselect_within_heads(keep, prefill, scores)

    def _unfitted_heads(self, counts: torch.Tensor, context: int) -> torch.Tensor:
        """``[compressed layers, kv_heads]`` bool: the heads keeping ``counts`` (``[compressed layers, kv_heads]``
        int) of their ``context`` entries that ``_fitted`` (the same rule, in float64) says the fit leaves as they
        are: more entries than their fit queries divided by ``queries_per_entry`` (a head keeping nothing or
        everything is the same under any selection). Off-policy pools only (``unfitted_selection`` is inert
        with ``on_policy``, whose fit pools differ)."""
        n_fit = torch.tensor([self._reference(i)[0].shape[1] for i in range(counts.shape[0])],
                             dtype=torch.float64)[:, None]
        return (counts > 0) & (counts < context) & (counts.double() * self.queries_per_entry > n_fit)

    def reselect_within_heads(self, keep: torch.Tensor, prefill: Prefill, scores: torch.Tensor | None = None
                              ) -> torch.Tensor:
        """``keep`` (``[compressed layers, kv_heads, context]`` bool, KVzip's choice within each head's budget)
        with each head's entries re-chosen by ``selection`` (``_reselect``), except, with
        ``unfitted_selection="kvzip"`` (and ``values="fit"``, off-policy), in the heads the fit will leave as they
        are (``_unfitted_heads``), which keep ``keep``'s. Raises as ``_reselect``."""
        chosen = self._reselect(keep, prefill, scores)
        if self.unfitted_selection == "kvzip" and self.values == "fit" and not self.on_policy:
            unfitted = self._unfitted_heads(keep.sum(dim=2), keep.shape[2])
            chosen[unfitted] = keep[unfitted]
        return chosen

    def _reselect(self, keep: torch.Tensor, prefill: Prefill, scores: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """``keep`` ``[compressed layers, kv_heads, context]`` bool with each head's count unchanged and its entries
        re-chosen by the highest RMS attention over the reference queries (``selection="rms"``, the paper's
        ``score_method="rms"``), by OMP (``"omp"``, ``kvpack.methods.am_omp``), or half by KVzip's ``scores``
        (``[compressed layers, kv_heads, context]``, needed for ``"kvzip+rms"``) and half by RMS attention
        (``"kvzip+rms"``, kvpack's: RMS alone loses planted facts that KVzip's maximum keeps, BENCHMARKS.md), the
        last ``recent`` tokens first either way. With ``select_pool`` > 1 both scores are max-pooled along the
        context first (``budgets.pool_context``). Needs ``score()`` first (the recorded queries): ``RuntimeError``
        otherwise, or without ``scores`` for ``"kvzip+rms"``."""
        layers, heads, n = keep.shape
        counts = keep.sum(dim=2)
        if self.selection == "omp":
            return torch.stack([self._omp_keep(prefill, i, counts[i]) for i in range(layers)])
        self._context_cache.clear()
        rms = torch.stack([self._rms_scores(prefill, i, counts[i]) for i in range(layers)])
        rms = protect_recent(pool_context(rms, self.select_pool), self.recent)
        flat, counts = rms.reshape(layers * heads, n), counts.reshape(-1)
        if self.selection == "rms":
            return top_k_rows(flat, counts).view(keep.shape)
        if scores is None:
            raise RuntimeError("am: selection='kvzip+rms' needs KVzip's scores")
        half = (counts + 1) // 2  # KVzip's half first (the recent floor comes first in it), then RMS's
        kvzip = pool_context(scores.detach().float().cpu(), self.select_pool)
        first = top_k_rows(protect_recent(kvzip, self.recent).reshape(layers * heads, n), half)
        second = top_k_rows(flat.masked_fill(first, float("-inf")), counts - half)
        return (first | second).view(keep.shape)

    def _omp_keep(self, prefill: Prefill, i: int, counts: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, context]`` bool: OMP's ``counts[h]`` entries of each head of compressed layer ``i``."""
        from .am_omp import omp_select

        fit, _, scaling = self._reference(i)
        keys = prefill.keys[prefill.spec.compressed_layers[i]][:, prefill.sink :].float()
        n = keys.shape[1]
        out = torch.zeros(keys.shape[0], n, dtype=torch.bool)
        for h in range(keys.shape[0]):
            t = int(counts[h])
            forced = torch.arange(max(0, n - min(self.recent, t)), n)
            out[h, omp_select(keys[h], fit[h], scaling, t, forced, shift=self.shift)] = True
        return out

    def _reference_scores(self, prefill: Prefill, i: int) -> torch.Tensor:
        """``[kv_heads, context]`` float32 on CPU: each context entry's largest attention probability within the
        context over the fit queries (``score_queries="reference"``: KVzip's score, arXiv 2505.23416 §3.2, with the
        reference queries in place of the repeat pass's)."""
        fit, _, scaling = self._reference(i)
        keys = prefill.keys[prefill.spec.compressed_layers[i]][:, prefill.sink :].float()
        return torch.stack([max_attention(fit[h], keys[h], scaling) for h in range(keys.shape[0])]).cpu()

    def _rms_scores(self, prefill: Prefill, i: int, counts: torch.Tensor | None = None) -> torch.Tensor:
        """``[kv_heads, context]`` float32 on CPU: the RMS over the fit queries of each context entry's attention
        probability within the context (the paper's ``score_method="rms"``). With ``counts`` (``[kv_heads]``, each
        head's kept entries), for each head that ``_fitted`` says will be fitted on these same queries (off-policy,
        ``shift="lse"``) the same pass also computes the queries' attention over the context and keeps it for the
        fit (``_context_cache``, up to ``CONTEXT_CACHE_BYTES``). Where the repeat pass recorded its attention over
        the context (``QueryReservoir.context_statistics``), its rows are not attended again: their squares are the
        pass's over every row it attended, less the held-out rows', scaled to the fit rows' count (the RMS over the
        fit queries exactly when neither the call nor the pool was subsampled; otherwise that RMS estimated from
        every row the pass attended). With ``select_queries="all"`` the mean runs over every recorded row but the
        held-out ones: the pass's every row where it recorded its attention, the stored rows of the other parts
        (``QueryReservoir.left_out``)."""
        fit, held, scaling = self._reference(i)
        layer = prefill.spec.compressed_layers[i]
        keys = prefill.keys[layer][:, prefill.sink :].float()
        values = prefill.values[layer][:, prefill.sink :]
        share = counts is not None and self.shift == "lse" and not self.on_policy
        # the repeat pass's own attention over the context, where it recorded it (QueryReservoir.context_attention):
        # only the rows without it (self-study's) are attended here, and the held-out rows' squares subtracted
        pooled = self._reservoirs[i].context_statistics() if self._reservoirs is not None else None
        if pooled is not None and pooled.square_sums.shape[-1] != keys.shape[1]:
            pooled = None
        every = self.select_queries == "all"
        # the recorded rows the subsampling left out of the pool: averaged over too with select_queries="all" (those
        # the repeat pass attended over the context are in its square sums already)
        extra = self._reservoirs[i].left_out(pooled is not None) if every and self._reservoirs else None
        n_rows = fit.shape[1]
        if pooled is not None:
            fit_rows, held_rows = self._reservoirs[i].split_rows()
            missing, held_known = ~pooled.has[fit_rows], pooled.has[held_rows]
            # the pass's squares, less the held-out rows', stand for the fit rows that have them: scaled to their
            # count (1 unless the call or the pool was subsampled, then the estimate from every row), or,
            # with select_queries="all", counted as they are
            others = pooled.count - int(held_known.sum())
            scale = int((~missing).sum()) / others if others > 0 else 0.0
            if every:
                scale, n_rows = 1.0, others + int(missing.sum())
        if extra is not None:
            n_rows += extra.shape[1]
        out = []
        for h in range(keys.shape[0]):
            row_bytes = 4 * (values.shape[-1] + 1)
            cached = sum(4 * c[1].numel() + 4 * c[2].numel() for c in self._context_cache.values())
            keep = (share and self._fitted(int(counts[h]), keys.shape[1], fit.shape[1])
                    and cached + fit.shape[1] * row_bytes <= CONTEXT_CACHE_BYTES)
            # the fit rows attended here: all of them, or those the repeat pass did not attend for us
            rows = fit[h] if pooled is None else fit[h][missing.to(fit.device)]
            rms = target = lse = None
            # the left-out rows' squares (select_queries="all")
            extra_squares = (None if extra is None
                             else rms_attention(extra[h], keys[h], scaling).square_().mul_(extra.shape[1]))
            if pooled is None or rows.shape[0]:
                got = rms_attention(rows, keys[h], scaling, values=values[h].float() if keep else None)
                rms, target, lse = got if keep else (got, None, None)
            if pooled is not None:  # the pooled squares, less the held-out rows', plus the rows attended here
                squares = pooled.square_sums[h].to(keys.device).clone()
                if bool(held_known.any()):
                    held_h = held[h][held_known.to(held.device)]
                    squares -= rms_attention(held_h, keys[h], scaling).square_().mul_(held_h.shape[0])
                if scale != 1.0:
                    squares.mul_(scale)
                if rms is not None:
                    squares += rms.square_().mul_(rows.shape[0])
                if extra_squares is not None:
                    squares += extra_squares
                if keep:
                    pooled_target = pooled.output[h][fit_rows].to(keys.device)
                    pooled_lse = pooled.lse[h][fit_rows].to(keys.device)
                    if target is not None:
                        pooled_target[missing], pooled_lse[missing] = target, lse
                    target, lse = pooled_target, pooled_lse
                rms = squares.clamp_min_(0).div_(max(1, n_rows)).sqrt_()
            elif extra_squares is not None:  # the fit rows' mean and the left-out rows', weighed by their counts
                rms = rms.square().mul_(rows.shape[0]).add_(extra_squares).div_(max(1, n_rows)).sqrt_()
            if keep:
                self._context_cache[(i, h)] = (fit, target, lse)
            out.append(rms)
        return torch.stack(out).cpu()

    def _fitted(self, kept: int, context: int, n_fit: int) -> bool:
        """Whether a head keeping ``kept`` of its ``context`` entries is fitted on ``n_fit`` queries: something kept
        and something evicted, and at least ``queries_per_entry`` queries per kept entry."""
        return 0 < kept < context and kept * self.queries_per_entry <= n_fit

    @torch.inference_mode()
    def update_entries(self, prefill: Prefill, keep: torch.Tensor, layers: list[LayerEntries]) -> dict:
        tally = _FitTally()
        reservoirs = list(self._reservoirs or [])
        passes = self._policy_passes(prefill) if self.on_policy else []
        if passes and len(prefill.spec.compressed_layers) > 1:
            from .am_sweep import on_policy_sweep

            def fit_layer(i: int, handed: list[tuple[torch.Tensor, float]]) -> None:
                if i > 0:  # layer 0's queries are the sources' own (nothing before it is compacted)
                    reservoirs[i] = self._reservoir(prefill.spec)
                    for item in handed:
                        reservoirs[i].append(item)
                self._fit_layer(prefill, keep, layers, i, reservoirs, tally)

            on_policy_sweep(self._model, prefill, layers, passes, fit_layer)
        else:
            for i in range(len(prefill.spec.compressed_layers)):
                self._fit_layer(prefill, keep, layers, i, reservoirs, tally)
        self._context_cache.clear()
        out = {"queries": tally.n_fit, "held_out": tally.n_held, "relative_error": tally.errors,
               "selection_error": tally.baseline, "mass_error": tally.mass, "heads_unfitted": tally.unfitted,
               "heads_rejected": tally.rejected, "heads_rejected_by": tally.rejected_by}
        if self.ridge_search:
            out["ridge_search"] = tally.chosen
        return out

    def _fit_layer(self, prefill: Prefill, keep: torch.Tensor, layers: list[LayerEntries], i: int,
                   reservoirs: list[QueryReservoir], tally: "_FitTally") -> None:
        """Fit compressed layer ``i``'s kept entries of every head on ``reservoirs[i]``'s queries, in place in
        ``layers`` (values and ``biases``), and add the layer's errors and counts to ``tally``."""
        sink, l = prefill.sink, prefill.spec.compressed_layers[i]
        fit_q, held_q, scaling = self._reference(i, reservoirs)
        tally.n_fit, tally.n_held = n_fit, n_held = fit_q.shape[1], held_q.shape[1]
        entries = layers[l]
        offsets = entries.head_offsets().tolist()
        biases = torch.zeros(entries.num_entries, dtype=torch.float32)
        keys = prefill.keys[l].float()  # [kv_heads, tokens, d], sink first
        values = prefill.values[l].float()
        positions = prefill.positions[l].to(keys.device)  # [tokens], the validation's causal mask
        err, base, ms = [], [], []
        # ridge search: choose_fit compares the candidates (the copied values among them) on the validation
        # queries, which stands in for fit_head's residual check
        validated = self.ridge_search and self.values == "fit"
        refined_rows = self._refine_rows(reservoirs[i]) if validated and self.refine_steps > 0 else None
        for h in range(keys.shape[0]):
            kept = keep[i, h].nonzero().squeeze(1).to(keys.device)
            cached = self._context_cache.pop((i, h), None)  # the RMS selection's pass, if on these same queries
            if not self._fitted(len(kept), keys.shape[1] - sink, n_fit):
                tally.unfitted += 1
                continue  # as KVzip selected it (nothing kept, or nothing evicted): beta = 0, values copied
            k_ctx, v_ctx = keys[h, sink:], values[h, sink:]
            context = cached[1:] if cached is not None and cached[0] is fit_q else None
            fit = fit_head(k_ctx, v_ctx, fit_q[h], kept, scaling, fit_values=self.values == "fit",
                           shift=self.shift, ridge=self.ridge, ridge_to=self.ridge_to,
                           weights=self.weights, sink_keys=keys[h, :sink],
                           keep_design=validated, residual_check=not validated,
                           beta_solve="clamped" if self.selection == "omp" else "nnls", context=context)
            new_keys = None  # the kept keys as prefilled, unless refined
            new_values, beta = fit.values, fit.beta
            if fit.design is not None:  # ridge_search: the candidate best on the validation queries
                vq, vpos, vscale = self._validation_queries(prefill, i, h)
                vq, vpos = vq.to(keys.device), vpos.to(keys.device)
                # the validation queries' output over the whole prefill, for choose_fit and the refinement alike
                want = causal_output(vq, vpos, keys[h], positions, values[h], vscale)
                name, beta, new_values, verrors = choose_fit(
                    keys[h], values[h], positions, sink, kept, fit.beta, *fit.design, vq, vpos, vscale,
                    C.MAX_KV_ABS, normal=fit.normal, full=want,
                    plain=fit.values if self.ridge == 0 else None)  # fit_head solved the ridge-0 values already
                # gradient steps from the chosen candidate, kept if validated better; on the in-window fit queries
                # alone where some sit past the window, and only with queries_per_entry of them per kept entry
                queries, part = fit_q[h], context
                if refined_rows is not None:
                    rows = refined_rows.to(fit_q.device)
                    queries, part = queries[rows], None if context is None else (context[0][rows], context[1][rows])
                if self.refine_steps > 0 and queries.shape[0] >= self.queries_per_entry * len(kept):
                    got = self._refine(keys[h], values[h], positions, sink, kept, beta, new_values, queries,
                                       scaling, part, vq, vpos, vscale, want, verrors[name])
                    if got is not None:
                        name, (new_keys, beta, new_values) = "refined", got
                tally.chosen[name] = tally.chosen.get(name, 0) + 1
                if name == "selection":
                    tally.reject("ridge_search")
                    continue  # KVzip's entries as they are
            else:
                if self.values == "merge" and len(kept) < k_ctx.shape[0]:
                    evicted = (~keep[i, h]).nonzero().squeeze(1).to(keys.device)
                    merged, target, w = merge_plan(k_ctx[kept].cpu(), k_ctx[evicted].cpu(), D2O.beta)
                    new_values = merge_rows(v_ctx[kept].cpu(), v_ctx[evicted].cpu()[merged], target, w)
                if not bool((new_values.abs() <= C.MAX_KV_ABS).all()):  # also NaN: a value the loader refuses
                    tally.reject("range")
                    continue  # an ill-conditioned fit: the head stays as KVzip selected it
                if self.value_bound > 0 and float(new_values.abs().max()) > self.value_bound * float(
                        v_ctx.abs().max()):
                    tally.reject("value_bound")
                    continue  # values far outside the context's own: an extrapolating fit
            if n_held:
                e_fit, e_sel = _held_out_errors(keys[h], values[h], held_q[h], sink, kept, beta,
                                                new_values.to(keys.device), scaling, new_keys)
                base.append(e_sel)
                if fit.design is None and self.held_out_check and e_fit > e_sel:
                    tally.reject("held_out_check")
                    err.append(e_sel)
                    continue  # the fit is worse than the selection alone on held-out queries
                err.append(e_fit)
            rows = slice(offsets[h] + sink, offsets[h] + sink + len(kept))
            entries.values[rows] = new_values.to(entries.values.dtype).cpu()
            if new_keys is not None:
                entries.keys[rows] = new_keys.to(entries.keys.dtype).cpu()
            biases[rows] = beta.cpu()
            ms.append(fit.mass_error)
        entries.biases = biases
        tally.errors.append(_mean(err))
        tally.baseline.append(_mean(base))
        tally.mass.append(_mean(ms))

    def _refine_rows(self, reservoir: "QueryReservoir") -> torch.Tensor | None:
        """With ``refine_queries="in-window"``, the indices ``[m]`` of ``reservoir``'s fit rows whose queries sit
        within the model's positions (``max_position_embeddings``; rows of unknown position count as within), or
        ``None`` when that is every row (or ``refine_queries="all"``, or the model sets no window): the refinement
        then fits every fit row. Rows past the window are the model extrapolating, not queries any later token
        asks (BENCHMARKS.md, "Issue 28, thirty-fifth session")."""
        window = getattr(getattr(self._model, "config", None), "max_position_embeddings", None)
        if self.refine_queries != "in-window" or not isinstance(window, int) or window <= 0:
            return None
        inside = reservoir.fit_positions() < window
        return None if bool(inside.all()) else inside.nonzero().squeeze(1)

    def _refine(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, sink: int,
                kept: torch.Tensor, beta: torch.Tensor, new_values: torch.Tensor, queries: torch.Tensor, scaling: float,
                context: tuple[torch.Tensor, torch.Tensor] | None, vq: torch.Tensor, vpos: torch.Tensor, vscale: float,
                want: torch.Tensor, chosen_error: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """One head's ``refine_steps`` Adam steps (``am_refine.refine_head``) from the candidate ``choose_fit`` chose
        (``beta`` ``[t]``, ``new_values`` ``[t, dv]``) on the fit ``queries`` ``[n, d]``: the refined ``(keys [t, d],
        beta [t], values [t, dv])`` when their error on the validation queries ``vq`` (at ``vpos``) is below the
        chosen candidate's ``chosen_error`` and every key and value is within the loader's bound, else ``None``.
        ``keys``, ``values``: ``[tokens, d]`` with the sink first; ``context``: the fit queries' ``(output, lse)``
        over the context when the RMS selection computed them, else computed here; ``want``: ``[m, dv]`` the
        validation queries' output over the whole prefill (``am_validate.causal_output``)."""
        from .am_refine import full_output, refine_head

        k_ctx, v_ctx = keys[sink:], values[sink:]
        target, lse = context if context is not None else context_attention(queries, k_ctx, v_ctx, scaling)
        full = full_output(queries, target, lse, keys[:sink], values[:sink], scaling)
        rk, rb, rv, _, _ = refine_head(k_ctx[kept], beta, new_values.to(keys.device), queries, full, keys[:sink],
                                       values[:sink], scaling, self.refine_steps, batch=self.refine_batch,
                                       lr=self.refine_lr, move=self.refine_move,
                                       measure=False)
        if not bool(torch.isfinite(rk).all() and torch.isfinite(rv).all()) or \
                float(rv.abs().max()) > C.MAX_KV_ABS or float(rk.abs().max()) > C.MAX_KV_ABS:
            return None
        rows = torch.cat([torch.arange(sink, device=keys.device), sink + kept])
        got = causal_output(vq, vpos, torch.cat([keys[:sink], rk]), positions[rows], torch.cat([values[:sink], rv]),
                            vscale, bias=torch.cat([torch.zeros(sink, device=keys.device), rb]))
        return (rk, rb, rv) if relative_error(want, got) < chosen_error else None

    def _policy_passes(self, prefill: Prefill) -> list:
        """The on-policy sweep's passes (``am_sweep.PolicyPass``), in the order their queries are pooled: KVzip's
        repeat chunks when the reference has the repeat pass's queries, then the token sequences the reference
        source fed (self-study answers, sampled continuations), each after the whole context."""
        from .am_sweep import PolicyPass

        passes = []
        if self.reference in REFERENCES_WITH_REPEAT:
            for start, stop, repeat_ids in self.repeat_inputs(self._tokenizer, prefill):
                passes.append(PolicyPass(prefill.view_cache(slice(start, stop)), repeat_ids, start, stop))
        for sequence in self._sequences or []:
            passes.append(PolicyPass(prefill.view_cache(), list(sequence), 0, prefill.context_tokens))
        return passes

    def _recompute_queries(self, prefill: Prefill, layers: list[LayerEntries], i: int) -> QueryReservoir:
        """On-policy queries of compressed layer ``i`` computed for that layer alone (one forward call per pass and
        layer; the reference ``tests/test_am.py`` checks the sweep against), the compressed layers before it holding
        their compacted entries (biases included): KVzip's repeat passes again when the reference has the repeat
        pass's queries (``am_policy.on_policy_queries``), and the self-study answers or sampled continuations
        replayed when it has those (``am_policy.replayed_queries``), pooled in one reservoir as the sweep pools
        them."""
        from .am_policy import on_policy_queries, replayed_queries

        reservoir = self._reservoir(prefill.spec)
        if self.reference in REFERENCES_WITH_REPEAT:
            on_policy_queries(self, self._model, self._tokenizer, prefill, layers, i, reservoir)
        if self._sequences:
            replayed_queries(self._model, prefill, layers, i, self._sequences, reservoir)
        return reservoir


@dataclass
class _FitTally:
    """What ``AttentionMatching._fit_layer`` adds up over the compressed layers for ``stats["fit"]``."""

    n_fit: int = 0
    n_held: int = 0
    unfitted: int = 0
    rejected: int = 0
    errors: list = field(default_factory=list)
    baseline: list = field(default_factory=list)
    mass: list = field(default_factory=list)
    chosen: dict = field(default_factory=dict)
    rejected_by: dict = field(default_factory=dict)

    def reject(self, rule: str) -> None:
        """Count one head whose fit ``rule`` rejected (``range``: values outside float16's, ``value_bound``,
        ``held_out_check``, ``ridge_search``: the selection validated best)."""
        self.rejected += 1
        self.rejected_by[rule] = self.rejected_by.get(rule, 0) + 1


def _held_out_errors(keys, values, queries, sink, kept, beta, new_values, scaling, new_keys=None
                     ) -> tuple[float, float]:
    """Relative errors of one head's output on held-out queries over ``[sink, context]``: the compacted head
    (``beta``, ``new_values``, and ``new_keys`` ``[t, d]`` when refined, else the kept keys) and KVzip's selection
    alone (beta = 0, values copied). ``keys``, ``values``: ``[tokens, d]`` float32 with the sink first; ``kept``:
    indices into the context."""
    full = attention_output(queries, keys, values, scaling)
    rows = torch.cat([torch.arange(sink, device=keys.device), sink + kept])
    zeros = torch.zeros(sink, device=keys.device)
    compact_keys = keys[rows] if new_keys is None else torch.cat([keys[:sink], new_keys.to(keys.device)])
    compact = attention_output(queries, compact_keys, torch.cat([values[:sink], new_values]), scaling,
                               torch.cat([zeros, beta]))
    selected = attention_output(queries, keys[rows], values[rows], scaling)
    return relative_error(full, compact), relative_error(full, selected)


def _mean(xs: list[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None
