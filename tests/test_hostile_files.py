"""Hostile and damaged .kvpack files, all derived from a golden file: each must raise its specific PackFormatError.

Forged files are re-signed with the spec's rules (canonical JSON, SHA-256) written out here independently of
the reader, so that the check under test, not a checksum, is what fires.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import tracemalloc

import pytest
import safetensors.torch
import torch

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


def forge(edit_header=None, tensors: dict[str, bytes] | None = None, sign: bool = True) -> bytes:
    """The golden file with some tensors' bytes replaced (same size, checksums updated) and/or the header edited."""
    obj, buf = split()
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


T = TruncatedFileError
X = CorruptFileError
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
    "format_version 2": (forge(set_meta("format_version", "2")), UnsupportedVersionError),
    "format_version 2 unsigned": (forge(set_meta("format_version", "2"), sign=False), UnsupportedVersionError),
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
# Checks that need the tensor data: read_header does not see these problems.
DATA_LEVEL = {
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


@pytest.mark.parametrize("case", ["cut inside header", "wrong magic", "format_version 2", "positions decreasing"])
def test_hostile_file_on_disk_names_the_file(tmp_path, case):
    data, error = CASES[case]
    path = tmp_path / "bad.kvpack"
    path.write_bytes(data)
    with pytest.raises(error, match="bad.kvpack"):
        load_pack(path)


def test_forge_without_changes_is_the_golden_file():
    assert forge() == GOLD


def test_newer_version_says_upgrade():
    with pytest.raises(UnsupportedVersionError, match="upgrade kvpack"):
        load_pack(CASES["format_version 2"][0])


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
