"""Format version 2 on valid packs: quantized layers and zstd-compressed tensors (golden bytes, round trips,
the version rule, safetensors compatibility). Hostile v2 files are in ``test_hostile_files.py``."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch
import xxhash
import zstandard

from kvpack import constants as C
from kvpack.errors import InputError
from kvpack.fileformat import load_pack, pack_to_bytes, read_header, save, verify
from kvpack.pack import Pack
from kvpack.quant import quantize_pack

from .golden_packs import GOLDEN, GOLDEN_DIR, GOLDEN_V2, GOLDEN_V3, GOLDEN_ZSTD_LIBRARY, golden_f32, golden_int4
from .test_fileformat import random_pack

QUANT_FIELDS = ("qtype", "group_size", "sink_lengths", "body_lengths", *C.QUANT_PARTS)


def assert_packs_equal(a: Pack, b: Pack) -> None:
    """Exact equality, quantized rows included."""
    assert a.sink_tokens == b.sink_tokens and a.metadata == b.metadata
    assert a.token_ids.dtype == b.token_ids.dtype and torch.equal(a.token_ids, b.token_ids)
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for name in ("keys", "values", "positions", "head_lengths"):
            x, y = getattr(la, name), getattr(lb, name)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
        assert (la.quant is None) == (lb.quant is None)
        if la.quant is not None:
            for name in QUANT_FIELDS:
                x, y = getattr(la.quant, name), getattr(lb.quant, name)
                if isinstance(x, torch.Tensor):
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
                else:
                    assert x == y, name


def _zstd_library_differs() -> bool:
    return tuple(zstandard.ZSTD_VERSION) != GOLDEN_ZSTD_LIBRARY


# --- golden files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN_V2))
def test_writer_reproduces_v2_golden_bytes(name):
    make, level = GOLDEN_V2[name]
    if level and _zstd_library_differs():
        pytest.skip(f"zstd {zstandard.ZSTD_VERSION} compresses differently from {GOLDEN_ZSTD_LIBRARY}; "
                    "reading is still tested")
    assert pack_to_bytes(make(), level, "sha256") == (GOLDEN_DIR / name).read_bytes()


@pytest.mark.parametrize("name", sorted(GOLDEN_V3))
def test_writer_reproduces_v3_golden_bytes(name):
    make, level = GOLDEN_V3[name]
    if level and _zstd_library_differs():
        pytest.skip(f"zstd {zstandard.ZSTD_VERSION} compresses differently from {GOLDEN_ZSTD_LIBRARY}; "
                    "reading is still tested")
    assert pack_to_bytes(make(), level) == (GOLDEN_DIR / name).read_bytes()


@pytest.mark.parametrize("name", sorted(GOLDEN_V2) + sorted(GOLDEN_V3))
def test_v2_v3_golden_loads_to_constructed_pack(name):
    make, _ = {**GOLDEN_V2, **GOLDEN_V3}[name]
    assert_packs_equal(load_pack(GOLDEN_DIR / name), make())


def test_v3_differs_from_its_sha256_twin_only_in_version_and_tensor_checksums():
    """The XXH3-128 of each tensor's stored bytes (computed here with xxhash directly) is what the file records."""
    for v3_name, v2_name in (("small_f32_xxh3.kvpack", "small_f32.kvpack"),
                             ("small_int4_zstd_xxh3.kvpack", "small_int4_zstd.kvpack")):
        data3, data2 = (GOLDEN_DIR / v3_name).read_bytes(), (GOLDEN_DIR / v2_name).read_bytes()
        (h3, b3), (h2, b2) = _split(data3), _split(data2)
        m3, m2 = h3.pop("__metadata__"), h2.pop("__metadata__")
        assert h3 == h2 and b3 == b2  # same index, same stored bytes
        assert m3["format_version"] == "3" and "tensor_sha256" not in m3 and "tensor_xxh3" not in m2
        sums = json.loads(m3["tensor_xxh3"])
        assert set(sums) == set(h3)
        for name, entry in h3.items():
            b, e = entry["data_offsets"]
            assert sums[name] == xxhash.xxh3_128(b3[b:e]).hexdigest() and len(sums[name]) == 32
        same = {k for k in m3 if k not in ("format_version", "tensor_xxh3", "header_sha256")}
        assert {k: m3[k] for k in same} == {k: m2[k] for k in same if k in m2} and same == set(m2) - {
            "format_version", "tensor_sha256", "header_sha256"}
        assert read_header(data3).checksum == "xxh3" and read_header(data2).checksum == "sha256"


def _split(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def test_v2_golden_headers():
    h = read_header(GOLDEN_DIR / "small_int4_zstd.kvpack")
    assert (h.format_version, h.quant_type, h.group_size, h.zstd_level) == (2, "int4", 32, 3)
    assert h.tensors["layers.0.key_codes"].dtype == "U8" and h.tensors["layers.0.key_codes"].shape == (32, 2)
    assert h.tensors["layers.1.value_scales"].shape == (64, 1) and h.tensors["layers.1.key_scales"].shape == (2, 4)
    assert h.tensors["layers.0.keys"].codec.filter == "shuffle"
    assert h.tensors["layers.0.positions"].codec.filter == "delta_shuffle"
    assert h.tensors["layers.0.key_codes"].codec.filter == "none"
    sections = h.bytes_by_section()
    assert set(C.QUANT_PARTS) <= set(sections) and sum(sections.values()) == h.file_bytes
    assert verify(GOLDEN_DIR / "small_int4_zstd.kvpack") == h
    plain = read_header(GOLDEN_DIR / "small_int4.kvpack")
    assert (plain.format_version, plain.zstd_level, plain.raw_bytes) == (2, 0, h.raw_bytes)
    z = read_header(GOLDEN_DIR / "small_f32_zstd.kvpack")
    assert (z.format_version, z.quant_type, z.group_size) == (2, "none", None)
    assert z.raw_bytes == read_header(GOLDEN_DIR / "small_f32.kvpack").raw_bytes


def test_zstd_golden_frames_decode_to_the_plain_tensors():
    """Independent of the reader: every stored frame decompresses (after un-filtering) to the v1 file's bytes."""
    plain = (GOLDEN_DIR / "small_f32.kvpack").read_bytes()
    zfile = (GOLDEN_DIR / "small_f32_zstd.kvpack").read_bytes()

    def split(data):
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8 : 8 + n]), data[8 + n :]

    (hp, bp), (hz, bz) = split(plain), split(zfile)
    codecs = json.loads(hz["__metadata__"]["tensor_codecs"])
    assert set(codecs) == set(hp) - {"__metadata__"}  # every (non-empty) tensor is compressed
    for name, c in codecs.items():
        b, e = hz[name]["data_offsets"]
        raw = zstandard.ZstdDecompressor().decompress(bz[b:e])
        k = torch.tensor([], dtype=C.DTYPE_BY_CODE[c["dtype"]]).element_size()
        if c["filter"] != "none":  # byte planes back to elements
            raw = bytes(raw[j * (len(raw) // k) + i] for i in range(len(raw) // k) for j in range(k))
        if c["filter"] == "delta_shuffle":
            d = torch.frombuffer(bytearray(raw), dtype=torch.int32)
            raw = torch.cumsum(d.long(), 0).to(torch.int32).numpy().tobytes()
        pb, pe = hp[name]["data_offsets"]
        assert raw == bp[pb:pe], name
        assert c["raw_bytes"] == pe - pb and c["shape"] == hp[name]["shape"] and c["dtype"] == hp[name]["dtype"]


@pytest.mark.parametrize("name", sorted(GOLDEN_V2))
def test_safetensors_can_open_v2(name):
    with safetensors.safe_open(str(GOLDEN_DIR / name), "pt") as f:
        meta = f.metadata()
        assert meta[C.META_FORMAT] == "kvpack" and meta[C.META_FORMAT_VERSION] == "2"
        codecs = json.loads(meta.get(C.META_TENSOR_CODECS, "{}"))
        for tname in f.keys():
            t = f.get_tensor(tname)
            if tname in codecs:
                assert t.dtype == torch.uint8 and t.dim() == 1  # the zstd frame, as bytes
                assert bytes(t.numpy()[:4]) == C.ZSTD_FRAME_MAGIC
        if "int4" in name and not codecs:
            pack = GOLDEN_V2[name][0]()
            assert torch.equal(f.get_tensor("layers.1.key_codes"), pack.layers[1].quant.key_codes)
            assert torch.equal(f.get_tensor("layers.1.keys"), pack.layers[1].keys)


# --- the version rule -------------------------------------------------------------------------------------------


def test_a_file_declares_the_lowest_version_it_needs():
    for name, make in GOLDEN.items():
        assert read_header(pack_to_bytes(make(), checksum="sha256")).format_version == 1
        assert pack_to_bytes(make(), 0, "sha256") == (GOLDEN_DIR / name).read_bytes()
        assert read_header(pack_to_bytes(make())).format_version == 3  # XXH3 checksums (the default)
    assert read_header(pack_to_bytes(golden_f32(), 1, "sha256")).format_version == 2
    assert read_header(pack_to_bytes(golden_int4(), 0, "sha256")).format_version == 2
    assert read_header(pack_to_bytes(golden_int4(), 3)).format_version == 3


@pytest.mark.parametrize("checksum", ["md5", "SHA256", None, 3])
def test_bad_checksum_is_input_error(checksum):
    with pytest.raises(InputError, match="checksum must be one of 'xxh3', 'sha256'"):
        pack_to_bytes(golden_f32(), 0, checksum)


def test_save_defaults_to_no_zstd_and_xxh3(tmp_path):
    path = tmp_path / "a.kvpack"
    save(golden_f32(), path)
    assert path.read_bytes() == (GOLDEN_DIR / "small_f32_xxh3.kvpack").read_bytes()
    n = save(golden_f32(), path, zstd_level=3)
    assert n == path.stat().st_size and read_header(path).zstd_level == 3


# --- round trips ------------------------------------------------------------------------------------------------


HEADS = [[40, 0, 3, 70], [33, 2, 3, 4], [0, 0, 0, 0], [64, 64, 1, 31]]


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", [0, 1, 3, 19])
@pytest.mark.parametrize("qtype", ["none", "int8", "int4"])
def test_round_trip(dtype, level, qtype, checksum):
    pack = random_pack(dtype, HEADS, head_dim=8, head_dim_v=8, tokens=90)
    if qtype != "none":
        pack = quantize_pack(pack, qtype, 32, "kivi")
    data = pack_to_bytes(pack, level, checksum)
    assert_packs_equal(load_pack(data), pack)
    assert pack_to_bytes(load_pack(data), level, checksum) == data
    header = read_header(data)
    assert header.checksum == checksum
    if checksum == "xxh3":
        assert header.format_version == 3
    else:
        assert header.format_version == (1 if qtype == "none" and level == 0 else 2)
    assert header.zstd_level == level and header.quant_type == qtype
    if level:  # zero-size tensors stay raw, every other one is one frame
        encoded = {n for n, t in header.tensors.items() if t.codec is not None}
        assert encoded == {n for n, t in header.tensors.items() if t.raw_nbytes > 0}


def test_delta_filter_handles_head_boundaries_and_extremes():
    pack = random_pack(torch.float16, [[5, 0, 7]], tokens=40)
    layer = pack.layers[0]
    layer.positions = torch.tensor([0, 9, 10, 38, 39, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)  # drops at a head
    assert_packs_equal(load_pack(pack_to_bytes(pack, 3)), pack)
    pack.token_ids = torch.tensor([C.INT32_MAX, 0] * 20)  # delta/shuffle is not used for token ids, but extremes
    assert_packs_equal(load_pack(pack_to_bytes(pack, 3)), pack)


def test_zstd_shrinks_compressible_packs_and_int4_shrinks_more():
    pack = random_pack(torch.float16, [[200, 180], [150, 220]], head_dim=32, head_dim_v=32, tokens=400)
    for layer in pack.layers:
        layer.keys = (layer.keys * 4).round() / 4  # a few distinct values: compressible
    plain, zipped = len(pack_to_bytes(pack)), len(pack_to_bytes(pack, 3))
    q = quantize_pack(pack, "int4", 32, "kivi")
    q_plain, q_zipped = len(pack_to_bytes(q)), len(pack_to_bytes(q, 3))
    assert zipped < 0.9 * plain and q_plain < 0.45 * plain and q_zipped < q_plain


@pytest.mark.parametrize("level", [-1, 23, True, 2.0, "3"])
def test_bad_zstd_level_is_input_error(level):
    with pytest.raises(InputError, match="zstd_level"):
        pack_to_bytes(golden_f32(), level)


def _bad_quant_packs():
    base = golden_int4
    p1 = base(); p1.layers[1].quant.group_size = 64
    p2 = base(); p2.layers[0].quant = None
    p3 = base(); p3.layers[0].quant.body_lengths = torch.tensor([0, 32])
    p4 = base(); p4.layers[0].keys = p4.layers[0].keys[1:]
    p5 = base(); p5.layers[0].quant.key_scales = p5.layers[0].quant.key_scales.float()
    p6 = base(); p6.layers[1].quant.value_codes = p6.layers[1].quant.value_codes[:, :1]
    p7 = base(); p7.sink_tokens = 40  # the layout rule now gives other body rows
    p8 = base(); p8.layers[0].quant.qtype = "int2"
    return [p1, p2, p3, p4, p5, p6, p7, p8]


@pytest.mark.parametrize("pack", _bad_quant_packs())
def test_writer_rejects_inconsistent_quantized_packs(pack):
    with pytest.raises(InputError, match="cannot write this pack"):
        pack_to_bytes(pack)
