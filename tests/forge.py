"""Forge ``.kvpack`` files the way an adversary would: edit a file's header or tensors and re-sign it with the
spec's rules (canonical JSON, SHA-256 of the header, XXH3-128 or SHA-256 of each tensor's stored bytes), written
out here independently of the reader, so that the check under test, not a checksum, is what fires.

Used by ``tests/test_hostile_files.py``, ``tests/test_header_properties.py`` and ``tools/fuzz_format.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct

import xxhash

__all__ = ["canon", "split", "assemble", "restore", "i32", "f32", "with_length", "set_meta", "set_kvpack",
           "set_entry", "set_codec", "stored", "with_float_element"]


def canon(obj) -> bytes:
    """Canonical JSON (``format/SPEC.md`` §4.1)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def split(data: bytes) -> tuple[dict, bytes]:
    """``(header object, data buffer)`` of a well-formed file."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def assemble(obj: dict, buf: bytes, sign: bool = True, text: bytes | None = None) -> bytes:
    """Length prefix + padded header (``text``, default the canonical form of ``obj``) + buffer; with ``sign`` the
    header checksum is recomputed first."""
    meta = obj.get("__metadata__")
    if sign and isinstance(meta, dict):
        meta.pop("header_sha256", None)
        meta["header_sha256"] = hashlib.sha256(canon(obj)).hexdigest()
    text = canon(obj) if text is None else text
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + buf


def _digest(algorithm: str, data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data) if algorithm == "xxh3" else hashlib.sha256(data).hexdigest()


def restore(base: bytes, blobs: dict[str, bytes] | None = None, edit_header=None, drop: tuple[str, ...] = (),
            sign: bool = True) -> bytes:
    """``base`` with some tensors' stored bytes replaced by bytes of any length (an encoded tensor's index shape, all
    offsets in data order and all tensor checksums recomputed), tensors dropped, and/or the header edited last
    (``edit_header(obj)``, before re-signing)."""
    obj, buf = split(base)
    meta = obj["__metadata__"]
    algorithm = "xxh3" if "tensor_xxh3" in meta else "sha256"
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
        sums[n] = _digest(algorithm, parts[n])
        out += parts[n]
        end += len(parts[n])
    meta["tensor_xxh3" if algorithm == "xxh3" else "tensor_sha256"] = canon(sums).decode()
    if "tensor_codecs" in meta:
        meta["tensor_codecs"] = canon(codecs).decode()
    if edit_header is not None:
        edit_header(obj)
    return assemble(obj, out, sign=sign)


def stored(data: bytes, name: str) -> bytes:
    """Tensor ``name``'s stored bytes."""
    obj, buf = split(data)
    b, e = obj[name]["data_offsets"]
    return buf[b:e]


def with_float_element(data: bytes, name: str, index: int, value: float) -> bytes:
    """``data`` with element ``index`` (flat, in stored order) of its raw (unencoded) float tensor ``name`` (F32, F16
    or BF16) set to ``value`` (NaN and infinities too), re-signed: a file whose every format check passes."""
    obj, _ = split(data)
    dtype = obj[name]["dtype"]
    assert dtype in ("F32", "F16", "BF16"), "with_float_element edits float tensors only"
    assert name not in json.loads(obj["__metadata__"].get("tensor_codecs", "{}")), "save with zstd_level=0"
    blob = bytearray(stored(data, name))
    size = 4 if dtype == "F32" else 2
    element = {"F32": f32(value), "F16": struct.pack("<e", value), "BF16": f32(value)[2:]}[dtype]
    blob[size * index : size * index + size] = element
    return restore(data, {name: bytes(blob)})


def i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def with_length(n: int, data: bytes) -> bytes:
    """``data`` with another header length in its prefix."""
    return n.to_bytes(8, "little") + data[8:]


def set_meta(key, value):
    def edit(obj):
        obj["__metadata__"][key] = value

    return edit


def set_kvpack(key, value, drop: bool = False):
    def edit(obj):
        kv = json.loads(obj["__metadata__"]["kvpack"])
        if drop:
            kv.pop(key, None)
        else:
            kv[key] = value
        obj["__metadata__"]["kvpack"] = canon(kv).decode()

    return edit


def set_entry(name, key, value):
    def edit(obj):
        obj[name][key] = value

    return edit


def set_codec(name, key, value):
    def edit(obj):
        codecs = json.loads(obj["__metadata__"]["tensor_codecs"])
        codecs[name][key] = value
        obj["__metadata__"]["tensor_codecs"] = canon(codecs).decode()

    return edit


def rle_frame(runs: list[tuple[int, int]], checksum: bool = False) -> bytes:
    """One zstd frame (RFC 8878) whose content is ``runs`` of ``(byte value, count)``, written by hand as RLE blocks
    of at most 128 KiB: a few bytes per 128 KiB decoded, however large the content (what a decompression bomb
    looks like); single-segment, declaring its content size, with zstd's content checksum if ``checksum``."""
    size = sum(n for _, n in runs)
    out = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0xE0 | (4 if checksum else 0)]) + size.to_bytes(8, "little"))
    blocks = [(v, min(n - at, 1 << 17)) for v, n in runs for at in range(0, n, 1 << 17)]
    for i, (value, n) in enumerate(blocks):
        out += ((n << 3) | (1 << 1) | (i == len(blocks) - 1)).to_bytes(3, "little") + bytes([value])
    if checksum:
        h = xxhash.xxh64()
        for value, n in runs:
            for at in range(0, n, 1 << 24):
                h.update(bytes([value]) * min(n - at, 1 << 24))
        out += (h.intdigest() & 0xFFFFFFFF).to_bytes(4, "little")
    return bytes(out)
