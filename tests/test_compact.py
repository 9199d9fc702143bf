"""The compact quantized layout of format 1.0 (``kvpack.compact``): widths, bit strings, grids, layers, files."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

import kvpack
from kvpack import constants as C
from kvpack.compact import (
    allocate_widths,
    compact_problem,
    compact_split,
    group_index,
    min_codes,
    min_grid,
    min_values,
    pack_bits,
    scale_codes,
    scale_table,
    unpack_bits,
)
from kvpack.errors import InputError
from kvpack.fileformat import load_pack, pack_to_bytes, read_header
from kvpack.pack import LayerEntries, Pack
from kvpack.quant import dequantize_rows, pack_codes, quantize_layer, quantize_pack

from .golden_packs import GOLDEN_DIR, golden_int4, golden_unquantized_for_int
from .test_fileformat import assert_packs_equal
from .tiny import ARCHITECTURES, TEXT, tiny_model


# --- key code widths --------------------------------------------------------------------------------------------


def _objective(w: torch.Tensor, bits: torch.Tensor) -> float:
    return float((w * torch.pow(4.0, -bits.double())).sum())


def test_allocation_is_optimal_against_exhaustive_search():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        w = torch.rand(1, 4, generator=gen, dtype=torch.float64) ** 4 * 100
        got = allocate_widths(w, 4)[0]
        assert int(got.sum()) == 16 and int(got.min()) >= 2 and int(got.max()) <= 8
        best = min(_objective(w[0], torch.tensor(c)) for c in itertools.product(range(2, 9), repeat=4)
                   if sum(c) == 16)
        assert _objective(w[0], got) == pytest.approx(best, rel=1e-12)


def test_allocation_edge_cases():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1e6, 0.0, 0.0, 0.0], [float("nan"), 1, 1, 1]])
    got = allocate_widths(w, 4)
    assert got[0].tolist() == [4, 4, 4, 4]  # equal weights: one width
    assert got[1].tolist() == [4, 4, 4, 4]  # no query energy: one width
    assert got[2].tolist() == [8, 4, 2, 2]  # one dominant channel takes the most bits (ties: lowest channel)
    assert got[3].tolist() == [4, 4, 4, 4]  # not finite: one width
    assert allocate_widths(torch.rand(3, 8), 8).tolist() == [[8] * 8] * 3  # int8: nothing to move


# --- bit strings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 1, 7])
def test_bit_strings_round_trip_any_widths(rows):
    gen = torch.Generator().manual_seed(rows)
    for widths in ([1, 7, 8, 8, 4, 4, 2, 6], [3, 5, 3, 5, 3, 5, 3, 5], [8] * 8):
        w = torch.tensor(widths)
        codes = (torch.rand(rows, 8, generator=gen) * 2.0 ** w).floor().long()
        packed = pack_bits(codes, w)
        assert packed.dtype == torch.uint8 and packed.shape == (rows, sum(widths) // 8)
        assert torch.equal(unpack_bits(packed, w), codes.float())


def test_uniform_widths_are_the_nibble_packing():
    codes = torch.randint(0, 16, (5, 6))
    assert torch.equal(pack_bits(codes, torch.full((6,), 4)), pack_codes(codes, "int4"))
    codes = torch.randint(0, 256, (5, 6))
    assert torch.equal(pack_bits(codes, torch.full((6,), 8)), pack_codes(codes, "int8"))


def test_bit_order_is_little_endian_channel_first():
    # channel 0: 3 bits = 0b101, channel 1: 5 bits = 0b10011 -> row bits 1,0,1, 1,1,0,0,1 -> byte 0b10011101
    assert pack_bits(torch.tensor([[5, 19]]), torch.tensor([3, 5])).tolist() == [[0b10011101]]


# --- parameter grids ----------------------------------------------------------------------------------------------


def test_scale_codes_round_up_to_the_nearest_grid_scale():
    needed = torch.tensor([[0.0, 1e-9], [0.5, 3.0], [0.013, 7.0], [0.25, 0.001]], dtype=torch.float64)
    codes, scales, base = scale_codes(needed)
    table = scale_table(base)
    assert torch.equal(scales, table.gather(1, codes.long().t()).t())
    assert bool((scales.double() >= needed).all())
    below = table.gather(1, (codes.long() - 1).clamp(min=0).t()).t().double()
    assert bool(((codes == 0) | (below < needed)).all())  # the smallest code that covers
    assert codes[0, 0] == 0 and scales[0, 0] == 0  # a constant group: scale 0
    assert int(codes[2, 1]) == 255  # the column's largest scale takes the top code
    k = torch.arange(1, 256)
    mult = (32 + (k & 31)).double() * torch.pow(2.0, (k >> 5).double() - 12)
    assert torch.equal(table[:, 1:], (base.double()[:, None] * mult).float())  # one float32 rounding
    assert bool((table[:, 1:].diff(dim=1) > 0).all())


def test_min_codes_round_down_onto_the_grid():
    mins = torch.tensor([[-3.0, 1.5, 0.0], [2.7, 1.5, -0.1], [0.3333, 1.5, 5.0]], dtype=torch.float64)
    base, step = min_grid(mins)
    codes, stored = min_codes(mins, base, step)
    assert bool((stored.double() <= mins).all())
    above = (codes.float() + 1) * step + base
    assert bool(((codes == 255) | (step == 0) | (above.double() > mins)).all())  # the largest code not above
    assert step[1] == 0 and bool((codes[:, 1] == 0).all()) and bool((stored[:, 1] == 1.5).all())


def test_group_index_gives_partial_last_groups():
    gidx, head_of_group = group_index(torch.tensor([5, 0, 2, 4]), 2)
    assert gidx.tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 4, 5, 5]
    assert head_of_group.tolist() == [0, 0, 0, 2, 3, 3]


# --- layers ---------------------------------------------------------------------------------------------------------


def _layer(lengths, d=8, dv=8, sink=2, seed=0, outliers=True) -> LayerEntries:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    keys = torch.randn(n, d, generator=gen) * torch.linspace(0.1, 4.0, d)
    values = torch.randn(n, dv, generator=gen)
    if outliers and n > 3:
        keys[3, 0], values[2, 1] = 60.0, -40.0
        keys[:, d - 1] = 0.75  # a constant channel: scale-0 groups
    positions = torch.cat([torch.arange(m) for m in lengths]).to(torch.int32)
    return LayerEntries(keys, values, positions, torch.tensor(lengths))


def _check_bound(layer: LayerEntries, q: LayerEntries) -> None:
    """Every quantized element is within scale/2 of its original (float32 arithmetic slack)."""
    qr = q.quant
    keys, values = dequantize_rows(qr)
    sink, body = compact_split(layer.positions, layer.head_lengths, 2, qr.group_size)
    mask = torch.zeros(layer.num_entries, dtype=torch.bool)
    start = 0
    for s, b, n in zip(sink.tolist(), body.tolist(), layer.head_lengths.tolist()):
        mask[start + s : start + s + b] = True
        start += n
    d = keys.shape[1]
    grid = qr.quant_grid
    gidx, _ = group_index(qr.body_lengths, qr.group_size)
    k_scale = scale_table(grid[2, :d]).gather(1, qr.key_params[1].t().long()).t()[gidx]
    assert bool(((keys - layer.keys[mask]).abs() <= k_scale / 2 * (1 + 1e-5) + 1e-6).all())
    v_scale = scale_table(grid[2, d:]).gather(1, qr.value_params[1].t().long()).t()
    gv = values.shape[1] // v_scale.shape[1]
    bound = v_scale.repeat_interleave(gv, dim=1) / 2 * (1 + 1e-5) + 1e-6
    assert bool(((values - layer.values[mask]).abs() <= bound).all())
    assert torch.equal(q.keys, layer.keys[~mask]) and torch.equal(q.values, layer.values[~mask])


@pytest.mark.parametrize("qtype", ["int4", "int8"])
@pytest.mark.parametrize("lengths", [[40, 3], [2, 50, 33], [0, 34], [5, 5]])
def test_compact_layer_error_bound_and_split(qtype, lengths):
    layer = _layer(lengths)
    energy = torch.rand(len(lengths), 8, generator=torch.Generator().manual_seed(1)) ** 3
    q = quantize_layer(layer, 2, qtype, 16, energy)
    sink, body = compact_split(layer.positions, layer.head_lengths, 2, 16)
    assert q.quant.body_lengths.tolist() == body.tolist()
    assert body.tolist() == [n - 2 if n - 2 >= 16 else 0 for n in lengths]  # every non-sink row, or none
    widths = q.quant.key_bits.long()
    assert widths.sum(dim=1).tolist() == [8 * C.QUANT_TYPES[qtype].bits] * len(lengths)
    _check_bound(layer, q)
    assert compact_problem(q.quant, 8, 8) is None


def test_compact_all_zero_and_constant_groups_are_exact():
    layer = _layer([40], outliers=False)
    layer.keys[:] = 0.0
    layer.values[:] = 3.25
    q = quantize_layer(layer, 2, "int4", 32, torch.ones(1, 8))
    deq = q.dequantized(torch.float32)
    assert torch.equal(deq.keys, layer.keys) and torch.equal(deq.values, layer.values)


def test_widths_follow_the_query_energy():
    layer = _layer([66], outliers=False)
    energy = torch.ones(1, 8)
    energy[0, 2] = 1e4  # the queries read channel 2
    q = quantize_layer(layer, 2, "int4", 32, energy)
    widths = q.quant.key_bits[0].tolist()
    assert widths[2] == max(widths) >= 6 and sum(widths) == 32
    uniform = quantize_layer(layer, 2, "int4", 32, None)
    assert uniform.quant.key_bits[0].tolist() == [4] * 8
    err = {name: (x.dequantized(torch.float32).keys[:, 2] - layer.keys[:, 2]).abs().mean()
           for name, x in (("allocated", q), ("uniform", uniform))}
    assert err["allocated"] < err["uniform"] / 3  # 2+ more bits: 4x smaller steps


def test_compact_problem_names_bad_widths_and_grids():
    q = quantize_layer(_layer([40, 20]), 2, "int4", 16, torch.ones(2, 8)).quant
    q.key_bits = q.key_bits.clone()
    q.key_bits[0, 0] += 1
    assert "sum to 32" in compact_problem(q, 8, 8)
    q.key_bits[0, 0] = 9
    q.key_bits[0, 1] -= 5
    assert "must lie in [1, 8]" in compact_problem(q, 8, 8)
    q.key_bits[0] = 4
    q.quant_grid = q.quant_grid.clone()
    q.quant_grid[1, 0] = float("nan")
    assert "finite" in compact_problem(q, 8, 8)
    q.quant_grid[1, 0] = -1.0
    assert "non-negative" in compact_problem(q, 8, 8)
    q.quant_grid[1, 0] = 0.0
    q.key_params = q.key_params[:, :-1]
    assert "quant.key_params must be" in compact_problem(q, 8, 8)


# --- files -----------------------------------------------------------------------------------------------------------


def test_compact_golden_file_tensors():
    """The quantized golden file holds the stacked compact tensors: widths and grids per layer, rows layer after
    layer (the writer's bytes are checked in test_fileformat)."""
    data = (GOLDEN_DIR / "small_int4.kvpack").read_bytes()
    header = read_header(data)
    assert (header.format_version, header.quant_layout, header.checksum) == ("1.0", "compact", "xxh3")
    assert sorted(header.tensors) == sorted((C.TOKEN_IDS, C.HEAD_LENGTHS) + C.LAYER_PARTS + C.COMPACT_PARTS)
    assert header.tensors[C.KEY_BITS].shape == (2, 2, 4) and header.tensors[C.KEY_PARAMS].shape == (2, 6, 4)
    assert header.entries == 124
    pack = load_pack(data)
    assert_packs_equal(pack, golden_int4())
    assert [l.quant.body_lengths.tolist() for l in pack.layers] == [[36, 0], [46, 33]]
    assert pack.layers[0].quant.key_bits.tolist()[0] == [7, 4, 3, 2]


def test_quantize_pack_checks_query_energy_shapes():
    pack = golden_unquantized_for_int()
    with pytest.raises(InputError, match="query_energy"):
        quantize_pack(pack, "int4", 32, [torch.ones(2, 4)])


def test_compress_records_the_query_energy_of_the_context_queries():
    """The prefill's query energy (mean q_c^2 after RoPE over the GQA group) equals one computed from a plain
    forward with hooks, for methods with and without their own recorder and with an observation question."""
    compress_module = importlib.import_module("kvpack.compress")
    model, tok = tiny_model("llama")
    text = TEXT * 3
    seen = {}
    original = compress_module.quantize_pack

    def spy(pack, qtype, group_size, energy):
        seen["energy"], seen["ids"] = energy, pack.token_ids
        return original(pack, qtype, group_size, energy)

    compress_module.quantize_pack = spy
    try:
        for method in ("kvzip", "h2o", "snapkv", "none"):
            kvpack.compress(model, tok, text, method=method, ratio=0.5, chunk_size=40, quant="int4")
            reference = _hooked_energy(model, seen["ids"])
            assert len(seen["energy"]) == len(reference)
            for got, want in zip(seen["energy"], reference):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    finally:
        compress_module.quantize_pack = original


def _hooked_energy(model, token_ids) -> list[torch.Tensor]:
    captured = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, out, l=l: captured.__setitem__(l, out[0]))
             for l, layer in enumerate(model.model.layers)]
    with torch.inference_mode():
        model.model(input_ids=token_ids[None], use_cache=False)
    for h in hooks:
        h.remove()
    cfg = model.config
    heads, kv_heads, dim, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, token_ids.shape[0]
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(n)[None])
    out = []
    for l in range(len(model.model.layers)):
        q = captured[l].view(n, heads, dim).transpose(0, 1)
        q = q * cos[0] + torch.cat([-q[..., dim // 2 :], q[..., : dim // 2]], dim=-1) * sin[0]
        out.append(q.double().pow(2).reshape(kv_heads, -1, dim).mean(dim=1))
    return out


def test_pack_with_mixed_quantization_is_refused():
    a = quantize_pack(golden_unquantized_for_int(), "int4", 32)
    b = quantize_pack(golden_unquantized_for_int(), "int8", 32)
    mixed = Pack(a.token_ids, [a.layers[0], b.layers[1]], a.sink_tokens, dict(a.metadata))
    with pytest.raises(InputError, match="quantization type"):
        pack_to_bytes(mixed)


def test_fast_key_decoding_matches_the_bit_string_reference():
    """``dequantize_compact_layers`` decodes codes through 16-bit windows for all layers at once, in group-padded
    rows; the codes must equal ``unpack_bits`` of each head's rows, for random widths 1-8 (codes straddling bytes
    included), and the padding rows must be zero codes."""
    from kvpack.compact import _key_codes, _padded_heads

    gen = torch.Generator().manual_seed(3)
    quants = []
    for layer in range(3):
        body = torch.tensor([5, 0, 9])
        widths = torch.stack([torch.tensor(w) for w in ([1, 7, 8, 8, 2, 2, 2, 2], [3, 5, 3, 5, 3, 5, 3, 5],
                                                         [8, 8, 8, 2, 2, 2, 1, 1])])
        codes = [(torch.rand(int(n), 8, generator=gen) * 2.0 ** w).floor().long() for n, w in zip(body, widths)]
        packed = torch.cat([pack_bits(c, w) for c, w in zip(codes, widths)])
        q = quantize_layer(_layer([40, 20]), 2, "int4", 16, torch.ones(2, 8)).quant
        q.body_lengths, q.key_bits, q.key_codes = body, widths.to(torch.uint8), packed
        quants.append((q, torch.cat(codes).float()))
    qs = [q for q, _ in quants]
    body, groups = [5, 0, 9] * 3, [1, 0, 1] * 3  # each head's rows start a group of G = 16 rows
    padded_rows = _padded_heads(torch.cat([q.key_codes for q in qs]), body, [16 * n for n in groups])
    codes = _key_codes(qs, torch.cat([q.key_bits for q in qs]).numpy(), groups, padded_rows).reshape(-1, 8)
    assert codes.shape == (96, 8) and codes.dtype == torch.int16
    rows = torch.tensor([16 * i + r for i, b in enumerate([5, 9] * 3) for r in range(b)])
    assert torch.equal(codes[rows].float(), torch.cat([c for _, c in quants]))
    pad = torch.ones(96, dtype=torch.bool)
    pad[rows] = False
    assert not codes[pad].any()


def _spec_decode(qr) -> tuple[torch.Tensor, torch.Tensor]:
    """``format/SPEC.md`` §5.4 spelled out one head and one group at a time: ``code x scale + min`` (float32
    multiply, then add), codes cut from each head's bit strings (``unpack_bits``), parameters from the grids."""
    d, g = qr.key_bits.shape[1], qr.group_size
    grid = qr.quant_grid.float()
    keys, values, row, group = [], [], 0, 0
    for h, b in enumerate(qr.body_lengths.tolist()):
        codes = unpack_bits(qr.key_codes[row : row + b], qr.key_bits[h])
        for start in range(0, b, g):
            mins = min_values(qr.key_params[0, group], grid[0, :d], grid[1, :d])
            scales = scale_table(grid[2, :d])[torch.arange(d), qr.key_params[1, group].long()]
            keys.append(codes[start : start + g] * scales + mins)
            group += 1
        row += b
    vcodes = unpack_bits(qr.value_codes, torch.full((qr.value_codes.shape[1] * 2,), 4))
    dv, cols = vcodes.shape[1], qr.value_params.shape[2]
    mins = min_values(qr.value_params[0], grid[0, d:], grid[1, d:])
    scales = scale_table(grid[2, d:])[torch.arange(cols), qr.value_params[1].long()]
    values = vcodes * scales.repeat_interleave(dv // cols, 1) + mins.repeat_interleave(dv // cols, 1)
    return torch.cat(keys) if keys else torch.zeros(0, d), values


def test_all_layers_at_once_decode_like_the_spec_one_group_at_a_time():
    """The load path dequantizes every layer together in group-padded rows (``dequantize_bodies``): each head's
    rows must equal the spec's formula applied group by group, bit for bit, with each layer's own grid and widths
    (partial last groups, a head without body rows, 8-bit and 2-bit channels included)."""
    from kvpack.quant import dequantize_bodies

    layers = [quantize_layer(_layer(lengths, seed=seed), 2, "int4", 16,
                             torch.rand(len(lengths), 8, generator=torch.Generator().manual_seed(seed)) ** 4).quant
              for seed, lengths in enumerate([[40, 3, 21], [18, 70, 2], [2, 2, 35]])]
    assert len({tuple(q.key_bits.flatten().tolist()) for q in layers}) == 3  # per-layer widths differ
    keys, values, key_starts, value_starts = dequantize_bodies(layers)
    # body rows 38, 0, 19 | 16, 68, 0 | 0, 0, 33: each head's keys start a new group of G = 16 rows
    assert key_starts.tolist() == [[0, 48, 48], [80, 96, 176], [176, 176, 176]] and keys.shape[0] == 224
    assert value_starts.tolist() == [[0, 38, 38], [57, 73, 141], [141, 141, 141]]  # values: back to back
    for qr, ks, vs in zip(layers, key_starts.tolist(), value_starts.tolist()):
        want_keys, want_values = _spec_decode(qr)
        body = qr.body_lengths.tolist()
        key_rows = torch.cat([torch.arange(s, s + b) for s, b in zip(ks, body)])
        value_rows = torch.cat([torch.arange(s, s + b) for s, b in zip(vs, body)])
        assert torch.equal(keys[key_rows], want_keys) and torch.equal(values[value_rows], want_values)
        assert torch.equal(dequantize_rows(qr)[0], want_keys)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compact_int4_builds_loads_and_generates_on_every_architecture(arch, tmp_path):
    model, tok = tiny_model(arch, dtype=torch.bfloat16 if arch == "qwen3" else torch.float32)
    pack = kvpack.compress(model, tok, TEXT * 3, ratio=0.4, chunk_size=64, quant="int4")
    path = tmp_path / "ctx.kvpack"
    kvpack.save(pack, path, zstd_level=3)
    header = read_header(path)
    assert (header.format_version, header.quant_layout) == ("1.0", "compact")
    loaded = load_pack(path)
    for a, b in zip(pack.layers, loaded.layers):
        assert torch.equal(a.dequantized(torch.float32).keys, b.dequantized(torch.float32).keys)
    cache = kvpack.load(path, model)
    assert cache.get_seq_length() == pack.original_tokens
    assert isinstance(kvpack.generate(model, tok, cache, "What is the secret code of Alice?", max_new_tokens=2), str)


def test_joined_is_a_view_of_consecutive_slices_and_a_copy_otherwise():
    """Loaded layers are slices of one tensor per part; joining them again must not copy, and must equal
    ``torch.cat`` whatever the parts."""
    from kvpack.compact import _joined

    base = torch.arange(2 * 9 * 3).view(2, 9, 3)
    parts = [base[:, 0:2], base[:, 2:2], base[:, 2:7], base[:, 7:9]]
    joined = _joined(parts, 1)
    assert torch.equal(joined, base) and joined.data_ptr() == base.data_ptr()
    rows = torch.arange(40).view(10, 4)
    assert _joined([rows[0:3], rows[3:10]]).data_ptr() == rows.data_ptr()
    stacked = _joined([rows[i].unsqueeze(0) for i in range(10)])
    assert torch.equal(stacked, rows) and stacked.data_ptr() == rows.data_ptr()
    for gappy in ([rows[0:3], rows[4:10]], [rows[3:6], rows[0:3]], [rows[0:3], rows[3:10].clone()]):
        out = _joined(gappy)
        assert torch.equal(out, torch.cat(gappy)) and out.data_ptr() != rows.data_ptr()


def test_zstd_files_load_alike_from_several_threads():
    """Loads of one zstd file on several threads at once must all give the golden pack."""
    from concurrent.futures import ThreadPoolExecutor

    data = (GOLDEN_DIR / "small_int4_zstd.kvpack").read_bytes()
    want = golden_int4()
    with ThreadPoolExecutor(4) as pool:
        for pack in pool.map(lambda _: load_pack(data), range(16)):
            assert_packs_equal(pack, want)


# --- dequantize="on-the-fly": the loaded cache keeps the codes (kvpack.compact_cache) -----------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_on_the_fly_cache_answers_as_the_at_load_cache_and_holds_fewer_bytes(arch, tmp_path, monkeypatch):
    """Without the kernel (plain CPU) a ``CompactLayer`` dequantizes per call with the loader's own code, so a
    question's logits equal the at-load cache's exactly; its tensors are the compact codes, counted byte by byte."""
    from kvpack.compact_cache import CompactLayer
    from kvpack.generation import question_input_ids

    from kvpack import kernels

    monkeypatch.setattr(kernels, "INTERPRETED", False)  # the per-call dequantization, even under the interpreter
    model, tok = tiny_model(arch, dtype=torch.bfloat16 if arch == "qwen3" else torch.float32)
    pack = kvpack.compress(model, tok, TEXT * 3, ratio=0.4, chunk_size=64, quant="int4")
    path = tmp_path / "ctx.kvpack"
    kvpack.save(pack, path)
    at_load = kvpack.load(path, model)
    on_the_fly = kvpack.load(path, model, dequantize="on-the-fly")
    from kvpack.model import model_spec

    sliding = model_spec(model).sliding_layers  # laid out at load either way (the kernel applies no window)
    quantized = [i for i, e in enumerate(load_pack(path).layers) if e.quant is not None and i not in sliding]
    assert quantized and all(isinstance(on_the_fly.layers[i], CompactLayer) for i in quantized)
    assert not any(isinstance(on_the_fly.layers[i], CompactLayer) for i in sliding)
    assert on_the_fly.kept_entries().tolist() == at_load.kept_entries().tolist()
    for i in quantized:
        layer = on_the_fly.layers[i]
        parts = [t for t in layer.compact.values() if torch.is_tensor(t)]
        assert layer.nbytes() == sum(t.numel() * t.element_size() for t in
                                     parts + [layer.kept_positions, layer.offsets, layer.keys, layer.values])
        assert layer.compact["key_codes"].dtype == torch.uint8 and layer.kept_keys is None
    assert on_the_fly.nbytes() < at_load.nbytes() / 1.5
    ids = question_input_ids(tok, at_load, "What is the secret code of Alice?")
    n = at_load.original_length
    logits = []
    for cache in (at_load, on_the_fly):
        with torch.no_grad():
            logits.append(model(ids[:, n:], past_key_values=cache,
                                position_ids=torch.arange(n, ids.shape[1])[None]).logits)
    assert torch.equal(logits[0], logits[1])
    answers = [kvpack.generate(model, tok, c, "What is the secret code of Alice?", max_new_tokens=4)
               for c in (at_load, on_the_fly)]
    assert answers[0] == answers[1]


def test_on_the_fly_is_refused_where_the_kernel_cannot_read_the_layer(monkeypatch):
    """On CUDA a layer the kernel cannot read (no triton, a group size or value width it does not take) is an
    ``InputError`` at load naming ``dequantize='at-load'``, not a failure in the middle of ``generate``; on CPU
    every layer is accepted. A bad ``dequantize`` value is refused."""
    from kvpack import kernels
    from kvpack.cache import KvpackCache
    from kvpack.compact_cache import check_on_the_fly, compact_layout_problem

    entries = quantize_layer(_layer([40, 3, 21], seed=0), 2, "int4", 16, None)
    assert compact_layout_problem(entries) is None
    odd = quantize_layer(_layer([40, 3, 21], seed=0), 2, "int4", 24, None)
    assert "group size 24" in compact_layout_problem(odd)
    check_on_the_fly(odd, torch.device("cpu"), 0)  # CPU: dequantized per call, any layout
    with pytest.raises(InputError, match="layer 3 .*group size 24.*dequantize='at-load'"):
        check_on_the_fly(odd, torch.device("cuda"), 3)
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    with pytest.raises(InputError, match="triton is not installed"):
        check_on_the_fly(entries, torch.device("cuda"), 0)
    with pytest.raises(InputError, match="dequantize must be one of at-load, on-the-fly"):
        KvpackCache.from_pack(Pack(torch.arange(64), [entries], 2, {}), dequantize="lazy")


def test_on_the_fly_leaves_sliding_layers_and_unreadable_layouts_to_the_dequantized_path(monkeypatch):
    """A sliding-window layer is laid out at load even with ``dequantize="on-the-fly"`` (the kernel applies no
    window); a layout the kernel cannot read (group size 24) stays compact on CPU but is never sent to the kernel,
    even where the kernel runs: it is dequantized per call, and answers as at load."""
    from kvpack.cache import KvpackCache, PackedLayer
    from kvpack.compact_cache import CompactLayer
    from kvpack.varlen import packed_attention

    entries = quantize_layer(_layer([40, 3, 21], seed=0), 2, "int4", 24, None)
    pack = Pack(torch.arange(64), [entries, entries], 2, {})
    cache = KvpackCache.from_pack(pack, sliding_layers=(1,), dequantize="on-the-fly")
    assert isinstance(cache.layers[0], CompactLayer) and cache.layers[0].kernel_problem.startswith("group size 24")
    assert type(cache.layers[1]) is PackedLayer
    at_load = KvpackCache.from_pack(pack).layers[0]
    from kvpack import kernels

    monkeypatch.setattr(kernels, "INTERPRETED", True)  # "the kernel runs here" (the layer never reaches it)
    gen = torch.Generator().manual_seed(3)
    for layer in (cache.layers[0], at_load):
        gen.manual_seed(3)
        layer.update(torch.randn(1, 3, 2, 8, generator=gen), torch.randn(1, 3, 2, 8, generator=gen))
    query = torch.randn(1, 6, 2, 8, generator=gen)
    assert torch.equal(packed_attention(query, cache.layers[0], 0.35), packed_attention(query, at_load, 0.35))
