"""Every compression method of the registry: budgets, selection scopes, scores against brute force, D2O's merge
arithmetic, option checks, and a registry-driven build / save / load / generate on every tiny architecture."""

from __future__ import annotations

import math
import re

import pytest
import torch

import kvpack
from kvpack.build import build, discover_contexts
from kvpack.errors import InputError
from kvpack.generation import question_input_ids
from kvpack.layout import chat_layout
from kvpack.methods import METHODS, get_method
from kvpack.methods.base import SCOPES, Method, fit_budgets, split_evenly, top_k_rows
from kvpack.methods.d2o import D2O, ema_thresholds, layer_variance, merge_evicted, nearest_kept
from kvpack.model import model_spec
from kvpack.prefill import prefill

from .reference import masked_reference_logits
from .tiny import ARCHITECTURES, TEXT, attention_implementation, required_options, tiny_heads_file, tiny_model

RATIO = 0.3
#: Harder settings per method, run on one architecture (every method also runs with its defaults everywhere).
VARIANTS = {
    "kvzip": [dict(tail_tokens=0), dict(scoring="plus")],
    "kvzip-head": [dict(heads=tiny_heads_file("qwen2"), window=5)],
    "am": [dict(selection="rms", values="merge", queries=64), dict(values="copy", on_policy=True)],
    "d2o": [dict(merge="off"), dict(merge="values"), dict(sink=0, recent_ratio=0.0, beta=1.0),
            dict(sink=50, recent_ratio=1.0)],
    "streaming": [dict(sink=0)],
    "h2o": [dict(budget="global"), dict(budget="layer")],
    "snapkv": [dict(window=8, kernel=1, pooling="max", budget="global"), dict(question="What is the code?")],
    "pyramidkv": [dict(budget="layer", beta=1.0), dict(question="What is the code?", window=4)],
    "knorm": [dict(budget="global")],
    "random": [dict(seed=7, budget="layer")],
    "none": [],
}


def test_every_method_has_variants_listed():
    assert set(VARIANTS) == set(METHODS)


def _check_pack(model, tok, pack, method: Method, tmp_path, exact: bool):
    """Budget exact, sink kept, heads within one of each other for per-head scopes; the pack saves, loads and
    answers without NaN; for pure eviction, the loaded cache equals the masked full cache."""
    spec = model_spec(model)
    stats = pack.metadata["stats"]
    entries = stats["context_entries"]
    want = entries if method.name == "none" else round(RATIO * entries)
    if method.name == "kvzip-head":  # whole heads: round(RATIO x pairs) of them, plus the window in the others
        pairs = len(spec.compressed_layers) * pack.kv_heads
        n = stats["context_tokens"]
        kept = round(RATIO * pairs)
        want = kept * n + (pairs - kept) * min(method.window, n)
    assert stats["context_entries_kept"] == want
    compressed = list(spec.compressed_layers)
    lengths = pack.head_lengths()[compressed] - pack.sink_tokens
    assert int(lengths.sum()) == want
    assert stats["layer_budgets"] == lengths.sum(dim=1).tolist()
    if method.scope == "head":
        assert int((lengths.max(dim=1).values - lengths.min(dim=1).values).max()) <= 1
    for l in compressed:
        for h in range(pack.kv_heads):
            pos = pack.layers[l].head(h)[2]
            assert pos[: pack.sink_tokens].tolist() == list(range(pack.sink_tokens))
            assert bool((pos[1:] > pos[:-1]).all())
    path = tmp_path / f"{method.name}.kvpack"
    kvpack.save(pack, path)
    cache = kvpack.load(path, model, tokenizer=tok)
    ids = question_input_ids(tok, cache, "What is the secret code of Alice?")[0].tolist()
    q_ids = ids[pack.original_tokens :]
    logits = model(input_ids=torch.tensor([q_ids]), past_key_values=cache, use_cache=True).logits[0].float()
    cache.rewind()
    assert torch.isfinite(logits).all()
    assert isinstance(kvpack.generate(model, tok, cache, "Who?", max_new_tokens=3), str)
    if exact:
        kept = [None if l in spec.sliding_layers else
                [set(pack.layers[l].head(h)[2].tolist()) for h in range(pack.kv_heads)]
                for l in range(spec.num_layers)]
        windows = [spec.sliding_window if (l in spec.sliding_layers or not spec.sliding_layers) else None
                   for l in range(spec.num_layers)]
        ref = masked_reference_logits(model, pack.token_ids.tolist(), q_ids, kept, windows)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_builds_loads_and_generates_on_every_architecture(name, arch, tmp_path):
    model, tok = tiny_model(arch)
    required = required_options(name, arch)
    pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method=name, ratio=RATIO, chunk_size=40, **required)
    method = get_method(name, **required)
    assert pack.metadata["method"] == name and pack.metadata["method_params"] == get_method(
        name, {"chunk_size": 40}, **required).params()
    merges = name == "d2o"
    assert ("merge" in pack.metadata["stats"]) == merges
    _check_pack(model, tok, pack, method, tmp_path, exact=not merges and name != "am")


@pytest.mark.parametrize("name, options", [(n, o) for n, opts in VARIANTS.items() for o in opts])
def test_method_variants(name, options, tmp_path):
    model, tok = tiny_model("qwen2")
    pack = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method=name, ratio=RATIO, chunk_size=40, **options)
    method = get_method(name, **options)
    assert pack.metadata["method_params"] == get_method(name, {"chunk_size": 40}, **options).params()
    _check_pack(model, tok, pack, method, tmp_path,
                exact=not (name == "d2o" and method.merge != "off") and name != "am")


def test_none_keeps_everything_and_records_ratio_one(tmp_path):
    model, tok = tiny_model("llama")
    pack = kvpack.compress(model, tok, TEXT, method="none", ratio=0.2)
    full = kvpack.compress(model, tok, TEXT, method="kvzip", ratio=1.0)
    assert pack.metadata["ratio"] == 1.0
    for a, b in zip(pack.layers, full.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions)
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    ctxs = discover_contexts([tmp_path / "a.txt"])
    first = build(ctxs, model, tok, out_dir=tmp_path / "packs", method="none", ratio=0.2)
    again = build(ctxs, model, tok, out_dir=tmp_path / "packs", method="none", ratio=0.2)
    assert not first[0].skipped and again[0].skipped  # the recorded ratio 1.0 counts as up to date


def test_options_are_part_of_the_up_to_date_check(tmp_path):
    model, tok = tiny_model("llama")
    (tmp_path / "a.txt").write_text(TEXT, encoding="utf-8")
    ctxs = discover_contexts([tmp_path / "a.txt"])
    out = tmp_path / "packs"
    assert not build(ctxs, model, tok, out_dir=out, method="d2o", beta=0.5)[0].skipped
    assert build(ctxs, model, tok, out_dir=out, method="d2o", beta=0.5)[0].skipped
    assert not build(ctxs, model, tok, out_dir=out, method="d2o", beta=0.5, merge="off")[0].skipped
    with pytest.raises(InputError, match="has no parameter 'sink'"):
        build(ctxs, model, tok, out_dir=out, method="h2o", sink=2)


# ---------------------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("name, options, fragment", [
    ("h2o", dict(sink=3), "has no parameter 'sink'"),
    ("none", dict(budget="head"), "it takes no parameters"),
    ("kvzip", dict(budget="head"), "has no parameter 'budget'"),
    ("d2o", dict(budget="layer"), "has no parameter 'budget'"),
    ("streaming", dict(merge=False), "has no parameter 'merge'"),
    ("d2o", dict(beta=1.5), "beta must be a number in [0.0, 1.0]"),
    ("d2o", dict(recent_ratio=-0.1), "recent_ratio"),
    ("d2o", dict(merge="yes"), "merge must be one of keys+values, values, off"),
    ("d2o", dict(sink=-1), "sink must be an integer >= 0"),
    ("pyramidkv", dict(budget="global"), "budget must be one of layer, head"),
    ("pyramidkv", dict(beta=0.5), "beta must be a number in [1.0"),
    ("snapkv", dict(kernel=4), "kernel must be odd"),
    ("snapkv", dict(pooling="median"), "pooling must be one of avg, max"),
    ("snapkv", dict(question="  "), "question must be a non-empty string"),
    ("h2o", dict(budget="tokens"), "budget must be one of global, layer, head"),
    ("random", dict(seed=-2), "seed must be an integer >= 0"),
])
def test_bad_options_raise_input_error(name, options, fragment):
    with pytest.raises(InputError) as err:
        get_method(name, **options)
    assert fragment in str(err.value)
    model, tok = tiny_model("llama")
    with pytest.raises(InputError):
        kvpack.compress(model, tok, TEXT, method=name, **options)


def test_defaults_only_fill_parameters_a_method_has():
    assert get_method("kvzip", {"chunk_size": 7}).chunk_size == 7
    assert get_method("kvzip", {"chunk_size": 7}, chunk_size=9).chunk_size == 9
    assert get_method("h2o", {"chunk_size": 7}).params() == {"budget": "head"}


def test_every_method_takes_the_parameters_declared_for_it():
    from kvpack.methods.params import PARAMS

    assert list(PARAMS) == list(METHODS)
    for name, cls in METHODS.items():
        assert issubclass(cls, PARAMS[name]) and cls.name == name
        assert cls.parameter_names() == PARAMS[name].parameter_names()
        assert PARAMS[name].defaults() == {k: v for k, v in PARAMS[name]().params().items()}


def test_build_flags_are_made_from_the_declared_fields():
    from kvpack.methods.params import command_line_options

    opts = {o.flag: o for o in command_line_options()}
    assert {f: o.param for f, o in opts.items()} == {
        "--score": "scoring", "--heads": "heads", "--window": "window", "--select": "selection", "--values": "values",
        "--queries": "queries", "--on-policy": "on_policy", "--reference": "reference", "--ridge": "ridge",
        "--ridge-to": "ridge_to", "--value-bound": "value_bound", "--fit-weights": "weights",
        "--ridge-search": "ridge_search", "--sink": "sink", "--recent-ratio": "recent_ratio", "--merge": "merge",
        "--beta": "beta", "--budget": "budget", "--question": "question", "--seed": "seed",
        "--max-head-ratio": "max_head_ratio", "--budgets": "budgets", "--schedule": "schedule", "--recent": "recent",
        "--score-queries": "score_queries", "--self-study-tokens": "self_study_tokens",
        "--self-study-temperature": "self_study_temperature", "--self-study-seed": "self_study_seed",
        "--self-study-samples": "self_study_samples",
        "--queries-per-entry": "queries_per_entry", "--refine-steps": "refine_steps", "--refine-batch": "refine_batch",
        "--head-floor": "head_floor", "--unfitted-selection": "unfitted_selection",
            "--refine-move": "refine_move", "--refine-lr": "refine_lr", "--refine-queries": "refine_queries",
            "--select-queries": "select_queries", "--query-sample": "query_sample", "--select-pool": "select_pool"}
    assert [u[0] for u in opts["--window"].uses] == ["kvzip-head", "snapkv", "pyramidkv"]
    assert [(u[0], u[2]) for u in opts["--beta"].uses] == [("d2o", 0.7), ("pyramidkv", 20.0)]
    assert opts["--budget"].choices == SCOPES and opts["--budget"].uses[2][3] == ("layer", "head")  # pyramidkv's
    assert (opts["--queries"].type, opts["--queries"].low) == (int, 16)
    assert (opts["--ridge"].low, opts["--ridge"].high) == (0.0, 1.0) and opts["--on-policy"].type is bool
    assert opts["--heads"].type is str and opts["--heads"].metavar == "FILE"


def test_a_new_field_is_a_flag_and_a_spec_key_and_a_clash_is_refused():
    from dataclasses import dataclass

    from kvpack.methods.params import D2OParams, MethodParams, command_line_options, option

    @dataclass
    class Toy(MethodParams):
        name = "toy"
        sink: int = option(4, "sinks", low=0)
        tile_width: float = option(0.5, "a new option", choices=None)

    opts = {o.flag: o for o in command_line_options({"toy": Toy, "d2o": D2OParams})}
    assert opts["--tile-width"].param == "tile_width" and opts["--tile-width"].uses == (("toy", "a new option", 0.5,
                                                                                          None),)
    assert [u[0] for u in opts["--sink"].uses] == ["toy", "d2o"]

    @dataclass
    class Clash(MethodParams):
        name = "clash"
        sink: float = option(4.0, "a float under the same flag")

    with pytest.raises(TypeError, match="--sink"):
        command_line_options({"d2o": D2OParams, "clash": Clash})


@pytest.mark.parametrize("spec, options", [
    ("snapkv[question=42;window=8]", {"question": "42", "window": 8}),  # question is text, window an integer
    ("d2o[beta=1;sink=2]", {"beta": 1.0, "sink": 2}),
    ("am[on_policy=TRUE;ridge=0.5;ridge_to=selected]", {"on_policy": True, "ridge": 0.5, "ridge_to": "selected"}),
])
def test_spec_values_are_read_as_their_fields_types(spec, options):
    from kvpack.bench.specs import parse_method_spec

    name, got = parse_method_spec(spec)
    assert got == options and [type(v) for v in got.values()] == [type(v) for v in options.values()]


@pytest.mark.parametrize("spec, fragment", [
    ("am[on_policy=1]", "on_policy must be true or false, got '1'"),
    ("d2o[sink=two]", "sink must be an integer, got 'two'"),
    ("d2o[beta=high]", "beta must be a number, got 'high'"),
    ("d2o[budget=head]", "has no parameter 'budget'"),
])
def test_spec_values_of_the_wrong_type_are_input_errors(spec, fragment):
    from kvpack.bench.specs import parse_method_spec

    with pytest.raises(InputError, match=re.escape(fragment)):
        parse_method_spec(spec)


# ---------------------------------------------------------------------------------------------------------------
# budgets and selection (base)


def test_split_evenly_and_top_k_rows():
    assert split_evenly(10, 4).tolist() == [3, 3, 2, 2]
    assert split_evenly(0, 3).tolist() == [0, 0, 0]
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.1], [1.0, 1.0, 1.0, 1.0]])
    assert top_k_rows(scores, torch.tensor([2, 3])).tolist() == [[True, True, False, False],
                                                                [True, True, True, False]]


@pytest.mark.parametrize("weights, total, low, high", [
    ([1.0, 1.0, 1.0], 10, [0, 0, 0], [10, 10, 10]),
    ([5.0, 1.0, 0.1], 12, [2, 2, 2], [5, 10, 10]),      # layer 0 clamped at 5, the rest redistributed
    ([0.0, 0.0], 7, [0, 0], [4, 4]),                   # zero weights: equal
    ([1e-9, 1.0, 1e9], 30, [3, 3, 3], [10, 10, 10]),   # clamps at both ends
    ([0.3, 0.2, 0.5], 0, [0, 0, 0], [9, 9, 9]),
])
def test_fit_budgets_sum_exactly_within_bounds(weights, total, low, high):
    w, lo, hi = torch.tensor(weights), torch.tensor(low), torch.tensor(high)
    out = fit_budgets(w, total, lo, hi)
    assert int(out.sum()) == total and bool((out >= lo).all()) and bool((out <= hi).all())


def test_fit_budgets_is_proportional_when_unclamped_and_refuses_infeasible_bounds():
    out = fit_budgets(torch.tensor([1.0, 2.0, 3.0, 4.0]), 101, torch.zeros(4, dtype=torch.long),
                      torch.full((4,), 100))
    assert out.tolist() == [10, 20, 30, 41]  # floors of 10.1, 20.2, 30.3, 40.4; the largest remainder gets +1
    assert fit_budgets(torch.tensor([5.0, 1.0, 0.1]), 12, torch.tensor([2, 2, 2]),
                       torch.tensor([5, 10, 10])).tolist()[0] == 5
    with pytest.raises(ValueError):
        fit_budgets(torch.ones(2), 9, torch.zeros(2, dtype=torch.long), torch.full((2,), 4))


class _Scores(Method):
    name = "test-scores"
    scopes = SCOPES

    def __init__(self, budget):
        self.budget = budget


@pytest.mark.parametrize("scope", SCOPES)
def test_select_scopes_keep_exactly_the_budget(scope):
    torch.manual_seed(0)
    scores = torch.rand(3, 2, 11) * torch.tensor([1.0, 4.0, 0.2])[:, None, None]  # layers differ in scale
    keep = _Scores(scope).select(scores, 0.4)
    total = round(0.4 * scores.numel())
    assert int(keep.sum()) == total
    per_layer = keep.sum(dim=(1, 2))
    per_head = keep.sum(dim=2)
    if scope == "global":
        ref = torch.zeros(scores.numel(), dtype=torch.bool)
        ref[scores.flatten().argsort(descending=True)[:total]] = True
        assert torch.equal(keep.flatten(), ref)
    elif scope == "layer":
        assert per_layer.tolist() == split_evenly(total, 3).tolist()
        assert per_head.min() != per_head.max()  # heads of a layer share its budget unevenly
    else:
        assert int((per_head.max(1).values - per_head.min(1).values).max()) <= 1
        for l in range(3):
            for h in range(2):
                chosen = scores[l, h][keep[l, h]]
                assert chosen.min() >= scores[l, h][~keep[l, h]].max()


# ---------------------------------------------------------------------------------------------------------------
# scores against brute force


def _recorded_prefill(name, arch="qwen3", chunk_size=17, **options):
    """(method, prefill with the method's recorder, eager attentions [layers] of [1, heads, n, n])."""
    model, tok = tiny_model(arch)
    method = get_method(name, **options)
    layout = chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, TEXT[:220])
    spec = model_spec(model)
    full = prefill(model, ids, len(layout.prefix_ids(tok)), layout, spec, chunk_size,
                   recorder=method.recorder(spec, len(ids), "cpu"),
                   observed_ids=method.observed_ids(tok, layout))
    observed = method.observed_ids(tok, layout)
    with attention_implementation(model, "eager"):
        attn = model(input_ids=torch.tensor([ids + observed]), output_attentions=True).attentions
    return model, tok, method, full, attn


def _group_mean(x, kv_heads):  # [heads, ...] -> [kv_heads, ...]
    return x.reshape(kv_heads, -1, *x.shape[1:]).mean(1)


def test_h2o_scores_are_column_sums_per_visible_query():
    model, tok, method, full, attn = _recorded_prefill("h2o")
    n, sink = full.tokens, full.sink
    ref = torch.stack([_group_mean(a[0].sum(1), 2)[:, sink:] for a in attn])
    ref = ref / (n - torch.arange(sink, n)).float()
    torch.testing.assert_close(method.score(model, tok, full), ref, atol=1e-5, rtol=1e-4)


def test_d2o_scores_are_cumulative_attention_and_its_variance_is_normalised():
    model, tok, method, full, attn = _recorded_prefill("d2o")
    sink = full.sink
    cols = [a[0].sum(1) for a in attn]  # per query head [heads, n]
    ref = torch.stack([_group_mean(c, 2)[:, sink:] for c in cols])
    torch.testing.assert_close(method.score(model, tok, full), ref, atol=1e-4, rtol=1e-4)
    var = torch.stack([c[:, sink:].double().var(-1, unbiased=False) for c in cols])
    f = ((var - var.min()) / (var.max() - var.min())).mean(1)
    torch.testing.assert_close(layer_variance(full.stats.column_sums, sink), f, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [dict(window=6, kernel=3), dict(pooling="max", kernel=5, window=3),
                                     dict(question="What is the secret code of Alice?")])
def test_snapkv_scores_are_pooled_window_attention(options):
    model, tok, method, full, attn = _recorded_prefill("snapkv", **options)
    n, sink = full.tokens, full.sink
    question = options.get("question")
    w = 0 if question else options["window"]
    rows = slice(n, None) if question else slice(n - w, n)
    got = method.score(model, tok, full)
    for l, a in enumerate(attn):
        win = _group_mean(a[0, :, rows, sink:n].sum(1), 2)  # [kv_heads, context]
        body = win[:, : win.shape[1] - w]
        k = method.kernel
        padded = torch.nn.functional.pad(body, (k // 2, k // 2), value=0.0 if method.pooling == "avg"
                                         else float("-inf"))
        windows = padded.unfold(1, k, 1)
        ref = windows.mean(-1) if method.pooling == "avg" else windows.amax(-1)
        torch.testing.assert_close(got[l, :, : body.shape[1]], ref, atol=1e-5, rtol=1e-4)
        assert bool(torch.isinf(got[l, :, body.shape[1] :]).all())


def test_knorm_keeps_the_smallest_keys_and_streaming_the_sinks_and_the_tail():
    model, tok = tiny_model("llama")
    spec = model_spec(model)
    pack = kvpack.compress(model, tok, TEXT, method="streaming", ratio=RATIO, sink=4)
    n = pack.original_tokens
    for l in spec.compressed_layers:
        for h in range(pack.kv_heads):
            pos = pack.layers[l].head(h)[2].tolist()[pack.sink_tokens :]
            ctx = [p - pack.sink_tokens for p in pos]
            assert ctx[:4] == [0, 1, 2, 3] and pos[4:] == list(range(n - len(pos) + 4, n))
    layout = chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, TEXT)
    full = prefill(model, ids, len(layout.prefix_ids(tok)), layout, spec, 64)
    pack = kvpack.compress(model, tok, TEXT, method="knorm", ratio=RATIO)
    for l in spec.compressed_layers:
        for h in range(pack.kv_heads):
            norms = full.keys[l][h, full.sink :].norm(dim=-1)
            kept = pack.layers[l].head(h)[2][pack.sink_tokens :].long() - full.sink
            mask = torch.zeros_like(norms, dtype=torch.bool)
            mask[kept] = True
            assert norms[mask].max() <= norms[~mask].min()


def test_random_is_seeded():
    model, tok = tiny_model("llama")
    a = kvpack.compress(model, tok, TEXT, method="random", ratio=RATIO, seed=1)
    b = kvpack.compress(model, tok, TEXT, method="random", ratio=RATIO, seed=1)
    c = kvpack.compress(model, tok, TEXT, method="random", ratio=RATIO, seed=2)
    assert torch.equal(a.layers[0].positions, b.layers[0].positions)
    assert not torch.equal(a.layers[0].positions, c.layers[0].positions)


def test_pyramidkv_budgets_shrink_with_depth_and_sum_exactly():
    method = get_method("pyramidkv")
    scores = torch.zeros(6, 2, 500)
    total = round(0.3 * scores.numel())
    budgets = method.layer_budgets(None, scores, total)
    assert int(budgets.sum()) == total
    assert bool((budgets[1:] <= budgets[:-1]).all())
    top = total / (20 * 6)
    expected = torch.linspace(2 * total / 6 - top, top, 6)
    assert (budgets - expected).abs().max() <= 1
    flat = get_method("pyramidkv", beta=1.0).layer_budgets(None, scores, total)
    assert flat.tolist() == split_evenly(total, 6).tolist()


# ---------------------------------------------------------------------------------------------------------------
# D2O: budgets, token selection and the merge arithmetic


def test_d2o_layer_budgets_follow_softmax_of_minus_variance_and_sum_exactly():
    model, tok, method, full, _ = _recorded_prefill("d2o", arch="llama")
    scores = method.score(model, tok, full)
    total = round(0.3 * scores.numel())
    budgets = method.layer_budgets(full, scores, total)
    assert int(budgets.sum()) == total
    alpha = torch.softmax(-layer_variance(full.stats.column_sums, full.sink), 0)
    assert (budgets.double() - alpha * total).abs().max() <= 1  # no clamp binds here
    keep = method.select(scores, 0.3, full)
    assert keep.sum(dim=(1, 2)).tolist() == budgets.tolist()


def test_d2o_layer_budgets_are_clamped_and_redistributed():
    method = D2O(sink=4)
    cols = [torch.rand(4, 103), torch.rand(4, 103) * 50, torch.rand(4, 103) * 1e3]  # dense .. sparse layers

    class _Stats:
        column_sums = cols

    class _Prefill:
        stats, sink = _Stats, 3

    scores = torch.zeros(3, 2, 100)
    for ratio in (0.01, 0.3, 0.95):
        total = round(ratio * scores.numel())
        b = method.layer_budgets(_Prefill, scores, total)
        assert int(b.sum()) == total and bool((b <= 200).all()) and bool((b >= min(2 * 5, total // 3)).all())


def test_d2o_keeps_sinks_recent_window_and_heavy_hitters_per_head():
    method = D2O(sink=2, recent_ratio=0.25)
    scores = torch.zeros(1, 2, 20)
    scores[0, 0, 5] = scores[0, 0, 9] = scores[0, 0, 11] = 1.0
    scores[0, 1, 3] = 2.0
    keep = method.select_heads(scores, torch.tensor([[10, 2]]))
    # head 0: 2 sinks, M = round(0.25 x 8) = 2 recent, N = 6: 3 heavy hitters then ties by index (2, 3, 4)
    assert keep[0, 0].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4, 5, 9, 11, 18, 19]
    assert keep[0, 1].nonzero().squeeze(1).tolist() == [0, 1]  # budget 2: sinks only


def _ema_loop(sims, beta):
    tau = sum(sims) / len(sims)
    out = []
    for s in sims:
        out.append(tau)
        tau = beta * s + (1 - beta) * tau
    return out


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.7, 1.0])
def test_ema_thresholds_match_the_recurrence(beta, monkeypatch):
    monkeypatch.setattr("kvpack.methods.d2o.EMA_BLOCK", 4)  # several blocks
    sims = torch.rand(11, generator=torch.Generator().manual_seed(1)) * 2 - 1
    torch.testing.assert_close(ema_thresholds(sims, beta), torch.tensor(_ema_loop(sims.tolist(), beta),
                                                                          dtype=torch.float64))


@pytest.mark.parametrize("kept", [1, 63, 64, 65, 200])
def test_nearest_kept_is_the_first_argmax_of_the_cosine_similarities(kept):
    """The two-stage argmax equals ``max(dim=1)`` of the similarity matrix, ties to the first index included
    (duplicated kept keys make exact ties, in the same group, across groups and in the partial last group)."""
    g = torch.Generator().manual_seed(kept)
    kept_k = torch.randn(kept, 16, generator=g)
    if kept > 1:
        kept_k[kept - 1] = kept_k[0]  # a copy: exactly the same similarity as entry 0
    if kept > 64:
        kept_k[64] = kept_k[5]
    ev_k = torch.randn(300, 16, generator=g)
    ev_k[:20] = kept_k[(torch.arange(20) * 5) % kept]  # the most similar to a kept key and to its copies
    sims, nearest = nearest_kept(ev_k, kept_k)
    ref = (torch.nn.functional.normalize(ev_k, dim=-1) @ torch.nn.functional.normalize(kept_k, dim=-1).T).max(dim=1)
    torch.testing.assert_close(sims, ref.values)
    assert torch.equal(nearest, ref.indices)
    if kept > 1:
        assert int((nearest == kept - 1).sum()) == 0  # the copy of entry 0 never wins: entry 0 comes first
        assert int((nearest == 0).sum()) >= 1


def test_merge_arithmetic_on_hand_built_tensors():
    """Three kept keys along the axes, five evicted keys in position order; merged or dropped by the EMA
    threshold, merged ones folded into their nearest kept key with weights exp(similarity), the kept one e."""
    kept_k = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    kept_v = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    ev_k = torch.tensor([[2.0, 0.1, 0.0],    # -> kept 0, sim ~0.999
                         [0.0, -1.0, 0.1],   # nearest kept 2, sim ~0.0995 (low: dropped)
                         [0.0, 1.0, 1.0],    # tie between kept 1 and 2 (0.707): first wins
                         [1.0, 1.0, 0.0],    # 0.707 to kept 0
                         [0.0, 0.2, 1.0]])   # -> kept 2, sim ~0.981
    ev_v = torch.arange(10, dtype=torch.float32).view(5, 2)
    beta = 0.7
    keys, values, merged = merge_evicted(kept_k, kept_v, ev_k, ev_v, beta)

    # reference, written from the formula
    sims = torch.nn.functional.normalize(ev_k, dim=-1) @ torch.nn.functional.normalize(kept_k, dim=-1).T
    best, nearest = sims.max(1)
    thresholds = _ema_loop(best.tolist(), beta)
    ref_merged = [s >= t for s, t in zip(best.tolist(), thresholds)]
    assert merged.tolist() == ref_merged
    assert ref_merged[1] is False and nearest[2] == 1  # the low-similarity entry is dropped; ties go first
    ref_k, ref_v = kept_k.clone(), kept_v.clone()
    for c in range(3):
        idx = [i for i in range(5) if ref_merged[i] and nearest[i] == c]
        w = [math.exp(best[i]) for i in idx]
        den = math.e + sum(w)
        ref_k[c] = (math.e * kept_k[c] + sum(wi * ev_k[i] for wi, i in zip(w, idx))) / den
        ref_v[c] = (math.e * kept_v[c] + sum(wi * ev_v[i] for wi, i in zip(w, idx))) / den
    torch.testing.assert_close(keys, ref_k)
    torch.testing.assert_close(values, ref_v)


def test_d2o_without_merge_is_its_eviction_and_merging_changes_only_kept_rows():
    model, tok = tiny_model("llama")
    spec = model_spec(model)
    evict = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="d2o", ratio=RATIO, merge="off")
    merged = kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="d2o", ratio=RATIO)
    assert merged.metadata["method_params"]["merge"] == "keys+values"  # the paper's merge is the default
    stats = merged.metadata["stats"]["merge"]
    assert stats["merged"] > 0 and stats["merged"] + stats["dropped"] == \
        evict.metadata["stats"]["context_entries"] - evict.metadata["stats"]["context_entries_kept"]
    assert "merge" not in evict.metadata["stats"]
    for l in spec.compressed_layers:
        a, b = evict.layers[l], merged.layers[l]
        assert torch.equal(a.positions, b.positions) and torch.equal(a.head_lengths, b.head_lengths)
        changed = (a.keys != b.keys).any(dim=1)
        assert bool(changed.any())
        for h in range(evict.kv_heads):  # the template prefix (the attention sink) is never a merge target
            start = int(a.head_offsets()[h])
            assert not bool(changed[start : start + evict.sink_tokens].any())
    # the eviction alone keeps the full cache's entries untouched (the masked-reference check of _check_pack)
    layout = chat_layout(tok)
    ids = layout.prefix_ids(tok) + layout.encode(tok, TEXT)
    full = prefill(model, ids, len(layout.prefix_ids(tok)), layout, spec, 64)
    for l in spec.compressed_layers:
        for h in range(evict.kv_heads):
            k, _, pos = evict.layers[l].head(h)
            torch.testing.assert_close(k, full.keys[l][h, pos.long()])


def test_d2o_merge_values_changes_only_values_by_the_same_weights():
    model, tok = tiny_model("llama")
    spec = model_spec(model)
    packs = {mode: kvpack.compress(model, tok, TEXT, kv_dtype="float32", method="d2o", ratio=RATIO, merge=mode)
             for mode in ("off", "values", "keys+values")}
    stats = {mode: p.metadata["stats"].get("merge") for mode, p in packs.items()}
    assert stats["off"] is None and stats["values"]["mode"] == "values"
    assert {k: v for k, v in stats["values"].items() if k != "mode"} == \
        {k: v for k, v in stats["keys+values"].items() if k != "mode"}  # the same entries are merged
    for l in spec.compressed_layers:
        off, val, both = (packs[m].layers[l] for m in ("off", "values", "keys+values"))
        assert torch.equal(val.keys, off.keys)  # keys stay as prefilled
        assert torch.equal(val.values, both.values)  # values merged exactly as in the paper's mode
        assert not torch.equal(val.values, off.values) and not torch.equal(both.keys, off.keys)
    # the earlier boolean option still reads as the paper's merge / the eviction alone
    assert get_method("d2o", merge=True).merge == "keys+values" and get_method("d2o", merge=False).merge == "off"
