"""Hostile and damaged .kvpack files, all derived from the golden files: each must raise its specific PackFormatError,
from ``load_pack``, ``verify`` and (for the header-level ones) ``read_header`` alike.

Forged files are re-signed with the spec's rules (``tests/forge.py``), so the check under test, not a checksum, is
what fires. ``tests/hostile/`` stores a corpus of these files (``python -m tests.test_hostile_files`` rewrites it);
``test_stored_corpus`` checks every stored file against its recorded error class.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import tracemalloc
from pathlib import Path

import pytest
import safetensors.torch
import torch
import zstandard

from kvpack import constants as C
from kvpack.errors import (ChecksumMismatchError, CorruptFileError, NotAKvpackFileError, PackFormatError,
                           TruncatedFileError, UnsupportedVersionError)
from kvpack.fileformat import load_pack, read_header, verify

from .forge import (assemble, canon, f32, i32, restore, rle_frame, set_codec, set_entry, set_kvpack, set_meta, split,
                    stored, with_length)
from .golden_packs import GOLDEN_DIR

GOLD = (GOLDEN_DIR / "small_f32.kvpack").read_bytes()  # 2 x 2 heads, entries [[4, 3], [5, 0]], 8 tokens, sink 2
GOLD_Z = (GOLDEN_DIR / "small_f32_zstd.kvpack").read_bytes()  # the same pack, every tensor one zstd frame
GOLD_Q = (GOLDEN_DIR / "small_int4.kvpack").read_bytes()  # int4, G 32, entries [[38, 5], [48, 33]]
GOLD_B = (GOLDEN_DIR / "small_f32_biases.kvpack").read_bytes()  # small_f32 with attention biases
GOLD_S = (GOLDEN_DIR / "small_f32_sha256.kvpack").read_bytes()  # small_f32 with SHA-256 tensor checksums
N = int.from_bytes(GOLD[:8], "little")
CORPUS = Path(__file__).resolve().parent / "hostile"
TOKEN_IDS_RAW = i32(1, 5, 9, 300, 70000, 2, 0, 2**31 - 1)  # golden_f32's token ids
POSITIONS = (0, 1, 4, 6, 0, 1, 7, 0, 1, 2, 3, 5)  # golden_f32's positions, layer after layer


def forge(edit_header=None, tensors: dict[str, bytes] | None = None, sign: bool = True, base: bytes = GOLD) -> bytes:
    """``base`` with some tensors' bytes replaced (checksums updated) and/or the header edited, re-signed."""
    return restore(base, tensors, edit_header, sign=sign)


def _non_json() -> bytes:
    text = C.MAGIC + b"this is not json"
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _indented() -> bytes:
    obj, buf = split(GOLD)
    return assemble(obj, buf, text=json.dumps(obj, sort_keys=True, indent=1).encode())


def _spaced() -> bytes:
    obj, buf = split(GOLD)
    return assemble(obj, buf, text=canon(obj).replace(b'"format_version":"1.0"', b'"format_version": "1.0"'))


def _duplicate_key() -> bytes:
    obj, buf = split(GOLD)
    text = canon(obj)
    return assemble(obj, buf, sign=False, text=text[:-1] + b',"token_ids":' + canon(obj["token_ids"]) + b"}")


def _kvpack_text(old: str, new: str, key: str, value):
    """An edit setting ``key`` of the kvpack metadata to ``value``, then replacing ``old`` by ``new`` in its JSON
    text (numbers such as ``1e400`` that no JSON serialiser writes)."""
    def edit(obj):
        set_kvpack(key, value)(obj)
        text = obj["__metadata__"]["kvpack"]
        assert old in text
        obj["__metadata__"]["kvpack"] = text.replace(old, new)

    return edit


def _utf16_kvpack():
    """An edit writing the kvpack metadata text in UTF-16-LE (NUL bytes escaped as ``\\u0000`` in the header), with a
    number beyond binary64 and a lone surrogate in it: ``json.loads`` of bytes would guess UTF-16 and accept both."""
    def edit(obj):
        kv = json.loads(obj["__metadata__"]["kvpack"])
        kv["stats"] = {"x": 0.0015}
        kv["method"] = "kvzip\ud800"
        text = canon(kv).decode().replace("0.0015", "1e400")
        obj["__metadata__"]["kvpack"] = text.encode("utf-16-le").decode("latin-1")

    return edit


def _raw_surrogate() -> bytes:
    """The header with a surrogate written as raw (CESU-style) UTF-8 bytes in a string, re-signed over those
    bytes: not canonical (canonical text is ASCII) and not Unicode."""
    obj, buf = split(GOLD)
    obj["__metadata__"]["note"] = "SURROGATE"
    text = canon(obj).replace(b"SURROGATE", b"\xed\xa0\x80")
    return assemble(obj, buf, sign=False, text=text)


def _deep(depth: int, where: str) -> bytes:
    """Nesting ``depth`` deep, in the kvpack metadata text or in the header itself (a tensor's shape)."""
    if where == "metadata":
        return forge(set_meta("kvpack", '{"sink_tokens":2,"stats":' + "[" * depth + "]" * depth + "}"))
    obj, buf = split(GOLD)
    text = canon(obj).replace(b'"shape":[8]', b'"shape":' + b"[" * depth + b"8" + b"]" * depth, 1)
    return assemble(obj, buf, sign=False, text=text)


def _long_header(nbytes: int) -> bytes:
    """A valid-looking header grown past ``nbytes`` by one long metadata string."""
    return forge(set_kvpack("stats", {"pad": "x" * nbytes}))


def _many_tensors(n: int) -> bytes:
    def edit(obj):
        end = obj["values"]["data_offsets"][1]
        for i in range(n):  # U8 tensors sort last: empty ones at the end of the buffer
            obj[f"zz{i:05d}"] = {"dtype": "U8", "shape": [0], "data_offsets": [end, end]}
        sums = json.loads(obj["__metadata__"]["tensor_xxh3"])
        sums.update({f"zz{i:05d}": "99aa06d3014798d86001c324468d497f" for i in range(n)})
        obj["__metadata__"]["tensor_xxh3"] = canon(sums).decode()

    return forge(edit)


def _heads(layers: int, heads: int) -> bytes:
    """``head_lengths`` declaring ``layers x heads`` (zstd-compressed zeros: a few bytes on disk)."""
    raw = bytes(4 * layers * heads)
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    return restore(GOLD_Z, {"head_lengths": frame}, lambda o: (set_codec("head_lengths", "shape", [layers, heads])(o),
                                                               set_codec("head_lengths", "raw_bytes", len(raw))(o)))


def _codec_entry(name: str, key: str, value):
    return restore(GOLD_Z, edit_header=set_codec(name, key, value))


def _plain_safetensors() -> bytes:
    return safetensors.torch.save({"a": torch.zeros(3)}, metadata={"format": "pt"})


def zframe(raw: bytes, content_size: bool = True) -> bytes:
    """``raw`` shuffled as 4-byte elements (the token ids' filter) in one zstd frame."""
    shuffled = bytes(raw[i * 4 + j] for j in range(4) for i in range(len(raw) // 4))
    return zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(shuffled)


def huge_frame(size: int = 2**40) -> bytes:
    """A hand-made zstd frame header declaring ``size`` decompressed bytes, then one empty last raw block."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x00]) + size.to_bytes(8, "little") + b"\x01\x00\x00"


def _flipped_frame_byte() -> bytes:
    frame = bytearray(stored(GOLD_Z, "values"))
    frame[len(frame) // 2] ^= 0x10
    return restore(GOLD_Z, {"values": bytes(frame)})


def _grid_with(row: int, col: int, value: float) -> bytes:
    grid = torch.frombuffer(bytearray(stored(GOLD_Q, "quant_grid")), dtype=torch.float32).reshape(2, 3, -1).clone()
    grid[0, row, col] = value
    return grid.numpy().tobytes()


_LAYOUT = {"prefix": "<s>", "separator": "\n\nQuestion: ", "turn_end": "\nAnswer:", "templated": False}


def _bomb(rows: int, code: str = "F16", pad: tuple[str, int] | None = None) -> bytes:
    """The decompression bomb of issue 30, scaled by ``rows``: small_f32_zstd with layer 0 head 0 holding ``rows``
    entries of zero keys and values (``code``, ``[rows, 4]``), token ids 0 and positions ``0 .. rows - 1``, every
    tensor one hand-made zstd frame of RLE blocks (a few bytes per 128 KiB decoded); otherwise consistent, checksums
    valid. ``pad``: ``(kvpack metadata field, characters)`` pads the header (``method_params`` is the issue's file:
    its 1,000,000 characters raised the old limit of 1,024x the file to about 1 GiB)."""
    kv = rows * 4 * (2 if code in ("F16", "BF16") else 4)
    blobs = {"token_ids": rle_frame([(0, 4 * rows)]), "head_lengths": zframe(i32(rows, 0, 0, 0)),
             "positions": rle_frame([(0, 1), (1, rows - 1), (0, 3 * rows)]),  # deltas 0, 1, 1, ... shuffled
             "keys": rle_frame([(0, kv)]), "values": rle_frame([(0, kv)])}

    def edit(obj):
        for name, shape, dtype in (("token_ids", [rows], "I32"), ("positions", [rows], "I32"),
                                   ("keys", [rows, 4], code), ("values", [rows, 4], code)):
            set_codec(name, "shape", shape)(obj)
            set_codec(name, "dtype", dtype)(obj)
            set_codec(name, "raw_bytes", math.prod(shape) * (4 if dtype in ("I32", "F32") else 2))(obj)
        if pad is not None:
            field, n = pad
            set_kvpack(field, {"method_params": {"pad": "x" * n}, "stats": {"pad": "x" * n},
                               "layout": {**_LAYOUT, "prefix": "x" * n}}[field])(obj)

    return restore(GOLD_Z, blobs, edit)


def _int4_codes_bomb(rows: int) -> bytes:
    """small_int4 with ``key_codes`` declared ``[rows, 2]`` and stored as one zstd frame of zero codes."""
    def edit(obj):
        obj["key_codes"]["dtype"], obj["key_codes"]["shape"] = "U8", [len(frame)]
        obj["__metadata__"]["tensor_codecs"] = canon({"key_codes": {
            "codec": "zstd", "dtype": "U8", "filter": "none", "level": 3, "raw_bytes": 2 * rows,
            "shape": [rows, 2]}}).decode()

    frame = rle_frame([(0, 2 * rows)])
    return restore(GOLD_Q, {"key_codes": frame}, edit)


#: Decompression bombs (issue 30): each refused from its header (no tensor decoded) by the per-tensor limit.
BOMBS = {
    "bomb: fp16 zeros, 1 MB of method_params padding": _bomb(1 << 24, pad=("method_params", 1_000_000)),
    "bomb: fp16 zeros, stats padding": _bomb(1 << 22, pad=("stats", 60_000)),
    "bomb: fp16 zeros, layout prefix padding": _bomb(1 << 22, pad=("layout", 60_000)),
    "bomb: fp16 zeros": _bomb(1 << 20),
    "bomb: bf16 zeros": _bomb(1 << 20, "BF16"),
    "bomb: f32 zeros": _bomb(1 << 20, "F32"),
    "bomb: keys just over the 1 MiB floor": _bomb((1 << 17) + 1),
    "bomb: int4 codes": _int4_codes_bomb(1 << 20),
    "bomb: token ids only": restore(GOLD_Z, {"token_ids": rle_frame([(0, 4 << 20)])}, lambda o: (
        set_codec("token_ids", "shape", [1 << 20])(o), set_codec("token_ids", "raw_bytes", 4 << 20)(o))),
}


_BITS = stored(GOLD_Q, "key_bits")  # [2 layers, 2 heads, 4 channels]; layer 0 head 0: [7, 4, 3, 2]
T, X, V = TruncatedFileError, CorruptFileError, UnsupportedVersionError
NEWER = f"{C.FORMAT_MAJOR + 1}.0"

#: name -> (file bytes, error class, whether ``read_header`` already sees it)
CASES: dict[str, tuple[bytes, type, bool]] = {}


def _add(level: str, cases: dict[str, tuple[bytes, type]]) -> None:
    for name, (data, error) in cases.items():
        CASES[name] = (data, error, level == "header")


_add("header", {
    # sizes and magic
    "empty": (b"", T),
    "5 bytes": (GOLD[:5], T),
    "only length prefix": (GOLD[:8], T),
    "cut inside magic": (GOLD[:20], T),
    "cut inside header": (GOLD[: 8 + N // 2], T),
    "cut at data start": (GOLD[: 8 + N], T),
    "cut inside data": (GOLD[:-1], T),
    "wrong magic": (GOLD.replace(b'"format":"kvpack"', b'"format":"kvpacc"', 1), NotAKvpackFileError),
    "plain safetensors file": (_plain_safetensors(), NotAKvpackFileError),
    "png": (b"\x89PNG\r\n\x1a\n" + bytes(100), NotAKvpackFileError),
    "zeros": (bytes(64), NotAKvpackFileError),
    "indented header": (_indented(), NotAKvpackFileError),
    "header length larger than file": (with_length(len(GOLD), GOLD), T),
    "header length over cap": (with_length(C.MAX_HEADER_BYTES + 8, GOLD), X),
    "header length 2**64-1": (with_length(2**64 - 1, GOLD), X),
    "header length not multiple of 8": (with_length(N - 1, GOLD), X),
    "header length too short": (with_length(N - 8, GOLD), X),
    "header of 5 MiB": (_long_header(5 << 20), X),
    "extra trailing byte": (GOLD + b"\0", X),
    # JSON
    "non-JSON header": (_non_json(), X),
    "non-canonical header": (_spaced(), X),
    "duplicate key": (_duplicate_key(), X),
    "NaN in header": (GOLD.replace(b'"shape":[8]', b'"shape":NaN', 1), X),
    "1e400 in header": (GOLD.replace(b'"shape":[8]', b'"shape":[1e400]', 1), X),
    "header nested 100000 deep": (_deep(100_000, "header"), X),
    "header nested 33 deep": (_deep(33, "header"), X),
    "metadata nested 100000 deep": (_deep(100_000, "metadata"), X),
    "metadata nested 40 deep": (_deep(40, "metadata"), X),
    "1e400 in the kvpack metadata": (forge(_kvpack_text("0.0015", "1e400", "method_params", {"x": 0.0015})), X),
    "-1e400 in the kvpack metadata": (forge(_kvpack_text("0.0015", "-1e400", "stats", {"x": 0.0015})), X),
    "integer 10**400 in the kvpack metadata": (forge(set_kvpack("stats", {"x": 10**400})), X),
    "lone surrogate in the method": (forge(set_kvpack("method", "kvzip\ud800")), X),
    "lone surrogate in the layout": (forge(set_kvpack("layout", {**_LAYOUT, "separator": "Q\udfff: "})), X),
    "lone surrogate in a metadata key": (forge(set_meta("note\udc00", "x")), X),
    "raw UTF-8 surrogate in the header": (_raw_surrogate(), X),
    "kvpack metadata as UTF-16 (1e400 and a surrogate in it)": (forge(_utf16_kvpack()), X),
    # __metadata__
    "metadata value not string": (forge(set_meta("kvpack", 3)), X),
    "metadata is a list": (forge(lambda o: o.update(__metadata__=["format"]), sign=False), NotAKvpackFileError),
    "metadata holds a number": (forge(set_meta("format_version", 1)), X),
    "missing tensor_xxh3": (forge(lambda o: o["__metadata__"].pop("tensor_xxh3")), X),
    "both checksum keys": (forge(set_meta("tensor_sha256", "{}")), X),
    "format_version 0.9": (forge(set_meta("format_version", "0.9")), X),
    "format_version text": (forge(set_meta("format_version", "one")), X),
    "format_version 1.00": (forge(set_meta("format_version", "1.00")), X),
    "format_version newer major": (forge(set_meta("format_version", NEWER)), V),
    "format_version newer unsigned": (forge(set_meta("format_version", NEWER), sign=False), V),
    "pre-1.0 draft version 5": (forge(set_meta("format_version", "5")), V),
    "format_version huge": (forge(set_meta("format_version", "9" * 400)), X),
    "header checksum mismatch": (forge(set_kvpack("method", "other"), sign=False), ChecksumMismatchError),
    "header checksum not hex": (forge(set_meta("header_sha256", "z" * 64), sign=False), X),
    # tensor index: type confusion first
    "dtype is a list": (forge(set_entry("keys", "dtype", ["F32"])), X),
    "dtype is a dict": (forge(set_entry("keys", "dtype", {"a": 1})), X),
    "shape is a dict": (forge(set_entry("keys", "shape", {"a": 1})), X),
    "shape is a string": (forge(set_entry("keys", "shape", "12,4")), X),
    "offsets are a string": (forge(set_entry("keys", "data_offsets", "16,208")), X),
    "entry is a list": (forge(lambda o: o.update(keys=[1, 2])), X),
    "shape of rank 5": (forge(set_entry("token_ids", "shape", [1, 1, 1, 1, 8])), X),
    "shape of 300000 dims": (forge(set_entry("token_ids", "shape", [1] * 300_000 + [8])), X),
    "65 tensors": (_many_tensors(61), X),
    "overlapping offsets": (forge(set_entry("positions", "data_offsets", [204, 252])), X),
    "holey offsets": (forge(set_entry("token_ids", "data_offsets", [260, 292])), X),
    "negative shape": (forge(set_entry("token_ids", "shape", [-8])), X),
    "huge shape": (forge(set_entry("keys", "shape", [2**40, 4])), X),
    "huge zero-size shape": (forge(set_entry("keys", "shape", [0, 2**70])), X),
    "float shape": (forge(set_entry("token_ids", "shape", [8.0])), X),
    "bool shape": (forge(set_entry("token_ids", "shape", [True])), X),
    "negative offset": (forge(set_entry("head_lengths", "data_offsets", [-16, 0])), X),
    "unknown dtype": (forge(set_entry("keys", "dtype", "Q4")), X),
    "keys stored as I32": (forge(set_entry("keys", "dtype", "I32")), X),
    "token_ids stored as F32": (forge(set_entry("token_ids", "dtype", "F32")), X),
    "extra index key": (forge(set_entry("token_ids", "note", "x")), X),
    "missing tensor": (restore(GOLD, drop=("token_ids",)), X),
    "unexpected tensor": (restore(GOLD_Q, drop=("quant_grid",), edit_header=lambda o: o["__metadata__"].pop("quant")),
                          X),
    "old per-layer tensor name": (restore(GOLD, edit_header=lambda o: o.update({"layers.0.keys": o.pop("keys")})), X),
    "checksums miss a tensor": (forge(set_meta("tensor_xxh3", "{}")), X),
    "checksums are a list": (forge(set_meta("tensor_xxh3", "[]")), X),
    "checksum not a string": (forge(lambda o: o["__metadata__"].update(tensor_xxh3=canon({
        k: 1 for k in json.loads(o["__metadata__"]["tensor_xxh3"])}).decode())), X),
    "xxh3 digest is a sha256": (forge(lambda o: o["__metadata__"].update(tensor_xxh3=canon({
        k: "0" * 64 for k in json.loads(o["__metadata__"]["tensor_xxh3"])}).decode())), X),
    # shapes and counts
    "100000 KV heads": (_heads(1, 100_000), X),
    "5000 layers": (_heads(5000, 1), X),
    "keys and values rows differ": (restore(GOLD, {"values": stored(GOLD, "values")[:-16]},
                                            set_entry("values", "shape", [11, 4])), X),
    "head_dim 0": (restore(GOLD, {"keys": b"", "values": b""}, lambda o: (set_entry("keys", "shape", [12, 0])(o),
                                                                          set_entry("values", "shape", [12, 0])(o))),
                   X),
    "attn_bias of I32": (restore(GOLD_B, edit_header=set_entry("attn_bias", "dtype", "I32")), X),
    "attn_bias too short": (restore(GOLD_B, {"attn_bias": f32(0.0) * 11}, set_entry("attn_bias", "shape", [11])), X),
    # codecs
    "unknown codec": (_codec_entry("token_ids", "codec", "lz4"), X),
    "codec dtype is a list": (_codec_entry("token_ids", "dtype", ["I32"]), X),
    "codec shape is a dict": (_codec_entry("token_ids", "shape", {"n": 8}), X),
    "unknown filter": (_codec_entry("token_ids", "filter", "xor"), X),
    "filter is a list": (_codec_entry("token_ids", "filter", ["none"]), X),
    "delta filter on floats": (_codec_entry("keys", "filter", "delta_shuffle"), X),
    "raw_bytes not shape x itemsize": (_codec_entry("token_ids", "raw_bytes", 36), X),
    "codec level 0": (_codec_entry("token_ids", "level", 0), X),
    "codec entry is a list": (restore(GOLD_Z, edit_header=lambda o: o["__metadata__"].update(tensor_codecs=canon(
        {**json.loads(o["__metadata__"]["tensor_codecs"]), "token_ids": [1]}).decode())), X),
    "codecs for an unknown tensor": (restore(GOLD_Z, edit_header=lambda o: o["__metadata__"].update(
        tensor_codecs=o["__metadata__"]["tensor_codecs"][:-1] + ',"zz":{}}')), X),
    **{name: (data, X) for name, data in BOMBS.items()},
    "entries declared beyond the keys (positions are exempt, bounded by the layout)": (restore(
        GOLD_Z, {"positions": rle_frame([(0, 1), (1, (1 << 24) - 1), (0, 3 << 24)])}, lambda o: (
            set_codec("positions", "shape", [1 << 24])(o), set_codec("positions", "raw_bytes", 4 << 24)(o))), X),
    "codec decodes to a huge tensor": (restore(GOLD_Z, edit_header=lambda o: (
        set_codec("token_ids", "shape", [2**31 - 1])(o), set_codec("token_ids", "raw_bytes", 4 * (2**31 - 1))(o))), X),
    "empty tensor_codecs": (forge(set_meta("tensor_codecs", "{}")), X),
    # quantization setting
    "quant type int3": (forge(set_meta("quant", '{"group_size":32,"type":"int3"}'), base=GOLD_Q), X),
    "quant type is a list": (forge(set_meta("quant", '{"group_size":32,"type":["int4"]}'), base=GOLD_Q), X),
    "quant group size 0": (forge(set_meta("quant", '{"group_size":0,"type":"int4"}'), base=GOLD_Q), X),
    "quant says int8 for int4 codes": (forge(set_meta("quant", '{"group_size":32,"type":"int8"}'), base=GOLD_Q), X),
    "quant with the old layout key": (forge(set_meta("quant", '{"group_size":32,"layout":"kivi","type":"int4"}'),
                                            base=GOLD_Q), X),
    "quant not JSON": (forge(set_meta("quant", "int4"), base=GOLD_Q), X),
    "quant key missing": (forge(lambda o: o["__metadata__"].pop("quant"), base=GOLD_Q), X),
    "key_codes missing": (restore(GOLD_Q, drop=("key_codes",)), X),
    "key widths of one layer": (forge(set_entry("key_bits", "shape", [4, 4]), base=GOLD_Q), X),
    # kvpack metadata: every field kvpack reads
    "kvpack metadata not JSON": (forge(set_meta("kvpack", "{oops")), X),
    "kvpack metadata a list": (forge(set_meta("kvpack", "[]")), X),
    "sink_tokens missing": (forge(set_kvpack("sink_tokens", None, drop=True)), X),
    "sink_tokens negative": (forge(set_kvpack("sink_tokens", -1)), X),
    "sink_tokens above tokens": (forge(set_kvpack("sink_tokens", 9)), X),
    "sink_tokens a string": (forge(set_kvpack("sink_tokens", "2")), X),
    "fingerprint a list": (forge(set_kvpack("fingerprint", [1, 2])), X),
    "fingerprint a string": (forge(set_kvpack("fingerprint", "llama")), X),
    "fingerprint rope a list": (forge(set_kvpack("fingerprint", {"rope": [1]})), X),
    "fingerprint sliding_layers a string": (forge(set_kvpack("fingerprint", {"sliding_layers": "0,1"})), X),
    "fingerprint name 100 KB": (forge(set_kvpack("fingerprint", {"name": "n" * 100_000})), X),
    "layout a string": (forge(set_kvpack("layout", "chat")), X),
    "layout missing a piece": (forge(set_kvpack("layout", {k: v for k, v in _LAYOUT.items() if k != "turn_end"})), X),
    "layout piece a list": (forge(set_kvpack("layout", {**_LAYOUT, "prefix": ["<s>"]})), X),
    "layout piece 100 KB": (forge(set_kvpack("layout", {**_LAYOUT, "separator": "Q" * 100_000})), X),
    "layer_kinds too short": (forge(set_kvpack("layer_kinds", ["compressed"])), X),
    "layer_kinds unknown kind": (forge(set_kvpack("layer_kinds", ["compressed", "evicted"])), X),
    "ratio a string": (forge(set_kvpack("ratio", "0.5")), X),
    "ratio 2": (forge(set_kvpack("ratio", 2)), X),
    "method a dict": (forge(set_kvpack("method", {"x": 1})), X),
    "method_params a list": (forge(set_kvpack("method_params", [1])), X),
    "source a list": (forge(set_kvpack("source", ["a"])), X),
    "stats a list": (forge(set_kvpack("stats", [1])), X),
    "stats layer_budgets strings": (forge(set_kvpack("stats", {"layer_budgets": ["a"]})), X),
})
_add("data", {
    "tensor checksum mismatch": (GOLD[:-1] + bytes([GOLD[-1] ^ 1]), ChecksumMismatchError),
    "sha256 tensor checksum mismatch": (GOLD_S[:-1] + bytes([GOLD_S[-1] ^ 1]), ChecksumMismatchError),
    # contents (re-signed, so the semantic checks fire)
    "head_lengths not summing": (forge(tensors={"head_lengths": i32(4, 2, 5, 0)}), X),
    "head_lengths negative": (forge(tensors={"head_lengths": i32(4, 3, 6, -1)}), X),
    "head_lengths moving a row across layers": (forge(tensors={"head_lengths": i32(4, 4, 4, 0)}), X),
    "position equal to tokens": (forge(tensors={"positions": i32(0, 1, 4, 6, 0, 1, 8, *POSITIONS[7:])}), X),
    "position negative": (forge(tensors={"positions": i32(-1, *POSITIONS[1:])}), X),
    "positions decreasing": (forge(tensors={"positions": i32(0, 4, 1, *POSITIONS[3:])}), X),
    "positions repeated": (forge(tensors={"positions": i32(*POSITIONS[:7], 0, 1, 2, 2, 5)}), X),
    "negative token id": (forge(tensors={"token_ids": i32(1, 5, 9, 300, -7, 2, 0, 1)}), X),
    "attention bias NaN": (forge(tensors={"attn_bias": f32(float("nan"), *[0.0] * 11)}, base=GOLD_B), X),
    "attention bias infinite": (forge(tensors={"attn_bias": f32(float("-inf"), *[0.0] * 11)}, base=GOLD_B), X),
    "attention bias 31": (forge(tensors={"attn_bias": f32(31.0, *[0.0] * 11)}, base=GOLD_B), X),
    # compact layout values
    "key widths not summing to 16": (forge(tensors={"key_bits": bytes([7, 4, 3, 3]) + _BITS[4:]}, base=GOLD_Q), X),
    "layer 1 key width 0": (forge(tensors={"key_bits": _BITS[:8] + bytes([8, 4, 4, 0]) + _BITS[12:]}, base=GOLD_Q), X),
    "key width 9": (forge(tensors={"key_bits": bytes([9, 4, 2, 1]) + _BITS[4:]}, base=GOLD_Q), X),
    "grid NaN": (forge(tensors={"quant_grid": _grid_with(1, 0, float("nan"))}, base=GOLD_Q), X),
    "grid negative scale base": (forge(tensors={"quant_grid": _grid_with(2, 1, -0.5)}, base=GOLD_Q), X),
    "sink moved (other body rows)": (forge(set_kvpack("sink_tokens", 1), base=GOLD_Q), X),
    "quant group size 16": (forge(set_meta("quant", '{"group_size":16,"type":"int4"}'), base=GOLD_Q), X),
    "quantized head lengths moving a row": (forge(tensors={"head_lengths": i32(39, 5, 47, 33)}, base=GOLD_Q), X),
    "one key group short": (restore(GOLD_Q, {"key_params": stored(GOLD_Q, "key_params")[:20]
                                              + stored(GOLD_Q, "key_params")[24:44]},
                                    set_entry("key_params", "shape", [2, 5, 4])), X),
    # zstd frames (each tensor's checksum matches, so the frame checks are what fire)
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
    "zstd frame with a reserved block": (restore(GOLD_Z, {"token_ids": huge_frame(32)[:-3] + b"\x07\x00\x00"}), X),
})


@pytest.mark.parametrize("reader", [load_pack, verify])
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file(case, reader):
    data, error, _ = CASES[case]
    with pytest.raises(error) as info:
        reader(data)
    assert type(info.value) is error
    assert "kvpack" in str(info.value)  # every message names the fix (`kvpack build` or upgrade kvpack)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_header_only(case):
    data, error, header_level = CASES[case]
    if header_level:
        with pytest.raises(error):
            read_header(data)
    else:
        read_header(data)


@pytest.mark.parametrize("case", ["cut inside header", "wrong magic", "format_version newer major",
                                  "positions decreasing"])
def test_hostile_file_on_disk_names_the_file(tmp_path, case):
    data, error, _ = CASES[case]
    path = tmp_path / "bad.kvpack"
    path.write_bytes(data)
    with pytest.raises(error, match="bad.kvpack"):
        load_pack(path)


def test_restore_without_changes_is_the_golden_file():
    for gold in (GOLD, GOLD_Z, GOLD_Q, GOLD_B, GOLD_S):
        assert restore(gold) == gold


def test_messages_name_the_problem():
    for case, pattern in (("format_version newer major", "upgrade kvpack"),
                          ("pre-1.0 draft version 5", "pre-1.0 draft"),
                          ("tensor checksum mismatch", r"'values'.*XXH3-128"),
                          ("sha256 tensor checksum mismatch", r"'values'.*SHA-256"),
                          ("header checksum mismatch", "'header'"),
                          ("dtype is a list", "unknown dtype"),
                          ("header nested 100000 deep", "deeper than 32"),
                          ("layout piece 100 KB", "'layout' is malformed"),
                          ("header of 5 MiB", "exceeds the 1048576-byte limit"),
                          ("100000 KV heads", "1 to 4096 KV heads"),
                          ("zstd frame declares another size", "'token_ids'.*declares 36 decompressed bytes.*32"),
                          ("zstd frame then trailing bytes", "ends after"),
                          ("codec decodes to a huge tensor", "decompression bomb"),
                          ("attention bias 31", r"\[-30, 30\]")):
        with pytest.raises(PackFormatError, match=pattern):
            load_pack(CASES[case][0])


@pytest.mark.parametrize("case", ["header length over cap", "header length 2**64-1", "zstd frame declares 2**40 bytes",
                                  "zstd frame declares 2**64-2 bytes", "codec decodes to a huge tensor",
                                  "100000 KV heads", "header nested 100000 deep"])
def test_huge_declared_sizes_allocate_nothing(case):
    data, error, _ = CASES[case]
    tracemalloc.start()
    try:
        with pytest.raises(error):
            load_pack(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * len(data) + 2_000_000  # work on the bytes present, nothing from the sizes declared


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_decompression_bombs_are_refused_from_the_header_with_bounded_memory(case):
    """Each bomb is refused by the per-tensor limit (``format/SPEC.md`` §6) before any tensor is read, holding
    memory linear in the file's bytes, never in what its frames declare."""
    data = BOMBS[case]
    tracemalloc.start()
    try:
        for reader in (read_header, load_pack):
            with pytest.raises(CorruptFileError, match="decompression bomb"):
                reader(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * len(data) + 2_000_000


def test_the_issue_bomb_passed_the_old_whole_file_limit():
    """The padded bomb is the issue's file: the old rule (all encoded tensors decode to at most 1,024x the file)
    accepted it, the header padding having raised that limit; the per-tensor rule names its keys instead."""
    data = BOMBS["bomb: fp16 zeros, 1 MB of method_params padding"]
    obj, _ = split(data)
    decoded = sum(c["raw_bytes"] for c in json.loads(obj["__metadata__"]["tensor_codecs"]).values())
    assert 1_000_000 < len(data) < decoded <= 1024 * len(data)
    with pytest.raises(CorruptFileError, match=r"tensor 'keys': it would decompress to 134,217,728 bytes"):
        read_header(data)


def test_tensors_at_the_floor_load_and_one_row_more_is_refused():
    """Keys and values of exactly 1 MiB decoded (the floor) from a few hundred stored bytes load, zeros and
    positions 0..n-1 as declared; one row more (``bomb: keys just over the 1 MiB floor``) is refused."""
    rows = C.EXPANSION_FLOOR_BYTES // 8
    pack = load_pack(_bomb(rows))
    assert pack.layers[0].keys.shape == (rows, 4) and pack.layers[0].keys.dtype == torch.float16
    assert not pack.layers[0].keys.any() and not pack.layers[0].values.any()
    assert torch.equal(pack.layers[0].positions.long(), torch.arange(rows))
    assert read_header(_bomb(rows)).tensors["keys"].nbytes * C.MAX_EXPANSION < C.EXPANSION_FLOOR_BYTES
    with pytest.raises(CorruptFileError, match="'keys'.*decompression bomb"):
        read_header(_bomb(rows + 1))


def test_the_limit_is_the_tensors_own_ratio():
    from kvpack.container import expansion_problem

    stored = C.EXPANSION_FLOOR_BYTES  # above the floor, the ratio decides
    assert expansion_problem("keys", C.MAX_EXPANSION * stored, stored) is None
    assert "decompression bomb" in expansion_problem("keys", C.MAX_EXPANSION * stored + 1, stored)
    assert expansion_problem("token_ids", C.EXPANSION_FLOOR_BYTES, 1) is None
    assert expansion_problem("token_ids", C.EXPANSION_FLOOR_BYTES + 1, 1) is not None
    assert expansion_problem("positions", 2**40, 1) is None and expansion_problem("attn_bias", 2**40, 1) is None


def test_entry_tensors_are_bounded_by_the_layout():
    with pytest.raises(CorruptFileError, match="keys/values have 12 rows but positions 16777216"):
        read_header(CASES["entries declared beyond the keys (positions are exempt, bounded by the layout)"][0])


def test_the_writer_stores_raw_what_the_reader_would_refuse_encoded(tmp_path):
    """Zero KV and a repeated text compress far beyond 8x: ``save`` stores those tensors raw (the reader accepts
    the file) and still encodes the others; the pack reads back equal."""
    from kvpack.fileformat import save
    from kvpack.pack import LayerEntries, Pack

    rows, tokens = 200_000, 300_000
    layer = LayerEntries(torch.zeros(rows, 4, dtype=torch.float16), torch.randn(rows, 4).half(),
                         torch.arange(rows, dtype=torch.int32), torch.tensor([rows]))
    pack = Pack(token_ids=torch.arange(tokens) % 7, layers=[layer], sink_tokens=0, metadata={})
    save(pack, tmp_path / "z.kvpack", zstd_level=19)
    header = read_header(tmp_path / "z.kvpack")
    assert header.tensors["keys"].codec is None and header.tensors["token_ids"].codec is None  # 8x+ and > 1 MiB
    assert header.tensors["values"].codec is not None and header.tensors["positions"].codec is not None
    back = load_pack(tmp_path / "z.kvpack")
    assert torch.equal(back.token_ids, pack.token_ids) and torch.equal(back.layers[0].values, layer.values)


EDGES = {0, 7, 8, 8 + len(C.MAGIC), 8 + N, len(GOLD) - 1}
SPREAD = sorted({round(i * (len(GOLD) - 1) / 29) for i in range(30)} | EDGES)


@pytest.mark.parametrize("offset", SPREAD)
def test_single_bit_flip_is_detected(offset):
    data = bytearray(GOLD)
    data[offset] ^= 1 << (offset % 8)
    with pytest.raises(ChecksumMismatchError if offset >= 8 + N else PackFormatError):
        load_pack(bytes(data))


def test_every_byte_of_a_frame_flipped_and_re_signed_is_an_error_or_changes_nothing():
    """zstd's content checksum and the size checks catch damage the tensor checksum no longer sees (re-signed); a
    flip that changes nothing decoded (e.g. a larger window) may load, but then to the very same pack."""
    frame0 = stored(GOLD_Z, "keys")
    good = load_pack(GOLD_Z)
    for i in range(len(frame0)):
        frame = bytearray(frame0)
        frame[i] ^= 1 << (i % 8)
        try:
            pack = load_pack(restore(GOLD_Z, {"keys": bytes(frame)}))
        except PackFormatError:
            continue
        assert torch.equal(pack.layers[0].keys, good.layers[0].keys), f"byte {i} of the frame changed the keys"


def test_stored_corpus():
    """Every file of tests/hostile/ raises the error class its manifest records, from every reader."""
    manifest = json.loads((CORPUS / "MANIFEST.json").read_text())
    assert len(manifest) >= 40
    errors = {cls.__name__: cls for cls in (TruncatedFileError, NotAKvpackFileError, CorruptFileError,
                                            ChecksumMismatchError, UnsupportedVersionError)}
    for fname, entry in manifest.items():
        data = (CORPUS / fname).read_bytes()
        for reader in (load_pack, verify):
            with pytest.raises(errors[entry["error"]]):
                reader(CORPUS / fname)
        with pytest.raises(errors[entry["error"]]):
            load_pack(data)


def write_corpus(folder: Path = CORPUS, limit: int = 16 * 1024) -> int:
    """Store every case under ``limit`` bytes, and every decompression bomb (``BOMBS``: mostly header padding, a few
    KB once git compresses them), in ``folder`` with a manifest (file -> case name, error class)."""
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.kvpack"):
        old.unlink()
    manifest = {}
    for i, (case, (data, error, _)) in enumerate(sorted(CASES.items())):
        if len(data) > limit and case not in BOMBS:
            continue
        fname = f"{i:03d}.kvpack"
        (folder / fname).write_bytes(data)
        manifest[fname] = {"case": case, "error": error.__name__}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return len(manifest)


def test_an_escaped_surrogate_pair_is_text_and_reads():
    """Only unpaired surrogates are refused: an emoji (written as an escaped pair in canonical JSON) reads back."""
    data = forge(set_kvpack("method", "kvzip \U0001f600"))
    assert b"ud83d" in data and "\U0001f600".encode() not in data  # escaped, as canonical JSON writes it
    assert read_header(data).metadata["method"] == "kvzip \U0001f600"


def test_every_number_beyond_binary64_is_refused_whatever_its_spelling():
    """``parse_json_text`` checks the range only when a byte scan finds a long digit run or a 2-digit exponent;
    every spelling of a number that overflows a float must still be refused, and every other accepted."""
    from kvpack.container import parse_json_text

    def corrupt(message):
        return CorruptFileError(message)

    for digits in (0, 9, 99, 100, 150, 209, 210, 250, 308, 309, 400):
        for exponent in ("", "e0", "e+5", "e9", "E10", "e99", "e100", "e+308", "e309", "e-5", "e-400"):
            for fraction in ("", ".5"):
                text = "1" + "0" * digits + fraction + exponent
                overflows = math.isinf(float(text))
                try:
                    parse_json_text(f"[{text}]", "x", corrupt)
                    refused = False
                except CorruptFileError:
                    refused = True
                assert refused == overflows, text


if __name__ == "__main__":  # python -m tests.test_hostile_files: rewrite the stored corpus
    print(f"wrote {write_corpus()} hostile files to {CORPUS}", file=sys.stderr)
