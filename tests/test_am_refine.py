"""Attention Matching's gradient refinement (``--refine-steps``, ``kvpack.methods.am_refine``): the objective against
attention computed directly, Adam lowering it by moving the keys, and the refined heads of a built pack (validated,
their keys stored, the rest as prefilled)."""

from __future__ import annotations

import torch

import kvpack
from kvpack.methods.am_fit import context_attention, fit_head
from kvpack.methods.am_refine import full_output, refine_head

from .tiny import TEXT, tiny_model


def _head(seed: int, T: int = 64, d: int = 8, sink: int = 2, n: int = 600):
    gen = torch.Generator().manual_seed(seed)
    K, V = torch.randn(T, d, generator=gen) * 2, torch.randn(T, d, generator=gen)
    return K, V, torch.randn(n, d, generator=gen) * 2, sink


def test_full_output_is_attention_over_the_sink_and_the_context():
    K, V, Q, sink = _head(1)
    scaling = 8 ** -0.5
    target, lse = context_attention(Q, K[sink:], V[sink:], scaling)
    got = full_output(Q, target, lse, K[:sink], V[:sink], scaling)
    torch.testing.assert_close(got, ((Q @ K.T) * scaling).softmax(-1) @ V, rtol=1e-5, atol=1e-5)
    assert torch.equal(full_output(Q, target, lse, K[:0], V[:0], scaling), target)


SCALING = 8 ** -0.5


def _fitted(seed: int):
    """A random head (``_head``), every eighth context entry kept and fitted by the closed form, and the full
    output over [sink, context] the refinement aims at: ``(K, V, Q, sink, kept, fit, full)``."""
    K, V, Q, sink = _head(seed)
    kept = torch.arange(0, K.shape[0] - sink, 8)
    fit = fit_head(K[sink:], V[sink:], Q, kept, SCALING)
    target, lse = context_attention(Q, K[sink:], V[sink:], SCALING)
    return K, V, Q, sink, kept, fit, full_output(Q, target, lse, K[:sink], V[:sink], SCALING)


def _loss(Q, K, V, sink, kept_keys, beta, values, scaling):
    full = ((Q @ K.T) * scaling).softmax(-1) @ V
    logits = torch.cat([(Q @ K[:sink].T) * scaling, (Q @ kept_keys.T) * scaling + beta], dim=1)
    out = logits.softmax(-1) @ torch.cat([V[:sink], values])
    return float((out - full).square().sum() / full.square().sum())


def test_refine_starts_from_the_fit_and_lowers_the_loss_by_moving_the_keys():
    K, V, Q, sink, kept, fit, full = _fitted(2)
    scaling = SCALING
    start = _loss(Q, K, V, sink, K[sink + kept], fit.beta, fit.values, scaling)
    k0, b0, v0, before, after = refine_head(K[sink + kept], fit.beta, fit.values, Q, full, K[:sink], V[:sink],
                                            scaling, steps=0)
    assert torch.equal(k0, K[sink + kept]) and torch.equal(b0, fit.beta) and torch.equal(v0, fit.values)
    assert before == after and abs(before - start) < 1e-5
    k, b, v, before, after = refine_head(K[sink + kept], fit.beta, fit.values, Q, full, K[:sink], V[:sink], scaling,
                                         steps=60, lr=0.02)
    assert after < 0.8 * before  # the closed form is not the optimum once the keys may move
    assert abs(after - _loss(Q, K, V, sink, k, b, v, scaling)) < 1e-5  # the returned iterate is the one measured
    assert not torch.equal(k, K[sink + kept]) and bool(b.abs().max() <= 10)


def test_refined_heads_of_a_pack_are_validated_and_store_their_keys(tmp_path):
    model, tok = tiny_model("llama")
    kw = dict(kv_dtype="float32", method="am", ratio=0.3, chunk_size=40, ridge_search=True)
    plain = kvpack.compress(model, tok, TEXT, **kw)
    refined = kvpack.compress(model, tok, TEXT, refine_steps=40, **kw)
    fit = refined.metadata["stats"]["fit"]
    chosen = fit["ridge_search"]
    assert sum(chosen.values()) == sum(plain.metadata["stats"]["fit"]["ridge_search"].values())
    assert chosen.get("refined", 0) > 0
    assert refined.metadata["method_params"]["refine_steps"] == 40
    moved = 0
    for a, b in zip(plain.layers, refined.layers):  # same entries (positions); keys differ only where refined
        assert torch.equal(a.positions, b.positions) and torch.equal(a.head_lengths, b.head_lengths)
        off = a.head_offsets().tolist()
        for h in range(len(a.head_lengths)):
            moved += int(not torch.equal(a.keys[off[h]:off[h + 1]], b.keys[off[h]:off[h + 1]]))
    assert moved == chosen["refined"]
    path = tmp_path / "r.kvpack"
    kvpack.save(refined, path)
    cache = kvpack.load(path, model, tokenizer=tok)
    assert isinstance(kvpack.generate(model, tok, cache, "Who?", max_new_tokens=4), str)


def test_refine_in_batches_is_deterministic_and_unmeasured_on_request():
    K, V, Q, sink, kept, fit, full = _fitted(3)
    scaling = SCALING
    args = (K[sink + kept], fit.beta, fit.values, Q, full, K[:sink], V[:sink], scaling, 40)
    a = refine_head(*args, lr=0.02, batch=128)
    b = refine_head(*args, lr=0.02, batch=128, measure=False)
    assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))  # same steps, the last iterate either way
    assert a[4] < a[3] and abs(a[4] - _loss(Q, K, V, sink, *a[:3], scaling)) < 1e-5
    assert b[3] != b[3] and b[4] != b[4]  # NaN: not measured
    c = refine_head(*args, lr=0.02, batch=128, seed=1)
    assert not torch.equal(c[0], a[0])  # another permutation, other steps


def test_refined_beta_stays_in_its_box_widened_to_its_start():
    """beta is clamped to +-BETA_BOUND after each step, or to its starting range where that is wider (AM-OMP's
    clamped weights start down to log 1e-12), never beyond what the loader accepts."""
    from kvpack.constants import MAX_ATTN_BIAS
    from kvpack.methods.am_refine import BETA_BOUND

    K, V, Q, sink, kept, _, full = _fitted(4)
    scaling = SCALING
    start = torch.zeros(len(kept))
    start[0] = -27.0
    _, b, _, _, _ = refine_head(K[sink + kept], start, V[sink + kept], Q, full, K[:sink], V[:sink], scaling, steps=50,
                                lr=0.5)
    assert float(b.min()) >= -27.0 and float(b.max()) <= BETA_BOUND < MAX_ATTN_BIAS
    assert float(b[1:].min()) < 0 or float(b[1:].max()) > 0  # the others moved


def test_refine_move_keys_leaves_beta_and_values_at_the_closed_form():
    K, V, Q, sink, kept, fit, full = _fitted(4)
    args = (K[sink + kept], fit.beta, fit.values, Q, full, K[:sink], V[:sink], SCALING, 60)
    k, b, v, before, after = refine_head(*args, lr=0.02, move="keys")
    assert torch.equal(b, fit.beta.float()) and torch.equal(v, fit.values.float())  # as given
    assert not torch.equal(k, K[sink + kept])
    assert after < 0.9 * before and abs(after - _loss(Q, K, V, sink, k, b, v, SCALING)) < 1e-5
    # the default moves all three
    k2, b2, v2, _, _ = refine_head(*args, lr=0.02)
    assert not torch.equal(b2, fit.beta.float()) and not torch.equal(v2, fit.values.float())
    try:
        refine_head(*args, move="values")
    except ValueError as e:
        assert "keys+beta+values" in str(e)
    else:
        raise AssertionError("refine_head accepted move='values'")


def test_a_pack_refined_by_its_keys_alone_keeps_the_fitted_values():
    model, tok = tiny_model("llama")
    kw = dict(kv_dtype="float32", method="am", ratio=0.3, chunk_size=40, ridge_search=True)
    plain = kvpack.compress(model, tok, TEXT, **kw)
    keys_only = kvpack.compress(model, tok, TEXT, refine_steps=40, refine_move="keys", refine_lr=0.02, **kw)
    chosen = keys_only.metadata["stats"]["fit"]["ridge_search"]
    assert chosen.get("refined", 0) > 0
    assert keys_only.metadata["method_params"]["refine_move"] == "keys"
    for a, b in zip(plain.layers, keys_only.layers):  # values and biases as the closed form left them, head by head
        assert torch.equal(a.values, b.values) and torch.equal(a.biases, b.biases)
    assert any(not torch.equal(a.keys, b.keys) for a, b in zip(plain.layers, keys_only.layers))


def test_hand_gradients_are_autograd_s():
    from kvpack.methods.am_refine import _loss_and_grads

    K, V, Q, sink, kept, fit, full = _fitted(5)
    keys = K[sink + kept].clone().requires_grad_(True)
    beta = fit.beta.float().clone().requires_grad_(True)
    values = fit.values.float().clone().requires_grad_(True)
    sink_logits = (Q @ K[:sink].T) * SCALING
    logits = torch.cat([sink_logits, (Q @ keys.T) * SCALING + beta], dim=1)
    out = logits.softmax(-1) @ torch.cat([V[:sink], values])
    loss = (out - full).square().sum() / full.square().sum()
    loss.backward()
    got = _loss_and_grads(Q, full, sink_logits, keys.detach(), beta.detach(), torch.cat([V[:sink], values.detach()]),
                          sink, SCALING, True)
    assert abs(float(got[0]) - float(loss.detach())) < 1e-6
    for mine, theirs in zip(got[1:], (keys.grad, beta.grad, values.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    keys_only = _loss_and_grads(Q, full, sink_logits, keys.detach(), beta.detach(),
                                torch.cat([V[:sink], values.detach()]), sink, SCALING, False)
    assert keys_only[2] is None and keys_only[3] is None
    torch.testing.assert_close(keys_only[1], keys.grad, rtol=1e-4, atol=1e-6)


def test_the_reservoir_keeps_each_fit_row_s_position_through_both_subsamplings():
    """``QueryReservoir.fit_positions``: the position of every fit row ``split`` returns, through the subsampling of
    a call larger than ``cap`` and of the pool, with -1 for a source that says none."""
    from kvpack.methods.am import QueryReservoir

    gen = torch.Generator().manual_seed(0)
    reservoir = QueryReservoir(kv_heads=2, cap=70)
    for first, q in ((100, 50), (None, 20), (1000, 30)):  # 100 rows a KV head in the first call: over the cap
        query = torch.randn(4, q, 3, generator=gen)  # 4 query heads, GQA group 2; channel 0 holds the position
        query[:, :, 0] = -1.0 if first is None else first + torch.arange(q).float()
        reservoir.first_position = first
        reservoir.append((query, 0.5))
    fit, _ = reservoir.split()
    got = reservoir.fit_positions()
    assert len(got) == fit.shape[1] == 70 - 8  # the pool subsampled to the cap, an eighth held out
    for h in range(2):
        assert torch.equal(got.float(), fit[h, :, 0])
    assert bool((got == -1).any()) and bool((got >= 1000).any()) and bool(((got >= 100) & (got < 150)).any())


def _refinement(window: int, refine_queries: str):
    """The tiny llama's AM fit with the repeat pass's queries alone and ``max_position_embeddings = window``:
    ``(prefill, refined heads, gathered layers, the refinement's rows of the first compressed layer, the positions of
    its fit rows)``."""
    from kvpack.layout import chat_layout
    from kvpack.methods import get_method
    from kvpack.methods.base import gather
    from kvpack.model import model_spec
    from kvpack.prefill import prefill

    model, tok = tiny_model("llama")
    saved = model.config.max_position_embeddings
    model.config.max_position_embeddings = window
    try:
        spec, layout = model_spec(model), chat_layout(tok)
        prefix = layout.prefix_ids(tok)
        full = prefill(model, prefix + layout.encode(tok, TEXT), len(prefix), layout, spec, 40)
        scorer = get_method("am", chunk_size=40, reference="repeat", refine_steps=20, refine_lr=0.02,
                            refine_queries=refine_queries)
        keep = scorer.select(scorer.score(model, tok, full), 0.3, full)
        layers = gather(full, keep)
        stats = scorer.update_entries(full, keep, layers)
        rows, positions = scorer._refine_rows(scorer._reservoirs[0]), scorer._reservoirs[0].fit_positions()
        return full, stats["ridge_search"].get("refined", 0), layers, rows, positions
    finally:
        model.config.max_position_embeddings = saved


def test_the_refinement_fits_only_the_queries_within_the_model_s_window():
    """``refine_queries="in-window"``: with every repeat query within the window it is ``"all"``, entry for entry;
    with the window ending at the repeat pass's first position only each chunk's first query is within it, too few
    to refine any head, where ``"all"`` refines some."""
    full, refined_all, layers_all, rows, _ = _refinement(4096, "all")
    assert rows is None
    _, refined_in, layers_in, rows, _ = _refinement(4096, "in-window")
    assert rows is None and refined_all == refined_in > 0
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(layers_all, layers_in))
    window = full.tokens + 1
    _, refined_in, _, rows, positions = _refinement(window, "in-window")
    _, refined_all, _, _, _ = _refinement(window, "all")
    chunks, group = -(-full.context_tokens // 40), full.spec.num_heads // full.spec.num_kv_heads
    assert 0 < len(rows) <= chunks * group and bool((positions[rows] == full.tokens).all())
    assert int((positions < window).sum()) == len(rows)
    assert refined_in == 0 < refined_all
