"""Attention Matching (``--method am``, arXiv 2602.16284): the solvers against closed forms, the fit against
KVzip's selection on held-out queries, ``values="copy"`` against KVzip's entries, per-entry biases on every
attention path and through save -> load -> generate, and the reference-query reservoir."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

import kvpack
from kvpack.attention import logit_mask, masked_attention
from kvpack.errors import CorruptFileError, InputError
from kvpack import validate
from kvpack.fileformat import load_pack, pack_to_bytes
from kvpack.generation import question_input_ids
from kvpack.methods import get_method
from kvpack.methods.am import QueryReservoir
from kvpack.methods.params import PARAMS
from kvpack.methods.am_fit import (attention_output, context_attention, context_share, fit_head, gram,
                                   least_squares, max_attention, nnls_box, rms_attention)
from kvpack.layout import chat_layout
from kvpack.model import model_spec
from kvpack.prefill import prefill

from .tiny import ARCHITECTURES, TEXT, tiny_model


# ---------------------------------------------------------------------------------------------------------------
# solvers


def test_nnls_orthogonal_columns_is_the_clamped_projection():
    """Orthogonal columns decouple the problem: w_j = clamp(m_j . y / ||m_j||^2, low, high) exactly."""
    M = torch.zeros(6, 3)
    M[0, 0], M[1, 0] = 1.0, 1.0          # ||m_0||^2 = 2
    M[2, 1] = 3.0                        # ||m_1||^2 = 9
    M[3, 2], M[4, 2], M[5, 2] = 1.0, 2.0, 2.0  # ||m_2||^2 = 9
    y = torch.tensor([1.0, 3.0, 0.3, 1.0, 1.0, 1.0])  # projections: 2.0, 0.1, 5/9
    w = nnls_box(M, y, 0.2, 1.5, iters=10)
    torch.testing.assert_close(w, torch.tensor([1.5, 0.2, 5 / 9]))


def test_nnls_returns_the_least_squares_solution_inside_the_box():
    gen = torch.Generator().manual_seed(0)
    M = torch.rand(40, 5, generator=gen)
    w_true = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3])
    w = nnls_box(M, M @ w_true, math.exp(-3), math.exp(3), iters=2)
    torch.testing.assert_close(w, w_true, atol=1e-4, rtol=1e-4)


def test_nnls_steps_on_the_normal_equations_are_the_explicit_steps():
    """With ``n >= t`` the power iteration and the gradient steps use ``M^T M`` and ``M^T y`` (built once for the
    least-squares start); the result is that of the steps on ``M`` itself, to float32 rounding."""
    gen = torch.Generator().manual_seed(4)
    M, y = torch.rand(300, 20, generator=gen), torch.rand(300, generator=gen) * 3
    low, high = math.exp(-3), math.exp(3)
    w = least_squares(M, y[:, None])[:, 0].clamp(low, high)
    u = torch.ones(20)
    for _ in range(8):
        u = M.T @ (M @ u)
        u = u / u.norm()
    lipschitz = float((M @ u).pow(2).sum())
    for _ in range(5):
        w = (w - (M.T @ (M @ w - y)) / lipschitz).clamp(low, high)
    got = nnls_box(M, y, low, high, iters=5)
    torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)
    assert bool((got == low).any() or (got == high).any())  # the box binds: the steps matter


def test_nnls_projected_gradient_reaches_the_constrained_optimum():
    """M = [[1, 1], [0, 1]] (not orthogonal), y = [1, -1]: the free solution (2, -1) clamps to (2, 0), but the
    constrained optimum is w = (1, 0) (KKT: with w_1 = 0 at its bound, w_0 = m_0 . y / ||m_0||^2 = 1, and the
    gradient of w_1, m_1 . (M w - y) = 0 + 1 = 1 > 0). Two steps do not get there; many do."""
    M = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    y = torch.tensor([1.0, -1.0])
    assert not torch.allclose(nnls_box(M, y, 0.0, 10.0, iters=0), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(nnls_box(M, y, 0.0, 10.0, iters=500), torch.tensor([1.0, 0.0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("t,block", [(5, 2), (7, 3), (9, 3), (12, 4), (4, 2), (40, 256)])
def test_blocked_gram_is_the_symmetric_product(t, block):
    # block rows on and above the diagonal, mirrored: every entry of X^T X, ragged last block included
    X = torch.randn(50, t, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    G = gram(X, block)
    torch.testing.assert_close(G, X.T @ X, atol=1e-12, rtol=1e-12)
    if t > 2 * block:  # mirrored, so exactly symmetric (a plain product may differ in the last bit)
        assert torch.equal(G, G.T)


def test_least_squares_matches_the_normal_equations():
    gen = torch.Generator().manual_seed(1)
    X, Y = torch.randn(30, 6, generator=gen), torch.randn(30, 4, generator=gen)
    closed = torch.linalg.solve((X.T @ X).double(), (X.T @ Y).double()).float()
    torch.testing.assert_close(least_squares(X, Y), closed, atol=1e-5, rtol=1e-5)


def test_least_squares_takes_the_callers_gram_matrix():
    gen = torch.Generator().manual_seed(2)
    X, Y, P = torch.randn(40, 7, generator=gen), torch.randn(40, 3, generator=gen), torch.randn(7, 3, generator=gen)
    for ridge, prior in ((0.0, None), (0.01, P), (1.0, P)):
        torch.testing.assert_close(least_squares(X, Y, ridge=ridge, prior=prior, G=gram(X)),
                                   least_squares(X, Y, ridge=ridge, prior=prior), atol=0, rtol=0)
    # and it is used: a different matrix gives a different answer
    assert not torch.allclose(least_squares(X, Y, G=gram(X) * 2), least_squares(X, Y), atol=1e-3)


def test_least_squares_with_a_ridge_matches_its_closed_form_and_shrinks_the_values():
    """``ridge=r``: ``(X^T X + r mean(diag(X^T X)) I)^-1 X^T Y`` (float64 reference), even for a well-posed system;
    on two nearly equal columns, where plain least squares blows the coefficients up, it keeps them small."""
    gen = torch.Generator().manual_seed(3)
    X, Y = torch.randn(30, 6, generator=gen), torch.randn(30, 4, generator=gen)
    gram = (X.T @ X).double()
    lam = 0.01 * float(gram.diagonal().mean())
    closed = torch.linalg.solve(gram + lam * torch.eye(6, dtype=torch.float64), (X.T @ Y).double()).float()
    torch.testing.assert_close(least_squares(X, Y, ridge=0.01), closed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(least_squares(X, Y), closed, atol=1e-3)
    x = torch.randn(50, 1, generator=gen)
    near = torch.cat([x, x + 1e-3 * torch.randn(50, 1, generator=gen)], dim=1)
    y = x + 0.1 * torch.randn(50, 1, generator=gen)
    assert float(least_squares(near, y).abs().max()) > 3  # plain: two large coefficients of opposite sign
    assert float(least_squares(near, y, ridge=1e-3).abs().max()) < 1


def test_a_ridge_toward_a_prior_matches_its_closed_form_and_tends_to_the_prior():
    """``prior=P``: ``(X^T X + lam I)^-1 (X^T Y + lam P)`` (float64 reference); a huge ridge gives ``P`` back, and in
    ``fit_head`` ``ridge_to="selected"`` shrinks the fitted values toward the kept entries' own values."""
    gen = torch.Generator().manual_seed(4)
    X, Y, P = torch.randn(30, 6, generator=gen), torch.randn(30, 4, generator=gen), torch.randn(6, 4, generator=gen)
    gram = (X.T @ X).double()
    lam = 0.3 * float(gram.diagonal().mean())
    closed = torch.linalg.solve(gram + lam * torch.eye(6, dtype=torch.float64),
                                (X.T @ Y).double() + lam * P.double()).float()
    torch.testing.assert_close(least_squares(X, Y, ridge=0.3, prior=P), closed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(least_squares(X, Y, ridge=0.3), closed, atol=1e-3)  # the prior matters
    torch.testing.assert_close(least_squares(X, Y, ridge=1e6, prior=P), P, atol=1e-4, rtol=0)
    torch.testing.assert_close(least_squares(X, Y, prior=P), least_squares(X, Y))  # no ridge: plain least squares
    keys, values = torch.randn(40, 8, generator=gen), torch.randn(40, 8, generator=gen)
    queries, kept = torch.randn(200, 8, generator=gen), torch.arange(0, 40, 4)
    plain = fit_head(keys, values, queries, kept, 0.35).values
    gaps = [float((fit_head(keys, values, queries, kept, 0.35, ridge=r, ridge_to="selected").values
                   - values[kept]).abs().max()) for r in (1e-3, 1e-1, 1.0)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[0] < float((plain - values[kept]).abs().max()) + 1e-6
    with pytest.raises(ValueError, match="ridge_to"):
        fit_head(keys, values, queries, kept, 0.35, ridge=0.1, ridge_to="mean")


def test_least_squares_singular_falls_back_to_ridge():
    """A zero column makes QR divide by zero; the ridge fallback gives it weight 0 and the others their exact
    values (Y = 3 x + 1), and two equal columns still give a finite, optimal fit."""
    x = torch.arange(1.0, 9.0)[:, None]
    Y = 3 * x + 1
    C = least_squares(torch.cat([x, torch.zeros(8, 1), torch.ones(8, 1)], dim=1), Y, fallback=torch.zeros(3, 1))
    torch.testing.assert_close(C, torch.tensor([[3.0], [0.0], [1.0]]), atol=1e-3, rtol=0)
    X = torch.cat([x, x, torch.ones(8, 1)], dim=1)
    C = least_squares(X, Y, fallback=torch.zeros(3, 1))
    assert torch.isfinite(C).all()
    torch.testing.assert_close(X @ C, Y, atol=1e-3, rtol=1e-4)


def test_least_squares_rank_one_gram_escalates_the_ridge():
    """A rank-one float32 Gram matrix (300 proportional columns) is not positive definite even with the 1e-6
    ridge; a larger ridge still gives a finite fit whose residual is that of the best one (Y lies in X's span)."""
    gen = torch.Generator().manual_seed(4)
    u, v = torch.rand(400, 1, generator=gen) + 0.5, torch.rand(1, 300, generator=gen) + 0.5
    X = u @ v
    Y = X @ torch.rand(300, 2, generator=gen)
    assert int(torch.linalg.cholesky_ex(X.T @ X + 1e-6 * (X.T @ X).diagonal().mean() * torch.eye(300))[1]) != 0
    C = least_squares(X, Y)
    assert torch.isfinite(C).all()
    assert float((X @ C - Y).norm() / Y.norm()) < 1e-3


@pytest.mark.parametrize("dv", [5, 8])  # values narrower than keys (explicit path) and as wide (flash)
@pytest.mark.parametrize("shift", ["lse", "max"])
def test_fit_of_every_key_is_exact(shift, dv):
    """Keeping every key: beta = 0 (w = 1 solves the mass exactly) and the least-squares values are V itself."""
    gen = torch.Generator().manual_seed(2)
    K, V, Q = torch.randn(12, 8, generator=gen), torch.randn(12, dv, generator=gen), torch.randn(200, 8, generator=gen)
    fit = fit_head(K, V, Q, torch.arange(12), 8 ** -0.5, shift=shift)
    torch.testing.assert_close(fit.beta, torch.zeros(12), atol=1e-4, rtol=0)
    torch.testing.assert_close(fit.values, V, atol=1e-3, rtol=1e-3)
    assert fit.mass_error < 1e-5


@pytest.mark.parametrize("dv", [7, 16])
def test_context_attention_is_softmax_attention_with_its_log_sum_exp(dv):
    gen = torch.Generator().manual_seed(5)
    Q, K, V = torch.randn(30, 16, generator=gen), torch.randn(50, 16, generator=gen), torch.randn(50, dv, generator=gen)
    out, lse = context_attention(Q, K, V, 0.3)
    logits = (Q.double() @ K.double().T) * 0.3
    torch.testing.assert_close(lse.double(), logits.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), logits.softmax(-1) @ V.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows_per_chunk", [None, 7, 1])
def test_rms_attention_is_the_root_mean_square_of_the_softmax_over_queries(monkeypatch, rows_per_chunk):
    """``selection="rms"``'s scores: sqrt(mean over queries of softmax(scaling Q K^T)^2) per key, against float64;
    the same in one chunk of query rows, in ragged chunks of 7 (40 rows) and row by row."""
    if rows_per_chunk:
        monkeypatch.setattr("kvpack.methods.am_fit.CHUNK_ELEMENTS", rows_per_chunk * 70)
    gen = torch.Generator().manual_seed(6)
    Q, K = torch.randn(40, 16, generator=gen) * 3, torch.randn(70, 16, generator=gen)
    want = ((Q.double() @ K.double().T) * 0.4).softmax(-1).pow(2).mean(0).sqrt()
    got = rms_attention(Q, K, 0.4)
    assert got.shape == (70,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    assert int(got.argmax()) == int(want.argmax())
    # with the values: the same scores, and the queries' attention over the context from the same chunks
    V = torch.randn(70, 9, generator=gen)
    rms, out, lse = rms_attention(Q, K, 0.4, values=V)
    assert torch.equal(rms, got)
    logits = (Q.double() @ K.double().T) * 0.4
    torch.testing.assert_close(lse.double(), logits.logsumexp(-1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.double(), logits.softmax(-1) @ V.double(), atol=1e-5, rtol=1e-5)


def test_rms_attention_in_base_two_keeps_float32_accuracy_on_sharp_logits():
    """The exponentials are taken with ``exp2`` (log2 e folded into the scaling): on logits spanning about 200
    (sharp heads, where a base-change rounding would show first) the scores, outputs and log-sum-exps still match
    float64 to float32 rounding."""
    gen = torch.Generator().manual_seed(9)
    Q, K = torch.randn(64, 32, generator=gen) * 6, torch.randn(300, 32, generator=gen) * 3
    V = torch.randn(300, 8, generator=gen)
    logits = (Q.double() @ K.double().T) * 32 ** -0.5
    assert float(logits.max() - logits.min()) > 150
    rms, out, lse = rms_attention(Q, K, 32 ** -0.5, values=V)
    p = logits.softmax(-1)
    torch.testing.assert_close(rms.double(), p.pow(2).mean(0).sqrt(), atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(lse.double(), logits.logsumexp(-1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.double(), p @ V.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows_per_chunk", [None, 7])
def test_max_attention_is_the_largest_softmax_probability_over_queries(monkeypatch, rows_per_chunk):
    """``score_queries="reference"``'s scores: KVzip's rule, max over queries of softmax(scaling Q K^T), against
    float64, in one chunk of query rows or ragged chunks of 7; not the RMS (a key one query attends to sharply
    outranks one many attend to mildly)."""
    if rows_per_chunk:
        monkeypatch.setattr("kvpack.methods.am_fit.CHUNK_ELEMENTS", rows_per_chunk * 70)
    gen = torch.Generator().manual_seed(8)
    Q, K = torch.randn(40, 16, generator=gen) * 3, torch.randn(70, 16, generator=gen)
    want = ((Q.double() @ K.double().T) * 0.4).softmax(-1).amax(0)
    got = max_attention(Q, K, 0.4)
    assert got.shape == (70,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, rms_attention(Q, K, 0.4), atol=1e-3)


def test_context_share_is_the_contexts_probability_mass_beside_the_sink():
    """``context_share``: the context's share of softmax attention over ``[sink, context]``, against float64."""
    gen = torch.Generator().manual_seed(7)
    Q, S, K = torch.randn(25, 8, generator=gen) * 2, torch.randn(3, 8, generator=gen), torch.randn(40, 8, generator=gen)
    _, lse = context_attention(Q, K, K, 0.5)
    want = ((Q.double() @ torch.cat([S, K]).double().T) * 0.5).softmax(-1)[:, 3:].sum(-1)
    torch.testing.assert_close(context_share(Q, S, lse, 0.5).double(), want, atol=1e-6, rtol=1e-5)
    assert torch.equal(context_share(Q, S[:0], lse, 0.5), torch.ones(25))


@pytest.mark.parametrize("shift", ["lse", "max"])
def test_share_weights_ignore_queries_that_rest_on_the_sink(shift):
    """``weights="share"``: queries whose attention is all on the sink leave the fit as it is without them, while
    the paper's uniform weights let them move it; with no sink the two weightings are the same fit."""
    gen = torch.Generator().manual_seed(8)
    d = 8
    K = torch.randn(30, d, generator=gen)
    K[:, 0] = 0  # the context's logits do not depend on a query's first coordinate
    V = torch.randn(30, d, generator=gen)
    sink = torch.zeros(1, d)
    sink[0, 0] = 10.0
    reads = torch.randn(300, d, generator=gen)
    rests = torch.randn(300, d, generator=gen) * 2  # other queries, whose attention sits on the sink
    reads[:, 0], rests[:, 0] = -30.0, 30.0
    kept = torch.tensor([1, 4, 9, 15, 22, 28])
    alone = fit_head(K, V, reads, kept, d ** -0.5, shift=shift, weights="share", sink_keys=sink)
    both = fit_head(K, V, torch.cat([reads, rests]), kept, d ** -0.5, shift=shift, weights="share", sink_keys=sink)
    torch.testing.assert_close(both.values, alone.values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both.beta, alone.beta, atol=1e-4, rtol=1e-4)
    uniform = fit_head(K, V, torch.cat([reads, rests]), kept, d ** -0.5, shift=shift)
    assert float((uniform.values - alone.values).abs().max()) > 0.1
    no_sink = fit_head(K, V, reads, kept, d ** -0.5, shift=shift, weights="share", sink_keys=sink[:0])
    plain = fit_head(K, V, reads, kept, d ** -0.5, shift=shift)
    torch.testing.assert_close(no_sink.values, plain.values)
    with pytest.raises(ValueError, match="sink_keys"):
        fit_head(K, V, reads, kept, d ** -0.5, weights="share")


def test_unknown_shift_is_refused():
    with pytest.raises(ValueError, match="shift"):
        fit_head(torch.randn(4, 2), torch.randn(4, 2), torch.randn(3, 2), torch.arange(2), 1.0, shift="mean")


@pytest.mark.parametrize("shift", ["lse", "max"])
def test_fitted_head_beats_the_selection_on_held_out_queries(shift):
    """A random head, half its keys kept: the fitted head's output on unseen queries is closer to the full head's
    than the kept subset's alone (beta = 0, values copied), and mass matching alone helps too."""
    gen = torch.Generator().manual_seed(3)
    K, V = torch.randn(64, 16, generator=gen), torch.randn(64, 16, generator=gen)
    Q, held = torch.randn(2000, 16, generator=gen), torch.randn(300, 16, generator=gen)
    kept = torch.arange(0, 64, 2)
    scale = 16 ** -0.5
    full = attention_output(held, K, V, scale)

    def err(out):
        return float(((out - full).norm(dim=-1) / full.norm(dim=-1)).mean())

    selection = err(attention_output(held, K[kept], V[kept], scale))
    fit = fit_head(K, V, Q, kept, scale, shift=shift)
    fitted = err(attention_output(held, K[kept], fit.values, scale, fit.beta))
    assert fitted < 0.5 * selection


# ---------------------------------------------------------------------------------------------------------------
# the method on tiny models


#: AM selecting by KVzip's scores from KVzip's repeat pass, each head's fit kept or reverted by the value bound and the
#: held-out check (the defaults until issue 28's twenty-sixth session): the tests that compare AM's entries with
#: KVzip's, or its guards' rejections, pin it
KVZIP_SELECTION = dict(selection="kvzip", reference="repeat", ridge_search=False)


def _build(arch, **options):
    model, tok = tiny_model(arch)
    return model, tok, kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="am", ratio=0.3, chunk_size=40,
                                       **options)


def test_values_copy_keeps_exactly_kvzips_entries():
    """With KVzip's split (``budgets="global"``, no recent floor) and the values copied, AM holds KVzip's entries."""
    model, tok, am = _build("llama", values="copy", budgets="global", recent=0, **KVZIP_SELECTION)
    kvzip = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="kvzip", ratio=0.3, chunk_size=40)
    assert am.metadata["stats"]["layer_budgets"] == kvzip.metadata["stats"]["layer_budgets"]
    for a, b in zip(am.layers, kvzip.layers):
        for part in ("keys", "values", "positions", "head_lengths"):
            assert torch.equal(getattr(a, part), getattr(b, part)), part
    assert any(bool((layer.biases != 0).any()) for layer in am.layers if layer.biases is not None)
    # with beta = 0 the loaded cache is KVzip's: the same logits
    zeroed = copy.deepcopy(am)
    for layer in zeroed.layers:
        layer.biases = None if layer.biases is None else torch.zeros_like(layer.biases)
    ids = question_input_ids(tok, kvpack.KvpackCache.from_pack(kvzip), "Who?")[0, kvzip.original_tokens:]
    logits = [model(input_ids=ids[None], past_key_values=kvpack.KvpackCache.from_pack(p), use_cache=True).logits
              for p in (zeroed, kvzip, am)]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    assert (logits[2] - logits[1]).abs().max() > 1e-3  # the biases are used


def test_a_fit_with_values_the_loader_would_refuse_keeps_kvzips_selection(monkeypatch):
    """An ill-conditioned fit (values beyond float16's range, or NaN) is rejected like a fit that loses on held-out
    queries, even without the held-out check: the head is exactly KVzip's, and the pack loads."""
    import kvpack.methods.am as am_module

    real = am_module.fit_head

    def blown_up(*args, **kwargs):
        fit = real(*args, **kwargs)
        return type(fit)(**{**vars(fit), "values": fit.values * 1e6})

    monkeypatch.setattr(am_module, "fit_head", blown_up)
    model, tok, pack = _build("llama", held_out_check=False, budgets="global", recent=0, **KVZIP_SELECTION)
    kvzip = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="kvzip", ratio=0.3, chunk_size=40)
    fit = pack.metadata["stats"]["fit"]
    assert fit["heads_rejected"] > 0 and fit["heads_rejected"] + fit["heads_unfitted"] == 4  # 2 layers x 2 heads
    for a, b in zip(pack.layers, kvzip.layers):
        assert torch.equal(a.values, b.values)
        assert a.biases is None or not bool(a.biases.any())
    kvpack.KvpackCache.from_pack(pack)
    from kvpack.loading import check_kv_range

    check_kv_range(pack)


def test_value_bound_rejects_fits_whose_values_leave_the_contexts_range(monkeypatch):
    """``value_bound``: a head whose fitted values exceed ``value_bound`` x its context's largest |value| keeps
    KVzip's entries as they are; fits inside the bound are kept, and without a bound (the default) nothing is
    rejected for its range."""
    import kvpack.methods.am as am_module

    real = am_module.fit_head
    stretch = {"factor": 1.0}

    def scaled(keys, values, *args, **kwargs):
        fit = real(keys, values, *args, **kwargs)
        peak = float(values.abs().max())  # the context's own largest |value|
        return type(fit)(**{**vars(fit), "values": fit.values / float(fit.values.abs().max()) * peak
                            * stretch["factor"]})

    monkeypatch.setattr(am_module, "fit_head", scaled)
    kvzip = None
    for factor, bound, rejected in ((3.0, 2.0, True), (1.5, 2.0, False), (3.0, 0.0, False)):
        stretch["factor"] = factor
        model, tok, pack = _build("llama", held_out_check=False, budgets="global", recent=0, value_bound=bound,
                                   **KVZIP_SELECTION)
        if kvzip is None:
            kvzip = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="kvzip", ratio=0.3, chunk_size=40)
        fit = pack.metadata["stats"]["fit"]
        fitted = 4 - fit["heads_unfitted"]  # 2 layers x 2 KV heads
        assert fitted > 0
        assert fit["heads_rejected"] == (fitted if rejected else 0), (factor, bound)
        assert fit["heads_rejected_by"] == ({"value_bound": fitted} if rejected else {})
        same = all(torch.equal(a.values, b.values) for a, b in zip(pack.layers, kvzip.layers))
        assert same == rejected


def test_fit_beats_selection_on_held_out_queries_of_a_real_model():
    _, _, pack = _build("llama", held_out_check=False, value_bound=0)  # the fit itself, no guard
    fit = pack.metadata["stats"]["fit"]
    assert fit["held_out"] > 0 and fit["heads_unfitted"] == 0
    for fitted, selected in zip(fit["relative_error"], fit["selection_error"]):
        assert fitted < 0.5 * selected


def test_rms_selection_hands_its_context_attention_to_the_fit(monkeypatch):
    # with selection="rms" every fitted head gets the selection's own pass over the context (the fit attends over
    # the context itself only when nothing was kept for it), and that is the attention of that head's fit queries
    import kvpack.methods.am as am_module
    import kvpack.methods.am_fit as fit_module

    calls, handed = {"n": 0}, []
    real_attention, real_fit = fit_module.context_attention, am_module.fit_head

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real_attention(*args, **kwargs)

    def checked(keys, values, queries, kept, scaling, **kwargs):
        if kwargs.get("context") is not None:
            out, lse = real_attention(queries, keys, values, scaling)
            torch.testing.assert_close(kwargs["context"][0], out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kwargs["context"][1], lse, atol=1e-5, rtol=1e-6)
            handed.append(queries.shape[0])
        return real_fit(keys, values, queries, kept, scaling, **kwargs)

    monkeypatch.setattr(fit_module, "context_attention", counted)
    monkeypatch.setattr(am_module, "fit_head", checked)
    options = dict(selection="rms", held_out_check=False, value_bound=0)
    _, _, pack = _build("llama", **options)
    assert len(handed) == 4 and calls["n"] == 0  # 2 layers x 2 KV heads, all fitted
    assert pack.metadata["stats"]["fit"]["heads_unfitted"] == 0
    monkeypatch.setattr(am_module, "CONTEXT_CACHE_BYTES", 0)  # nothing kept: every fit attends again
    _build("llama", **options)
    assert len(handed) == 4 and calls["n"] == 4


def test_info_says_which_rule_rejected_the_fits():
    from kvpack.listing import _fit_lines

    fit = {"relative_error": [0.1], "selection_error": [0.2], "mass_error": [0.01], "held_out": 256, "queries": 3840,
           "heads_unfitted": 1, "heads_rejected": 5, "heads_rejected_by": {"value_bound": 3, "held_out_check": 2}}
    assert "5 rejected (value_bound: 3, held_out_check: 2))" in _fit_lines(fit, [1])[0]
    for hostile in (None, [1, 2], "x", {}):  # anything else, or a pack from before the rules were recorded
        assert _fit_lines({**fit, "heads_rejected_by": hostile}, [1])[0].endswith("5 rejected)")


def test_queries_per_entry_leaves_heads_with_too_few_queries_unfitted():
    # the tiny model's heads keep a few dozen entries each, fitted on hundreds of queries: all fitted at the default
    # (2 queries per kept entry), none where each kept entry would need a million queries
    _, _, fitted = _build("llama", held_out_check=False, value_bound=0)
    _, _, guarded = _build("llama", held_out_check=False, value_bound=0, queries_per_entry=1e6)
    assert fitted.metadata["stats"]["fit"]["heads_unfitted"] == 0
    assert guarded.metadata["stats"]["fit"]["heads_unfitted"] == 4  # 2 layers x 2 KV heads
    assert guarded.metadata["method_params"]["queries_per_entry"] == 1e6
    assert all(not bool(layer.biases.any()) for layer in guarded.layers if layer.biases is not None)
    assert any(bool(layer.biases.any()) for layer in fitted.layers if layer.biases is not None)


def test_unfitted_selection_kvzip_keeps_kvzips_entries_in_the_heads_the_fit_leaves():
    """``unfitted_selection="kvzip"``: a head left unfitted (more entries than its fit queries / queries_per_entry)
    keeps KVzip's top entries; a fitted head keeps RMS's. Nothing fitted: KVzip's selection exactly; everything
    fitted: RMS's exactly; and inert under ``selection="kvzip"`` or ``values`` other than ``fit``."""
    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)

    def chosen(**options):
        m = get_method("am", chunk_size=40, selection="rms", **options)
        return m.select(m.score(model, tok, full), 0.3, full)

    kvzip_keep = get_method("am", chunk_size=40, selection="kvzip")
    kvzip_keep = kvzip_keep.select(kvzip_keep.score(model, tok, full), 0.3, full)
    rms = chosen(queries_per_entry=1e6)
    assert not torch.equal(rms, kvzip_keep)  # the two selections differ on this context
    assert torch.equal(chosen(queries_per_entry=1e6, unfitted_selection="kvzip"), kvzip_keep)
    assert torch.equal(chosen(queries_per_entry=1.0, unfitted_selection="kvzip"), chosen(queries_per_entry=1.0))
    assert torch.equal(chosen(queries_per_entry=1e6, unfitted_selection="kvzip", values="copy"), rms)
    # a mix: with a threshold between the heads' counts, exactly the heads over it keep KVzip's entries
    m = get_method("am", chunk_size=40, selection="rms", unfitted_selection="kvzip")
    m.select(m.score(model, tok, full), 0.3, full)
    counts = kvzip_keep.sum(dim=2)
    n_fit = m._reference(0)[0].shape[1]
    cut = (int(counts.min()) + int(counts.max())) / 2
    assert int(counts.min()) < cut < int(counts.max())  # KVzip's split gives the heads different budgets here
    m.queries_per_entry = n_fit / cut
    unfitted = m._unfitted_heads(counts, kvzip_keep.shape[2])
    assert 0 < int(unfitted.sum()) < unfitted.numel()
    mixed = m.reselect_within_heads(kvzip_keep, full, None)
    assert torch.equal(mixed[unfitted], kvzip_keep[unfitted]) and torch.equal(mixed[~unfitted], rms[~unfitted])
    for i, h in itertools.product(range(counts.shape[0]), range(counts.shape[1])):  # the fit's own rule
        assert bool(unfitted[i, h]) == (not m._fitted(int(counts[i, h]), kvzip_keep.shape[2], n_fit))
    inert = PARAMS["am"].inert
    assert "unfitted_selection" in inert({**PARAMS["am"].defaults(), "on_policy": True})
    assert "unfitted_selection" in inert({**PARAMS["am"].defaults(), "selection": "kvzip"})
    assert "unfitted_selection" not in inert(PARAMS["am"].defaults())
    assert PARAMS["am"].recorded_defaults()["unfitted_selection"] == "same"
    with pytest.raises(InputError, match="unfitted_selection"):
        get_method("am", unfitted_selection="rms")


def _reference_pools(arch, **options):
    """Per compressed layer, the rows of the scorer's query pool (before its subsampling to ``queries``)."""
    model, tok = tiny_model(arch)
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
    scorer = get_method("am", chunk_size=40, queries=50_000, **options)
    scorer.score(model, tok, full)
    return full, [sum(p.shape[1] for p in r.parts) for r in scorer._reservoirs], scorer


def test_continuation_queries_are_the_sampled_tokens_and_deterministic():
    """``reference="continue"``: one query row per sampled token and query head of the group (continue_tokens x
    group, nothing from the repeat pass), the same rows on a second run; ``both`` pools the two sources."""
    full, repeat, _ = _reference_pools("llama", reference="repeat")
    group = full.spec.num_heads // full.spec.num_kv_heads
    _, sampled, first = _reference_pools("llama", reference="continue", continue_tokens=37)
    assert sampled == [37 * group] * len(sampled)
    _, _, again = _reference_pools("llama", reference="continue", continue_tokens=37)
    for a, b in zip(first._reservoirs, again._reservoirs):
        assert torch.equal(torch.cat(a.parts, dim=1), torch.cat(b.parts, dim=1))
    _, both, _ = _reference_pools("llama", reference="both", continue_tokens=37)
    assert both == [r + 37 * group for r in repeat]


def test_continuation_queries_build_a_pack_that_generates(tmp_path):
    model, tok, pack = _build("llama", reference="both", continue_tokens=20)
    assert pack.metadata["method_params"]["reference"] == "both"
    path = tmp_path / "c.kvpack"
    kvpack.save(pack, path)
    cache = kvpack.load(path, model, tokenizer=tok)
    assert isinstance(kvpack.generate(model, tok, cache, "Who?", max_new_tokens=4), str)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_continuation_queries_on_every_architecture(arch):
    _, _, pack = _build(arch, reference="continue", continue_tokens=6)
    fit = pack.metadata["stats"]["fit"]
    assert fit["queries"] + fit["held_out"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q-norm before RoPE
def test_prefill_queries_are_the_contexts_own_attention_queries(arch):
    """``reference="prefill"``: the recorded rows are the prefill's queries (after q-norm and RoPE), one per
    position and query head: attending causally over the prefill's own keys and values with them reproduces each
    layer's attention output (the input of ``o_proj``) of a plain forward, position by position."""
    from kvpack.methods.am_prefill import PrefillQueries

    model, tok = tiny_model(arch)
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    ids = prefix + layout.encode(tok, TEXT)
    scorer = get_method("am", chunk_size=40, queries=50_000, reference="prefill")
    recorder = scorer.recorder(spec, len(ids), "cpu")
    assert isinstance(recorder, PrefillQueries)
    full = prefill(model, ids, len(prefix), layout, spec, 40, recorder=recorder)
    outputs = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args, l=l: outputs.__setitem__(l, args[0][0].detach()))
        for l, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    kv, group, d, n = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim, len(ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i, l in enumerate(spec.compressed_layers):
        reservoir = recorder.reservoirs[i]
        q = torch.cat([p.view(kv, group, -1, d).reshape(kv * group, -1, d) for p in reservoir.parts], dim=1)
        assert q.shape == (spec.num_heads, n, d)
        k = full.keys[l].float().repeat_interleave(group, dim=0)
        v = full.values[l].float().repeat_interleave(group, dim=0)
        logits = (q @ k.transpose(1, 2) * reservoir.scaling).masked_fill(~causal, float("-inf"))
        want = outputs[l].view(n, spec.num_heads, d).transpose(0, 1).float()
        torch.testing.assert_close(logits.softmax(-1) @ v, want, atol=2e-4, rtol=2e-4)
    tailed = PrefillQueries(spec, len(ids), None, tail=7)  # the last 7 positions' queries, whole
    prefill(model, ids, len(prefix), layout, spec, 40, recorder=tailed)
    assert tailed.tail_start == n - 7 and tailed.scaling == recorder.reservoirs[0].scaling
    for i, part in enumerate(tailed.tail_queries):
        q = torch.cat([p.view(kv, group, -1, d).reshape(kv * group, -1, d) for p in recorder.reservoirs[i].parts], 1)
        assert torch.equal(part, q[:, -7:])
    scorer.score(model, tok, full)  # the recorded pools become the reference; a prefill without them re-records
    again = get_method("am", chunk_size=40, queries=50_000, reference="prefill")
    again.score(model, tok, prefill(model, ids, len(prefix), layout, spec, 40))
    for a, b in zip(scorer._reservoirs, again._reservoirs):
        assert torch.equal(torch.cat(a.parts, dim=1), torch.cat(b.parts, dim=1))
    both = get_method("am", chunk_size=40, queries=50_000, reference="prefill+repeat")
    both.score(model, tok, full)
    _, repeat, _ = _reference_pools(arch, reference="repeat")
    assert [sum(p.shape[1] for p in r.parts) for r in both._reservoirs] == [r + n * group for r in repeat]


def test_prefill_queries_build_a_pack_that_generates(tmp_path):
    model, tok, pack = _build("llama", reference="prefill")
    assert pack.metadata["method_params"]["reference"] == "prefill"
    assert pack.metadata["stats"]["fit"]["queries"] > 0
    path = tmp_path / "p.kvpack"
    kvpack.save(pack, path)
    cache = kvpack.load(path, model, tokenizer=tok)
    assert isinstance(kvpack.generate(model, tok, cache, "Who?", max_new_tokens=4), str)


def test_causal_output_is_masked_softmax_attention():
    from kvpack.methods.am_validate import causal_output

    gen = torch.Generator().manual_seed(9)
    Q, K, V = torch.randn(6, 8, generator=gen), torch.randn(10, 8, generator=gen), torch.randn(10, 4, generator=gen)
    qpos, kpos, bias = torch.tensor([3, 5, 9, 9, 4, 7]), torch.arange(10), torch.randn(10, generator=gen)
    got = causal_output(Q, qpos, K, kpos, V, 0.4, bias)
    for r in range(6):
        seen = slice(0, int(qpos[r]) + 1)
        want = ((Q[r] @ K[seen].T) * 0.4 + bias[seen]).softmax(-1) @ V[seen]
        torch.testing.assert_close(got[r], want)


def test_ridge_search_takes_the_candidate_best_on_the_validation_queries():
    """``choose_fit``: every candidate scored; the one returned has the lowest validation error; on validation
    queries like the fit's the least-squares fits beat KVzip's entries as they are, and on queries where every fit
    is worse the selection itself is returned (beta 0, values copied)."""
    from kvpack.methods.am_validate import CANDIDATES, choose_fit

    gen = torch.Generator().manual_seed(10)
    T, d, sink = 64, 8, 2
    K, V = torch.randn(T, d, generator=gen), torch.randn(T, d, generator=gen)
    pos = torch.arange(T)
    kept = torch.arange(0, T - sink, 4)
    fit_q = torch.randn(2000, d, generator=gen)
    fit = fit_head(K[sink:], V[sink:], fit_q, kept, d ** -0.5, keep_design=True)
    like = torch.randn(300, d, generator=gen)
    name, beta, values, errors = choose_fit(K, V, pos, sink, kept, fit.beta, *fit.design, like,
                                            torch.full((300,), T - 1), d ** -0.5)
    assert set(errors) == set(CANDIDATES) and name == min(errors, key=errors.get)
    assert name.startswith("ridge") and errors[name] < 0.8 * errors["selection"]
    assert torch.equal(beta, fit.beta) and values.shape == (len(kept), d)
    # the candidates share their softmaxes: each error is that of the head's own causal attention (causal_output)
    from kvpack.methods.am_fit import relative_error
    from kvpack.methods.am_validate import causal_output

    qpos, rows = torch.full((300,), T - 1), torch.cat([torch.arange(sink), sink + kept])
    full = causal_output(like, qpos, K, pos, V, d ** -0.5)
    for candidate, b in (("selection", torch.zeros(sink + len(kept))), ("copy", torch.cat([torch.zeros(sink),
                                                                                           fit.beta]))):
        out = causal_output(like, qpos, K[rows], pos[rows], V[rows], d ** -0.5, b)
        assert errors[candidate] == pytest.approx(relative_error(full, out), rel=1e-5)
    out = causal_output(like, qpos, K[rows], pos[rows], torch.cat([V[:sink], values]), d ** -0.5,
                        torch.cat([torch.zeros(sink), beta]))
    assert errors[name] == pytest.approx(relative_error(full, out), rel=1e-5)
    # queries that see only the sink and the first context entry (kept): the selection is exact there, a fit is not
    name, beta, values, errors = choose_fit(K, V, pos, sink, kept, fit.beta, *fit.design, like * 0,
                                            torch.full((300,), sink), d ** -0.5)
    assert name == "selection" and torch.equal(beta, torch.zeros_like(beta)) and torch.equal(values, V[sink + kept])


def test_ridge_search_reuses_the_fits_normal_equations():
    """``fit_head(keep_design=True)`` hands over its Gram matrix, ``X^T Y`` and ridge-0 values; ``choose_fit`` given
    them scores every candidate as it does solving them itself, and ``least_squares`` given ``G`` and ``XtY`` solves
    every ridge as it does without them."""
    from kvpack.methods.am_fit import gram, least_squares
    from kvpack.methods.am_validate import choose_fit

    gen = torch.Generator().manual_seed(11)
    T, d, sink = 80, 8, 2
    K, V = torch.randn(T, d, generator=gen), torch.randn(T, d, generator=gen)
    kept = torch.arange(1, T - sink, 3)
    fit = fit_head(K[sink:], V[sink:], torch.randn(1500, d, generator=gen), kept, d ** -0.5, keep_design=True)
    X, Y = fit.design
    torch.testing.assert_close(fit.normal[0], X.T @ X, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fit.normal[1], X.T @ Y, rtol=1e-4, atol=1e-4)
    assert torch.equal(fit.values, least_squares(X, Y, fallback=V[sink + kept]))
    # without the residual check (AM's ridge search) the values are the plain solve of the same normal equations
    unchecked = fit_head(K[sink:], V[sink:], torch.randn(1500, d, generator=gen), kept, d ** -0.5, keep_design=True,
                         residual_check=False)
    Xu, Yu = unchecked.design
    assert torch.equal(unchecked.values, torch.cholesky_solve(Xu.T @ Yu, torch.linalg.cholesky(gram(Xu))))
    for ridge in (0.0, 1e-2, 1.0):
        prior = V[sink + kept] if ridge else None
        assert torch.equal(least_squares(X, Y, ridge=ridge, prior=prior, G=gram(X), XtY=X.T @ Y),
                           least_squares(X, Y, ridge=ridge, prior=prior))
    q, pos = torch.randn(200, d, generator=gen), torch.full((200,), T - 1)
    fresh = choose_fit(K, V, torch.arange(T), sink, kept, fit.beta, X, Y, q, pos, d ** -0.5)
    reused = choose_fit(K, V, torch.arange(T), sink, kept, fit.beta, X, Y, q, pos, d ** -0.5, normal=fit.normal,
                        plain=fit.values)
    assert fresh[0] == reused[0] and fresh[3] == reused[3] and torch.equal(fresh[2], reused[2])


def test_ridge_search_builds_a_pack_that_generates(tmp_path):
    model, tok, pack = _build("llama", ridge_search=True)
    fit = pack.metadata["stats"]["fit"]
    fitted = 4 - fit["heads_unfitted"]
    assert fitted > 0 and sum(fit["ridge_search"].values()) == fitted
    assert fit["heads_rejected"] == fit["ridge_search"].get("selection", 0)
    path = tmp_path / "r.kvpack"
    kvpack.save(pack, path)
    cache = kvpack.load(path, model, tokenizer=tok)
    assert isinstance(kvpack.generate(model, tok, cache, "Who?", max_new_tokens=4), str)


def _whole_layer(full, l, drop_every=0):
    """``LayerEntries`` of every entry of prefill layer ``l`` (or, with ``drop_every = k``, without every k-th
    context entry of each head)."""
    from kvpack.pack import LayerEntries

    heads, tokens = full.keys[l].shape[:2]
    keep = torch.ones(tokens, dtype=torch.bool)
    if drop_every:
        keep[full.sink :: drop_every] = False
        keep[: full.sink] = True
    pos = full.positions[l][keep].to(torch.int32)
    return LayerEntries(full.keys[l][:, keep].reshape(-1, full.keys[l].shape[-1]),
                        full.values[l][:, keep].reshape(-1, full.values[l].shape[-1]), pos.repeat(heads),
                        torch.full((heads,), int(keep.sum()), dtype=torch.int64))


def test_on_policy_queries_are_the_repeat_pass_queries_once_earlier_layers_are_compacted():
    """Layer 1's on-policy queries equal its off-policy (repeat-pass) queries when layer 0 keeps every entry, and
    differ when layer 0 has evicted some: the pass really runs over the compacted layer 0."""
    from kvpack.methods.am_policy import on_policy_queries

    full, _, scorer = _reference_pools("llama", reference="repeat")
    assert full.spec.compressed_layers[:2] == (0, 1)
    off = torch.cat(scorer._reservoirs[1].parts, dim=1)
    layers = [_whole_layer(full, 0), None]
    model, tok = tiny_model("llama")
    same = on_policy_queries(scorer, model, tok, full, layers, 1, QueryReservoir(full.spec.num_kv_heads, 100_000))
    torch.testing.assert_close(torch.cat(same.parts, dim=1), off, rtol=1e-5, atol=1e-5)
    layers[0] = _whole_layer(full, 0, drop_every=3)
    other = on_policy_queries(scorer, model, tok, full, layers, 1, QueryReservoir(full.spec.num_kv_heads, 100_000))
    moved = torch.cat(other.parts, dim=1)
    assert moved.shape == off.shape and not torch.allclose(moved, off, atol=1e-3)


def test_on_policy_refuses_the_prefills_own_queries():
    for reference in ("prefill", "prefill+repeat"):
        with pytest.raises(InputError, match="on-policy"):
            get_method("am", on_policy=True, reference=reference)


def test_replayed_queries_are_the_sources_own_until_earlier_layers_are_compacted():
    """On-policy self-continuations (``reference="continue"``, ``on_policy``): the fed sequences replayed with
    nothing compacted give exactly the sampled queries of layer 0, and of layer 1 while layer 0 keeps every entry;
    with layer 0 compacted, layer 1's queries move (the replay reads the compacted layer)."""
    from kvpack.methods.am_policy import replayed_queries

    full, pools, scorer = _reference_pools("llama", reference="continue", continue_tokens=23, on_policy=True)
    assert sum(len(s) for s in scorer._sequences) == 23
    model, _ = tiny_model("llama")
    kv, group = full.spec.num_kv_heads, full.spec.num_heads // full.spec.num_kv_heads

    def replay(layers, i):  # one part per sequence, rows (query head, position): to the decode's (position, head)
        parts = replayed_queries(model, full, layers, i, scorer._sequences, QueryReservoir(kv, 100_000)).parts
        return torch.cat([p.view(kv, group, -1, p.shape[-1]).transpose(1, 2).reshape(kv, -1, p.shape[-1])
                          for p in parts], dim=1)

    for i, layers in ((0, [None, None]), (1, [_whole_layer(full, 0), None])):
        torch.testing.assert_close(replay(layers, i), torch.cat(scorer._reservoirs[i].parts, dim=1), rtol=1e-5,
                                   atol=1e-5)
    moved = replay([_whole_layer(full, 0, drop_every=3), None], 1)
    assert moved.shape[1] == pools[1] and not torch.allclose(moved, torch.cat(scorer._reservoirs[1].parts, 1),
                                                             atol=1e-3)


def test_self_study_records_the_sequences_it_fed():
    """Self-study's fed sequences (prompt, then the answer tokens fed) hold one row of queries per token and query
    head: as many as the reservoirs recorded, batched or one prompt at a time."""
    from kvpack.methods.am_selfstudy import self_study_queries

    full, pools, scorer = _reference_pools("llama", reference="self-study", self_study_tokens=4, on_policy=True,
                                           self_study_temperature=0.0)  # greedy: one answer per prompt
    group = full.spec.num_heads // full.spec.num_kv_heads
    assert len(scorer._sequences) == 4 and pools[0] == group * sum(len(s) for s in scorer._sequences)
    model, tok = tiny_model("llama")
    one_by_one: list = []
    self_study_queries(model, tok, full, scorer._new_reservoirs(full), 4, batched_off=True, fed=one_by_one)
    assert one_by_one == scorer._sequences
    # the defaults: two sampled answers per prompt, each fed with its prompt, whose queries are recorded once
    full, pools, scorer = _reference_pools("llama", reference="self-study", self_study_tokens=4, on_policy=True)
    assert len(scorer._sequences) == 8 and scorer._sequences[:4] != scorer._sequences[4:]
    one_by_one = []
    self_study_queries(model, tok, full, scorer._new_reservoirs(full), 4, batched_off=True, fed=one_by_one,
                       temperature=scorer.self_study_temperature, seed=scorer.self_study_seed, samples=2)
    assert one_by_one == scorer._sequences


def test_on_policy_self_study_builds_a_pack_that_generates(tmp_path):
    """The paper's headline source with on-policy queries (``self-study+repeat``, ``on_policy``): a pack that
    loads and generates, every head fitted or counted."""
    model, tok, pack = _build("llama", reference="self-study+repeat", self_study_tokens=3, on_policy=True)
    fit = pack.metadata["stats"]["fit"]
    assert fit["queries"] > 0 and pack.metadata["method_params"]["on_policy"] is True
    path = tmp_path / "p.kvpack"
    kvpack.save(pack, path)
    assert isinstance(kvpack.generate(model, tok, kvpack.load(path, model, tokenizer=tok), "Who?", max_new_tokens=3),
                      str)


@pytest.mark.parametrize("reference", ["self-study+repeat", "continue"])
def test_on_policy_sweep_fits_each_layer_on_the_layer_by_layer_replays_queries(monkeypatch, reference):
    """The on-policy sweep (``am_sweep``: every pass once, in step) fits layer ``i`` on exactly the queries the
    layer-by-layer reference (``_recompute_queries``: the repeat chunks and fed sequences run again up to layer
    ``i``) computes over the final compacted layers before it, pooled in the same order; layer 0 on the sources'
    own queries. Several repeat chunks and sequences run as concurrent passes here."""
    from kvpack.methods.am import AttentionMatching
    from kvpack.methods.base import gather

    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
    # greedy self-study (one answer per prompt), so the off-policy pool and the replays hold the same tokens
    scorer = get_method("am", chunk_size=40, queries=50_000, reference=reference, self_study_tokens=3,
                        continue_tokens=9, on_policy=True, self_study_temperature=0.0)
    scores = scorer.score(model, tok, full)
    passes = scorer._policy_passes(full)
    assert len(passes) >= (3 if "repeat" in reference else 1)
    original = [torch.cat(r.parts, dim=1) for r in scorer._reservoirs]
    seen: dict[int, torch.Tensor] = {}
    fit_layer = AttentionMatching._fit_layer

    def spy(self, prefill_, keep_, layers_, i, reservoirs, tally):
        seen[i] = torch.cat(reservoirs[i].parts, dim=1)
        return fit_layer(self, prefill_, keep_, layers_, i, reservoirs, tally)

    monkeypatch.setattr(AttentionMatching, "_fit_layer", spy)
    keep = scorer.select(scores, 0.3, full)
    layers = gather(full, keep)
    stats = scorer.update_entries(full, keep, layers)
    assert sorted(seen) == list(range(len(spec.compressed_layers))) and stats["queries"] > 0
    torch.testing.assert_close(seen[0], original[0])
    for i in range(1, len(spec.compressed_layers)):
        want = torch.cat(scorer._recompute_queries(full, layers, i).parts, dim=1)
        torch.testing.assert_close(seen[i], want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(seen[i], original[i], atol=1e-3)  # the compacted layers moved them


def test_on_policy_sweep_raises_a_passs_error_and_leaves_no_thread_waiting(monkeypatch):
    """A pass that fails mid-forward stops the sweep: its error reaches the caller and every thread ends."""
    import threading

    from kvpack.methods import am_sweep
    from kvpack.methods.base import gather

    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
    scorer = get_method("am", chunk_size=40, on_policy=True)
    scores = scorer.score(model, tok, full)
    passes = scorer._policy_passes(full)
    passes[-1].input_ids = [10 ** 9]  # an id past the vocabulary: the embedding lookup fails in that thread
    before = threading.active_count()
    fitted = []
    with pytest.raises(IndexError):
        am_sweep.on_policy_sweep(model, full, gather(full, scores > -1), passes, lambda i, handed: fitted.append(i))
    assert fitted == [] and threading.active_count() == before


def test_score_queries_reference_scores_by_the_reference_queries_without_the_repeat_pass(monkeypatch):
    """``score_queries="reference"`` with sampled continuations: KVzip's repeat pass does not run, and the scores are
    each entry's largest attention over the fit queries (``max_attention``), which then drive the split."""
    from kvpack.methods.kvzip import KVzip

    def no_repeat_pass(*args, **kwargs):
        raise AssertionError("the repeat pass ran")

    monkeypatch.setattr(KVzip, "score", no_repeat_pass)
    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
    scorer = get_method("am", chunk_size=40, reference="continue", continue_tokens=30, score_queries="reference")
    scores = scorer.score(model, tok, full)
    assert scores.shape == (len(spec.compressed_layers), spec.num_kv_heads, full.context_tokens)
    fit, _, scaling = scorer._reference(1)
    keys = full.keys[spec.compressed_layers[1]][:, full.sink:]
    torch.testing.assert_close(scores[1, 0], max_attention(fit[0], keys[0], scaling))
    keep = scorer.select(scores, 0.3, full)
    assert int(keep.sum()) == round(0.3 * scores.numel())
    with pytest.raises(AssertionError, match="repeat pass"):  # the repeat source still needs it
        get_method("am", chunk_size=40, score_queries="reference").score(model, tok, full)


def test_merge_values_changes_values_only():
    model, tok, merged = _build("llama", values="merge")
    _, _, copied = _build("llama", values="copy")
    for a, b in zip(merged.layers, copied.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
    assert any(not torch.equal(a.values, b.values) for a, b in zip(merged.layers, copied.layers))


def test_sink_stays_exact():
    model, tok, pack = _build("qwen3")
    from kvpack.model import model_spec

    spec = model_spec(model)
    kvzip = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="kvzip", ratio=0.3, chunk_size=40)
    for l in spec.compressed_layers:
        a, b = pack.layers[l], kvzip.layers[l]
        for h in range(pack.kv_heads):
            rows = slice(int(a.head_offsets()[h]), int(a.head_offsets()[h]) + pack.sink_tokens)
            rows_b = slice(int(b.head_offsets()[h]), int(b.head_offsets()[h]) + pack.sink_tokens)  # its own split
            assert torch.equal(a.values[rows], b.values[rows_b])
            assert torch.equal(a.biases[rows], torch.zeros(pack.sink_tokens))


def test_bad_options_are_input_errors():
    for bad in (dict(values="lsq"), dict(selection="mean"), dict(queries=3), dict(on_policy="yes"), dict(shift="mean"),
                dict(ridge=0.1, ridge_to="mean"), dict(ridge=2.0), dict(weights="query"), dict(refine_steps=-1),
                dict(refine_steps=10_001), dict(refine_batch=-1), dict(refine_batch=1.5), dict(head_floor=-0.5),
                dict(head_floor=2.0)):
        with pytest.raises(InputError):
            get_method("am", **bad)
    with pytest.raises(InputError, match="give --ridge too"):  # a ridge target without a ridge would do nothing
        get_method("am", ridge_to="selected")


def test_reservoir_pools_the_gqa_group_and_is_deterministic():
    q = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2)  # [heads=4, q=3, d=2], 2 KV heads
    r = QueryReservoir(kv_heads=2, cap=100)
    r.append((q, 0.5))
    pooled = torch.cat(r.parts, dim=1)
    torch.testing.assert_close(pooled[1], q[2:].reshape(6, 2))  # query heads 2, 3 serve KV head 1
    a, b = QueryReservoir(2, 5), QueryReservoir(2, 5)
    for res in (a, b):
        res.append((torch.randn(4, 50, 2, generator=torch.Generator().manual_seed(9)), 0.5))
    assert torch.equal(a.split()[0], b.split()[0]) and a.split()[0].shape[1] <= 5


@pytest.mark.parametrize("cap", [40, 60, 100])
def test_per_position_sampling_keeps_a_row_of_every_query_first(cap):
    """``query_sample="per-position"``: a pool of 40 queries asked by the 3 heads of a GQA group (120 rows)
    subsampled to ``cap`` keeps one row of every query before a second of any; uniform sampling does not."""
    counts = {}
    for per_position in (True, False):
        r = QueryReservoir(kv_heads=1, cap=cap, per_position=per_position)
        r.append((torch.randn(3, 40, 4), 1.0))
        assert r.parts[0].shape[1] == cap and torch.equal(r._last_rows, r._last_rows.sort().values)
        counts[per_position] = torch.bincount(r.strata[0], minlength=40)
    assert int(counts[True].min()) == cap // 40 and int(counts[True].max()) == -(-cap // 40)
    assert int(counts[False].min()) < cap // 40 or int(counts[False].max()) > -(-cap // 40)


def test_per_position_sampling_of_an_extended_pool_and_the_method_reservoirs():
    """Two reservoirs' parts pooled by ``extend`` keep distinct query indices, and the pool's subsampling to
    ``cap`` (``split``) then keeps a row of each of their queries; ``query_sample`` reaches the method's
    reservoirs."""
    a, b = (QueryReservoir(kv_heads=1, cap=100, per_position=True) for _ in range(2))
    a.append((torch.randn(2, 30, 4), 1.0))
    b.append((torch.randn(2, 30, 4), 1.0))
    a.extend(b)
    fit, held = a.split()
    assert fit.shape[1] + held.shape[1] == 100 and a._pool_rows is not None
    kept = torch.bincount(torch.cat(a.strata)[a._pool_rows], minlength=60)
    assert len(kept) == 60 and int(kept.min()) == 1 and int(kept.max()) == 2
    spec = model_spec(tiny_model("llama")[0])
    for sample, flag in (("per-position", True), ("uniform", False)):
        assert get_method("am", query_sample=sample)._reservoir(spec).per_position is flag


def test_reservoir_split_is_computed_once_and_holds_out_rows_from_the_whole_pool():
    """The selection (``selection="rms"``) and the fit read the same split, whatever the number of calls; the
    held-out rows are a random subset of the pool (not its first rows, which are one query head's first
    positions), disjoint from the fit rows; a new ``append`` makes a new split."""
    r = QueryReservoir(kv_heads=1, cap=4096)
    r.append((torch.arange(2 * 1000, dtype=torch.float32).view(2, 1000, 1), 1.0))  # 2 query heads, row = its id
    fit, held = r.split()
    again = r.split()
    assert torch.equal(fit, again[0]) and torch.equal(held, again[1])
    ids_fit, ids_held = fit[0, :, 0].long(), held[0, :, 0].long()
    assert held.shape[1] == 250 and fit.shape[1] == 1750  # pool / 8 held out
    assert not set(ids_fit.tolist()) & set(ids_held.tolist())
    assert (ids_held >= 1000).any() and (ids_held < 1000).any()  # both query heads are held out from
    assert ids_held.max() - ids_held.min() > 1500  # spread over the pool
    r.append((torch.full((2, 10, 1), -1.0), 1.0))
    assert r.split()[0].shape[1] + r.split()[1].shape[1] == 2020
    eight = r.split(8)
    r.split(4)
    assert torch.equal(r.split(8)[0], eight[0])  # another held-out size leaves the pool as it was
    r.parts.extend([torch.zeros(1, 5, 1)])  # "both" pools another reservoir's parts this way
    assert r.split()[0].shape[1] + r.split()[1].shape[1] == 2025


# ---------------------------------------------------------------------------------------------------------------
# biases on the attention paths, in the file, and through generate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_masked_attention_adds_the_bias(dtype, q_len):
    """Both CPU paths (SDPA with a float mask; the explicit scored path) equal an explicit softmax with the bias."""
    gen = torch.Generator().manual_seed(4)
    kv_heads, group, kv, d = 2, 2, 7, 8
    q = torch.randn(1, kv_heads * group, q_len, d, generator=gen)
    k, v = torch.randn(1, kv_heads, kv, d, generator=gen), torch.randn(1, kv_heads, kv, d, generator=gen)
    visible = torch.rand(kv_heads, q_len, kv, generator=gen) > 0.3
    visible[:, :, -1] = True
    bias = torch.randn(kv_heads, kv, generator=gen) * 2
    ref = torch.empty(1, q_len, kv_heads * group, d)
    for j in range(kv_heads * group):
        h = j // group
        logits = q[0, j] @ k[0, h].T * 0.4 + bias[h]
        ref[0, :, j] = logits.masked_fill(~visible[h], float("-inf")).softmax(-1) @ v[0, h]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=4e-2)
    out = masked_attention(q.to(dtype), k.to(dtype), v.to(dtype), visible, 0.4, bias=bias)
    torch.testing.assert_close(out.float(), ref, **tol)
    scores = torch.zeros(kv_heads, kv)
    out = masked_attention(q.to(dtype), k.to(dtype), v.to(dtype), visible, 0.4, scores=scores, bias=bias)
    torch.testing.assert_close(out.float(), ref, **tol)
    assert logit_mask(visible, bias, torch.float32)[~visible].eq(float("-inf")).all()


def test_file_round_trip_and_hostile_biases(monkeypatch):
    _, _, pack = _build("llama")
    data = pack_to_bytes(pack)
    back = load_pack(data)
    for a, b in zip(pack.layers, back.layers):
        assert torch.equal(a.biases, b.biases)
    plain = copy.deepcopy(pack)
    for layer in plain.layers:
        layer.biases = None
    assert all(layer.biases is None for layer in load_pack(pack_to_bytes(plain)).layers)
    bad = copy.deepcopy(pack)
    bad.layers[0].biases = bad.layers[0].biases[:-1]
    with pytest.raises(InputError, match="biases"):
        pack_to_bytes(bad)
    bad.layers[0].biases = torch.full_like(pack.layers[0].biases, float("nan"))
    with pytest.raises(InputError, match="biases"):
        pack_to_bytes(bad)
    # hostile files (written past the writer's own checks): a biases tensor one value short, or not finite
    monkeypatch.setattr(validate, "pack_problem", lambda p: None)  # the writer's check, read when it writes
    bad.layers[0].biases = pack.layers[0].biases[:-1]
    with pytest.raises(CorruptFileError, match="attn_bias.*one per entry"):
        load_pack(pack_to_bytes(bad))
    bad.layers[0].biases = torch.full_like(pack.layers[0].biases, float("inf"))
    with pytest.raises(CorruptFileError, match="biases"):
        load_pack(pack_to_bytes(bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_load_generate_with_biases(arch, dtype, tmp_path):
    model, tok = tiny_model(arch)
    if dtype != torch.float32:
        model = copy.deepcopy(model).to(dtype)
    # value_bound=0: the random tiny models' fits all leave twice their context's value range, and this test is
    # about carrying the fitted biases through the file
    pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="am", ratio=0.3, chunk_size=40,
                           value_bound=0)
    path = tmp_path / "am.kvpack"
    kvpack.save(pack, path)
    cache = kvpack.load(path, model, tokenizer=tok)
    assert any(layer.biases is not None and bool((layer.biases != 0).any()) for layer in cache.layers)
    answer = kvpack.generate(model, tok, cache, "What is the secret code of Alice?", max_new_tokens=4)
    assert isinstance(answer, str)
    # plain model.generate with the cache, then the same again after rewind: identical tokens
    ids = question_input_ids(tok, cache, "Who?")
    outs = []
    for _ in range(2):
        outs.append(model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)[0].tolist())
        cache.rewind()
    assert outs[0] == outs[1] and len(outs[0]) > ids.shape[1]


def test_bench_method_specs():
    from kvpack.bench.grid import expand_grid, parse_method_spec

    assert parse_method_spec("am[values=copy;queries=64;on_policy=true]") == (
        "am", {"values": "copy", "queries": 64, "on_policy": True})
    assert parse_method_spec("kvzip") == ("kvzip", {})
    for bad in ("am[values]", "am[values=lsq]", "nope[x=1]", "kvzip[values=copy]", "am:values=copy"):
        with pytest.raises(InputError):
            parse_method_spec(bad)
    assert [v.label for v in expand_grid(["am[values=merge]"], [0.1], ["none"])] == ["none@1", "am[values=merge]@0.1"]


def test_kvzip_plus_scoring_gives_am_kvzip_plus_selection():
    """``scoring="plus"`` reaches AM through KVzip's repeat pass (which also records AM's queries): with the values
    copied, AM holds exactly KVzip+'s entries, a selection other than plain KVzip's."""
    model, tok, am = _build("llama", values="copy", scoring="plus", queries=64, budgets="global", recent=0,
                       **KVZIP_SELECTION)
    plus = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="kvzip", ratio=0.3, chunk_size=40,
                           scoring="plus")
    plain = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="kvzip", ratio=0.3, chunk_size=40)
    for a, b in zip(am.layers, plus.layers):
        for part in ("keys", "values", "positions", "head_lengths"):
            assert torch.equal(getattr(a, part), getattr(b, part)), part
    assert any(not torch.equal(a.positions, b.positions) for a, b in zip(plus.layers, plain.layers))
    assert am.metadata["stats"]["fit"]["queries"] > 0


def test_rms_selection_takes_a_subsampled_repeat_pass_attention(monkeypatch):
    """A whole-context repeat pass with more query rows than ``queries`` (GQA groups make ``group x tokens`` rows
    per KV head) still hands its attention over: the fit's targets and log-sum-exps are those of its own rows (the
    rows each subsampling kept, in the pool's order), and the RMS is the square sums of every row the pass
    attended, less the held-out rows', scaled to the fit rows' count, plus the self-study rows attended again."""
    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 4096)
    recorded, real_append = {}, QueryReservoir.append

    def append(self, item):  # every query of the repeat pass, before any subsampling
        if self.context_range is not None:
            recorded.setdefault(id(self), []).append(item[0].reshape(self.kv_heads, -1, item[0].shape[-1]))
        real_append(self, item)

    monkeypatch.setattr(QueryReservoir, "append", append)
    scorer = get_method("am", chunk_size=4096, reference="self-study+repeat", self_study_tokens=3, queries=64,
                        queries_per_entry=1.0)
    scorer.select(scorer.score(model, tok, full), 0.1, full)
    assert scorer._context_cache
    for i, reservoir in enumerate(scorer._reservoirs):
        pooled = reservoir.context_statistics()
        assert pooled is not None and reservoir._pool_rows is not None  # the pool was subsampled
        every = torch.cat(recorded[id(reservoir)], dim=1).float()
        assert pooled.count == every.shape[1] > sum(p.shape[1] for p in reservoir.parts[:1])
        fit, held, scaling = scorer._reference(i)
        fit_rows, held_rows = reservoir.split_rows()
        known, held_known = pooled.has[fit_rows], pooled.has[held_rows]
        layer = full.spec.compressed_layers[i]
        keys, values = full.keys[layer][:, full.sink :].float(), full.values[layer][:, full.sink :].float()
        rms = scorer._rms_scores(full, i)
        for h in range(keys.shape[0]):
            def square_sum(q):
                return rms_attention(q, keys[h], scaling).square() * q.shape[0]
            scale = int(known.sum()) / (every.shape[1] - int(held_known.sum()))
            squares = (square_sum(every[h]) - square_sum(held[h][held_known])) * scale + square_sum(fit[h][~known])
            torch.testing.assert_close(rms[h], squares.clamp_min(0).div(fit.shape[1]).sqrt(), atol=1e-6, rtol=1e-4)
            if (i, h) in scorer._context_cache:
                _, target, lse = scorer._context_cache[(i, h)]
                want, want_lse = context_attention(fit[h], keys[h], values[h], scaling)
                torch.testing.assert_close(target, want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [4096, 16])
def test_select_queries_all_averages_over_every_recorded_query_but_the_held_out(monkeypatch, chunk_size):
    """``select_queries="all"``: the RMS selection's mean runs over every query recorded (the whole-context repeat
    pass's every row, which it attended itself, or, chunked, the parts' rows), less the held-out rows, rather than
    over the fit's subsample; ``"fit"`` differs from it once the pool is subsampled."""
    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 4096)
    recorded, real_append = {}, QueryReservoir.append

    def append(self, item):  # the whole-context repeat pass's every query, before the call's subsampling
        if self.context_range is not None:
            recorded.setdefault(id(self), []).append(item[0].reshape(self.kv_heads, -1, item[0].shape[-1]))
        real_append(self, item)

    monkeypatch.setattr(QueryReservoir, "append", append)
    rms = {}
    for which in ("all", "fit"):
        scorer = get_method("am", chunk_size=chunk_size, reference="self-study+repeat", self_study_tokens=3,
                            queries=64, select_queries=which)
        scorer.score(model, tok, full)
        rms[which] = torch.stack([scorer._rms_scores(full, i) for i in range(len(scorer._reservoirs))])
    for i, reservoir in enumerate(scorer._reservoirs):
        assert reservoir._pool_rows is not None  # subsampled
        whole = recorded.get(id(reservoir), [])
        assert bool(whole) == (chunk_size == 4096)
        parts = [p for j, p in enumerate(reservoir.parts) if not whole or j not in reservoir.contexts]
        every = torch.cat([w.float() for w in whole] + parts, dim=1)
        _, held, scaling = scorer._reference(i)
        layer = full.spec.compressed_layers[i]
        keys = full.keys[layer][:, full.sink :].float()
        for h in range(keys.shape[0]):
            is_held = torch.zeros(every.shape[1], dtype=torch.bool)
            for row in held[h]:  # one copy of each held-out row (a chunk's repeat prompt repeats in layer 0)
                is_held[int(((every[h] == row).all(-1) & ~is_held).nonzero()[0])] = True
            want = rms_attention(every[h][~is_held], keys[h], scaling)
            torch.testing.assert_close(rms["all"][i, h], want, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(rms["all"], rms["fit"], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("reference", ["repeat", "self-study+repeat"])
def test_rms_selection_takes_the_repeat_pass_attention_over_a_whole_context(monkeypatch, reference):
    """A repeat pass over the whole context (one chunk) also records its queries' attention over the context
    (``QueryReservoir.context_attention``): the RMS selection then attends again only the rows without it (the
    self-study answers') and the held-out rows whose squares it subtracts; its scores, the fit's targets and
    log-sum-exps, and so the kept entries, are the explicit pass's (to float32 rounding)."""
    import kvpack.methods.am as am_module

    model, tok = tiny_model("llama")
    spec, layout = model_spec(model), chat_layout(tok)
    prefix = layout.prefix_ids(tok)
    full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 4096)
    rows, real = [], am_module.rms_attention

    def counted(queries, keys, scaling, values=None):
        rows.append(queries.shape[0])
        return real(queries, keys, scaling, values=values)

    def select():
        rows.clear()
        scorer = get_method("am", chunk_size=4096, reference=reference, self_study_tokens=3)
        keep = scorer.select(scorer.score(model, tok, full), 0.3, full)
        return scorer, keep, sum(rows)

    monkeypatch.setattr(am_module, "rms_attention", counted)
    shared, keep, shared_rows = select()
    assert all(r.contexts and r.context_statistics() is not None for r in shared._reservoirs)
    monkeypatch.setattr(QueryReservoir, "context_attention", lambda self, visible: None)
    explicit, explicit_keep, explicit_rows = select()
    heads = len(spec.compressed_layers) * spec.num_kv_heads
    fit, held, _ = explicit._reference(0)
    assert explicit_rows == heads * fit.shape[1]
    if reference == "repeat":
        assert shared_rows == heads * held.shape[1]  # only the held-out rows, whose squares are subtracted
    else:
        assert heads * held.shape[1] < shared_rows < explicit_rows
    assert torch.equal(keep, explicit_keep)
    assert shared._context_cache.keys() == explicit._context_cache.keys() and shared._context_cache
    for key, (q, target, lse) in explicit._context_cache.items():
        q2, target2, lse2 = shared._context_cache[key]
        # the repeat pass's own output is summed in another order (context part apart), so the next layers' queries
        # move by float32 rounding
        torch.testing.assert_close(q2, q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(target2, target, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse2, lse, atol=1e-5, rtol=1e-5)
    for i in range(len(spec.compressed_layers)):
        torch.testing.assert_close(shared._rms_scores(full, i), explicit._rms_scores(full, i), atol=1e-6, rtol=1e-4)
