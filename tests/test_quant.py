"""Pack-level quantization (``kvpack.quant``, the compact layout; KIVI grouping, arXiv 2402.02750): settings, layout
rules, and the codec inside packs, the loader and ``kvpack.compress``."""

from __future__ import annotations

import pytest
import torch

import kvpack
from kvpack import settings as S
from kvpack.cache import KvpackCache
from kvpack.errors import InputError
from kvpack.fileformat import load_pack, pack_to_bytes
from kvpack.pack import LayerEntries, Pack
from kvpack.quant import (
    check_quant_args,
    compact_split,
    dequantize_rows,
    pack_codes,
    quantize_layer,
    quantize_pack,
    unpack_codes,
)

from .tiny import TEXT, tiny_model

QTYPES = ("int8", "int4")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- settings and packing ---------------------------------------------------------------------------------------


def test_nibble_packing_order():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    packed = pack_codes(codes, "int4")
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]  # even channel low nibble, odd channel high nibble
    assert torch.equal(unpack_codes(packed, "int4"), codes)
    assert torch.equal(pack_codes(codes, "int8"), codes)


@pytest.mark.parametrize("bad", [
    dict(qtype="int3"), dict(qtype="none"), dict(group_size=0), dict(group_size=True), dict(group_size=2.0),
    dict(head_dim=5), dict(head_dim_v=7), dict(group_size=32, head_dim_v=48),
])
def test_bad_settings_are_input_errors(bad):
    args = dict(qtype="int4", group_size=32, head_dim=8, head_dim_v=8) | bad
    with pytest.raises(InputError):
        check_quant_args(args.pop("qtype"), args.pop("group_size"), **args)


def test_group_size_outside_the_accepted_ones():
    with pytest.raises(InputError, match="one of"):
        check_quant_args("int4", 16, allowed_group_sizes=S.GROUP_SIZES)


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
    [0, 1, 2, *range(10, 80)],  # 3 sink rows, 70 body rows (a 6-row last key group)
    [0, 1, 2, *range(5, 30)],  # 25 non-sink rows < G: nothing quantized
    list(range(40, 72)),  # no sink, exactly one group
    [],  # an empty head
    [1, *range(4, 36)],  # 1 sink row (position 1 < 3), 32 body rows
]
BODY_ROWS = 70 + 32 + 32


def test_split_follows_the_layout_rule():
    layer = _layer(HEADS)
    sink, body = compact_split(layer.positions, layer.head_lengths, 3, 32)
    assert sink.tolist() == [3, 3, 0, 0, 1]
    assert body.tolist() == [70, 0, 32, 0, 32]


@pytest.mark.parametrize("qtype", QTYPES)
def test_sinks_and_short_heads_stay_exact(qtype):
    layer = _layer(HEADS)
    q = quantize_layer(layer, 3, qtype, 32)
    assert q.quant.rows == BODY_ROWS and q.keys.shape == (layer.num_entries - BODY_ROWS, 8)
    assert torch.equal(q.positions, layer.positions) and torch.equal(q.head_lengths, layer.head_lengths)
    deq = q.dequantized()
    sink, body = compact_split(layer.positions, layer.head_lengths, 3, 32)
    off = layer.head_offsets()
    exact = torch.ones(layer.num_entries, dtype=torch.bool)
    for h in range(len(HEADS)):
        s = int(off[h]) + int(sink[h])
        exact[s : s + int(body[h])] = False
    assert torch.equal(deq.keys[exact], layer.keys[exact]) and torch.equal(deq.values[exact], layer.values[exact])
    assert not torch.equal(deq.keys[~exact], layer.keys[~exact])
    assert torch.equal(q.keys, layer.keys[exact])  # full-precision rows, head by head, in position order
    keys, values = dequantize_rows(q.quant)
    assert torch.equal(keys, deq.keys[~exact]) and torch.equal(values, deq.values[~exact])
    assert torch.equal(q.head(0)[0], deq.keys[: int(off[1])])


def test_quantize_pack_records_errors_and_leaves_the_input_alone():
    pack = Pack(torch.arange(80), [_layer(HEADS, seed=1), _layer(HEADS[::-1], seed=2)], 3, {"stats": {"a": 1}})
    q = quantize_pack(pack, "int4", 32)
    assert pack.layers[0].quant is None and "quant_error" not in pack.metadata["stats"]
    errors = q.metadata["stats"]["quant_error"]
    assert q.metadata["stats"]["a"] == 1 and [e["layer"] for e in errors] == [0, 1]
    for e, layer, ql in zip(errors, pack.layers, q.layers):
        deq = ql.dequantized(torch.float32)
        assert e["key_max_abs"] == pytest.approx(float((deq.keys - layer.keys).abs().max()), rel=1e-3)
        assert e["value_mean_abs"] == pytest.approx(float((deq.values - layer.values).abs().mean()), rel=1e-3)
        assert e["quantized_fraction"] == pytest.approx(BODY_ROWS / layer.num_entries, rel=1e-3)
    assert quantize_pack(pack, "none") is pack
    with pytest.raises(InputError, match="already quantized"):
        quantize_pack(q, "int4", 32)


# --- loader ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("zstd", [0, 3])
def test_loader_dequantizes_exactly_like_the_codec(qtype, zstd):
    layers = [_layer(HEADS, dtype=torch.float16), _layer(HEADS[::-1], seed=5, dtype=torch.float16)]
    pack = Pack(torch.arange(80), layers, 3, {})
    q = quantize_pack(pack, qtype, 32)
    loaded = load_pack(pack_to_bytes(q, zstd))
    cache = KvpackCache.from_pack(loaded, dtype=torch.float32)
    for layer, ql in zip(cache.layers, q.layers):
        deq = ql.dequantized(torch.float32)
        assert torch.equal(layer.kept_keys, deq.keys) and torch.equal(layer.kept_values, deq.values)
        assert torch.equal(layer.kept_positions, ql.positions.long())
        assert torch.equal(layer.offsets, ql.head_offsets())
        # the codec's own functions give the same body rows
        body = dequantize_rows(ql.quant)[0]
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
