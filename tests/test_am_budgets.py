"""Issue 28: Attention Matching's per-head budgets (global, global-capped, uniform, schedule), the recent floor,
OMP selection, self-study queries, the cap on KVzip/SnapKV, schedule files, and old packs' parameters."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import kvpack
from kvpack.errors import InputError, ModelMismatchError
from kvpack.layout import chat_layout
from kvpack.methods import get_method
from kvpack.methods.am_fit import context_attention, nnls_box, BETA_RANGE
from kvpack.methods.am_omp import omp_select
from kvpack.methods.base import select_global
from kvpack.methods.budgets import (cap_entries, capped_top_k, floor_entries, pool_context, protect_recent,
                                    scheduled_split, uniform_split)
from kvpack.methods.params import PARAMS
from kvpack.model import model_spec
from kvpack.prefill import prefill

from .tiny import TEXT, tiny_model


def _skewed(layers=2, heads=3, n=40, seed=0):
    """Scores where head (0, 0) outranks every other entry: the global top-k gives it everything first."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(layers, heads, n, generator=gen)
    s[0, 0] += 10.0
    return s


# ---------------------------------------------------------------------------------------------------------------
# splits


def test_capped_top_k_keeps_no_head_above_the_cap_and_the_exact_total():
    s = _skewed()
    total = int(round(0.3 * s.numel()))  # 72 > 40: uncapped, head (0, 0) keeps all 40
    assert int(select_global(s, 0.3)[0, 0].sum()) == 40
    keep = capped_top_k(s, total, 0.75)
    assert int(keep.sum()) == total
    assert int(keep.sum(dim=2).max()) == 30  # floor(0.75 x 40), reached by the dominant head
    # the surplus goes by score: the other heads keep their own top entries, and the capped head its top 30
    assert torch.equal(keep[0, 0], s[0, 0] >= s[0, 0].sort(descending=True).values[29])
    others = s.clone()
    others[0, 0] = float("-inf")
    expected = select_global(others, (total - 30) / s.numel())
    expected[0, 0] = keep[0, 0]
    assert torch.equal(keep, expected)


def test_capped_top_k_is_the_global_top_k_when_no_head_reaches_the_cap():
    s = torch.rand(3, 4, 50, generator=torch.Generator().manual_seed(1))
    for ratio in (0.1, 0.3):
        total = int(round(ratio * s.numel()))
        assert torch.equal(capped_top_k(s, total, 0.75), select_global(s, ratio))
        assert torch.equal(capped_top_k(s, total, 1.0), select_global(s, ratio))


def test_the_cap_rises_when_the_ratio_exceeds_it():
    assert cap_entries(0.75, 40, total=0.9 * 40 * 6, heads=6) == 36
    keep = capped_top_k(_skewed(), int(0.9 * 240), 0.5)
    assert int(keep.sum()) == 216 and int(keep.sum(dim=2).max()) == 36


def test_uniform_split_gives_every_head_the_same_budget():
    s = _skewed()
    keep = uniform_split(s, 60)
    assert keep.sum(dim=2).flatten().tolist() == [10] * 6
    keep = uniform_split(s, 62)
    assert sorted(keep.sum(dim=2).flatten().tolist()) == [10, 10, 10, 10, 11, 11]
    # within a head, its top scores
    top = s[1, 2].sort(descending=True).indices[:10]
    assert torch.equal(keep[1, 2].nonzero().squeeze(1), top.sort().values)


def test_scheduled_split_follows_the_fractions_under_the_cap():
    s = _skewed()
    fractions = torch.tensor([[4.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    keep = scheduled_split(s, 64, fractions, cap=1.0)
    assert keep.sum(dim=2).tolist() == [[32, 8, 8], [8, 8, 0]]
    keep = scheduled_split(s, 64, fractions, cap=0.5)  # head (0, 0) capped at 20; its surplus by the fractions
    counts = keep.sum(dim=2)
    assert int(counts.sum()) == 64 and int(counts[0, 0]) == 20 and int(counts[1, 2]) == 0
    assert counts[0, 1:].tolist() == [11, 11] and counts[1, :2].tolist() == [11, 11]
    with pytest.raises(ValueError, match="shape"):
        scheduled_split(s, 64, torch.ones(3, 2))


def test_head_floor_gives_every_head_its_share_first_and_the_rest_by_global_top_k():
    s = _skewed()  # head (0, 0) outranks everything: the plain global top-k of 60 gives it 40, the others 20
    assert int(capped_top_k(s, 60, 1.0)[0, 0].sum()) == 40
    assert floor_entries(0.5, 40, 60, 6) == 5  # half the even share of 10
    keep = capped_top_k(s, 60, 1.0, floor=0.5)
    counts = keep.sum(dim=2)
    assert int(counts.sum()) == 60 and int(counts.min()) >= 5
    # each head's floor is its own top 5; the remaining 30 go by score over everything else: all to head (0, 0)
    for l, h in itertools.product(range(2), range(3)):
        top5 = s[l, h].sort(descending=True, stable=True).indices[:5]
        assert bool(keep[l, h, top5].all())
    assert int(counts[0, 0]) == 35 and counts.flatten().tolist()[1:] == [5] * 5
    # floor 1: the even split; floor 0: the plain global top-k; with the cap, both apply
    assert capped_top_k(s, 60, 1.0, floor=1.0).sum(dim=2).flatten().tolist() == [10] * 6
    assert torch.equal(capped_top_k(s, 60, 1.0, floor=0.0), capped_top_k(s, 60, 1.0))
    capped = capped_top_k(s, 60, 0.5, floor=0.5).sum(dim=2)
    assert int(capped.sum()) == 60 and int(capped[0, 0]) == 20 and int(capped.min()) >= 5
    # the floors always fit: at most total // heads each, never more than a head's entries
    assert floor_entries(1.0, 40, 7, 6) == 1 and floor_entries(1.0, 3, 600, 6) == 3


def test_am_head_floor_counts_the_recent_tokens_and_is_inert_outside_global_splits():
    s = _skewed()
    keep = get_method("am", head_floor=0.5, recent=2, selection="kvzip").select(s, 0.25)  # 60 entries
    assert int(keep.sum()) == 60 and keep.sum(dim=2).flatten().tolist() == [35] + [5] * 5
    assert bool(keep[..., -2:].all())  # the recent tokens are within each head's floor of 5
    inert = PARAMS["am"].inert({**PARAMS["am"].defaults(), "budgets": "uniform", "head_floor": 0.5})
    assert "head_floor" in inert
    assert "head_floor" not in PARAMS["am"].inert({**PARAMS["am"].defaults(), "head_floor": 0.5})
    for bad in (-0.1, 1.5, float("nan"), "half", True):
        with pytest.raises(InputError, match="head_floor"):
            get_method("am", head_floor=bad)


def test_am_select_split_cap_and_recent_floor():
    s = _skewed()
    am = get_method("am", budgets="global-capped", recent=8, selection="kvzip")  # capped at 0.75
    keep = am.select(s, 0.3)
    assert int(keep.sum()) == 72 and int(keep.sum(dim=2).max()) <= 30
    assert bool(keep[..., -8:].all())  # every head keeps its last 8 tokens (48 of the 72)
    uni = get_method("am", budgets="uniform", recent=4, selection="kvzip").select(s, 0.3)
    assert uni.sum(dim=2).flatten().tolist() == [12] * 6 and bool(uni[..., -4:].all())
    old = get_method("am", budgets="global", recent=0, selection="kvzip").select(s, 0.3)
    assert torch.equal(old, select_global(s, 0.3))
    # the default split is KVzip's uncapped one (the cap is an option): no head is held to 0.75 of its entries
    default = get_method("am", recent=0, selection="kvzip").select(s, 0.3)
    assert torch.equal(default, old) and int(default.sum(dim=2).max()) > 30
    assert torch.equal(protect_recent(s, 0), s)


def test_kvzip_and_snapkv_cap_is_off_by_default_and_caps_when_asked():
    s = _skewed()
    assert torch.equal(get_method("kvzip").select(s, 0.3), select_global(s, 0.3))
    capped = get_method("kvzip", max_head_ratio=0.75).select(s, 0.3)
    assert int(capped.sum()) == 72 and int(capped.sum(dim=2).max()) == 30
    snap = get_method("snapkv", budget="global", max_head_ratio=0.5).select(s, 0.3)
    assert int(snap.sum()) == 72 and int(snap.sum(dim=2).max()) == 20
    for bad in (0, 1.5, -0.1):
        with pytest.raises(InputError, match="max_head_ratio"):
            get_method("kvzip", max_head_ratio=bad)


# ---------------------------------------------------------------------------------------------------------------
# OMP


def _omp_by_hand(keys, queries, scaling, t, forced=(), schedule=((300, 1, 1), (None, 4, 2))):
    """The official AM-OMP written out in float64 numpy with explicit loops (the reference): greedy by correlation
    with the mass residual, weights by least squares clamped to [1e-12, e^7] (lazily, per ``schedule``), then keys
    with beta < -7 dropped and replaced (3 rounds at most). Returns the sorted keys and how many were dropped."""
    import numpy as np

    lo, hi = 1e-12, math.exp(7.0)
    logits = (queries.double() @ keys.double().T).numpy() * scaling
    E = np.exp(logits - np.log(np.exp(logits).sum(axis=1, keepdims=True)))
    y = np.ones(E.shape[0])

    def solve(S):
        return np.clip(np.linalg.lstsq(E[:, S], y, rcond=None)[0], lo, hi) if S else np.zeros(0)

    S, excluded, dropped = list(forced), set(), 0
    w, step, rounds, fresh = solve(S), 0, 0, True
    while True:
        if len(S) < t:
            r = y - E[:, S] @ w
            corr = {j: sum(E[i, j] * r[i] for i in range(E.shape[0]))
                    for j in range(E.shape[1]) if j not in S and j not in excluded}
            k, interval = next((k, iv) for below, k, iv in schedule if below is None or len(S) < below)
            k = min(k, t - len(S), len(corr))
            if k == 0:
                break
            new = sorted(corr, key=lambda j: -corr[j])[:k]
            S += new
            if fresh or step % interval == 0:
                w, fresh = solve(S), False
            else:
                w = np.concatenate([w, np.full(k, lo)])
            step += 1
            continue
        if rounds >= 3:
            break
        rounds += 1
        drop = [j for j, wj in zip(S, solve(S)) if math.log(wj) < -7 and j not in forced]
        if not drop:
            break
        dropped += len(drop)
        excluded |= set(drop)
        S = [j for j in S if j not in drop]
        w, step, fresh = solve(S), step + 1, True
    return sorted(S), dropped


def test_omp_matches_the_official_greedy_written_out_by_hand(monkeypatch):
    """Random small heads, budgets from 1 to all but one key, with and without a forced key, under the official
    schedule (one key and one solve per step here) and under a compressed one that exercises several keys per step
    and the lazy solves; some instances drop keys (beta < -7), so the refinement is checked too."""
    import kvpack.methods.am_omp as am_omp

    drops = 0
    for schedule in (am_omp.SCHEDULE, ((2, 1, 1), (5, 2, 2), (None, 3, 2))):
        monkeypatch.setattr(am_omp, "SCHEDULE", schedule)
        for seed in range(6):
            gen = torch.Generator().manual_seed(seed)
            keys, queries = torch.randn(12, 4, generator=gen), 1.5 * torch.randn(40, 4, generator=gen)
            for t in (1, 3, 6, 11):
                for forced in ((), (11,)):
                    want, dropped = _omp_by_hand(keys, queries, 0.5, t, forced, schedule)
                    got = omp_select(keys, queries, 0.5, t, torch.tensor(forced, dtype=torch.int64))
                    assert got.tolist() == want, (schedule, seed, t, forced)
                    drops += dropped
    assert drops > 0  # the drop-and-replace rounds ran


def test_omp_schedule_and_clamped_weights_are_the_official_ones():
    from kvpack.methods.am_fit import W_RANGE, clamped_least_squares
    from kvpack.methods.am_omp import _schedule

    assert [_schedule(i) for i in (0, 299, 300, 1499, 1500, 10_000)] == [(1, 1), (1, 1), (2, 2), (2, 2), (4, 2),
                                                                         (4, 2)]
    gen = torch.Generator().manual_seed(5)
    M, y = torch.rand(30, 5, generator=gen), torch.rand(30, generator=gen)
    M[:, 4] = M[:, 3] * 1.001 + 0.01 * M[:, 0]  # nearly dependent: a large positive and negative weight
    exact = torch.linalg.lstsq(M.double(), y.double()[:, None]).solution[:, 0]
    assert float(exact.min()) < 0  # so the clamp acts
    torch.testing.assert_close(clamped_least_squares(M, y), exact.clamp(*W_RANGE).float(), rtol=1e-4, atol=1e-12)
    assert clamped_least_squares(M[:, :0], y).shape == (0,)


def test_omp_finds_the_keys_that_hold_the_mass_and_keeps_forced_ones():
    """Two keys aligned with every query hold nearly all attention: OMP's picks are the best pair by mass error
    among all pairs (brute force, with the same clamped least-squares weights)."""
    from kvpack.methods.am_fit import clamped_least_squares

    gen = torch.Generator().manual_seed(4)
    keys = 0.05 * torch.randn(8, 4, generator=gen)
    keys[2] = torch.tensor([4.0, 0, 0, 0])
    keys[6] = torch.tensor([0, 4.0, 0, 0])
    queries = torch.rand(20, 4, generator=gen) + torch.tensor([1.0, 1.0, 0, 0])
    _, lse = context_attention(queries, keys, keys, 1.0)
    E = ((queries @ keys.T) - lse[:, None]).exp()
    y = torch.ones(20)

    def err(pair):
        M = E[:, list(pair)]
        return float((M @ clamped_least_squares(M, y) - y).norm())

    best = min(itertools.combinations(range(8), 2), key=err)
    assert omp_select(keys, queries, 1.0, 2).tolist() == sorted(best) == [2, 6]
    assert omp_select(keys, queries, 1.0, 2, shift="max").tolist() == [2, 6]
    got = omp_select(keys, queries, 1.0, 3, forced=torch.tensor([7]))
    assert 7 in got.tolist() and len(got) == 3
    assert omp_select(keys, queries, 1.0, 8).tolist() == list(range(8))
    assert omp_select(keys, queries, 1.0, 0).tolist() == []
    for bad in ({"t": 1, "forced": torch.tensor([0, 1])}, {"t": 9}, {"t": 2, "shift": "mean"}):
        with pytest.raises(ValueError):
            omp_select(keys, queries, 1.0, **bad)


def test_fit_head_clamped_weights_are_omps_and_the_values_follow():
    """``beta_solve="clamped"`` (AM-OMP's fit): beta is the log of the clamped least-squares weights of the kept
    columns, which may leave the NNLS fit's [-3, 3]; the values are then fitted as for any selection."""
    from kvpack.methods.am_fit import clamped_least_squares, fit_head

    gen = torch.Generator().manual_seed(6)
    keys, values, queries = torch.randn(10, 4, generator=gen), torch.randn(10, 3, generator=gen), \
        2 * torch.randn(50, 4, generator=gen)
    kept = torch.tensor([1, 4, 5, 8])
    _, lse = context_attention(queries, keys, keys, 0.5)
    M = ((queries @ keys[kept].T) * 0.5 - lse[:, None]).exp()
    fit = fit_head(keys, values, queries, kept, 0.5, beta_solve="clamped")
    torch.testing.assert_close(fit.beta, clamped_least_squares(M, torch.ones(50)).log())
    boxed = fit_head(keys, values, queries, kept, 0.5)
    assert float(boxed.beta.abs().max()) <= 3 + 1e-5 and not torch.allclose(fit.beta, boxed.beta)
    with pytest.raises(ValueError):
        fit_head(keys, values, queries, kept, 0.5, beta_solve="lstsq")


def test_am_omp_and_rms_selection_build_and_keep_the_split_counts():
    model, tok = tiny_model("llama")
    base = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="am", ratio=0.3, chunk_size=40)
    for sel in ("omp", "rms", "kvzip+rms"):
        pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="am", ratio=0.3, chunk_size=40,
                               selection=sel)
        for a, b in zip(pack.layers, base.layers):
            assert torch.equal(a.head_lengths, b.head_lengths)
        kvpack.KvpackCache.from_pack(pack)


def test_am_kvzip_plus_rms_keeps_kvzips_top_half_and_fills_by_rms():
    """``selection="kvzip+rms"``: in every head, the ``ceil(c / 2)`` entries of highest KVzip score are kept, and
    the other ``c // 2`` are the highest RMS attention among the rest; the counts are those of the split."""
    scorer = _scorer(selection="kvzip+rms", recent=0)
    full = scorer._full
    scores = scorer._scores
    keep = scorer.select(scores, 0.3, full)
    kvzip_only = get_method("am", chunk_size=40, recent=0, selection="kvzip").select(scores, 0.3, full)
    assert torch.equal(keep.sum(dim=2), kvzip_only.sum(dim=2))
    rms = torch.stack([scorer._rms_scores(full, i) for i in range(keep.shape[0])])
    differs = False
    for layer in range(keep.shape[0]):
        for h in range(keep.shape[1]):
            c = int(keep[layer, h].sum())
            top = scores[layer, h].float().argsort(descending=True, stable=True)[: (c + 1) // 2]
            assert bool(keep[layer, h, top].all())
            rest = torch.ones_like(keep[layer, h])
            rest[top] = False
            chosen = (keep[layer, h] & rest).nonzero().squeeze(1)
            others = (~keep[layer, h] & rest).nonzero().squeeze(1)
            if len(chosen) and len(others):
                assert float(rms[layer, h, chosen].min()) >= float(rms[layer, h, others].max())
            differs |= not torch.equal(keep[layer, h], kvzip_only[layer, h])
    assert differs  # the RMS half changed some head's entries


def test_pool_context_takes_each_entrys_largest_neighbour_within_its_head():
    s = torch.tensor([[[0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]]])
    assert torch.equal(pool_context(s, 1), s)
    assert pool_context(s, 3).tolist() == [[[5.0, 5.0, 5.0, 0.0, 1.0, 1.0, 1.0],
                                                  [2.0, 2.0, 0.0, 0.0, 0.0, 3.0, 3.0]]]
    # width 5: two neighbours each side, never across heads or layers
    assert pool_context(s, 5)[0, 0].tolist() == [5.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0]
    assert pool_context(s, 5)[0, 1].tolist() == [2.0, 2.0, 2.0, 0.0, 3.0, 3.0, 3.0]
    inf = torch.tensor([[[float("-inf"), float("-inf"), 1.0, float("-inf"), float("-inf")]]])
    assert pool_context(inf, 3).tolist() == [[[float("-inf"), 1.0, 1.0, 1.0, float("-inf")]]]


@pytest.mark.parametrize("selection", ["rms", "kvzip+rms"])
def test_am_select_pool_keeps_the_top_entries_of_the_pooled_scores(selection):
    """``select_pool=5``: each head keeps its split's count, the top of its max-pooled selection scores (RMS, or for
    ``kvzip+rms`` KVzip's pooled half then RMS's), which differs from the unpooled choice."""
    scorer = _scorer(selection=selection, recent=0, select_pool=5)
    full, scores = scorer._full, scorer._scores
    pooled_keep = scorer.select(scores, 0.3, full)
    plain = get_method("am", chunk_size=40, queries=50_000, recent=0, selection=selection)
    plain.score(*tiny_model("llama"), full)
    plain_keep = plain.select(scores, 0.3, full)
    assert torch.equal(pooled_keep.sum(dim=2), plain_keep.sum(dim=2))
    assert not torch.equal(pooled_keep, plain_keep)
    rms = pool_context(torch.stack([scorer._rms_scores(full, i) for i in range(pooled_keep.shape[0])]), 5)
    kvzip = pool_context(scores.float(), 5)
    for layer in range(pooled_keep.shape[0]):
        for h in range(pooled_keep.shape[1]):
            kept, c = pooled_keep[layer, h], int(pooled_keep[layer, h].sum())
            rest = torch.ones_like(kept)
            if selection == "kvzip+rms":
                top = kvzip[layer, h].argsort(descending=True, stable=True)[: (c + 1) // 2]
                assert bool(kept[top].all())
                rest[top] = False
            chosen, others = (kept & rest).nonzero().squeeze(1), (~kept & rest).nonzero().squeeze(1)
            if len(chosen) and len(others):
                assert float(rms[layer, h, chosen].min()) >= float(rms[layer, h, others].max())


def test_am_select_pool_must_be_odd_and_is_inert_under_kvzip_selection():
    with pytest.raises(InputError, match=r"odd number of tokens.*e\.g\. 3 or 5\), got 4"):
        get_method("am", select_pool=4)
    with pytest.raises(InputError, match="select_pool"):
        get_method("am", select_pool=0)
    with pytest.raises(InputError, match="at most 255"):
        get_method("am", select_pool=257)
    assert "select_pool" in PARAMS["am"].inert({"selection": "kvzip", "select_pool": 7})
    assert "select_pool" not in PARAMS["am"].inert({"selection": "rms", "select_pool": 7})


# ---------------------------------------------------------------------------------------------------------------
# self-study queries


def _scorer(**options):
    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
    scorer = get_method("am", chunk_size=40, queries=50_000, **options)
    scorer._scores = scorer.score(model, tok, full)
    scorer._full = full
    return scorer


def test_self_study_queries_are_deterministic_and_pool_with_the_repeat_pass():
    a, b = _scorer(reference="self-study", self_study_tokens=5), _scorer(reference="self-study", self_study_tokens=5)
    pa = [torch.cat(r.parts, dim=1) for r in a._reservoirs]
    pb = [torch.cat(r.parts, dim=1) for r in b._reservoirs]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    repeat = _scorer(reference="repeat")
    both = _scorer(reference="self-study+repeat", self_study_tokens=5)
    for r, s, bo in zip(repeat._reservoirs, a._reservoirs, both._reservoirs):
        rows = lambda res: sum(p.shape[1] for p in res.parts)  # noqa: E731
        assert rows(bo) == rows(r) + rows(s) and rows(s) > 0
    # more answer tokens, more queries (greedy answers that did not stop at end-of-sequence)
    longer = _scorer(reference="self-study", self_study_tokens=9)
    assert sum(p.shape[1] for p in longer._reservoirs[0].parts) >= sum(p.shape[1] for p in a._reservoirs[0].parts)


def _self_study_rows(tokens: int, batched_off: bool, prompts=None, fed: list | None = None, **sampling):
    """Per compressed layer the recorded self-study queries ``[kv_heads, rows, d]``, rows sorted (the batched and
    one-by-one paths record the same rows in another order); ``fed`` gets each prompt's fed token ids."""
    from kvpack.methods.am import QueryReservoir
    from kvpack.methods.am_selfstudy import PROMPTS, self_study_queries

    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
    res = [QueryReservoir(spec.num_kv_heads, 50_000) for _ in spec.compressed_layers]
    self_study_queries(model, tok, full, res, tokens, prompts or PROMPTS, batched_off=batched_off, fed=fed,
                       **sampling)
    out = []
    for r in res:
        q = torch.cat(r.parts, dim=1)
        order = torch.argsort(q[0, :, 0] * 1e3 + q[0, :, 1], stable=True)
        out.append(q[:, order])
    return out


def test_batched_self_study_records_the_same_queries_as_one_prompt_at_a_time():
    """The prompts answered as one left-padded batch over copies of the context's KV record the queries of the same
    tokens as answering them one after another over the prefill's cache (prompts of different lengths, so there is
    padding; answers long enough that some rows run on after others would stop)."""
    prompts = ("Summarize.", "Aggregate all the key facts mentioned in the context, please.", "List names.")
    for tokens in (1, 6):
        batched = _self_study_rows(tokens, False, prompts)
        single = _self_study_rows(tokens, True, prompts)
        for x, y in zip(batched, single):
            assert x.shape == y.shape and x.shape[1] > 0
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_sampled_self_study_is_seeded_and_the_batch_draws_what_one_prompt_at_a_time_draws():
    """With a temperature the answers are sampled (the paper's decoding): one seed gives the same tokens twice and
    in both paths (each prompt has its own generator), another seed or greedy decoding gives other tokens."""
    prompts = ("Summarize.", "Aggregate all the key facts mentioned in the context, please.", "List names.")
    runs = {}
    for name, off, sampling in (("batched", False, {"temperature": 5.0, "seed": 3}),
                                ("again", False, {"temperature": 5.0, "seed": 3}),
                                ("single", True, {"temperature": 5.0, "seed": 3}),
                                ("other seed", False, {"temperature": 5.0, "seed": 4}),
                                ("greedy", False, {})):
        fed = []
        rows = _self_study_rows(8, off, prompts, fed, **sampling)
        runs[name] = (fed, rows)
    fed, rows = runs["batched"]
    assert all(len(f) > 0 for f in fed)
    assert runs["again"][0] == fed and all(torch.equal(x, y) for x, y in zip(runs["again"][1], rows))
    assert runs["single"][0] == fed
    for x, y in zip(runs["single"][1], rows):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    assert runs["other seed"][0] != fed and runs["greedy"][0] != fed


def test_several_sampled_answers_per_prompt_share_the_prompt():
    """``samples=2``: each prompt's tokens are recorded once, every answer's tokens (two per prompt, drawn from their
    own generators) are; both paths feed and record the same; the first answers are those of ``samples=1``."""
    prompts = ("Summarize.", "Aggregate all the key facts mentioned in the context, please.", "List names.")
    sampling = {"temperature": 5.0, "seed": 3}
    one_fed, two_fed, single_fed = [], [], []
    one = _self_study_rows(6, False, prompts, one_fed, **sampling)
    two = _self_study_rows(6, False, prompts, two_fed, samples=2, **sampling)
    single = _self_study_rows(6, True, prompts, single_fed, samples=2, **sampling)
    assert len(two_fed) == 2 * len(prompts) and two_fed[: len(prompts)] == one_fed
    assert single_fed == two_fed and two_fed[len(prompts):] != one_fed  # other draws for the second answers
    for x, y in zip(single, two):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    # rows per KV head: every fed token once per query head of its GQA group, each prompt's tokens once
    model, _ = tiny_model("llama")
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    assert one[0].shape[1] == group * sum(len(f) for f in one_fed)
    assert two[0].shape[1] == group * (sum(len(f) for f in two_fed) - _prompt_tokens(prompts))


def _prompt_tokens(prompts) -> int:
    """Tokens of the prompts as the tiny llama model's layout lays them out after the context."""
    model, tok = tiny_model("llama")
    layout = chat_layout(tok)
    return sum(len(layout.question_ids(tok, p)) for p in prompts)


def test_sampling_keeps_only_the_top_k_tokens():
    """The warped distribution puts no mass outside the ``TOP_K`` largest logits: a draw from logits whose top
    ``TOP_K`` are the last ids never picks another (drawn many times)."""
    from kvpack.methods.am_selfstudy import TOP_K, _NextToken

    vocab = 200
    logits = torch.zeros(1, vocab)
    logits[0, -TOP_K:] = torch.linspace(0.1, 0.2, TOP_K)  # nearly flat: top-p 0.8 keeps most of the 20
    choose = _NextToken(1, 1.0, seed=0)
    drawn = {int(choose(logits, [0])[0]) for _ in range(300)}
    assert drawn <= set(range(vocab - TOP_K, vocab)) and len(drawn) > 5
    assert int(_NextToken(1, 0.0, seed=0)(logits, [0])[0]) == vocab - 1  # greedy: the argmax


# ---------------------------------------------------------------------------------------------------------------
# schedule files


def test_schedule_file_round_trip_validation_and_model_check(tmp_path):
    from kvpack.fingerprint import model_fingerprint
    from kvpack.schedule import (HeadSchedule, check_schedule, load_schedule, save_schedule,
                                 schedule_from_scores)

    model, tok = tiny_model("llama")
    spec = model_spec(model)
    layers = list(spec.compressed_layers)
    scores = [torch.rand(len(layers), spec.num_kv_heads, 30, generator=torch.Generator().manual_seed(i))
              for i in range(2)]
    sched = schedule_from_scores(scores, 0.3, 0.75, layers, model_fingerprint(model, tok))
    torch.testing.assert_close(sched.fractions.sum(), torch.tensor(1.0))
    path = tmp_path / "schedule.safetensors"
    save_schedule(sched, path)
    back = load_schedule(path)
    assert torch.equal(back.fractions, sched.fractions) and back.compressed_layers == layers
    check_schedule(back, model, tok)
    other, otok = tiny_model("qwen3")
    with pytest.raises(ModelMismatchError):
        check_schedule(back, other, otok)
    # the method reads it, records its hash, and splits by it
    pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="am", ratio=0.3, chunk_size=40,
                           budgets="schedule", schedule=str(path))
    assert len(pack.metadata["method_params"]["schedule_sha256"]) == 64
    with pytest.raises(InputError, match="schedule"):
        get_method("am", budgets="schedule")
    with pytest.raises(InputError, match="schedule"):
        get_method("am", schedule=str(path))
    # hostile files
    bad = HeadSchedule(-sched.fractions, layers, sched.fingerprint)
    save_schedule(bad, tmp_path / "neg.safetensors")
    with pytest.raises(InputError, match="non-negative"):
        load_schedule(tmp_path / "neg.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(InputError, match="not a valid safetensors"):
        load_schedule(tmp_path / "junk.safetensors")
    from kvpack.heads import save_head_scores, HeadScores

    heads = HeadScores(scores=torch.ones(len(layers), spec.num_kv_heads),
                       context_scores=torch.ones(1, len(layers), spec.num_kv_heads), compressed_layers=layers,
                       fingerprint=sched.fingerprint, contexts=[{"name": "a", "sha256": "0", "tokens": 1}],
                       method={"scoring": "attention"})
    save_head_scores(heads, tmp_path / "heads.safetensors")
    with pytest.raises(InputError, match="not a kvpack head schedule"):
        load_schedule(tmp_path / "heads.safetensors")
    with pytest.raises(InputError, match="does not exist"):
        load_schedule(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# parameters: options, specs, old packs


def test_new_options_are_flags_and_specs_with_their_checks():
    from kvpack.bench.specs import parse_method_spec
    from kvpack.methods.params import command_line_options

    flags = {o.flag: o for o in command_line_options()}
    for flag in ("--budgets", "--max-head-ratio", "--recent", "--schedule", "--select", "--reference",
                 "--self-study-tokens", "--self-study-temperature", "--self-study-seed"):
        assert flag in flags
    assert "omp" in flags["--select"].choices and "self-study+repeat" in flags["--reference"].choices
    assert {u[0] for u in flags["--max-head-ratio"].uses} == {"kvzip", "am", "snapkv", "pyramidkv"}
    assert parse_method_spec("am[budgets=uniform;recent=0;max_head_ratio=0.5;selection=omp]") == (
        "am", {"budgets": "uniform", "recent": 0, "max_head_ratio": 0.5, "selection": "omp"})
    assert parse_method_spec("kvzip[max_head_ratio=0.75]") == ("kvzip", {"max_head_ratio": 0.75})
    for bad in ({"budgets": "even"}, {"recent": -1}, {"queries": 50_001}, {"reference": "ss"},
                {"selection": "lasso"}, {"self_study_tokens": 0}, {"self_study_temperature": -0.1},
                {"self_study_temperature": float("nan")}, {"self_study_temperature": "hot"}, {"self_study_seed": -1},
                {"self_study_seed": 2**32}, {"self_study_temperature": 101.0}):
        with pytest.raises(InputError):
            get_method("am", **bad)
    assert get_method("am", queries=50_000).queries == 50_000


def test_packs_from_before_the_budgets_read_as_built_with_the_global_split():
    """A pack recorded without ``budgets``/``max_head_ratio``/``recent`` was built with KVzip's global split: its
    completed parameters say so, so a build with the new defaults rebuilds it; a KVzip pack is unchanged (the cap
    is off by default)."""
    from kvpack.build import _with_defaults

    am = PARAMS["am"]
    old = {k: v for k, v in am.defaults().items() if k not in ("budgets", "max_head_ratio", "recent")}
    done = _with_defaults("am", old)
    # the cap an uncapped split never reads stands at its default (MethodParams.canonical)
    assert (done["budgets"], done["max_head_ratio"], done["recent"]) == ("global", 0.75, 0)
    assert done != get_method("am").params()
    # a pack from before the head floor was built without one: a build with the default floor rebuilds it
    no_floor = _with_defaults("am", {k: v for k, v in am.defaults().items() if k != "head_floor"})
    assert no_floor["head_floor"] == 0.0 and am.defaults()["head_floor"] == 0.25
    kv_old = {k: v for k, v in PARAMS["kvzip"].defaults().items() if k != "max_head_ratio"}
    assert _with_defaults("kvzip", kv_old) == get_method("kvzip").params()


def test_several_self_study_answers_are_sampled_ones():
    """``self_study_samples`` above 1 samples that many answers per prompt; greedy answers (temperature 0) would be
    one answer repeated, so there it is inert: one answer per prompt, and a pack built so compares as built with
    the default count."""
    from kvpack.errors import InputError
    from kvpack.methods.params import PARAMS

    with pytest.raises(InputError, match="self_study_samples"):
        get_method("am", self_study_samples=0, self_study_temperature=0.7)
    assert get_method("am", self_study_samples=4, self_study_temperature=0.7).self_study_samples == 4
    am = PARAMS["am"]
    assert "self_study_samples" in am.inert({**am.defaults(), "reference": "repeat"})
    assert "self_study_samples" in am.inert({**am.defaults(), "self_study_temperature": 0.0})
    assert "self_study_samples" not in am.inert({**am.defaults(), "self_study_temperature": 0.7})
    greedy = _scorer(reference="self-study", self_study_samples=3, self_study_temperature=0.0)
    once = _scorer(reference="self-study", self_study_samples=1, self_study_temperature=0.0)
    assert [p.shape for p in greedy._reservoirs[0].parts] == [p.shape for p in once._reservoirs[0].parts]
