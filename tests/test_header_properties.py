"""Property tests of the reader (hypothesis, as safetensors fuzzes its header): any header, any bytes, any valid pack.

* any JSON header (re-signed or not) gives a header or a typed ``PackFormatError``, never another exception, and
  ``verify`` agrees with ``load_pack``;
* any bytes after the magic give a typed error;
* ``json_depth`` is the true nesting depth, whatever the strings hold;
* any valid pack round-trips exactly, through paths, bytes and file objects alike.
"""

from __future__ import annotations

import io
import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpack import constants as C
from kvpack.container import json_depth
from kvpack.errors import PackFormatError
from kvpack.fileformat import load_pack, pack_to_bytes, read_header, verify
from kvpack.pack import LayerEntries, Pack

from .forge import assemble, canon, restore, split
from .golden_packs import GOLDEN_DIR

GOLD = (GOLDEN_DIR / "small_f32.kvpack").read_bytes()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                     st.sampled_from(["F32", "I32", "U8", "BF16", "zstd", "int4", "none", "1.0", "keys"]))
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=20)


def _outcome(reader, data):
    try:
        reader(data)
        return "ok"
    except PackFormatError as exc:
        assert "kvpack" in str(exc)
        return type(exc).__name__


@SETTINGS
@given(path_choice=st.integers(min_value=0, max_value=10**6), value=_json, sign=st.booleans())
def test_any_value_anywhere_in_the_header_is_a_typed_error_or_a_valid_file(path_choice, value, sign):
    obj, buf = split(GOLD)
    nodes = []

    def walk(node, path):
        nodes.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + (i,))

    walk(obj, ())
    path = nodes[1 + path_choice % (len(nodes) - 1)]
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    data = assemble(obj, buf, sign=sign)
    results = {r.__name__: _outcome(r, data) for r in (read_header, verify, load_pack)}
    assert results["verify"] == results["load_pack"]


@SETTINGS
@given(key=st.sampled_from(["kvpack", "quant", "tensor_codecs", "tensor_xxh3"]), value=_json)
def test_any_json_text_in_the_metadata_is_a_typed_error_or_a_valid_file(key, value):
    data = restore(GOLD, edit_header=lambda o: o["__metadata__"].update({key: json.dumps(value)}))
    assert _outcome(verify, data) == _outcome(load_pack, data)


@SETTINGS
@given(tail=st.binary(max_size=400), n=st.integers(min_value=0, max_value=2**64 - 1) | st.integers(0, 600))
def test_any_bytes_after_the_magic_are_a_typed_error(tail, n):
    data = n.to_bytes(8, "little") + C.MAGIC + tail
    assert _outcome(load_pack, data) != "ok"
    assert _outcome(verify, data) == _outcome(load_pack, data)


def _depth(x) -> int:
    if isinstance(x, list):
        return 1 + max((_depth(v) for v in x), default=0)
    if isinstance(x, dict):
        return 1 + max((_depth(v) for v in x.values()), default=0)
    return 0


@SETTINGS
@given(value=st.recursive(st.text(alphabet='[]{}"\\ax', max_size=6) | st.integers(),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                              st.text(alphabet='[]{}"\\', max_size=3), inner, max_size=3), max_leaves=30))
def test_json_depth_is_the_nesting_depth(value):
    assert json_depth(json.dumps(value).encode()) == _depth(value)
    assert json_depth(canon(value)) == _depth(value)


@st.composite
def packs(draw):
    layers, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 40))
    d, dv = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([2, 4]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    biases = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    out = []
    for _ in range(layers):
        pos, lengths = [], []
        for _ in range(heads):
            keep = sorted(draw(st.sets(st.integers(0, tokens - 1), max_size=tokens)))
            pos += keep
            lengths.append(len(keep))
        n = len(pos)
        out.append(LayerEntries(torch.randn(n, d, generator=gen).to(dtype), torch.randn(n, dv, generator=gen).to(dtype),
                                torch.tensor(pos, dtype=torch.int32), torch.tensor(lengths),
                                biases=(torch.rand(n, generator=gen) * 60 - 30) if biases else None))
    return Pack(torch.randint(0, 1000, (tokens,), generator=gen), out, draw(st.integers(0, tokens)),
                {"method": draw(st.text(max_size=10)), "stats": {"x": draw(_scalars)}})


@SETTINGS
@given(pack=packs(), level=st.sampled_from([0, 1]), checksum=st.sampled_from(["xxh3", "sha256"]))
def test_any_valid_pack_round_trips(pack, level, checksum):
    data = pack_to_bytes(pack, level, checksum)
    for source in (data, io.BytesIO(data)):
        back = load_pack(source)
        assert pack_to_bytes(back, level, checksum) == data
    for a, b in zip(back.layers, pack.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.positions, b.positions.int())
        assert (a.biases is None) == (b.biases is None)
    assert verify(data).entries == sum(layer.num_entries for layer in pack.layers)
