"""Attention over a ``PackedLayer`` (``kvpack.varlen``): every path against an explicit per-head softmax with the
entries' biases, for one decode token and a multi-token question, with empty heads, GQA, sliding windows and
non-float32 dtypes; and the packed cache's memory: its tensors total the kept entries plus the tail."""

from __future__ import annotations

import pytest
import torch

from kvpack.cache import KvpackCache, PackedLayer
from kvpack.fileformat import load_pack
from kvpack.pack import LayerEntries, Pack
from kvpack.varlen import _packed_attention_flash, _packed_attention_torch, packed_attention

from .golden_packs import GOLDEN_DIR

D = 16
ORIGINAL = 200


def _layer(lengths, q_len, tail_extra=0, biased=True, dtype=torch.float32, seed=0):
    """A packed layer with random rows at random increasing positions, and a tail of ``tail_extra + q_len``."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    positions = torch.cat([torch.randperm(ORIGINAL, generator=g)[:m].sort().values for m in lengths]).long()
    biases = (torch.randn(n, generator=g) * 2) if biased else None
    layer = PackedLayer(torch.randn(n, D, generator=g).to(dtype), torch.randn(n, D, generator=g).to(dtype),
                        positions, lengths, ORIGINAL, biases=biases)
    heads = len(lengths)
    for t in (tail_extra, q_len):
        if t:
            layer.update(torch.randn(1, heads, t, D, generator=g).to(dtype),
                         torch.randn(1, heads, t, D, generator=g).to(dtype))
    return layer


def _explicit(query, layer, scaling, window=None):
    """softmax(scale q . k + beta) v per query head over its KV head's kept rows and the tail, causal in the tail,
    in float64, written out entry by entry."""
    _, heads, q_len, _ = query.shape
    kv_heads, tail = layer.num_kv_heads, layer.tail_length
    group = heads // kv_heads
    out = torch.zeros(1, q_len, heads, layer.kept_values.shape[-1], dtype=torch.float64)
    for j in range(heads):
        h = j // group
        k, v, pos, beta = layer.head_rows(h)
        keys = torch.cat([k, layer.keys[0, h]]).double()
        values = torch.cat([v, layer.values[0, h]]).double()
        kpos = torch.cat([pos, ORIGINAL + torch.arange(tail)])
        bias = torch.cat([beta.double() if beta is not None else torch.zeros(k.shape[0], dtype=torch.float64),
                          torch.zeros(tail, dtype=torch.float64)])
        for i in range(q_len):
            qpos = ORIGINAL + tail - q_len + i
            logits = keys @ query[0, j, i].double() * scaling + bias
            hidden = kpos > qpos
            if window is not None:
                hidden |= (qpos - kpos) >= window
            logits[hidden] = float("-inf")
            out[0, i, j] = logits.softmax(0) @ values
    return out


PATHS = {"dispatch": packed_attention, "flash": lambda q, l, s, w=None: _packed_attention_flash(q, l, s),
         "torch": _packed_attention_torch}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("q_len,tail_extra", [(1, 0), (1, 3), (5, 0), (4, 2)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("biased", [True, False])
def test_packed_attention_matches_explicit_softmax_with_biases(path, q_len, tail_extra, group, biased):
    lengths = [7, 0, 30, 1]  # an empty head and uneven budgets
    layer = _layer(lengths, q_len, tail_extra, biased)
    query = torch.randn(1, q_len, group * len(lengths), D).transpose(1, 2)  # strided, as the model's queries are
    fn = PATHS[path]
    got = fn(query, layer, 0.3) if path != "torch" else fn(query, layer, 0.3, None)
    assert got.shape == (1, q_len, group * len(lengths), D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _explicit(query, layer, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len,tail_extra", [(1, 0), (1, 4), (5, 2)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("biased", [True, False])
def test_dense_layer_attends_in_one_call_exactly(q_len, tail_extra, group, biased):
    """Heads that keep the same entries (a ``none`` pack) take one flash call over ``[1, kv_heads, kept, d]`` views:
    the same softmax as the explicit one, and the per-head calls' output to float32 rounding (not bit for bit: the
    CPU flash kernel's blocking, and so its summation order, can differ between the two shapes and thread counts)."""
    layer = _layer([9, 9, 9], q_len, tail_extra, biased)
    keys, values, beta = layer.dense_views()
    assert keys.shape == (1, 3, 9, D) and keys.data_ptr() == layer.kept_keys.data_ptr()  # views, no copy
    assert (beta is None) == (not biased)
    query = torch.randn(1, q_len, group * 3, D).transpose(1, 2)
    got = packed_attention(query, layer, 0.3)
    torch.testing.assert_close(got.double(), _explicit(query, layer, 0.3), atol=2e-5, rtol=2e-5)
    layer._dense_views = False  # force one call per KV head
    torch.testing.assert_close(packed_attention(query, layer, 0.3), got, atol=1e-6, rtol=1e-6)


def test_uneven_layer_has_no_dense_views():
    assert _layer([3, 4], 1).dense_views() is None
    assert _layer([0, 0], 1).dense_views() is not None  # every head empty: the tail alone is attended
    query = torch.randn(1, 2, 1, D)
    layer = _layer([0, 0], 1)
    torch.testing.assert_close(packed_attention(query, layer, 0.3).double(), _explicit(query, layer, 0.3),
                               atol=2e-5, rtol=2e-5)


def test_merge_partials_is_the_softmax_over_the_union():
    from kvpack.attention_math import merge_partials

    g = torch.Generator().manual_seed(3)
    logits, values = torch.randn(2, 5, 12, generator=g) * 3, torch.randn(12, 4, generator=g)  # [heads, q, keys]

    def part(sl):
        lse = logits[..., sl].logsumexp(-1)
        return logits[..., sl].softmax(-1) @ values[sl], lse

    out, lse = merge_partials(*part(slice(0, 7)), *part(slice(7, 12)))
    torch.testing.assert_close(out, logits.softmax(-1) @ values, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    empty = (torch.zeros(2, 5, 4), torch.full((2, 5), float("-inf")))  # a part with no visible key weighs nothing
    out, lse = merge_partials(*empty, *part(slice(0, 12)))
    torch.testing.assert_close(out, logits.softmax(-1) @ values, atol=1e-6, rtol=1e-6)
    half, _ = merge_partials(*(t.bfloat16() if t.dim() == 3 else t for t in part(slice(0, 7))), *part(slice(7, 12)))
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("q_len", [1, 4])
def test_shared_prefix_attention_is_each_rows_softmax_over_prefix_and_its_own_suffix(group, q_len):
    """Each row against an explicit softmax over [shared prefix, its visible suffix entries], with GQA, left
    padding (row 1's first suffix slots hidden) and a query that sees no suffix entry (row 2, a padding row)."""
    from kvpack.attention_math import shared_prefix_attention

    g = torch.Generator().manual_seed(4)
    b, kv_heads, p, s = 3, 2, 9, 6
    query = torch.randn(b, kv_heads * group, q_len, D, generator=g)
    pk, pv = torch.randn(1, kv_heads, p, D, generator=g), torch.randn(1, kv_heads, p, D, generator=g)
    k, v = torch.randn(b, kv_heads, s, D, generator=g), torch.randn(b, kv_heads, s, D, generator=g)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :2] = False
    valid[2, : s - q_len + 1] = False  # row 2's first query sees no suffix entry at all
    causal = torch.arange(s)[None, :] <= (s - q_len + torch.arange(q_len))[:, None]
    visible = valid[:, None, :] & causal[None]
    out = shared_prefix_attention(query, pk, pv, k, v, visible, 0.3)
    for r in range(b):
        for h in range(kv_heads * group):
            kh = h // group
            keys, values = torch.cat([pk[0, kh], k[r, kh]]), torch.cat([pv[0, kh], v[r, kh]])
            mask = torch.cat([torch.ones(q_len, p, dtype=torch.bool), visible[r]], dim=1)
            logits = (query[r, h] @ keys.T * 0.3).masked_fill(~mask, float("-inf"))
            torch.testing.assert_close(out[r, h], logits.softmax(-1) @ values, atol=1e-5, rtol=1e-5)


def test_shared_context_cache_fills_its_suffix_and_refuses_to_overflow():
    from kvpack.shared_context import shared_context_cache

    keys, values = [torch.randn(2, 5, D)], [torch.randn(2, 5, D)]
    valid = torch.tensor([[False, True, True], [True, True, True]])
    cache = shared_context_cache(keys, values, valid)
    layer = cache.layers[0]
    k, v = cache.update(torch.randn(2, 2, 2, D), torch.randn(2, 2, 2, D), 0)
    assert k.shape == (2, 2, 2, D) and k._kvpack_shared is layer and cache.get_seq_length() == 7
    assert torch.equal(layer.visible(2), torch.tensor([[[False, False], [False, True]], [[True, False], [True, True]]]))
    assert layer.context_keys.data_ptr() == keys[0].data_ptr()  # the context is held once, not copied
    with pytest.raises(ValueError, match="capacity 3"):
        cache.update(torch.randn(2, 2, 2, D), torch.randn(2, 2, 2, D), 0)


def test_packed_sequences_see_only_their_own_slots_and_unpack_into_left_padded_rows():
    """Two sequences (2 and 3 slots) packed in one row: each slot sees its own sequence's earlier slots only; unpacked,
    row b holds sequence b's entries right-aligned at slot 3, the context still shared, and the next token of each
    row sees its sequence and itself (not the padding slot)."""
    from kvpack.shared_context import shared_context_cache, unpack_rows

    keys, values = [torch.randn(2, 5, D)], [torch.randn(2, 5, D)]
    packed = shared_context_cache(keys, values, torch.ones(1, 5, dtype=torch.bool), torch.tensor([[0, 0, 1, 1, 1]]))
    k, v = torch.randn(1, 2, 5, D), torch.randn(1, 2, 5, D)
    packed.update(k, v, 0)
    seen = packed.layers[0].visible(5)[0].int()
    assert seen.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    rows = unpack_rows(packed, [2, 3], valid)
    layer = rows.layers[0]
    assert layer.filled == 3 and layer.context_keys.data_ptr() == keys[0].data_ptr()
    assert torch.equal(layer.keys[0, :, 1:3], k[0, :, :2]) and torch.equal(layer.values[1, :, :3], v[0, :, 2:])
    assert not layer.keys[0, :, 0].any() and not layer.values[0, :, 0].any()  # padding: zeros, never NaN
    rows.update(torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D), 0)
    assert layer.visible(1)[:, 0].int().tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="4 slots asked for, 5 packed"):
        unpack_rows(packed, [2, 2], valid)


def test_biases_change_the_output_as_softmax_says():
    layer = _layer([5, 9], 1)
    query = torch.randn(1, 2, 1, D)
    base = packed_attention(query, layer, 0.3)
    layer.biases += 1.5  # a constant bias on every kept entry moves weight from the tail to them
    layer._head_views = None
    shifted = packed_attention(query, layer, 0.3)
    assert not torch.allclose(base, shifted)
    torch.testing.assert_close(shifted.double(), _explicit(query, layer, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 4, 60, 1000])
@pytest.mark.parametrize("q_len", [1, 6])
def test_sliding_window_hides_entries_behind_it(window, q_len):
    layer = _layer([12, 12], q_len, tail_extra=2)
    query = torch.randn(1, 4, q_len, D)
    got = packed_attention(query, layer, 0.3, window)
    torch.testing.assert_close(got.double(), _explicit(query, layer, 0.3, window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("path", ["flash", "torch"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_other_dtypes_stay_within_their_rounding(path, dtype, tol):
    layer = _layer([20, 3, 0, 11], 3, 1, dtype=dtype)
    query = torch.randn(1, 8, 3, D).to(dtype)
    got = PATHS[path](query, layer, 0.25) if path == "flash" else _packed_attention_torch(query, layer, 0.25, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), _explicit(query, layer, 0.25), atol=tol, rtol=tol)


def test_long_question_is_blocked_and_still_exact(monkeypatch):
    import kvpack.varlen as varlen

    monkeypatch.setattr(varlen, "LOGIT_BLOCK", 64)  # a few queries per block
    layer = _layer([9, 17], 11, 2)
    query = torch.randn(1, 4, 11, D)
    got = _packed_attention_torch(query, layer, 0.3, 7)
    torch.testing.assert_close(got.double(), _explicit(query, layer, 0.3, 7), atol=2e-5, rtol=2e-5)


# --- memory --------------------------------------------------------------------------------------------------


def _storage_bytes(cache: KvpackCache) -> int:
    """Bytes of the distinct storages behind every tensor of the cache's layers."""
    seen = {}
    for layer in cache.layers:
        for t in (layer.kept_keys, layer.kept_values, layer.kept_positions, layer.offsets, layer.biases,
                  layer.keys, layer.values):
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_cache_tensors_total_the_kept_entries_plus_the_tail():
    g = torch.Generator().manual_seed(1)
    lengths = [[5, 0, 40, 2], [0, 0, 0, 9]]  # skewed heads and empty heads
    layers = []
    for ls in lengths:
        n = sum(ls)
        pos = torch.cat([torch.arange(m) for m in ls]).int()
        layers.append(LayerEntries(torch.randn(n, D, generator=g), torch.randn(n, 24, generator=g), pos,
                                   torch.tensor(ls), biases=torch.randn(n, generator=g)))
    pack = Pack(torch.arange(50), layers, 0, {})
    cache = KvpackCache.from_pack(pack, dtype=torch.bfloat16)
    entries = sum(map(sum, lengths))
    heads = 4
    # rows (bf16 keys of 16 and values of 24 channels), int64 positions, float32 biases, int64 head offsets
    expected = entries * (2 * (D + 24) + 8 + 4) + len(lengths) * (heads + 1) * 8
    assert cache.nbytes() == expected
    assert _storage_bytes(cache) == expected
    for layer in cache.layers:
        layer.update(torch.randn(1, heads, 3, D), torch.randn(1, heads, 3, 24))
    assert cache.nbytes() == expected + len(lengths) * heads * 3 * 2 * (D + 24)
    cache.rewind()
    assert _storage_bytes(cache) == expected
    assert cache.kept_entries().tolist() == lengths


@pytest.mark.parametrize("golden", sorted(p.name for p in GOLDEN_DIR.glob("*.kvpack")))
def test_from_pack_keeps_every_row_in_pack_order(golden):
    pack = load_pack(GOLDEN_DIR / golden)
    cache = KvpackCache.from_pack(pack, dtype=torch.float32)
    for entries, layer in zip(pack.layers, cache.layers):
        full = entries.dequantized(torch.float32)
        assert torch.equal(layer.kept_keys, full.keys) and torch.equal(layer.kept_values, full.values)
        assert torch.equal(layer.kept_positions, entries.positions.long())
        assert layer.head_lengths == entries.head_lengths.tolist()
        assert layer.kept_keys.shape[0] == entries.num_entries  # no padding


def test_from_pack_keeps_each_heads_biases_with_its_rows():
    pack = load_pack(GOLDEN_DIR / "small_f32.kvpack")
    for entries in pack.layers:
        entries.biases = torch.arange(entries.num_entries, dtype=torch.float32) / 7
    cache = KvpackCache.from_pack(pack, dtype=torch.bfloat16)
    for entries, layer in zip(pack.layers, cache.layers):
        off = entries.head_offsets().tolist()
        for h in range(layer.num_kv_heads):
            k, _, pos, beta = layer.head_rows(h)
            assert beta.dtype == torch.float32  # never cast to the cache's dtype
            assert torch.equal(beta, entries.biases[off[h] : off[h + 1]])
            assert torch.equal(pos, entries.positions[off[h] : off[h + 1]].long())
