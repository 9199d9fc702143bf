"""Influence-based head schedules for Attention Matching's ``--budgets schedule`` (``kvpack schedule``), made once
per model the way the official code's ``head_budget_optimization/`` makes them (arXiv 2602.16284 §4;
github.com/adamzweiger/compaction: ``influence.py`` measures how the loss moves as ONE head's keep ratio moves while
every other head stays at the baseline, ``solver.py`` then hands the budget out greedily by those influences).

What is measured, per context (a text given by the user; its last ``continuation_tokens + 1`` tokens are held back):

1. the rest is prefilled and scored by KVzip's repeat pass once (``kvpack.methods.kvzip.KVzip.score``:
   ``[compressed_layers, kv_heads, n]`` entry scores, ``n`` context tokens after the sink);
2. the *loss* of a cache is the mean negative log-likelihood (nats/token) of the held-back continuation,
   teacher-forced over that cache: only the ``continuation_tokens`` tokens run through the model, attending to the
   cache's kept entries (as ``kvpack.bench.continuation`` does over a loaded pack);
3. the baseline is the uniform split at ``ratio``: every (compressed layer, KV head) keeps its top
   ``b = round(ratio x n)`` entries by KVzip score (plus the sink); then for each head alone its budget is lowered to
   ``round(ratio x (1 - delta) x n)`` and raised to ``round(ratio x (1 + delta) x n)`` (clamped to ``[0, n]``, at
   least one entry away from ``b``), the others staying at ``b``. That is ``2 H + 1`` loss evaluations per context
   for ``H`` heads (plus one over the full cache, reported only), after one prefill and one repeat pass;
4. a head's *gains* are the loss differences per unit of its keep ratio: ``gain_down = (loss_down - loss_base) /
   (x_base - x_down)`` (what the entries just below its uniform budget are worth) and ``gain_up = (loss_base -
   loss_up) / (x_up - x_base)`` (what entries above it would bring), in nats/token per unit of keep ratio, averaged
   over the contexts. Every head of a context has the same ``n``, so ordering by gain per unit of keep ratio is
   ordering by loss reduction per entry. A side clamped away (``b = 0`` or ``b = n``) takes the other side's gain.

Proxy: the cache is *evicted* (each head keeps its top KVzip-scored entries as they are), with no Attention
Matching fit (no β, no fitted values): that is far cheaper (no fit per evaluation) and ranks heads by how much their
entries matter, but a fitted head may degrade more gracefully than an evicted one. The file's ``source`` says so.

``greedy_allocation`` then solves for the per-head shares: every head starts at a floor, and budget increments go,
one at a time, to the head with the largest gain for its next increment (``gain_down`` below the uniform share,
``gain_up`` from it up, both extrapolated as constants beyond the probes), none above the ``max_head_ratio`` cap,
until the whole budget ``ratio x H`` (in units of one head's keep ratio) is allocated. With concave loss curves
(``gain_down >= gain_up``) this greedy is optimal for the piecewise-linear model; the official solver does the same
on curves measured at more points (``--n-eval-points 5``). Everything is deterministic: stable ties (the lower flat
head index first), no sampling.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .attention import use_kvpack_attention
from .build_settings import check_chunk_size
from .cache import KvpackCache, PackedLayer
from .compress import max_context_tokens
from .errors import InputError
from .evaluation import cache_logprobs, target_nll
from .fingerprint import model_fingerprint
from .generation import check_text
from .layout import chat_layout
from .methods.kvzip import KVzip
from .model import model_spec
from .prefill import Prefill, prefill
from .schedule import HeadSchedule, schedule_from_scores

__all__ = ["HeadInfluence", "head_influence", "greedy_allocation", "influence_schedule", "scores_schedule",
           "SOLVERS", "REFERENCE"]

#: ``kvpack schedule --solver``: the influence solver (this module) or ``kvpack.schedule.schedule_from_scores``.
SOLVERS = ("influence", "scores")
REFERENCE = "arXiv 2602.16284 §4; github.com/adamzweiger/compaction head_budget_optimization/"
PROXY = "eviction: each head keeps its top KVzip-scored entries, no Attention Matching fit"
#: Fewest context tokens left after the held-back continuation.
MIN_CONTEXT_TOKENS = 8


@dataclass
class HeadInfluence:
    """What ``head_influence`` measured.

    Attributes:
        gain_down, gain_up: ``[contexts, compressed_layers, kv_heads]`` float32, loss reduction (nats/token) per unit
            of one head's keep ratio below / above the uniform ``ratio`` (module docstring, step 4).
        base_loss: ``[contexts]`` float32, the continuation's mean NLL (nats/token) over the uniform split.
        full_loss: ``[contexts]`` float32, the same over the full cache (nothing evicted).
        contexts: ``[{"name", "sha256", "tokens", "continuation_tokens"}]`` (``tokens``: context tokens after the
            sink; ``sha256``: of the whole UTF-8 text).
        compressed_layers: the layer index of each row.
        evaluations: continuation passes run (``contexts x (2 H + 2)``).
        seconds: wall-clock seconds of the whole measurement.
        settings: ``{"ratio", "delta", "continuation_tokens", "chunk_size"}`` as given.
    """

    gain_down: torch.Tensor
    gain_up: torch.Tensor
    base_loss: torch.Tensor
    full_loss: torch.Tensor
    contexts: list[dict[str, Any]]
    compressed_layers: list[int]
    evaluations: int = 0
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)


def head_influence(model, tokenizer, texts: list[str], *, ratio: float = 0.1, delta: float = 0.5,
                   continuation_tokens: int = 128, names: list[str] | None = None, chunk_size: int = 2048,
                   progress: Callable[[int, int], None] | None = None) -> HeadInfluence:
    """Each head's loss gains around the uniform split at ``ratio`` (module docstring, steps 1-4).

    Args:
        model, tokenizer: from ``kvpack.load_model`` or transformers.
        texts: the contexts (a few thousand tokens each of the kind of text to be compressed); each must have more
            than ``continuation_tokens + 1 + MIN_CONTEXT_TOKENS`` tokens.
        ratio: the keep ratio the schedule is made for, in (0, 1).
        delta: the relative probe step, in (0, 1]: a head's budget moves to ``ratio x (1 +- delta)``.
        continuation_tokens: tokens of each text's end scored as the continuation (``>= 1``).
        names: one per text, recorded (default ``context-0``, ...).
        chunk_size: prefill and repeat-pass chunk (tokens).
        progress: called with ``(evaluations done, evaluations)`` after each continuation pass.

    Returns:
        ``HeadInfluence``. Cost per context: one prefill and one KVzip repeat pass of the context, then ``2 H + 2``
        forward passes of ``continuation_tokens`` tokens over a cache of about ``ratio x n`` entries per head.

    Raises:
        InputError: no texts, an empty or too short text, names not matching the texts, ``ratio``, ``delta``,
            ``continuation_tokens`` or ``chunk_size`` out of range, a text too long for the model.
    """
    _check_options(ratio, delta, continuation_tokens, chunk_size)
    t0 = time.perf_counter()
    spec = model_spec(model)
    layers, heads = len(spec.compressed_layers), spec.num_kv_heads
    per_pass = 2 * layers * heads + 2
    total = per_pass * len(texts)
    done = 0
    downs, ups, base, full_nll, contexts = [], [], [], [], []
    for name, text, full, scores, target in _scored_contexts(model, tokenizer, texts, names, chunk_size,
                                                              continuation_tokens):
        n = full.context_tokens
        order = torch.sort(scores, dim=2, descending=True, stable=True).indices  # [layers, heads, n]
        b = min(n, max(0, int(round(ratio * n))))
        lo = min(b - 1, int(round(ratio * (1 - delta) * n))) if b > 0 else None
        hi = max(b + 1, int(round(ratio * (1 + delta) * n))) if b < n else None
        hi = None if hi is None else min(n, hi)
        uniform = full.view_cache()
        for i, l in enumerate(spec.compressed_layers):
            uniform.layers[l] = _evicted_layer(full, l, order[i], [b] * heads)
        use_kvpack_attention(model)
        full_loss = _continuation_nll(model, full.view_cache(), target)
        base_loss = _continuation_nll(model, uniform, target)
        done += 2
        down = torch.zeros(layers, heads)
        up = torch.zeros(layers, heads)
        for i, l in enumerate(spec.compressed_layers):
            kept = uniform.layers[l]
            for h in range(heads):
                side = {}
                for key, budget in (("down", lo), ("up", hi)):
                    if budget is not None:
                        budgets = [b] * heads
                        budgets[h] = budget
                        uniform.layers[l] = _evicted_layer(full, l, order[i], budgets)
                        side[key] = (_continuation_nll(model, uniform, target), budget / n)
                    done += 1
                    if progress:
                        progress(done, total)
                uniform.layers[l] = kept
                x = b / n
                g_down = (side["down"][0] - base_loss) / (x - side["down"][1]) if "down" in side else None
                g_up = (base_loss - side["up"][0]) / (side["up"][1] - x) if "up" in side else None
                down[i, h] = g_down if g_down is not None else g_up
                up[i, h] = g_up if g_up is not None else g_down
        downs.append(down)
        ups.append(up)
        base.append(base_loss)
        full_nll.append(full_loss)
        contexts.append({"name": name, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "tokens": n,
                         "continuation_tokens": len(target) - 1})
    return HeadInfluence(torch.stack(downs), torch.stack(ups), torch.tensor(base), torch.tensor(full_nll), contexts,
                         list(spec.compressed_layers), evaluations=done, seconds=time.perf_counter() - t0,
                         settings={"ratio": ratio, "delta": delta, "continuation_tokens": continuation_tokens,
                                   "chunk_size": chunk_size})


def greedy_allocation(gain_down: torch.Tensor, gain_up: torch.Tensor, ratio: float, cap: float = 0.75, *,
                      floor: float = 0.25, resolution: int = 1000) -> torch.Tensor:
    """Per-head shares of the budget, allocated greedily by marginal gain (module docstring).

    The budget is ``H x resolution`` units (``H`` heads; one unit is ``1 / resolution`` of the uniform share, i.e.
    ``ratio / resolution`` of a head's keep ratio). Every head starts at ``floor(floor x resolution)`` units; then
    each unit goes to the head whose next unit gains most: ``gain_down`` while the head holds fewer than
    ``resolution`` units (below the uniform share), ``gain_up`` from there on; no head goes above
    ``max(floor(cap / ratio x resolution), resolution)`` units (the cap as a keep ratio, raised to the uniform share
    when ``ratio > cap``). Ties go to the lower flat index. Runs a heap over each head's two constant-gain segments
    (the same result as the unit-by-unit loop, in ``O(H log H)``).

    Args:
        gain_down, gain_up: ``[compressed_layers, kv_heads]`` (any float dtype), loss reduction per unit of keep
            ratio; larger = more worth the budget (``HeadInfluence`` averaged over contexts).
        ratio: the keep ratio, in (0, 1); cap: ``max_head_ratio``, in (0, 1].
        floor: each head's minimum, as a fraction of the uniform share, in [0, 1].
        resolution: units per uniform share, ``>= 1``.

    Returns:
        ``[compressed_layers, kv_heads]`` float32 fractions summing to 1 (units / total units).

    Raises:
        ValueError: shapes that differ, or an argument out of range.
    """
    if gain_down.shape != gain_up.shape or gain_down.dim() != 2:
        raise ValueError(f"greedy_allocation: gains of shapes {list(gain_down.shape)} and {list(gain_up.shape)}; "
                         "give two [layers, kv_heads] tensors")
    if not (0 < ratio < 1 and 0 < cap <= 1 and 0 <= floor <= 1 and resolution >= 1):
        raise ValueError(f"greedy_allocation: ratio {ratio} must be in (0, 1), cap {cap} in (0, 1], floor {floor} "
                         f"in [0, 1], resolution {resolution} >= 1")
    down, up = gain_down.double().flatten().tolist(), gain_up.double().flatten().tolist()
    heads = len(down)
    low = int(math.floor(floor * resolution + 1e-9))
    high = max(int(math.floor(cap / ratio * resolution + 1e-9)), resolution)
    units = [low] * heads
    left = heads * resolution - low * heads
    # each head's next segment: (-gain, head, units in it); a head's up segment opens when its down one is spent
    segments = {h: [(down[h], resolution - low), (up[h], high - resolution)] if low < resolution
                else [(up[h], high - low)] for h in range(heads)}
    heap = []
    for h in range(heads):
        _push_next(heap, segments, h)
    while left > 0 and heap:
        _, h, size = heapq.heappop(heap)
        take = min(size, left)
        units[h] += take
        left -= take
        _push_next(heap, segments, h)
    return (torch.tensor(units, dtype=torch.float64) / (heads * resolution)).float().view(gain_down.shape)


def _push_next(heap: list, segments: dict, h: int) -> None:
    """Push head ``h``'s next non-empty segment (``(-gain, h, size)``) onto ``heap``."""
    while segments[h]:
        gain, size = segments[h].pop(0)
        if size > 0:
            heapq.heappush(heap, (-gain, h, size))
            return


def influence_schedule(model, tokenizer, texts: list[str], *, ratio: float = 0.1, cap: float = 0.75,
                       delta: float = 0.5, floor: float = 0.25, continuation_tokens: int = 128,
                       names: list[str] | None = None, chunk_size: int = 2048, resolution: int = 1000,
                       progress: Callable[[int, int], None] | None = None) -> tuple[HeadSchedule, HeadInfluence]:
    """``head_influence`` then ``greedy_allocation`` of the context-mean gains: a ``HeadSchedule`` for ``model``
    (its fingerprint) whose ``source`` records ``method="influence"``, the proxy, ``ratio``, ``delta``, ``floor``,
    ``max_head_ratio``, ``continuation_tokens``, ``chunk_size``, ``resolution``, the contexts (name, SHA-256,
    tokens), the total ``tokens``, the ``evaluations`` run and the mean base and full-cache losses.

    Returns ``(schedule, influence)``. Raises ``InputError`` as ``head_influence`` does, and for ``cap`` outside
    (0, 1] or ``floor`` outside [0, 1]."""
    if not 0 < cap <= 1 or not 0 <= floor <= 1:
        raise InputError(f"max_head_ratio must be in (0, 1] and floor in [0, 1], got {cap} and {floor}")
    inf = head_influence(model, tokenizer, texts, ratio=ratio, delta=delta, continuation_tokens=continuation_tokens,
                         names=names, chunk_size=chunk_size, progress=progress)
    fractions = greedy_allocation(inf.gain_down.mean(dim=0), inf.gain_up.mean(dim=0), ratio, cap, floor=floor,
                                  resolution=resolution)
    source = {"method": "influence", "proxy": PROXY, "reference": REFERENCE, "ratio": ratio, "delta": delta,
              "floor": floor, "max_head_ratio": cap, "continuation_tokens": continuation_tokens,
              "chunk_size": chunk_size, "resolution": resolution, "contexts": inf.contexts,
              "tokens": sum(c["tokens"] for c in inf.contexts), "evaluations": inf.evaluations,
              "base_nll": round(float(inf.base_loss.mean()), 6), "full_nll": round(float(inf.full_loss.mean()), 6)}
    return HeadSchedule(fractions, inf.compressed_layers, model_fingerprint(model, tokenizer), source), inf


def scores_schedule(model, tokenizer, texts: list[str], *, ratio: float = 0.1, cap: float = 0.75,
                    names: list[str] | None = None, chunk_size: int = 2048) -> HeadSchedule:
    """``kvpack.schedule.schedule_from_scores`` of the KVzip scores of ``texts`` (whole; nothing held back): each
    head's mean share of the capped global top-k. One prefill and one repeat pass per text. ``source`` records
    ``method="scores"``, the contexts and ``tokens``. Raises ``InputError`` as ``head_influence`` does."""
    _check_options(ratio, 0.5, 1, chunk_size)
    if not 0 < cap <= 1:
        raise InputError(f"max_head_ratio must be in (0, 1], got {cap}")
    scores, contexts = [], []
    for name, text, full, s, _ in _scored_contexts(model, tokenizer, texts, names, chunk_size, None):
        scores.append(s)
        contexts.append({"name": name, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                         "tokens": full.context_tokens})
    spec = model_spec(model)
    return schedule_from_scores(scores, ratio, cap, list(spec.compressed_layers), model_fingerprint(model, tokenizer),
                                {"method": "scores", "reference": REFERENCE, "chunk_size": chunk_size,
                                 "contexts": contexts, "tokens": sum(c["tokens"] for c in contexts)})


# ---------------------------------------------------------------------------------------------------------------


def _check_options(ratio: float, delta: float, continuation_tokens: int, chunk_size: int) -> None:
    if not 0 < ratio < 1:
        raise InputError(f"the schedule's keep ratio must be in (0, 1), got {ratio}")
    if not 0 < delta <= 1:
        raise InputError(f"delta (the probe step) must be in (0, 1], got {delta}")
    if isinstance(continuation_tokens, bool) or not isinstance(continuation_tokens, int) or continuation_tokens < 1:
        raise InputError(f"continuation_tokens must be a positive integer, got {continuation_tokens!r}")
    check_chunk_size(chunk_size)


def _scored_contexts(model, tokenizer, texts, names, chunk_size: int, held: int | None
                     ) -> Iterator[tuple[str, str, Prefill, torch.Tensor, list[int]]]:
    """Per text ``(name, text, prefill, scores, target)``: the text's tokens less its last ``held + 1`` (none when
    ``held`` is None) prefilled after the chat prefix and scored by KVzip (``[compressed_layers, kv_heads, n]`` float32
    on CPU); ``target`` the held-back ids (fed ``[:-1]``, predicted ``[1:]``)."""
    if isinstance(texts, str) or not texts:
        raise InputError("give a list of one or more context texts")
    names = [f"context-{i}" for i in range(len(texts))] if names is None else list(names)
    if len(names) != len(texts):
        raise InputError(f"{len(names)} names for {len(texts)} texts")
    spec, layout = model_spec(model), chat_layout(tokenizer)
    prefix = layout.prefix_ids(tokenizer)
    limit = max_context_tokens(model)
    scorer = KVzip(chunk_size=chunk_size)
    for name, text in zip(names, texts):
        check_text(text, f"{name}: the context")
        if not text.strip():
            raise InputError(f"{name}: the context is empty; give a non-empty text")
        ids = layout.encode_text(tokenizer, text)
        cut = len(ids) - (0 if held is None else held + 1)
        if held is not None and cut < MIN_CONTEXT_TOKENS:
            raise InputError(f"{name}: {len(ids)} tokens leave {max(cut, 0)} context tokens after the "
                             f"{held + 1}-token continuation (at least {MIN_CONTEXT_TOKENS} needed); give a longer "
                             "text or a smaller --continuation-tokens")
        if limit is not None and len(prefix) + len(ids) > limit:
            raise InputError(f"{name}: {len(prefix) + len(ids)} tokens is too long for this model (at most "
                             f"{limit}); use a shorter context")
        full = prefill(model, prefix + ids[:cut], len(prefix), layout, spec, chunk_size)
        scores = scorer.score(model, tokenizer, full).float().cpu()
        yield name, text, full, scores, ids[cut:]


def _evicted_layer(full: Prefill, layer: int, order: torch.Tensor, budgets: list[int]) -> PackedLayer:
    """Compressed layer ``layer`` of ``full`` with head ``h`` holding the sink plus its ``budgets[h]`` best entries
    (``order``: ``[kv_heads, n]`` context indices by descending score), in position order."""
    k, v, pos = full.keys[layer], full.values[layer], full.positions[layer]
    sink = torch.arange(full.sink)
    rows, lengths = [], []
    for h, b in enumerate(budgets):
        idx = torch.cat([sink, full.sink + torch.sort(order[h, :b]).values]).to(k.device)
        rows.append((k[h, idx], v[h, idx], pos[idx]))
        lengths.append(len(idx))
    return PackedLayer(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]),
                       torch.cat([r[2] for r in rows]).long(), lengths, full.tokens)


def _continuation_nll(model, cache: KvpackCache, target: list[int]) -> float:
    """Mean NLL (nats/token) of ``target[1:]`` teacher-forced after ``cache`` (``target[:-1]`` fed), tail dropped
    before and after (``kvpack.evaluation.cache_logprobs``)."""
    return target_nll(cache_logprobs(model, cache, target), target)
