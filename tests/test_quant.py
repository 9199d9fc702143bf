"""The reference KV quantization codec (``kvpack.quant``, KIVI layout, arXiv 2402.02750): properties, layout
rules, and the codec inside packs, the loader and ``kvpack.compress``."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack import constants as C
from kvpack.cache import KvpackCache
from kvpack.errors import InputError
from kvpack.fileformat import load_pack, pack_to_bytes
from kvpack.pack import LayerEntries, Pack
from kvpack.quant import (
    check_quant_args,
    dequantize_keys,
    dequantize_values,
    pack_codes,
    quantize_keys,
    quantize_layer,
    quantize_pack,
    quantize_values,
    split_lengths,
    unpack_codes,
)

from .tiny import TEXT, tiny_model

QTYPES = ("int8", "int4")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _key_bound(scales: torch.Tensor, g: int) -> torch.Tensor:
    return scales.float().repeat_interleave(g, dim=0) / 2


def _value_bound(scales: torch.Tensor, dv: int) -> torch.Tensor:
    return scales.float().repeat_interleave(dv // scales.shape[1], dim=1) / 2


def _assert_within(err: torch.Tensor, bound: torch.Tensor, x: torch.Tensor) -> None:
    """|error| <= scale / 2, up to float32 rounding of the dequantization (a few ulps of x); a constant group
    (scale 0) dequantizes to x rounded to float16."""
    bound = torch.where(bound == 0, (x - x.half().float()).abs(), bound)
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs() + bound * 2)
    over = err - bound - slack
    if (over > 0).any():
        i = tuple(int(j) for j in (over > 0).nonzero()[0])
        raise AssertionError(f"first element over the bound at {i}: error {err[i]}, bound {bound[i]}, x {x[i]}")


# --- the group codec ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("g", [1, 4, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keys_round_trip_within_half_a_scale(qtype, g, dtype):
    x = (torch.randn(2 * g, 6, generator=_gen(g)) * 3).to(dtype)
    codes, scales, mins = quantize_keys(x, qtype, g)
    assert codes.dtype == torch.uint8 and codes.shape == (2 * g, 6 // C.QUANT_TYPES[qtype].codes_per_byte)
    assert scales.dtype == mins.dtype == torch.float16 and scales.shape == mins.shape == (2, 6)
    y = dequantize_keys(codes, scales, mins, qtype, g)
    assert y.dtype == torch.float32 and y.shape == x.shape
    _assert_within((y - x.float()).abs(), _key_bound(scales, g), x.float())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("g,dv", [(32, 32), (32, 64), (64, 32), (128, 96), (4, 12), (2, 2)])
def test_values_round_trip_within_half_a_scale(qtype, g, dv):
    x = torch.randn(7, dv, generator=_gen(dv)) * 2  # odd row count: values have no row grouping
    codes, scales, mins = quantize_values(x, qtype, g)
    gv = min(g, dv)
    assert codes.shape == (7, dv // C.QUANT_TYPES[qtype].codes_per_byte) and scales.shape == (7, dv // gv)
    y = dequantize_values(codes, scales, mins, qtype, g)
    _assert_within((y - x).abs(), _value_bound(scales, dv), x)


def test_int8_is_tighter_than_int4():
    x = torch.randn(64, 32, generator=_gen(1))
    errs = {}
    for qtype in QTYPES:
        k = dequantize_keys(*quantize_keys(x, qtype, 32), qtype, 32)
        v = dequantize_values(*quantize_values(x, qtype, 32), qtype, 32)
        errs[qtype] = ((k - x).abs().mean(), (v - x).abs().mean(), (k - x).abs().max())
    for a, b in zip(errs["int8"], errs["int4"]):
        assert a * 8 < b  # 255 vs 15 levels: about 17x finer


def test_outlier_heavy_tensors_keep_the_bound_and_per_channel_keys_isolate_outlier_channels():
    """Keys have outlier channels (KIVI, arXiv 2402.02750): per-channel groups keep the other channels precise."""
    x = torch.randn(64, 16, generator=_gen(2))
    x[:, 3] *= 100.0  # an outlier channel
    x[10, 7] = 500.0  # a single outlier element
    codes, scales, mins = quantize_keys(x, "int4", 32)
    y = dequantize_keys(codes, scales, mins, "int4", 32)
    _assert_within((y - x).abs(), _key_bound(scales, 32), x)
    normal = [c for c in range(16) if c not in (3, 7)]
    assert (y - x)[:, normal].abs().max() < 0.5  # untouched by the outliers
    vcodes, vscales, vmins = quantize_values(x, "int4", 16)
    yv = dequantize_values(vcodes, vscales, vmins, "int4", 16)
    _assert_within((yv - x).abs(), _value_bound(vscales, 16), x)


def test_all_zero_and_constant_groups_are_exact():
    x = torch.zeros(32, 4)
    x[:, 1] = 1.5
    x[:, 2] = -0.375
    x[:, 3] = torch.linspace(-1, 1, 32)
    for qtype in QTYPES:
        codes, scales, mins = quantize_keys(x, qtype, 32)
        assert scales[0, :3].tolist() == [0.0, 0.0, 0.0] and mins[0, :3].tolist() == [0.0, 1.5, -0.375]
        y = dequantize_keys(codes, scales, mins, qtype, 32)
        assert torch.equal(y[:, :3], x[:, :3])
        vcodes, vscales, vmins = quantize_values(torch.full((3, 8), 2.25), qtype, 4)
        assert torch.equal(dequantize_values(vcodes, vscales, vmins, qtype, 4), torch.full((3, 8), 2.25))
        assert vscales.abs().sum() == 0


def test_group_extremes_are_exact_when_representable():
    """min rounds down and scale up, so an fp16-exact group minimum is reproduced exactly."""
    x = torch.tensor([[0.0], [0.25], [1.0], [3.75]]).repeat(8, 2)  # 32 rows, 2 channels
    for qtype in QTYPES:
        y = dequantize_keys(*quantize_keys(x, qtype, 32), qtype, 32)
        assert y.min() == 0.0 and (y.max() - 3.75).abs() <= 3.75 / C.QUANT_TYPES[qtype].levels / 2


def test_values_beyond_float16_are_clamped_not_nan():
    x = torch.tensor([[1e6, -1e6, 0.0, 1.0]])
    codes, scales, mins = quantize_values(x, "int8", 4)
    assert torch.isfinite(scales).all() and torch.isfinite(mins).all()
    assert float(mins.abs().max()) <= C.QUANT_PARAM_MAX and float(scales.max()) <= C.QUANT_PARAM_MAX
    assert torch.isfinite(dequantize_values(codes, scales, mins, "int8", 4)).all()


def test_nibble_packing_order():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    packed = pack_codes(codes, "int4")
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]  # even channel low nibble, odd channel high nibble
    assert torch.equal(unpack_codes(packed, "int4"), codes)
    assert torch.equal(pack_codes(codes, "int8"), codes)
    k = torch.tensor([[0.0, 15.0]] + [[15.0, 0.0]] * 31)  # 32 rows, 2 channels, scale 1, min 0
    kc, ks, km = quantize_keys(k, "int4", 32)
    assert ks.tolist() == [[1.0, 1.0]] and kc[0].tolist() == [0xF0] and kc[1].tolist() == [0x0F]


@pytest.mark.parametrize("bad", [
    dict(qtype="int3"), dict(qtype="none"), dict(group_size=0), dict(group_size=True), dict(group_size=2.0),
    dict(head_dim=5), dict(head_dim_v=7), dict(group_size=32, head_dim_v=48),
])
def test_bad_settings_are_input_errors(bad):
    args = dict(qtype="int4", group_size=32, head_dim=8, head_dim_v=8) | bad
    with pytest.raises(InputError):
        check_quant_args(args.pop("qtype"), args.pop("group_size"), **args)


def test_shape_and_value_errors():
    with pytest.raises(InputError, match="multiple of group_size"):
        quantize_keys(torch.zeros(33, 4), "int4", 32)
    with pytest.raises(InputError, match="NaN"):
        quantize_values(torch.tensor([[float("nan"), 0.0]]), "int8", 2)
    with pytest.raises(InputError, match="even|multiple of 2"):
        quantize_values(torch.zeros(2, 3), "int4", 3)
    with pytest.raises(InputError, match="one of"):
        check_quant_args("int4", 16, allowed_group_sizes=C.GROUP_SIZES)


def test_quantization_is_deterministic():
    x = torch.randn(64, 8, generator=_gen(3))
    a, b = quantize_keys(x, "int4", 32), quantize_keys(x.clone(), "int4", 32)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


# --- layers: sinks, short heads, residuals ----------------------------------------------------------------------


def _layer(head_positions: list[list[int]], d: int = 8, dv: int = 8, seed: int = 0,
           dtype: torch.dtype = torch.float32) -> LayerEntries:
    g = _gen(seed)
    n = sum(map(len, head_positions))
    return LayerEntries(
        keys=torch.randn(n, d, generator=g).to(dtype),
        values=torch.randn(n, dv, generator=g).to(dtype),
        positions=torch.tensor([p for h in head_positions for p in h], dtype=torch.int32),
        head_lengths=torch.tensor([len(h) for h in head_positions], dtype=torch.int64),
    )


HEADS = [
    [0, 1, 2, *range(10, 80)],  # 3 sink rows, 64 body rows, 6 residual rows
    [0, 1, 2, *range(5, 30)],  # 25 non-sink rows < G: nothing quantized
    list(range(40, 72)),  # no sink, exactly one group, no residual
    [],  # an empty head
    [1, *range(4, 36)],  # 1 sink row (position 1 < 3), 32 body rows
]


def test_split_lengths_follow_the_layout_rule():
    layer = _layer(HEADS)
    sink, body, resid = split_lengths(layer.positions, layer.head_lengths, 3, 32)
    assert sink.tolist() == [3, 3, 0, 0, 1]
    assert body.tolist() == [64, 0, 32, 0, 32]
    assert resid.tolist() == [6, 25, 0, 0, 0]


@pytest.mark.parametrize("qtype", QTYPES)
def test_sinks_short_heads_and_residuals_stay_exact(qtype):
    layer = _layer(HEADS)
    q = quantize_layer(layer, 3, qtype, 32, "kivi")
    assert q.quant.rows == 128 and q.keys.shape == (layer.num_entries - 128, 8)
    assert torch.equal(q.positions, layer.positions) and torch.equal(q.head_lengths, layer.head_lengths)
    deq = q.dequantized()
    sink, body, _ = split_lengths(layer.positions, layer.head_lengths, 3, 32)
    off = layer.head_offsets()
    exact = torch.ones(layer.num_entries, dtype=torch.bool)
    for h in range(len(HEADS)):
        s = int(off[h]) + int(sink[h])
        exact[s : s + int(body[h])] = False
    assert torch.equal(deq.keys[exact], layer.keys[exact]) and torch.equal(deq.values[exact], layer.values[exact])
    assert not torch.equal(deq.keys[~exact], layer.keys[~exact])
    # the full-precision rows are stored sink rows then residual rows, head by head, in position order
    assert torch.equal(q.keys, layer.keys[exact])
    # body rows of head 0 then 2 then 4, each quantized in its own groups
    body_keys = layer.keys[~exact]
    assert torch.equal(q.quant.key_codes, quantize_keys(body_keys, qtype, 32)[0])
    head2 = layer.keys[int(off[2]) : int(off[3])]
    assert torch.equal(q.quant.key_codes[64:96], quantize_keys(head2, qtype, 32)[0])
    # head(h) dequantizes
    assert torch.equal(q.head(0)[0], deq.keys[: int(off[1])])


def test_quantize_pack_records_errors_and_leaves_the_input_alone():
    pack = Pack(torch.arange(80), [_layer(HEADS, seed=1), _layer(HEADS[::-1], seed=2)], 3, {"stats": {"a": 1}})
    q = quantize_pack(pack, "int4", 32, "kivi")
    assert pack.layers[0].quant is None and "quant_error" not in pack.metadata["stats"]
    errors = q.metadata["stats"]["quant_error"]
    assert q.metadata["stats"]["a"] == 1 and [e["layer"] for e in errors] == [0, 1]
    for e, layer, ql in zip(errors, pack.layers, q.layers):
        deq = ql.dequantized(torch.float32)
        assert e["key_max_abs"] == pytest.approx(float((deq.keys - layer.keys).abs().max()), rel=1e-3)
        assert e["value_mean_abs"] == pytest.approx(float((deq.values - layer.values).abs().mean()), rel=1e-3)
        assert e["quantized_fraction"] == pytest.approx(128 / layer.num_entries, rel=1e-3)
    assert quantize_pack(pack, "none") is pack
    with pytest.raises(InputError, match="already quantized"):
        quantize_pack(q, "int4", 32)


# --- loader ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("zstd", [0, 3])
def test_loader_dequantizes_exactly_like_the_codec(qtype, zstd):
    layers = [_layer(HEADS, dtype=torch.float16), _layer(HEADS[::-1], seed=5, dtype=torch.float16)]
    pack = Pack(torch.arange(80), layers, 3, {})
    q = quantize_pack(pack, qtype, 32, "kivi")
    loaded = load_pack(pack_to_bytes(q, zstd))
    cache = KvpackCache.from_pack(loaded, dtype=torch.float32)
    for layer, ql in zip(cache.layers, q.layers):
        deq = ql.dequantized(torch.float32)
        assert torch.equal(layer.kept_keys, deq.keys) and torch.equal(layer.kept_values, deq.values)
        assert torch.equal(layer.kept_positions, ql.positions.long())
        assert torch.equal(layer.offsets, ql.head_offsets())
        # the codec's own functions give the same body rows
        qr = ql.quant
        body = dequantize_keys(qr.key_codes, qr.key_scales, qr.key_mins, qtype, 32)
        assert torch.equal(body, deq.keys[~torch.isin(torch.arange(ql.num_entries), _fp_rows(ql))])


def _fp_rows(layer: LayerEntries) -> torch.Tensor:
    """Row indices (heads back to back) of the full-precision rows."""
    off, qr = layer.head_offsets(), layer.quant
    rows = []
    for h in range(len(layer.head_lengths)):
        s, b, n = int(qr.sink_lengths[h]), int(qr.body_lengths[h]), int(layer.head_lengths[h])
        rows += list(range(int(off[h]), int(off[h]) + s)) + list(range(int(off[h]) + s + b, int(off[h]) + n))
    return torch.tensor(rows, dtype=torch.int64)


# --- kvpack.compress on a tiny model ----------------------------------------------------------------------------


def test_compress_quantizes_after_selection_and_packs_save_load_and_generate(tmp_path):
    model, tok = tiny_model("llama")
    text = TEXT * 3
    plain = kvpack.compress(model, tok, text, ratio=0.5, chunk_size=64)
    kivi = kvpack.compress(model, tok, text, ratio=0.5, chunk_size=64, quant="int4", group_size=32, quant_layout="kivi")
    assert pack_to_bytes(kivi) == pack_to_bytes(quantize_pack(plain, "int4", 32, "kivi"))  # same selection, quantized
    q = kvpack.compress(model, tok, text, ratio=0.5, chunk_size=64, quant="int4", group_size=32)
    assert all(l.quant.layout == "compact" for l in q.layers)
    for a, b in zip(plain.layers, q.layers):  # the same selection; the compact layout quantizes every non-sink row
        assert torch.equal(a.positions, b.positions) and b.keys.shape[0] == b.num_entries - b.quant.rows
    assert sum(l.quant.rows for l in q.layers) > 0
    errors = q.metadata["stats"]["quant_error"]
    assert len(errors) == len(q.layers) and all(e["key_max_abs"] > 0 for e in errors)
    sizes = {}
    for name, pack, level in (("plain", plain, 0), ("int4", q, 0), ("int4+zstd", q, 3)):
        path = tmp_path / f"{name}.kvpack"
        sizes[name] = kvpack.save(pack, path, zstd_level=level)
        cache = kvpack.load(path, model, tokenizer=tok)
        answer = kvpack.generate(model, tok, cache, "What is the secret code of Alice?", max_new_tokens=8)
        assert isinstance(answer, str)
    assert sizes["int4+zstd"] < sizes["int4"] < sizes["plain"] / 2.5  # float32 KV -> int4 + scales


def test_compress_refuses_bad_quant_settings_before_prefilling():
    model, tok = tiny_model("llama")
    for kwargs in (dict(quant="int2"), dict(quant="int4", group_size=16), dict(quant="int4", group_size="32")):
        with pytest.raises(InputError):
            kvpack.compress(model, tok, TEXT, **kwargs)
