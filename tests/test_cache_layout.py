"""``KvpackCache.from_pack`` lays every layer out exactly like a plain per-head reference does.

The loader dequantizes all layers at once and concatenates every head's blocks in one copy per tensor kind; the
reference here dequantizes each layer alone (``LayerEntries.dequantized``) and pads head by head, which is what
``PackedLayer.padded`` (KVzip's scoring grid) must give from the packed rows.
"""

from __future__ import annotations

import pytest
import torch

from kvpack.cache import KvpackCache
from kvpack.errors import InputError
from kvpack.fileformat import load_pack
from kvpack.pack import LayerEntries, Pack

from .golden_packs import GOLDEN_DIR

GOLDEN = sorted(p.name for p in GOLDEN_DIR.glob("*.kvpack"))


def _reference_layer(entries: LayerEntries, dtype: torch.dtype | None):
    """``(keys [1, H, longest, D], values [1, H, longest, Dv], positions [H, longest])`` padded head by head."""
    full = entries.dequantized(dtype or entries.keys.dtype)
    dt = dtype or entries.keys.dtype
    keys, values = full.keys.to(dt), full.values.to(dt)
    lengths = entries.head_lengths.tolist()
    longest = max(lengths)
    k = torch.zeros(len(lengths), longest, keys.shape[1], dtype=dt)
    v = torch.zeros(len(lengths), longest, values.shape[1], dtype=dt)
    p = torch.full((len(lengths), longest), -1, dtype=torch.int64)
    start = 0
    for h, n in enumerate(lengths):
        rows = slice(start, start + n)
        k[h, :n], v[h, :n], p[h, :n] = keys[rows], values[rows], entries.positions[rows]
        start += n
    return k.unsqueeze(0), v.unsqueeze(0), p


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.is_floating_point and t.numel() else t


@pytest.mark.parametrize("golden", GOLDEN)
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_from_pack_matches_a_per_head_reference(golden, dtype):
    pack = load_pack(GOLDEN_DIR / golden)
    cache = KvpackCache.from_pack(pack, dtype=dtype)
    for entries, layer in zip(pack.layers, cache.layers):
        keys, values, positions = _reference_layer(entries, dtype)
        for got, want in zip(layer.padded()[:3], (keys, values, positions)):
            assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
            assert torch.equal(_bits(got), _bits(want))
        assert layer.dense == bool((positions >= 0).all())


def test_layers_of_different_dtypes_keep_their_own():
    pack = load_pack(GOLDEN_DIR / "small_f32.kvpack")
    mixed = [LayerEntries(e.keys.to(dt), e.values.to(dt), e.positions, e.head_lengths)
             for e, dt in zip(pack.layers, (torch.float16, torch.bfloat16))]
    cache = KvpackCache.from_pack(Pack(pack.token_ids, mixed, pack.sink_tokens, pack.metadata))
    assert [layer.kept_keys.dtype for layer in cache.layers] == [torch.float16, torch.bfloat16]
    for entries, layer in zip(mixed, cache.layers):
        keys, values, positions = _reference_layer(entries, None)
        got_keys, got_values, got_positions, _ = layer.padded()
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
        assert torch.equal(got_positions, positions)


def test_rows_that_do_not_match_the_head_lengths_are_refused():
    pack = load_pack(GOLDEN_DIR / "small_f32.kvpack")
    e = pack.layers[0]
    bad = LayerEntries(e.keys[1:], e.values[1:], e.positions, e.head_lengths)
    with pytest.raises(InputError, match="rows do not match"):
        KvpackCache.from_pack(Pack(pack.token_ids, [bad, pack.layers[1]], pack.sink_tokens, pack.metadata))
