"""Hostile and damaged .kvpack files, all derived from a golden file: each must raise its specific PackFormatError.

Forged files are re-signed with the spec's rules (canonical JSON, SHA-256; XXH3-128 for version-3 tensor checksums)
written out here independently of the reader, so that the check under test, not a checksum, is what fires.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import time
import tracemalloc

import pytest
import safetensors.torch
import torch
import xxhash
import zstandard

from kvpack import constants as C
from kvpack.errors import (
    ChecksumMismatchError,
    CorruptFileError,
    NotAKvpackFileError,
    PackFormatError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from kvpack.fileformat import load_pack, read_header, verify

from .golden_packs import GOLDEN_DIR

GOLD = (GOLDEN_DIR / "small_f32.kvpack").read_bytes()
NEWER = str(C.MAX_READABLE_VERSION + 1)
N = int.from_bytes(GOLD[:8], "little")


def canon(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def split(data: bytes = GOLD) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def assemble(obj: dict, buf: bytes, sign: bool = True, text: bytes | None = None) -> bytes:
    """Header + buffer; with ``sign`` the header checksum is recomputed per the spec."""
    meta = obj["__metadata__"]
    if sign:
        meta.pop("header_sha256", None)
        meta["header_sha256"] = sha(canon(obj))
    text = canon(obj) if text is None else text
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + buf


def forge(edit_header=None, tensors: dict[str, bytes] | None = None, sign: bool = True, base: bytes = GOLD) -> bytes:
    """A golden file with some tensors' bytes replaced (same size, checksums updated) and/or the header edited."""
    obj, buf = split(base)
    buf = bytearray(buf)
    sums = json.loads(obj["__metadata__"]["tensor_sha256"])
    for name, data in (tensors or {}).items():
        b, e = obj[name]["data_offsets"]
        assert len(data) == e - b
        buf[b:e] = data
        sums[name] = sha(data)
    obj["__metadata__"]["tensor_sha256"] = canon(sums).decode()
    if edit_header is not None:
        edit_header(obj)
    return assemble(obj, bytes(buf), sign=sign)


def i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def with_length(n: int, data: bytes = GOLD) -> bytes:
    return n.to_bytes(8, "little") + data[8:]


def set_meta(key, value):
    def edit(obj):
        obj["__metadata__"][key] = value

    return edit


def set_kvpack(key, value):
    def edit(obj):
        kv = json.loads(obj["__metadata__"]["kvpack"])
        if value is None:
            kv.pop(key)
        else:
            kv[key] = value
        obj["__metadata__"]["kvpack"] = canon(kv).decode()

    return edit


def set_entry(name, key, value):
    def edit(obj):
        obj[name][key] = value

    return edit


def move_token_ids(obj):
    """Holey layout: token_ids (last in the buffer) starts 4 bytes late."""
    obj["token_ids"]["data_offsets"] = [452, 484]


def overlap(obj):
    obj["layers.0.positions"]["data_offsets"] = [120, 148]


def add_tensor(obj):
    obj["extra"] = {"dtype": "U8", "shape": [0], "data_offsets": [480, 480]}
    sums = json.loads(obj["__metadata__"]["tensor_sha256"])
    sums["extra"] = sha(b"")
    obj["__metadata__"]["tensor_sha256"] = canon(sums).decode()


def drop_token_ids(obj):
    del obj["token_ids"]
    sums = json.loads(obj["__metadata__"]["tensor_sha256"])
    del sums["token_ids"]
    obj["__metadata__"]["tensor_sha256"] = canon(sums).decode()


def _non_json() -> bytes:
    text = C.MAGIC + b"this is not json"
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _indented() -> bytes:
    obj, buf = split()
    return assemble(obj, buf, text=json.dumps(obj, sort_keys=True, indent=1).encode())


def _spaced() -> bytes:
    """Same JSON, magic intact, one extra space: not canonical."""
    obj, buf = split()
    return assemble(obj, buf, text=canon(obj).replace(b'"format_version":"1"', b'"format_version": "1"'))


def _duplicate_key() -> bytes:
    obj, buf = split()
    text = canon(obj)
    text = text[:-1] + b',"token_ids":' + canon(obj["token_ids"]) + b"}"
    return assemble(obj, buf, sign=False, text=text)


def _plain_safetensors() -> bytes:
    return safetensors.torch.save({"a": torch.zeros(3)}, metadata={"format": "pt"})


# --- version 2: zstd frames and quantized layers ---------------------------------------------------------------

GOLD_Z = (GOLDEN_DIR / "small_f32_zstd.kvpack").read_bytes()  # every tensor one zstd frame
GOLD_Q = (GOLDEN_DIR / "small_int4.kvpack").read_bytes()  # int4, group size 32, no zstd
TOKEN_IDS_RAW = struct.pack("<8i", 1, 5, 9, 300, 70000, 2, 0, 2**31 - 1)  # golden_f32's token ids


def restore(base: bytes, blobs: dict[str, bytes] | None = None, edit_header=None, drop: tuple[str, ...] = (),
            sign: bool = True, xxh3: bool = False) -> bytes:
    """``base`` with some tensors' stored bytes replaced by bytes of any length (an encoded tensor's index shape,
    all offsets and checksums recomputed: SHA-256, or XXH3-128 with ``xxh3``), tensors dropped, and/or the header
    edited."""
    obj, buf = split(base)
    meta = obj["__metadata__"]
    names = sorted((n for n in obj if n != "__metadata__"), key=lambda n: obj[n]["data_offsets"][0])
    parts = {n: buf[obj[n]["data_offsets"][0] : obj[n]["data_offsets"][1]] for n in names}
    parts.update(blobs or {})
    codecs = json.loads(meta.get("tensor_codecs", "{}"))
    sums, out, end = {}, b"", 0
    for n in names:
        if n in drop:
            del obj[n]
            codecs.pop(n, None)
            continue
        obj[n]["data_offsets"] = [end, end + len(parts[n])]
        if n in codecs:
            obj[n]["shape"] = [len(parts[n])]
        sums[n] = xxhash.xxh3_128_hexdigest(parts[n]) if xxh3 else sha(parts[n])
        out += parts[n]
        end += len(parts[n])
    meta["tensor_xxh3" if xxh3 else "tensor_sha256"] = canon(sums).decode()
    if "tensor_codecs" in meta:
        meta["tensor_codecs"] = canon(codecs).decode()
    if edit_header is not None:
        edit_header(obj)
    return assemble(obj, out, sign=sign)


def zframe(raw: bytes, content_size: bool = True) -> bytes:
    """``raw`` shuffled as 4-byte elements (the token ids' filter) in one zstd frame."""
    shuffled = bytes(raw[i * 4 + j] for j in range(4) for i in range(len(raw) // 4))
    return zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(shuffled)


def huge_frame(size: int = 2**40) -> bytes:
    """A hand-made zstd frame header declaring ``size`` decompressed bytes, then one empty last raw block."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x00]) + size.to_bytes(8, "little") + b"\x01\x00\x00"


def set_codec(name, key, value):
    def edit(obj):
        codecs = json.loads(obj["__metadata__"]["tensor_codecs"])
        codecs[name][key] = value
        obj["__metadata__"]["tensor_codecs"] = canon(codecs).decode()

    return edit


def _flipped_frame_byte() -> bytes:
    obj, buf = split(GOLD_Z)
    b, e = obj["layers.0.values"]["data_offsets"]
    frame = bytearray(buf[b:e])
    frame[len(frame) // 2] ^= 0x10
    return restore(GOLD_Z, {"layers.0.values": bytes(frame)})


T = TruncatedFileError
X = CorruptFileError
CASES_V2 = {
    # zstd frames (data level: each tensor's SHA-256 matches, so the frame checks are what fire)
    "zstd frame damaged, checksum re-signed": (_flipped_frame_byte(), X),
    "zstd frame declares another size": (restore(GOLD_Z, {"token_ids": zframe(TOKEN_IDS_RAW + bytes(4))}), X),
    "zstd frame declares 2**40 bytes": (restore(GOLD_Z, {"token_ids": huge_frame()}), X),
    "zstd frame declares 2**64-2 bytes": (restore(GOLD_Z, {"token_ids": huge_frame(2**64 - 2)}), X),
    "zstd frame without content size": (restore(GOLD_Z, {"token_ids": zframe(TOKEN_IDS_RAW, False)}), X),
    "zstd frame then trailing bytes": (restore(GOLD_Z, {"token_ids": zframe(TOKEN_IDS_RAW) + b"\0\0"}), X),
    "two zstd frames": (restore(GOLD_Z, {"token_ids": zframe(TOKEN_IDS_RAW) + zframe(TOKEN_IDS_RAW)}), X),
    "not a zstd frame": (restore(GOLD_Z, {"token_ids": b"not compressed at all"}), X),
    "empty zstd frame bytes": (restore(GOLD_Z, {"token_ids": b""}), X),
    "skippable zstd frame": (restore(GOLD_Z, {"token_ids": b"\x50\x2a\x4d\x18" + struct.pack("<I", 0)}), X),
    "zstd frame cut short": (restore(GOLD_Z, {"token_ids": zframe(TOKEN_IDS_RAW)[:-6]}), X),
    # tensor_codecs (header level)
    "unknown codec": (restore(GOLD_Z, edit_header=set_codec("token_ids", "codec", "lz4")), X),
    "unknown filter": (restore(GOLD_Z, edit_header=set_codec("token_ids", "filter", "xor")), X),
    "delta filter on floats": (restore(GOLD_Z, edit_header=set_codec("layers.0.keys", "filter", "delta_shuffle")), X),
    "raw_bytes not shape x itemsize": (restore(GOLD_Z, edit_header=set_codec("token_ids", "raw_bytes", 36)), X),
    "codec level 0": (restore(GOLD_Z, edit_header=set_codec("token_ids", "level", 0)), X),
    "codec extra key": (restore(GOLD_Z, edit_header=set_codec("token_ids", "note", 1)), X),
    "codec decodes to a huge tensor": (restore(GOLD_Z, edit_header=lambda o: (
        set_codec("token_ids", "shape", [2**31 - 1])(o), set_codec("token_ids", "raw_bytes", 4 * (2**31 - 1))(o))), X),
    "codec for an unknown tensor": (restore(GOLD_Z, edit_header=lambda o: o["__metadata__"].update(
        tensor_codecs=o["__metadata__"]["tensor_codecs"][:-1] + ',"zz":{}}')), X),
    "empty tensor_codecs": (forge(set_meta("tensor_codecs", "{}"), base=GOLD_Q), X),
    "v1 file with tensor_codecs": (restore(GOLD_Z, edit_header=set_meta("format_version", "1")), X),
    "zstd file says version 3": (restore(GOLD_Z, edit_header=set_meta("format_version", NEWER)),
                                  UnsupportedVersionError),
    # quantization (header level unless noted)
    "quant type int3": (forge(set_meta("quant", '{"group_size":32,"type":"int3"}'), base=GOLD_Q), X),
    "quant group size 0": (forge(set_meta("quant", '{"group_size":0,"type":"int4"}'), base=GOLD_Q), X),
    "quant group size 16": (forge(set_meta("quant", '{"group_size":16,"type":"int4"}'), base=GOLD_Q), X),
    "quant says int8 for int4 codes": (forge(set_meta("quant", '{"group_size":32,"type":"int8"}'), base=GOLD_Q), X),
    "quant not JSON": (forge(set_meta("quant", "int4"), base=GOLD_Q), X),
    "quant key missing": (forge(lambda o: o["__metadata__"].pop("quant"), base=GOLD_Q), X),
    "key_codes missing": (restore(GOLD_Q, drop=("layers.0.key_codes",)), X),
    "value_mins missing": (restore(GOLD_Q, drop=("layers.1.value_mins",)), X),
    "sink_tokens breaks the layout rule": (forge(set_kvpack("sink_tokens", 7), base=GOLD_Q), X),  # data level
}
DATA_LEVEL_V2 = {name for name in CASES_V2 if name.startswith(("zstd frame", "two zstd", "not a zstd", "empty zstd",
                                                                 "skippable", "sink_tokens"))}

CASES = {
    # sizes and magic
    "empty": (b"", T),
    "5 bytes": (GOLD[:5], T),
    "only length prefix": (GOLD[:8], T),
    "cut inside magic": (GOLD[:20], T),
    "cut inside header": (GOLD[: 8 + N // 2], T),
    "cut at data start": (GOLD[: 8 + N], T),
    "cut inside data": (GOLD[:-1], T),
    "cut inside data 2": (GOLD[:-100], T),
    "wrong magic": (GOLD.replace(b'"format":"kvpack"', b'"format":"kvpacc"', 1), NotAKvpackFileError),
    "plain safetensors file": (_plain_safetensors(), NotAKvpackFileError),
    "png": (b"\x89PNG\r\n\x1a\n" + bytes(100), NotAKvpackFileError),
    "zeros": (bytes(64), NotAKvpackFileError),
    "header length larger than file": (with_length(len(GOLD)), T),
    "header length over cap": (with_length(C.MAX_HEADER_BYTES + 8), X),
    "header length 2**64-1": (with_length(2**64 - 1), X),
    "header length not multiple of 8": (with_length(N - 1), X),
    "header length too short": (with_length(N - 8), X),
    "non-JSON header": (_non_json(), X),
    "extra trailing byte": (GOLD + b"\0", X),
    "extra trailing bytes": (GOLD + bytes(8), X),
    # header JSON
    "indented header": (_indented(), NotAKvpackFileError),
    "non-canonical header": (_spaced(), X),
    "duplicate key": (_duplicate_key(), X),
    "NaN in header": (GOLD.replace(b'"shape":[8]', b'"shape":NaN', 1), X),
    "metadata value not string": (forge(set_meta("kvpack", 3)), X),
    "missing tensor_sha256": (forge(lambda o: o["__metadata__"].pop("tensor_sha256")), X),
    "format_version 0": (forge(set_meta("format_version", "0")), X),
    "format_version text": (forge(set_meta("format_version", "one")), X),
    "format_version newer": (forge(set_meta("format_version", NEWER)), UnsupportedVersionError),
    "format_version newer unsigned": (forge(set_meta("format_version", NEWER), sign=False), UnsupportedVersionError),
    "format_version 2 without v2 features": (forge(set_meta("format_version", "2")), X),
    "v1 file with quant key": (forge(set_meta("quant", '{"group_size":32,"type":"int4"}')), X),
    "format_version huge": (forge(set_meta("format_version", "9" * 400)), X),
    # tensor index
    "overlapping offsets": (forge(overlap), X),
    "holey offsets": (forge(move_token_ids), X),
    "negative shape": (forge(set_entry("token_ids", "shape", [-8])), X),
    "huge shape": (forge(set_entry("layers.0.keys", "shape", [2**40, 4])), X),
    "huge zero-size shape": (forge(set_entry("layers.1.keys", "shape", [0, 2**70])), X),
    "float shape": (forge(set_entry("token_ids", "shape", [8.0])), X),
    "bool shape": (forge(set_entry("token_ids", "shape", [True] * 1)), X),
    "negative offset": (forge(set_entry("head_lengths", "data_offsets", [-16, 0])), X),
    "unknown dtype": (forge(set_entry("layers.0.keys", "dtype", "Q4")), X),
    "F64 dtype": (forge(set_entry("layers.0.keys", "dtype", "F64")), X),
    "keys stored as I32": (forge(set_entry("layers.0.keys", "dtype", "I32")), X),
    "token_ids stored as F32": (forge(set_entry("token_ids", "dtype", "F32")), X),
    "extra index key": (forge(set_entry("token_ids", "note", "x")), X),
    "unexpected tensor": (forge(add_tensor), X),
    "missing tensor": (assemble(*(lambda o, b: (drop_token_ids(o) or o, b[:-32]))(*split())), X),
    "tensor_sha256 missing a tensor": (forge(lambda o: o["__metadata__"].update(tensor_sha256="{}")), X),
    "kvpack metadata not JSON": (forge(set_meta("kvpack", "{oops")), X),
    "sink_tokens missing": (forge(set_kvpack("sink_tokens", None)), X),
    "sink_tokens negative": (forge(set_kvpack("sink_tokens", -1)), X),
    "sink_tokens above tokens": (forge(set_kvpack("sink_tokens", 9)), X),
    # checksums
    "header checksum mismatch": (forge(set_kvpack("method", "other"), sign=False), ChecksumMismatchError),
    "header checksum not hex": (forge(set_meta("header_sha256", "z" * 64), sign=False), X),
    "tensor checksum mismatch": (GOLD[:-1] + bytes([GOLD[-1] ^ 1]), ChecksumMismatchError),
    # tensor contents (re-signed, so the semantic checks fire)
    "head_lengths not summing": (forge(tensors={"head_lengths": i32(4, 2, 5, 0)}), X),
    "head_lengths negative": (forge(tensors={"head_lengths": i32(4, 3, 6, -1)}), X),
    "position equal to tokens": (forge(tensors={"layers.0.positions": i32(0, 1, 4, 6, 0, 1, 8)}), X),
    "position negative": (forge(tensors={"layers.0.positions": i32(-1, 1, 4, 6, 0, 1, 7)}), X),
    "positions decreasing": (forge(tensors={"layers.0.positions": i32(0, 4, 1, 6, 0, 1, 7)}), X),
    "positions repeated": (forge(tensors={"layers.1.positions": i32(0, 1, 2, 2, 5)}), X),
    "negative token id": (forge(tensors={"token_ids": i32(1, 5, 9, 300, -7, 2, 0, 1)}), X),
}

# --- version 3: XXH3-128 tensor checksums (re-signed with xxhash directly, not through the reader) ----------------
GOLD3 = (GOLDEN_DIR / "small_f32_xxh3.kvpack").read_bytes()


def forge3(edit_header=None, tensors: dict[str, bytes] | None = None, base: bytes = GOLD3) -> bytes:
    """``forge`` for a golden file with XXH3-128 tensor checksums (version 3, or ``base``): replaced tensors get
    their XXH3-128 recomputed."""
    obj, buf = split(base)
    buf = bytearray(buf)
    sums = json.loads(obj["__metadata__"]["tensor_xxh3"])
    for name, data in (tensors or {}).items():
        b, e = obj[name]["data_offsets"]
        buf[b:e] = data
        sums[name] = xxhash.xxh3_128_hexdigest(data)
    obj["__metadata__"]["tensor_xxh3"] = canon(sums).decode()
    if edit_header is not None:
        edit_header(obj)
    return assemble(obj, bytes(buf))


def _sha256_sums_of(data: bytes) -> str:
    obj, buf = split(data)
    return canon({n: sha(buf[e["data_offsets"][0] : e["data_offsets"][1]]) for n, e in obj.items()
                  if n != "__metadata__"}).decode()


CASES_V3 = {
    "v3 tensor checksum mismatch": (GOLD3[:-1] + bytes([GOLD3[-1] ^ 1]), ChecksumMismatchError),
    "v3 labelled v1 keeps tensor_xxh3": (forge3(set_meta("format_version", "1")), X),
    "v3 labelled v2 keeps tensor_xxh3": (forge3(set_meta("format_version", "2")), X),
    "v3 with sha256 sums only": (forge3(lambda o: o["__metadata__"].update(
        tensor_sha256=o["__metadata__"].pop("tensor_xxh3"))), X),
    "v3 with both checksum keys": (forge3(set_meta("tensor_sha256", _sha256_sums_of(GOLD3))), X),
    "v1 labelled v3 (no tensor_xxh3)": (forge(set_meta("format_version", "3")), X),
    "v3 xxh3 digest too short": (forge3(lambda o: o["__metadata__"].update(tensor_xxh3=canon({
        k: v[:-1] for k, v in json.loads(o["__metadata__"]["tensor_xxh3"]).items()}).decode())), X),
    "v3 xxh3 digest is a sha256": (forge3(set_meta("tensor_xxh3", _sha256_sums_of(GOLD3))), X),
    "v3 positions decreasing": (forge3(tensors={"layers.0.positions": i32(0, 4, 1, 6, 0, 1, 7)}), X),
}
# --- version 4: the compact quantized layout ---------------------------------------------------------------------
GOLD4 = (GOLDEN_DIR / "small_int4_compact.kvpack").read_bytes()


#: ``forge3`` on the version-4 golden file.
forge4 = functools.partial(forge3, base=GOLD4)


def _grid_with(row: int, col: int, value: float) -> bytes:
    obj, buf = split(GOLD4)
    b, e = obj["layers.0.quant_grid"]["data_offsets"]
    grid = torch.frombuffer(bytearray(buf[b:e]), dtype=torch.float32).reshape(3, -1).clone()
    grid[row, col] = value
    return grid.numpy().tobytes()


def _drop_quant(obj):
    obj["__metadata__"].pop("quant")


# layer 0's key widths are [[7, 4, 3, 2], [4, 4, 4, 4]] (head_dim 4, int4: 16 bits a row)
CASES_V4 = {
    "v4 key widths not summing to 16": (forge4(tensors={"layers.0.key_bits": bytes([7, 4, 3, 3, 4, 4, 4, 4])}), X),
    "v4 key width 0": (forge4(tensors={"layers.0.key_bits": bytes([8, 4, 4, 0, 4, 4, 4, 4])}), X),
    "v4 key width 9": (forge4(tensors={"layers.0.key_bits": bytes([9, 4, 2, 1, 4, 4, 4, 4])}), X),
    "v4 grid NaN": (forge4(tensors={"layers.0.quant_grid": _grid_with(1, 0, float("nan"))}), X),
    "v4 grid negative scale base": (forge4(tensors={"layers.0.quant_grid": _grid_with(2, 1, -0.5)}), X),
    "v4 quant without layout": (forge4(set_meta("quant", '{"group_size":32,"type":"int4"}')), X),
    "v4 quant with another layout": (forge4(set_meta("quant", '{"group_size":32,"layout":"kivi","type":"int4"}')),
                                     X),
    "v4 labelled v3": (forge4(set_meta("format_version", "3")), X),
    "v4 without quant": (forge4(_drop_quant), X),
    "v4 sink moved (other body rows)": (forge4(set_kvpack("sink_tokens", 1)), X),
}
DATA_LEVEL_V4 = {"v4 key widths not summing to 16", "v4 key width 0", "v4 key width 9", "v4 grid NaN",
                 "v4 grid negative scale base", "v4 sink moved (other body rows)"}

# --- version 5: the compact layout, tensors stacked over the layers ---------------------------------------------
GOLD5 = (GOLDEN_DIR / "small_int4_stacked.kvpack").read_bytes()

#: ``forge3`` on the version-5 golden file.
forge5 = functools.partial(forge3, base=GOLD5)


def _stored(data: bytes, name: str) -> bytes:
    obj, buf = split(data)
    b, e = obj[name]["data_offsets"]
    return buf[b:e]


def _add_layer_tensor(obj):
    """An empty ``layers.0.key_bits`` where the layout rule puts it (U8 tensors by name: after ``key_params``)."""
    end = obj["key_params"]["data_offsets"][1]
    obj["layers.0.key_bits"] = {"dtype": "U8", "shape": [0], "data_offsets": [end, end]}
    sums = json.loads(obj["__metadata__"]["tensor_xxh3"])
    sums["layers.0.key_bits"] = xxhash.xxh3_128_hexdigest(b"")
    obj["__metadata__"]["tensor_xxh3"] = canon(sums).decode()


# entries per (layer, head) [[38, 5], [48, 33]], sink 2, G 32: body rows [[36, 0], [46, 33]], 6 key groups
_BITS5 = _stored(GOLD5, "key_bits")  # [2 layers, 2 heads, 4 channels] uint8; layer 0 head 0: [7, 4, 3, 2]
CASES_V5 = {
    "v5 key widths not summing to 16": (forge5(tensors={"key_bits": bytes([7, 4, 3, 3]) + _BITS5[4:]}), X),
    "v5 layer 1 key width 0": (forge5(tensors={"key_bits": _BITS5[:8] + bytes([8, 4, 4, 0]) + _BITS5[12:]}), X),
    "v5 head lengths not summing": (forge5(tensors={"head_lengths": i32(38, 5, 48, 32)}), X),
    "v5 head lengths moving a row to layer 0": (forge5(tensors={"head_lengths": i32(39, 5, 47, 33)}), X),
    "v5 one key group short": (restore(GOLD5, {"key_params": _stored(GOLD5, "key_params")[:20]
                                                 + _stored(GOLD5, "key_params")[24:44]},
                                       edit_header=set_entry("key_params", "shape", [2, 5, 4]), xxh3=True), X),
    "v5 sink moved (other body rows)": (forge5(set_kvpack("sink_tokens", 1)), X),
    "v5 key widths of one layer": (forge5(set_entry("key_bits", "shape", [4, 4])), X),
    "v5 grid as one layer": (forge5(set_entry("quant_grid", "shape", [6, 5])), X),
    "v5 with a per-layer tensor": (forge5(_add_layer_tensor), X),
    "v5 labelled v4": (forge5(set_meta("format_version", "4")), X),
    "v4 labelled v5": (forge4(set_meta("format_version", "5")), X),
    "v5 without quant": (forge5(_drop_quant), X),
}
DATA_LEVEL_V5 = {"v5 key widths not summing to 16", "v5 layer 1 key width 0", "v5 head lengths not summing",
                 "v5 head lengths moving a row to layer 0", "v5 one key group short", "v5 sink moved (other body rows)"}

# Checks that need the tensor data: read_header does not see these problems.
CASES.update(CASES_V2)
CASES.update(CASES_V3)
CASES.update(CASES_V4)
CASES.update(CASES_V5)
DATA_LEVEL = DATA_LEVEL_V2 | DATA_LEVEL_V4 | DATA_LEVEL_V5 | {
    "v3 tensor checksum mismatch", "v3 positions decreasing"} | {
    "tensor checksum mismatch",
    "head_lengths not summing",
    "head_lengths negative",
    "position equal to tokens",
    "position negative",
    "positions decreasing",
    "positions repeated",
    "negative token id",
}


@pytest.mark.parametrize("reader", [load_pack, verify])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file(case, reader):
    data, error = CASES[case]
    with pytest.raises(error) as info:
        reader(data)
    assert type(info.value) is error
    assert "kvpack" in str(info.value)  # every message names the fix (`kvpack build` or upgrade kvpack)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_header_only(case):
    data, error = CASES[case]
    if case in DATA_LEVEL:
        read_header(data)
    else:
        with pytest.raises(error):
            read_header(data)


@pytest.mark.parametrize("case", ["cut inside header", "wrong magic", "format_version newer", "positions decreasing"])
def test_hostile_file_on_disk_names_the_file(tmp_path, case):
    data, error = CASES[case]
    path = tmp_path / "bad.kvpack"
    path.write_bytes(data)
    with pytest.raises(error, match="bad.kvpack"):
        load_pack(path)


def test_forge_without_changes_is_the_golden_file():
    assert forge() == GOLD and forge3() == GOLD3


def test_v3_checksum_error_names_the_algorithm_and_section():
    with pytest.raises(ChecksumMismatchError, match=r"'token_ids'.*XXH3-128"):
        load_pack(CASES["v3 tensor checksum mismatch"][0])


def test_newer_version_says_upgrade():
    with pytest.raises(UnsupportedVersionError, match="upgrade kvpack"):
        load_pack(CASES["format_version newer"][0])


def test_checksum_error_names_the_section():
    with pytest.raises(ChecksumMismatchError, match="token_ids"):
        load_pack(GOLD[:-1] + bytes([GOLD[-1] ^ 0x80]))
    with pytest.raises(ChecksumMismatchError, match="'header'"):
        load_pack(CASES["header checksum mismatch"][0])


def test_huge_header_length_allocates_nothing():
    tracemalloc.start()
    try:
        for n in (C.MAX_HEADER_BYTES, 2**63):
            with pytest.raises(PackFormatError):
                load_pack(with_length(n))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


EDGES = {0, 7, 8, 8 + len(C.MAGIC), 8 + N, len(GOLD) - 1}
SPREAD = sorted({round(i * (len(GOLD) - 1) / 29) for i in range(30)} | EDGES)


@pytest.mark.parametrize("offset", SPREAD)
def test_single_bit_flip_is_detected(offset):
    bit = offset % 8
    data = bytearray(GOLD)
    data[offset] ^= 1 << bit
    expected = ChecksumMismatchError if offset >= 8 + N else PackFormatError
    with pytest.raises(expected):
        load_pack(bytes(data))


def test_every_byte_flipped_once_is_detected_quickly():
    """One bit of every byte of the file (bit = offset mod 8): always a PackFormatError, never a hang."""
    start = time.monotonic()
    for offset in range(len(GOLD)):
        data = bytearray(GOLD)
        data[offset] ^= 1 << (offset % 8)
        with pytest.raises(PackFormatError):
            load_pack(bytes(data))
    assert time.monotonic() - start < 60


# --- version 2 --------------------------------------------------------------------------------------------------


def test_restore_without_changes_is_the_golden_file():
    assert restore(GOLD_Z) == GOLD_Z and restore(GOLD_Q) == GOLD_Q


@pytest.mark.parametrize("case", ["zstd frame declares 2**40 bytes", "zstd frame declares 2**64-2 bytes",
                                  "codec decodes to a huge tensor"])
def test_huge_declared_sizes_allocate_nothing(case):
    data, error = CASES[case]
    tracemalloc.start()
    try:
        with pytest.raises(error, match="kvpack"):
            load_pack(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_zstd_errors_name_the_tensor_and_the_problem():
    for case, pattern in (("zstd frame declares another size", "'token_ids'.*declares 36 decompressed bytes.*32"),
                          ("zstd frame without content size", "'token_ids'.*does not declare its decompressed size"),
                          ("zstd frame damaged, checksum re-signed", "'layers.0.values'.*damaged"),
                          ("codec decodes to a huge tensor", "decompression bomb")):
        with pytest.raises(CorruptFileError, match=pattern):
            load_pack(CASES[case][0])


def test_every_byte_of_a_frame_flipped_and_re_signed_is_an_error_or_changes_nothing():
    """zstd's content checksum and the size checks catch damage the SHA-256 no longer sees (it was re-signed);
    a flip that changes nothing decoded (e.g. a larger window) may load, but then to the very same pack."""
    obj, buf = split(GOLD_Z)
    b, e = obj["layers.0.keys"]["data_offsets"]
    good = load_pack(GOLD_Z)
    for i in range(e - b):
        frame = bytearray(buf[b:e])
        frame[i] ^= 1 << (i % 8)
        data = restore(GOLD_Z, {"layers.0.keys": bytes(frame)})
        try:
            pack = load_pack(data)
        except PackFormatError:
            continue
        assert torch.equal(pack.layers[0].keys, good.layers[0].keys), f"byte {i} of the frame changed the keys"
