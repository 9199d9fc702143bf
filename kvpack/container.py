"""The safetensors container of format 1.0 (``format/SPEC.md`` §2-4, §7-9): length prefix, canonical JSON header,
flat data buffer; header parse and validation, tensor checksums, streaming reads, the bytes a writer writes (the
file itself is written by ``kvpack.storage.write_atomic``).

This module knows nothing about KV caches: it hands the KV layout (``kvpack.fileformat``) a validated
``Container`` (the ``__metadata__`` strings, the tensor index in data order, the tensor checksums) and reads,
checks and decodes one tensor at a time. Validation trusts nothing before checking it: every value's JSON type
is checked before it is used as a key, a size or an index; the header's size, nesting depth, tensor count and
ranks are capped (``constants.MAX_*``) before anything is allocated from them; all work is linear in the header's
bytes. A source is a path, a seekable binary file object, or the file's bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from . import constants as C
from .codecs import CodecError, allowed_filters, decode_zstd, iter_decoded
from .packbytes import RECOPY, REBUILD, Source
from .errors import (ChecksumMismatchError, CorruptFileError, NotAKvpackFileError, TruncatedFileError,
                     UnsupportedVersionError)

__all__ = ["TensorCodec", "TensorInfo", "Container", "parse_header", "parse_json_text", "has_lone_surrogate",
           "json_depth", "canonical", "check_tensor", "expansion_problem", "tensor_bytes", "stream_tensor",
           "container_bytes"]

_UPGRADE = "upgrade kvpack (`pip install -U kvpack`)"
_VERSION = re.compile(r"([1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})")
_HEX = {a: re.compile(f"[0-9a-f]{{{n}}}") for a, n in C.CHECKSUM_HEX_LENGTH.items()}


@dataclass(frozen=True)
class TensorCodec:
    """How an encoded tensor is stored (``format/SPEC.md`` §6).

    Attributes:
        codec: ``"zstd"``: the stored bytes are one zstd frame (RFC 8878) declaring its content size.
        filter: ``"none"``, ``"shuffle"`` or ``"delta_shuffle"``, applied to the raw bytes before compressing.
        level: the zstd level the writer used (informational).
    """

    codec: str
    filter: str
    level: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file, as the header describes it.

    Attributes:
        dtype: the tensor's own dtype code (``constants.ITEMSIZE_BY_CODE``).
        shape: the tensor's own shape.
        offsets: ``(begin, end)`` byte offsets of its stored bytes in the data buffer.
        codec: ``None`` if stored raw; else how it is encoded (the index entry then says ``U8 [stored bytes]``).
    """

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]
    codec: TensorCodec | None = None

    @property
    def nbytes(self) -> int:
        """Stored bytes (the compressed size for an encoded tensor)."""
        return self.offsets[1] - self.offsets[0]

    @property
    def raw_nbytes(self) -> int:
        """Decoded bytes: ``numel x itemsize``."""
        return math.prod(self.shape) * C.ITEMSIZE_BY_CODE[self.dtype]


@dataclass(frozen=True)
class Container:
    """A validated container header (``parse_header``).

    Attributes:
        version: ``(major, minor)`` of ``format_version``.
        metadata: ``__metadata__``, string to string (JSON texts still unparsed but ``tensor_codecs`` and the checksums).
        tensors: tensor name -> ``TensorInfo``, in data order.
        sums: tensor name -> its checksum (hex) of the stored bytes.
        checksum: ``"xxh3"`` or ``"sha256"``.
        header_bytes: bytes before the data buffer (8 + N); file_bytes: size of the whole file.
    """

    version: tuple[int, int]
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    sums: dict[str, str]
    checksum: str
    header_bytes: int
    file_bytes: int


# ---------------------------------------------------------------------------------------------------------------
# header


def parse_header(src: Source) -> Container:
    """Validate everything up to the tensor data (``format/SPEC.md`` §8 steps 1-11) and return it.

    Raises:
        TruncatedFileError: shorter than 8 bytes, or than the header or data it declares.
        NotAKvpackFileError: no kvpack magic.
        UnsupportedVersionError: another major version (or a pre-1.0 draft file).
        CorruptFileError: anything malformed: size caps, nesting depth, JSON, canonical form, types, index,
            offsets, codecs, checksum table.
        ChecksumMismatchError: the header's SHA-256 does not match.
    """
    name, size = src.name, src.size

    def corrupt(problem: str) -> CorruptFileError:
        return CorruptFileError(f"{name}: {problem}; {REBUILD}")

    if size < C.LENGTH_PREFIX_BYTES:
        what = "is empty" if size == 0 else f"is only {size} bytes long"
        raise TruncatedFileError(f"{name} {what}, too short for a kvpack file; {RECOPY}")
    n = int.from_bytes(src.read(0, C.LENGTH_PREFIX_BYTES), "little")
    avail = min(len(C.MAGIC), n, size - C.LENGTH_PREFIX_BYTES)
    if n < len(C.MAGIC) or src.read(C.MAGIC_OFFSET, avail) != C.MAGIC[:avail]:
        raise NotAKvpackFileError(f"{name} is not a kvpack file (no kvpack magic at byte {C.MAGIC_OFFSET}); check "
                                  "the path, or make a .kvpack file with `kvpack build`")
    if n > C.MAX_HEADER_BYTES:
        raise corrupt(f"the header length {n} exceeds the {C.MAX_HEADER_BYTES}-byte limit")
    if n > size - C.LENGTH_PREFIX_BYTES:
        raise TruncatedFileError(f"{name} is cut inside its header: the file has {size:,} bytes, but its length "
                                 f"prefix declares a {n:,}-byte header ({size - C.LENGTH_PREFIX_BYTES:,} bytes "
                                 f"present); {RECOPY}")
    if n % C.HEADER_ALIGNMENT:
        raise corrupt(f"the header length {n} is not a multiple of {C.HEADER_ALIGNMENT}")
    raw = src.read(C.LENGTH_PREFIX_BYTES, n)
    obj = parse_json_text(raw, "the header", corrupt)
    if type(obj) is not dict:
        raise corrupt("the header is not a JSON object")
    meta = obj.get(C.METADATA_KEY)
    if type(meta) is not dict or any(type(v) is not str for v in meta.values()):
        raise corrupt(f"{C.METADATA_KEY!r} is missing or not a string-to-string map")
    if meta.get(C.META_FORMAT) != C.FORMAT_NAME:
        raise corrupt(f"{C.META_FORMAT!r} is {meta.get(C.META_FORMAT, '')[:20]!r}, not {C.FORMAT_NAME!r}")
    version = _version(meta.get(C.META_FORMAT_VERSION), name, corrupt)
    if len(meta) > C.MAX_METADATA_KEYS or len(obj) - 1 > C.MAX_TENSORS:
        raise corrupt(f"the header has {len(meta)} metadata keys and {len(obj) - 1} tensors; at most "
                      f"{C.MAX_METADATA_KEYS} and {C.MAX_TENSORS} are allowed")

    sums_keys = [k for k in C.TENSOR_CHECKSUM_KEY.values() if k in meta]
    missing = [k for k in C.METADATA_KEYS if k not in meta]
    if missing or len(sums_keys) != 1:
        what = repr(missing[0]) if missing else f"exactly one of {sorted(C.TENSOR_CHECKSUM_KEY.values())}"
        raise corrupt(f"{C.METADATA_KEY!r} lacks {what}" if missing or not sums_keys
                      else f"{C.METADATA_KEY!r} must have {what}, not both")
    tensors: dict[str, TensorInfo] = {}
    for tname, entry in obj.items():
        if tname != C.METADATA_KEY:
            problem = _entry_problem(entry)
            if problem is not None:
                raise corrupt(f"tensor {tname[:80]!r}: {problem}")
            tensors[tname] = TensorInfo(entry[C.INDEX_DTYPE], tuple(entry[C.INDEX_SHAPE]),
                                        tuple(entry[C.INDEX_OFFSETS]))
    try:
        text = canonical(obj)
    except ValueError:  # a number that parsed to infinity (1e400): not canonical
        text = b""
    if raw != _padded(text):
        raise corrupt("the header is not in canonical form (sorted keys, compact, ASCII, space padding)")
    stored = meta[C.META_HEADER_SHA256]
    if _HEX[C.CHECKSUM_SHA256].fullmatch(stored) is None:
        raise corrupt(f"{C.META_HEADER_SHA256!r} is not a lowercase hex SHA-256")
    if hashlib.sha256(_unsigned(text, obj, stored)).hexdigest() != stored:
        raise ChecksumMismatchError(f"{name}: section 'header' does not match its SHA-256: the file was altered or "
                                    f"damaged; {RECOPY}")

    order = sorted(tensors, key=lambda t: (-C.ITEMSIZE_BY_CODE[tensors[t].dtype], t))
    end = 0
    for tname in order:
        info = tensors[tname]
        want = (end, end + info.raw_nbytes)
        if info.offsets != want:
            raise corrupt(f"tensor {tname[:80]!r} has data_offsets {list(info.offsets)}, but the layout rule "
                          f"(contiguous, by descending itemsize then name) puts it at {list(want)}")
        end = want[1]
    tensors = {t: tensors[t] for t in order}
    data_len = size - C.LENGTH_PREFIX_BYTES - n
    if end > data_len:
        raise TruncatedFileError(f"{name} is cut inside its data: the file has {size:,} bytes of the "
                                 f"{size + end - data_len:,} its header declares; {RECOPY}")
    if end < data_len:
        raise corrupt(f"{data_len - end} unexpected bytes follow the last tensor")
    if C.META_TENSOR_CODECS in meta:
        _apply_codecs(meta[C.META_TENSOR_CODECS], tensors, corrupt)
    checksum = next(a for a, k in C.TENSOR_CHECKSUM_KEY.items() if k == sums_keys[0])
    sums = parse_json_text(meta[sums_keys[0]], repr(sums_keys[0]), corrupt)
    if (type(sums) is not dict or sums.keys() != tensors.keys()
            or any(type(x) is not str or _HEX[checksum].fullmatch(x) is None for x in sums.values())):
        raise corrupt(f"{sums_keys[0]!r} must map exactly the tensor names to lowercase hex "
                      f"{C.CHECKSUM_NAMES[checksum]}s")
    return Container(version, meta, tensors, sums, checksum, C.LENGTH_PREFIX_BYTES + n, size)


def _unsigned(text: bytes, obj: dict[str, Any], stored: str) -> bytes:
    """The canonical header without ``header_sha256`` (what that checksum covers), cut out of the canonical text
    ``text`` when the member is where the sorted keys put it (after ``format`` and ``format_version``, no other key
    in between), else re-encoded."""
    meta = obj[C.METADATA_KEY]
    head = canonical({C.METADATA_KEY: {k: meta[k] for k in (C.META_FORMAT, C.META_FORMAT_VERSION)}})[:-2] + b","
    member = f'"{C.META_HEADER_SHA256}":"{stored}",'.encode("ascii")
    if text.startswith(head) and text.startswith(member, len(head)):
        return head + text[len(head) + len(member) :]
    return canonical({**obj, C.METADATA_KEY: {k: v for k, v in meta.items() if k != C.META_HEADER_SHA256}})


def _version(v: Any, name: str, corrupt) -> tuple[int, int]:
    """``(major, minor)`` of a ``format_version`` string; refuses other majors and pre-1.0 drafts."""
    m = _VERSION.fullmatch(v) if type(v) is str else None
    if m is None:
        if type(v) is str and v.isascii() and v.isdigit() and len(v) < 4:
            raise UnsupportedVersionError(f"{name} is a pre-1.0 draft kvpack file (format_version {v!r}), which this "
                                          f"kvpack no longer reads; {REBUILD}")
        raise corrupt(f"{C.META_FORMAT_VERSION!r} is {str(v)[:20]!r}, not '<major>.<minor>'")
    major, minor = int(m.group(1)), int(m.group(2))
    if major != C.FORMAT_MAJOR:
        fix = _UPGRADE if major > C.FORMAT_MAJOR else REBUILD
        raise UnsupportedVersionError(f"{name} uses kvpack file format {major}.{minor}, but this kvpack reads format "
                                      f"{C.FORMAT_MAJOR}.x; {fix}")
    return major, minor


def json_depth(text: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in a JSON text, counted outside strings; vectorised, linear in the bytes.

    A ``"`` opens or closes a string unless an odd number of backslashes precedes it; brackets between an opening
    and a closing quote do not count. (For text that is not valid JSON the count may be off, but such text is
    refused by the parser anyway.)"""
    b = np.frombuffer(text, dtype=np.uint8)
    if not b.size:
        return 0
    idx = np.arange(b.size, dtype=np.int32)
    last_plain = np.maximum.accumulate(np.where(b != 0x5C, idx, -1))  # last non-backslash at or before i
    before = np.concatenate(([-1], last_plain[:-1]))  # ... at or before i - 1
    escaped = ((idx - 1 - before) & 1).astype(bool)  # preceded by an odd run of backslashes
    quote = (b == 0x22) & ~escaped
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0  # after an even number of quotes (closing ones count)
    outside &= ~quote
    step = (((b == 0x5B) | (b == 0x7B)) & outside).view(np.int8) - (((b == 0x5D) | (b == 0x7D)) & outside).view(np.int8)
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def parse_json_text(text: str | bytes, what: str, corrupt) -> Any:
    """Parse one JSON text of the header (the header itself or a string of ``__metadata__``): its nesting depth is
    checked first (``json_depth`` <= ``MAX_JSON_DEPTH``, so parsing never depends on the stack), then it is decoded
    as UTF-8 (never guessed: ``json.loads`` of bytes takes a text with NUL bytes for UTF-16 or UTF-32) and parsed
    with no duplicate keys, no NaN/Infinity, no number beyond binary64 and no unpaired surrogate
    (``format/SPEC.md`` §4.1, §4.3). Raises ``corrupt(problem)``."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    # (fewer brackets than the cap cannot nest deeper; the scan is for texts that have more)
    if data.count(b"[") + data.count(b"{") > C.MAX_JSON_DEPTH and json_depth(data) > C.MAX_JSON_DEPTH:
        raise corrupt(f"{what} nests JSON deeper than {C.MAX_JSON_DEPTH} levels")
    try:  # (raw surrogate bytes do not decode: UnicodeDecodeError is a ValueError)
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant,
                         parse_float=_finite_float, parse_int=_binary64_int)
    except (ValueError, RecursionError) as exc:  # RecursionError cannot happen below MAX_JSON_DEPTH; kept as a guard
        raise corrupt(f"{what} is not valid JSON ({str(exc)[:160] or type(exc).__name__})") from None
    if _MAYBE_SURROGATE.search(data) and has_lone_surrogate(obj):  # the walk only when an escape could be one
        raise corrupt(f"{what} holds a lone UTF-16 surrogate (U+D800-U+DFFF unpaired): not Unicode text")
    return obj


#: A surrogate's escape (``\ud800``-``\udfff``, any case): the only way a surrogate can reach a decoded text.
_MAYBE_SURROGATE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def _finite_float(token: str) -> float:
    """A JSON number with a fraction or exponent; one beyond the binary64 range (``1e400``) is refused
    (``format/SPEC.md`` §4.1), where ``float`` would give infinity."""
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"the number {token[:40]} is outside the binary64 range")
    return value


#: The largest integer within the binary64 range.
_MAX_BINARY64_INT = int(sys.float_info.max)


def _binary64_int(token: str) -> int:
    """A JSON integer; one beyond the binary64 range (``10**400``) is refused (``format/SPEC.md`` §4.1). Python
    refuses integers of more than 4,300 digits itself (``ValueError``), so the conversion stays linear."""
    value = int(token)
    if abs(value) > _MAX_BINARY64_INT:
        raise ValueError(f"the integer {token[:40]}... is outside the binary64 range")
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(obj: Any) -> bool:
    """Whether a parsed JSON value holds, in any string or object key, a UTF-16 surrogate code point. ``json``
    joins an escaped pair (``\\ud83d\\ude00``) into one character, so what remains is unpaired: text that cannot be
    encoded, printed or tokenized. Iterative, linear in the value's size. Raises nothing."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if type(x) is str:
            if _SURROGATE.search(x):
                return True
        elif type(x) is dict:
            stack.extend(x.keys())
            stack.extend(x.values())
        elif type(x) is list:
            stack.extend(x)
    return False


def _entry_problem(entry: Any) -> str | None:
    """Why a tensor index entry is malformed (types checked before any value is used), or None."""
    if type(entry) is not dict or entry.keys() != _INDEX_KEY_SET:
        return f"the index entry must be an object with exactly the keys {list(C.INDEX_KEYS)}"
    dtype, shape, offsets = entry[C.INDEX_DTYPE], entry[C.INDEX_SHAPE], entry[C.INDEX_OFFSETS]
    problem = _dtype_shape_problem(dtype, shape)
    if problem:
        return problem
    if type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int or o < 0 for o in offsets):
        return "data_offsets must be two non-negative integers"
    if offsets[1] - offsets[0] != math.prod(shape) * C.ITEMSIZE_BY_CODE[dtype]:
        return f"data_offsets {offsets} do not span shape x itemsize bytes"
    return None


def _dtype_shape_problem(dtype: Any, shape: Any) -> str | None:
    if type(dtype) is not str or dtype not in C.ITEMSIZE_BY_CODE:
        return f"unknown dtype {str(dtype)[:20]!r} (known: {sorted(C.ITEMSIZE_BY_CODE)})"
    if type(shape) is not list or len(shape) > C.MAX_RANK:
        return f"the shape must be a list of at most {C.MAX_RANK} integers"
    for d in shape:
        if type(d) is not int or not 0 <= d <= C.INT32_MAX:
            return f"the shape must be a list of integers in [0, {C.INT32_MAX}]"
    return None


_INDEX_KEY_SET = frozenset(C.INDEX_KEYS)
_CODEC_KEY_SET = frozenset(C.CODEC_KEYS)


def _apply_codecs(text: str, tensors: dict[str, TensorInfo], corrupt) -> None:
    """Validate ``tensor_codecs`` and give each encoded tensor its own dtype, shape and codec (in place)."""
    codecs = parse_json_text(text, repr(C.META_TENSOR_CODECS), corrupt)
    if type(codecs) is not dict or not codecs:
        raise corrupt(f"{C.META_TENSOR_CODECS!r} must be a non-empty JSON object")
    for tname, codec in codecs.items():
        stored = tensors.get(tname)
        if stored is None:
            raise corrupt(f"{C.META_TENSOR_CODECS!r} names {tname[:80]!r}, which is not in the tensor index")
        problem = _codec_problem(codec)
        if problem is None and (stored.dtype != C.STORED_CODE or len(stored.shape) != 1):
            problem = f"its index entry must be {C.STORED_CODE} [stored bytes], not {stored.dtype} {list(stored.shape)}"
        if problem is not None:
            raise corrupt(f"encoded tensor {tname[:80]!r}: {problem}")
        tensors[tname] = TensorInfo(codec["dtype"], tuple(codec["shape"]), stored.offsets,
                                    TensorCodec(codec["codec"], codec["filter"], codec["level"]))
    for tname in codecs:
        problem = expansion_problem(tname, tensors[tname].raw_nbytes, tensors[tname].nbytes)
        if problem is not None:
            raise corrupt(f"encoded tensor {tname[:80]!r}: {problem}")


def expansion_problem(tname: str, raw: int, stored: int) -> str | None:
    """Why an encoded tensor of ``stored`` bytes decoding to ``raw`` bytes is refused as a possible decompression
    bomb (``format/SPEC.md`` §6): more than ``max(EXPANSION_FLOOR_BYTES, MAX_EXPANSION x stored)`` bytes, for every
    tensor but ``ENTRY_TENSORS`` (bounded by the entries of ``keys`` and ``key_codes``); or None. The reader
    refuses such a file, the writer stores such a tensor raw instead."""
    limit = max(C.EXPANSION_FLOOR_BYTES, C.MAX_EXPANSION * stored)
    if tname in C.ENTRY_TENSORS or raw <= limit:
        return None
    return (f"it would decompress to {raw:,} bytes, {raw / max(stored, 1):,.0f} times its {stored:,} stored bytes "
            f"(at most {C.MAX_EXPANSION}x, or {C.EXPANSION_FLOOR_BYTES:,} bytes, are allowed; real KV compresses "
            "about 2x): refusing a possible decompression bomb")


def _codec_problem(codec: Any) -> str | None:
    """Why a ``tensor_codecs`` entry is malformed (types first), or None."""
    if type(codec) is not dict or codec.keys() != _CODEC_KEY_SET:
        return f"its codec entry must be an object with exactly the keys {list(C.CODEC_KEYS)}"
    if codec["codec"] != C.CODEC_ZSTD:
        return f"unknown codec {str(codec['codec'])[:20]!r} (known: {C.CODEC_ZSTD!r})"
    dtype, shape, level, filt, raw = (codec[k] for k in ("dtype", "shape", "level", "filter", "raw_bytes"))
    problem = _dtype_shape_problem(dtype, shape)
    if problem:
        return problem
    if type(level) is not int or not C.ZSTD_MIN_LEVEL <= level <= C.ZSTD_MAX_LEVEL:
        return f"the level must be an integer in [{C.ZSTD_MIN_LEVEL}, {C.ZSTD_MAX_LEVEL}]"
    if type(filt) is not str or filt not in allowed_filters(dtype):
        return f"filter {str(filt)[:20]!r} is not one of {list(allowed_filters(dtype))} for {dtype}"
    want = math.prod(shape) * C.ITEMSIZE_BY_CODE[dtype]
    if type(raw) is not int or raw != want or want == 0:
        return f"raw_bytes must be the tensor's size, shape x itemsize = {want} > 0"
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:80]!r}")
        out[k] = v
    return out


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not allowed")


def canonical(obj: Any) -> bytes:
    """The canonical JSON text of ``obj`` (``format/SPEC.md`` §4.1), ASCII bytes."""
    return json.dumps(obj, **C.JSON_DUMPS_KWARGS).encode("ascii")


def _padded(text: bytes) -> bytes:
    return text + C.HEADER_PAD_BYTE * (-len(text) % C.HEADER_ALIGNMENT)


# ---------------------------------------------------------------------------------------------------------------
# tensor data


def _digest(checksum: str):
    return xxhash.xxh3_128() if checksum == C.CHECKSUM_XXH3 else hashlib.sha256()


def check_tensor(src: Source, box: Container, tname: str, data: np.ndarray | None = None) -> None:
    """Stream tensor ``tname``'s stored bytes through its checksum, ``READ_CHUNK_BYTES`` at a time (read from the
    file, or taken from ``data``, the stored bytes already mapped or read).

    Raises:
        ChecksumMismatchError: naming the tensor and the algorithm.
    """
    info = box.tensors[tname]
    h = _digest(box.checksum)
    step = C.READ_CHUNK_BYTES
    if data is not None:
        for at in range(0, info.nbytes, step):
            h.update(data[at : at + step])
    else:
        buf = np.empty(min(step, info.nbytes), dtype=np.uint8)
        begin = box.header_bytes + info.offsets[0]
        for at in range(0, info.nbytes, step):
            piece = buf[: min(step, info.nbytes - at)]
            src.readinto(begin + at, piece)
            h.update(piece)
    if h.hexdigest() != box.sums[tname]:
        raise _mismatch(src, box, tname)


def _mismatch(src: Source, box: Container, tname: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(f"{src.name}: section {tname!r} (tensor {tname!r}) does not match its "
                                 f"{C.CHECKSUM_NAMES[box.checksum]}: the file was altered or damaged; {RECOPY}")


def tensor_bytes(src: Source, box: Container, tname: str, keep: bool = True) -> np.ndarray | None:
    """Tensor ``tname``'s decoded bytes, uint8 ``[raw bytes]``, after its checksum matched (``check_tensor``).

    A raw tensor of a path is a private copy-on-write memory map (checksummed through the map; a file changed in
    place while it is loaded can therefore give other bytes: kvpack's writer never changes a file in place, it
    renames a new one over it), otherwise a fresh buffer. An encoded tensor is decoded into a fresh buffer
    (``codecs.decode_zstd``). With ``keep=False`` nothing is returned and nothing is held but one bounded buffer:
    a raw tensor is only checksummed, an encoded one also decoded and checked.

    Raises:
        ChecksumMismatchError: see ``check_tensor``.
        CorruptFileError: the zstd frame is not one intact frame of exactly the declared size.
    """
    info = box.tensors[tname]
    begin = box.header_bytes + info.offsets[0]
    if info.codec is None and keep:
        out = src.array(begin, info.nbytes)
        check_tensor(src, box, tname, out)
        return out
    check_tensor(src, box, tname)
    if info.codec is None:
        return None
    out = np.empty(info.raw_nbytes, dtype=np.uint8) if keep else None
    try:
        decode_zstd(lambda at, n: src.read(begin + at, n), info.nbytes, info.raw_nbytes, info.codec.filter,
                    C.ITEMSIZE_BY_CODE[info.dtype], out)
    except CodecError as exc:
        raise CorruptFileError(f"{src.name}: tensor {tname!r}: {exc}; {RECOPY}") from None
    return out


def stream_tensor(src: Source, box: Container, tname: str, put, row: int = 1) -> None:
    """Hand tensor ``tname``'s decoded bytes to ``put(first element, uint8 [m x itemsize])`` in element order, in
    chunks of whole rows of ``row`` elements (about ``READ_CHUNK_BYTES`` each; the buffer is reused), so that the
    caller can cast and place each chunk once, never holding the tensor twice.

    A raw tensor is read chunk by chunk and checksummed on the way (a mismatch is raised after the last chunk: the
    caller drops what it received); an encoded one is checksummed first, then decoded (``codecs.iter_decoded``).
    Memory: one chunk (and, encoded, one zstd window per byte plane).

    Raises:
        ChecksumMismatchError: see ``check_tensor``.
        CorruptFileError: the zstd frame is not one intact frame of exactly the declared size.
    """
    info = box.tensors[tname]
    itemsize = C.ITEMSIZE_BY_CODE[info.dtype]
    numel = info.raw_nbytes // itemsize
    step = max(1, C.READ_CHUNK_BYTES // (itemsize * row)) * row
    begin = box.header_bytes + info.offsets[0]
    if info.codec is None:
        h = _digest(box.checksum)
        buf = np.empty(min(step, numel) * itemsize, dtype=np.uint8)
        for at in range(0, numel, step):
            piece = buf[: min(step, numel - at) * itemsize]
            src.readinto(begin + at * itemsize, piece)
            h.update(piece)
            put(at, piece)
        if h.hexdigest() != box.sums[tname]:
            raise _mismatch(src, box, tname)
        return
    check_tensor(src, box, tname)
    try:
        for at, chunk in iter_decoded(lambda o, n: src.read(begin + o, n), info.nbytes, info.raw_nbytes,
                                      info.codec.filter, itemsize, step):
            put(at, chunk)
    except CodecError as exc:
        raise CorruptFileError(f"{src.name}: tensor {tname!r}: {exc}; {RECOPY}") from None


# ---------------------------------------------------------------------------------------------------------------
# writing


def container_bytes(metadata: dict[str, str], stored: dict[str, tuple[str, list[int], bytes]], checksum: str
                    ) -> tuple[bytes, list[bytes]]:
    """The length prefix and padded canonical header, and the tensors' bytes in data order (``format/SPEC.md`` §8).

    Args:
        metadata: ``__metadata__`` without the checksums (``format`` first in sort order; no key may sort before it).
        stored: tensor name -> ``(index dtype code, index shape, stored bytes)``.
        checksum: ``"xxh3"`` or ``"sha256"`` for the tensor checksums.
    """
    order = sorted(stored, key=lambda t: (-C.ITEMSIZE_BY_CODE[stored[t][0]], t))
    index, end = {}, 0
    for tname in order:
        code, shape, blob = stored[tname]
        index[tname] = {C.INDEX_DTYPE: code, C.INDEX_SHAPE: shape, C.INDEX_OFFSETS: [end, end + len(blob)]}
        end += len(blob)
    digest = {C.CHECKSUM_XXH3: xxhash.xxh3_128_hexdigest, C.CHECKSUM_SHA256: lambda b: hashlib.sha256(b).hexdigest()}
    meta = dict(metadata)
    meta[C.TENSOR_CHECKSUM_KEY[checksum]] = canonical({t: digest[checksum](stored[t][2]) for t in order}).decode()
    header = {C.METADATA_KEY: meta, **index}
    meta[C.META_HEADER_SHA256] = hashlib.sha256(canonical(header)).hexdigest()
    text = _padded(canonical(header))
    if not text.startswith(C.MAGIC):
        raise RuntimeError("internal error: a __metadata__ key sorts before 'format', so the header lost its magic")
    return len(text).to_bytes(C.LENGTH_PREFIX_BYTES, "little") + text, [stored[t][2] for t in order]
