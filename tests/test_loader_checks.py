"""The reader's vectorised value checks (``fileformat._checked_split``) against the full ``_pack_problem``.

Golden files get random, re-signed edits of their head lengths, positions and token ids. For every forged file
the fast path must give the same verdict as ``_pack_problem`` on the same pack, and the same error message (the
message always comes from ``_pack_problem``); on valid files it must give ``split_lengths``' sink and body rows.
"""

from __future__ import annotations

import random
import struct

import pytest
import torch

from kvpack import fileformat
from kvpack.errors import CorruptFileError
from kvpack.fileformat import load_pack
from kvpack.quant import split_lengths

from .golden_packs import GOLDEN_DIR
from .test_hostile_files import forge, split

RAW_GOLDEN = ["small_f32.kvpack", "small_int4.kvpack", "small_int8.kvpack"]  # tensors stored raw: easy to edit
GOLDEN = RAW_GOLDEN + ["small_int4_zstd.kvpack"]


def _outcome(data: bytes) -> str:
    """``"ok"`` or the ``CorruptFileError`` message of loading ``data``."""
    try:
        load_pack(data)
    except CorruptFileError as exc:
        return str(exc)
    return "ok"


def _slow_outcome(data: bytes, monkeypatch) -> str:
    """The same, with the fast checks forced to report a problem, so ``_pack_problem`` decides."""
    with monkeypatch.context() as m:
        m.setattr(fileformat, "_checked_split", lambda *args: None)
        try:
            load_pack(data)
        except CorruptFileError as exc:
            return str(exc)
        except RuntimeError as exc:  # _pack_problem found nothing wrong
            assert "internal error" in str(exc)
            return "ok"
    raise AssertionError("the forced slow path neither raised nor reported an internal error")


def _int32s(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def _edits(base: bytes, rng: random.Random) -> dict[str, bytes]:
    """Random same-size replacements for some int32 tensors of ``base`` (raw tensors only)."""
    obj, buf = split(base)
    names = [n for n in obj if n != "__metadata__" and obj[n]["dtype"] == "I32"]
    out = {}
    for name in rng.sample(names, rng.randint(1, 2)):
        b, e = obj[name]["data_offsets"]
        values = _int32s(buf[b:e])
        if not values:
            continue
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(values))
            kind = rng.random()
            if kind < 0.3:
                values[i] += rng.choice([-2, -1, 1, 2])
            elif kind < 0.5:
                values[i] = rng.choice([-1, 0, 1, 2, 31, 32, 33, 47, 48, 49])
            elif kind < 0.7 and len(values) > 1:
                j = rng.randrange(len(values))
                values[i], values[j] = values[j], values[i]
            elif kind < 0.85 and len(values) > 1:  # move one unit between two entries (keeps sums)
                j = rng.randrange(len(values))
                values[i] += 1
                values[j] -= 1
            else:
                values[i] = -values[i]
        values = [max(-(2**31), min(2**31 - 1, v)) for v in values]
        out[name] = struct.pack(f"<{len(values)}i", *values)
    return out


@pytest.mark.parametrize("golden", RAW_GOLDEN)
def test_fast_checks_agree_with_pack_problem(golden, monkeypatch):
    base = (GOLDEN_DIR / golden).read_bytes()
    rng = random.Random(golden)
    verdicts = set()
    for _ in range(150):
        data = forge(tensors=_edits(base, rng), base=base)
        fast, slow = _outcome(data), _slow_outcome(data, monkeypatch)
        assert fast == slow
        verdicts.add(fast == "ok")
    assert verdicts == {True, False}  # both kinds were exercised


@pytest.mark.parametrize("golden", GOLDEN)
def test_loaded_split_is_the_layout_rule(golden):
    pack = load_pack(GOLDEN_DIR / golden)
    for layer in pack.layers:
        if layer.quant is None:
            continue
        sink, body, _ = split_lengths(layer.positions, layer.head_lengths, pack.sink_tokens, layer.quant.group_size)
        assert torch.equal(layer.quant.sink_lengths, sink) and torch.equal(layer.quant.body_lengths, body)
        assert layer.quant.sink_lengths.dtype == layer.quant.body_lengths.dtype == torch.int64
