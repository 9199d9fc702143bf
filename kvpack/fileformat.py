"""Read and write ``.kvpack`` files: a canonical, checksummed safetensors container (spec: ``format/SPEC.md``).

Writing is deterministic (the same ``Pack`` and settings always give the same bytes). Reading validates every
length, offset, shape and checksum before any tensor is handed out, and every failure is a ``PackFormatError``
subclass (or ``InputError`` for a path that cannot be read) whose message names the file, the problem and the fix.

A file declares the lowest version whose features it uses: version 5 when its layers are quantized in the compact
layout (``kvpack.compact``; XXH3-128 checksums; one tensor per part, stacked over the layers; version 4 files, the
compact layout with per-layer tensors, are still read); version 3 when its tensor checksums are XXH3-128 (the default:
``save(..., checksum="xxh3")``); otherwise (SHA-256 tensor checksums) version 2 when it has quantized
layers (``kvpack.quant``) or zstd-compressed tensors (``save(..., zstd_level=N)``), else version 1. Compressed
tensors are decoded only after their checksum matched and their zstd frame declared exactly the size the header
records, so a damaged or hostile frame never allocates more.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch
import xxhash
import zstandard

from kvpack import constants as C
from kvpack.errors import (
    ChecksumMismatchError,
    CorruptFileError,
    InputError,
    NotAKvpackFileError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from kvpack.pack import LayerEntries, Pack, QuantizedRows
from kvpack.compact import compact_shapes, compact_split, compact_values_problem
from kvpack.quant import layer_quant_problem, split_lengths, value_group_size

__all__ = ["TensorCodec", "TensorInfo", "PackHeader", "pack_to_bytes", "check_storage_args", "save", "load_pack",
           "read_header", "verify"]

Source = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]

_REBUILD = "rebuild it with `kvpack build`"
_RECOPY = f"copy it again or {_REBUILD}"
_UPGRADE = "upgrade kvpack (`pip install -U kvpack`)"


# ---------------------------------------------------------------------------------------------------------------
# public types


@dataclass(frozen=True)
class TensorCodec:
    """How an encoded tensor is stored (v2, ``format/SPEC.md`` section 5.5).

    Attributes:
        codec: ``"zstd"``: the stored bytes are one zstd frame (RFC 8878) declaring its content size.
        filter: ``"none"``, ``"shuffle"`` or ``"delta_shuffle"``, applied to the raw bytes before compressing.
        level: the zstd level the writer used (informational; decoding does not need it).
    """

    codec: str
    filter: str
    level: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file, as the header describes it.

    Attributes:
        dtype: the tensor's dtype code, one of ``constants.DTYPE_BY_CODE`` (``"F32"``, ``"BF16"``, ``"I32"``, ...).
        shape: the tensor's shape.
        offsets: ``(begin, end)`` byte offsets of its stored bytes in the data buffer (which starts right after the
            header).
        codec: ``None`` if the bytes are stored raw; else how they are encoded (the index entry then says ``U8``,
            ``[stored bytes]``, and ``dtype``/``shape`` come from ``__metadata__.tensor_codecs``).
    """

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]
    codec: TensorCodec | None = None

    @property
    def nbytes(self) -> int:
        """Size of the tensor's stored data in bytes (compressed size for an encoded tensor)."""
        return self.offsets[1] - self.offsets[0]

    @property
    def raw_nbytes(self) -> int:
        """Size of the tensor's decoded data in bytes: ``numel x itemsize``."""
        return math.prod(self.shape) * C.DTYPE_BY_CODE[self.dtype].itemsize


@dataclass
class PackHeader:
    """The validated header of a ``.kvpack`` file (what ``read_header`` and ``verify`` return).

    Attributes:
        format_version: the file's format version: 5 (or 4, per-layer tensors) with compact-layout quantization,
            else 3 with XXH3-128 tensor checksums; with SHA-256 ones, 2 when it uses quantization or zstd, else 1.
        metadata: the kvpack metadata: ``Pack.metadata`` plus ``"sink_tokens"``.
        tensors: tensor name -> ``TensorInfo``, in data order.
        header_bytes: bytes before the data buffer (8-byte length prefix + padded JSON header).
        file_bytes: size of the whole file in bytes.
        quant_type: ``"none"``, ``"int8"`` or ``"int4"``.
        group_size: the quantization group size ``G``, or ``None`` when not quantized.
        checksum: the tensor checksum algorithm, ``"xxh3"`` (versions 3-5) or ``"sha256"`` (versions 1, 2).
        quant_layout: ``"compact"`` (versions 4, 5), ``"kivi"`` (quantized versions 2, 3), or ``None`` when not
            quantized.
    """

    format_version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    header_bytes: int
    file_bytes: int
    quant_type: str = C.QUANT_NONE
    group_size: int | None = None
    checksum: str = C.CHECKSUM_SHA256
    quant_layout: str | None = None

    @property
    def zstd_level(self) -> int:
        """The zstd level the tensors were compressed with (0: none is compressed)."""
        return max((t.codec.level for t in self.tensors.values() if t.codec is not None), default=0)

    @property
    def raw_bytes(self) -> int:
        """Bytes of all tensors once decoded (what loading allocates for them)."""
        return sum(t.raw_nbytes for t in self.tensors.values())

    @property
    def num_layers(self) -> int:
        """Number of model layers stored."""
        return self.tensors[C.HEAD_LENGTHS].shape[0]

    @property
    def kv_heads(self) -> int:
        """Number of KV heads per layer."""
        return self.tensors[C.HEAD_LENGTHS].shape[1]

    @property
    def entries(self) -> int:
        """Kept entries over all layers and KV heads (the rows of every layer's positions)."""
        if C.POSITIONS in self.tensors:  # version 5: stacked
            return self.tensors[C.POSITIONS].shape[0]
        return sum(self.tensors[C.layer_tensor_name(l, C.POSITIONS)].shape[0] for l in range(self.num_layers))

    @property
    def tokens(self) -> int:
        """Length of the original cached sequence in tokens."""
        return self.tensors[C.TOKEN_IDS].shape[0]

    def bytes_by_section(self) -> dict[str, int]:
        """Stored bytes per section: ``header``, ``token_ids``, ``head_lengths``, ``keys``, ``values``, ``positions``
        and, in a quantized file, its quantization parts (``constants.QUANT_PARTS`` for the KIVI layout,
        ``constants.COMPACT_PARTS`` for the compact one).

        Layer tensors are summed over layers by part. The values add up to ``file_bytes``.
        """
        parts = {None: (), C.QUANT_LAYOUT_KIVI: C.QUANT_PARTS, C.QUANT_LAYOUT_COMPACT: C.COMPACT_PARTS}
        out = dict.fromkeys(C.SECTIONS + parts[self.quant_layout], 0)
        out[C.SECTION_HEADER] = self.header_bytes
        for name, info in self.tensors.items():
            part = name.rsplit(".", 1)[-1]
            out[part] = out.get(part, 0) + info.nbytes  # ``biases`` (temporary, until format 1.0): when present
        return out


# ---------------------------------------------------------------------------------------------------------------
# writing


def pack_to_bytes(pack: Pack, zstd_level: int = C.SAVE_DEFAULT_ZSTD_LEVEL,
                  checksum: str = C.DEFAULT_CHECKSUM) -> bytes:
    """Serialise ``pack`` to the bytes of a ``.kvpack`` file (deterministic: same pack and settings, same bytes).

    ``token_ids``, ``head_lengths`` and ``positions`` are stored as int32; keys and values keep their dtype
    (float32, float16 or bfloat16); a quantized pack adds its codes (uint8), scales and mins (float16) per layer.
    Tuples in ``pack.metadata`` come back as lists.

    Args:
        pack: the pack.
        zstd_level: 0 (default) stores every tensor raw; 1..22 stores every non-empty tensor as one zstd frame of
            that level (after a byte shuffle, and a delta for positions; ``format/SPEC.md`` section 5.5). The
            compressed bytes depend on the zstd library's version; decoding does not.
        checksum: the tensor checksum, ``"xxh3"`` (default: XXH3-128, ~40x faster to verify than SHA-256, detects
            damage but not deliberate tampering) or ``"sha256"`` (cryptographic; readable by kvpack 0.1). The
            header's own checksum is SHA-256 either way.

    The file is format version 5 if the pack is quantized in the compact layout (``kvpack.compact``; XXH3-128 only;
    its tensors stacked over the layers),
    else version 3 with ``checksum="xxh3"``; with ``"sha256"`` it is version 1 if the pack is not quantized and
    ``zstd_level`` is 0, else version 2.

    Raises:
        InputError: the pack is inconsistent (see ``load_pack`` for the rules), has a dtype the format cannot
            hold, or its metadata is not plain JSON (or already has a ``sink_tokens`` key); a bad ``zstd_level``
            or ``checksum``; ``checksum="sha256"`` for a compact-layout pack.
    """
    problem = _pack_problem(pack)
    if problem is None and not isinstance(pack.metadata, dict):
        problem = "pack.metadata must be a dict"
    if problem is None and C.SINK_TOKENS_KEY in pack.metadata:
        problem = f"pack.metadata must not contain {C.SINK_TOKENS_KEY!r} (it is written from pack.sink_tokens)"
    if problem is not None:
        raise InputError(f"cannot write this pack: {problem}")
    check_storage_args(zstd_level, checksum)
    quant = pack.layers[0].quant
    compact = quant is not None and quant.layout == C.QUANT_LAYOUT_COMPACT
    if compact and checksum != C.CHECKSUM_XXH3:
        raise InputError("a pack quantized in the compact layout is written as format version 5, which uses XXH3-128 "
                         "checksums; save it with checksum='xxh3', or build it with kvpack.compress(..., "
                         "quant_layout='kivi') for a version-2 file with SHA-256 checksums")
    try:
        kvpack_json = json.dumps({**pack.metadata, C.SINK_TOKENS_KEY: pack.sink_tokens}, **C.JSON_DUMPS_KWARGS)
    except (TypeError, ValueError) as exc:
        raise InputError(
            f"cannot write this pack: pack.metadata is not plain JSON ({exc}); use only dicts with string keys, "
            "lists, strings, finite numbers, booleans and None"
        ) from exc

    i32 = C.DTYPE_BY_CODE[C.INDEX_INT_CODE]
    tensors = {C.TOKEN_IDS: pack.token_ids.to(i32), C.HEAD_LENGTHS: pack.head_lengths().to(i32)}
    if compact:  # version 5: each part stacked over the layers
        tensors.update(_stacked_parts(pack))
        tensors[C.POSITIONS] = tensors[C.POSITIONS].to(i32)
    else:
        for l, layer in enumerate(pack.layers):
            tensors[C.layer_tensor_name(l, C.KEYS)] = layer.keys
            tensors[C.layer_tensor_name(l, C.VALUES)] = layer.values
            tensors[C.layer_tensor_name(l, C.POSITIONS)] = layer.positions.to(i32)
            if layer.quant is not None:
                for part, tensor in layer.quant.parts().items():
                    tensors[C.layer_tensor_name(l, part)] = tensor

    if any(layer.biases is not None for layer in pack.layers):
        tensors[C.BIASES] = torch.cat([layer.biases.float() if layer.biases is not None else
                                       torch.zeros(layer.num_entries) for layer in pack.layers])

    stored, codecs = {}, {}
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        if zstd_level and raw:
            code = C.CODE_BY_DTYPE[t.dtype]
            filt = _writer_filter(name, code)
            blob = _encode(raw, code, filt, zstd_level)
            stored[name] = (C.STORED_CODE, [len(blob)], blob)
            codecs[name] = {"codec": C.CODEC_ZSTD, "dtype": code, "filter": filt, "level": zstd_level,
                            "raw_bytes": len(raw), "shape": list(t.shape)}
        else:
            stored[name] = (C.CODE_BY_DTYPE[t.dtype], list(t.shape), raw)

    blobs, index, end = [], {}, 0
    for name in sorted(stored, key=lambda n: (-C.DTYPE_BY_CODE[stored[n][0]].itemsize, n)):
        code, shape, blob = stored[name]
        index[name] = {C.INDEX_DTYPE: code, C.INDEX_SHAPE: shape, C.INDEX_OFFSETS: [end, end + len(blob)]}
        blobs.append((name, blob))
        end += len(blob)

    if compact:
        version = C.FORMAT_VERSION_V5
    elif checksum == C.CHECKSUM_XXH3:
        version = C.FORMAT_VERSION_V3
    else:
        version = C.FORMAT_VERSION_V2 if quant is not None or codecs else C.FORMAT_VERSION_PLAIN
    digest = _DIGESTS[checksum]
    meta = {
        C.META_FORMAT: C.FORMAT_NAME,
        C.META_FORMAT_VERSION: str(version),
        C.META_KVPACK: kvpack_json,
        C.TENSOR_CHECKSUM_KEY[checksum]: json.dumps({n: digest(b) for n, b in blobs}, **C.JSON_DUMPS_KWARGS),
    }
    if quant is not None:
        info = {"group_size": quant.group_size, "type": quant.qtype}
        if compact:
            info["layout"] = C.QUANT_LAYOUT_COMPACT
        meta[C.META_QUANT] = json.dumps(info, **C.JSON_DUMPS_KWARGS)
    if codecs:
        meta[C.META_TENSOR_CODECS] = json.dumps(codecs, **C.JSON_DUMPS_KWARGS)
    header = {C.METADATA_KEY: meta, **index}
    meta[C.META_HEADER_SHA256] = _sha256(_canonical(header))
    text = _padded(_canonical(header))
    if not text.startswith(C.MAGIC):
        raise RuntimeError("internal error: a __metadata__ key sorts before 'format', so the header lost its magic")
    return len(text).to_bytes(C.LENGTH_PREFIX_BYTES, "little") + text + b"".join(b for _, b in blobs)


def _stacked_parts(pack: Pack) -> dict[str, torch.Tensor]:
    """The version-5 tensors of a compact-layout pack: each of ``STACKED_PARTS`` over all layers, layer 0 first
    (rows, key groups or value rows concatenated; ``key_bits`` and ``quant_grid`` stacked on a new layer axis)."""
    layers = pack.layers
    parts = [layer.quant.parts() for layer in layers]
    out = {C.KEYS: torch.cat([e.keys for e in layers]), C.VALUES: torch.cat([e.values for e in layers]),
           C.POSITIONS: torch.cat([e.positions for e in layers])}
    for part in C.COMPACT_PARTS:
        pieces = [p[part] for p in parts]
        if part in (C.KEY_BITS, C.QUANT_GRID):
            out[part] = torch.stack(pieces)
        else:
            out[part] = torch.cat(pieces, dim=1 if part in (C.KEY_PARAMS, C.VALUE_PARAMS) else 0)
    return out


def check_storage_args(zstd_level: int, checksum: str) -> None:
    """Check ``save``'s storage arguments before anything is computed or written.

    Raises:
        InputError: ``zstd_level`` is not 0 or an integer in ``[1, 22]``, or ``checksum`` is not ``"xxh3"`` or
            ``"sha256"``; the message gives the allowed values.
    """
    if isinstance(zstd_level, bool) or not isinstance(zstd_level, int) or not (
            zstd_level == 0 or C.ZSTD_MIN_LEVEL <= zstd_level <= C.ZSTD_MAX_LEVEL):
        raise InputError(f"zstd_level must be 0 (off) or an integer in [{C.ZSTD_MIN_LEVEL}, {C.ZSTD_MAX_LEVEL}], "
                         f"got {zstd_level!r}")
    if checksum not in C.CHECKSUMS:
        raise InputError(f"checksum must be one of {', '.join(map(repr, C.CHECKSUMS))}, got {checksum!r}")


def save(pack: Pack, path: str | os.PathLike, zstd_level: int = C.SAVE_DEFAULT_ZSTD_LEVEL,
         checksum: str = C.DEFAULT_CHECKSUM) -> int:
    """Write ``pack`` to ``path`` atomically and return the number of bytes written.

    ``zstd_level`` (default 0: off, so an unquantized pack gives a file that plain safetensors tools read tensor
    by tensor) compresses each tensor with zstd at that level (1..22; ``kvpack build`` uses 3); ``checksum``
    (default ``"xxh3"``; ``"sha256"`` for a file kvpack 0.1 can read when it uses no other new feature) picks the
    tensor checksum; see ``pack_to_bytes``.

    The bytes go to ``<path>.tmp.<pid>.<random>`` in the same folder, are flushed and fsynced, and the temporary
    file is then renamed over ``path`` with ``os.replace``. On any error the temporary file is removed and an
    existing ``path`` is left untouched.

    Raises:
        InputError: the pack cannot be written (see ``pack_to_bytes``) or the file cannot be created
            (missing folder, no permission, disk full).
    """
    data = pack_to_bytes(pack, zstd_level, checksum)
    try:
        target = os.fspath(path)
    except TypeError as exc:
        raise InputError(f"cannot save to {path!r}: expected a file path") from exc
    tmp = f"{target}{C.TEMP_INFIX}{os.getpid()}.{secrets.token_hex(C.TEMP_RANDOM_BYTES)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), C.TEMP_FILE_MODE)
    except OSError as exc:
        raise InputError(
            f"cannot save {target}: {exc.strerror or exc}; check that the folder exists and is writable"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            reason = exc.strerror or exc
            raise InputError(f"cannot save {target}: {reason}; check the disk space and permissions") from exc
        raise
    _fsync_folder(os.path.dirname(os.path.abspath(target)))
    return len(data)


# ---------------------------------------------------------------------------------------------------------------
# reading


def read_header(source: Source) -> PackHeader:
    """Read and validate the header of a ``.kvpack`` file (a path or the file's bytes) without reading the data.

    Checks everything except the tensor checksums and the tensor values: sizes, magic, version, the tensor index
    (dtypes, shapes, offsets, layout), the tensor set, the header checksum and the kvpack metadata.

    Raises:
        InputError: the path cannot be read.
        TruncatedFileError, NotAKvpackFileError, CorruptFileError, ChecksumMismatchError (header),
        UnsupportedVersionError: see ``load_pack``.
    """
    with _Source(source) as src:
        return _parse_header(src)[0]


def verify(source: Source) -> PackHeader:
    """Check everything ``load_pack`` checks, raising on the first problem; return the header.

    Raises: the errors of ``load_pack``.
    """
    return _load(source)[0]


def load_pack(source: Source) -> Pack:
    """Read a ``.kvpack`` file (a path or its bytes) into a ``Pack`` after validating all of it.

    Returned tensors are fresh copies: ``token_ids`` int64 ``[tokens]``; per layer ``keys`` ``[entries, head_dim]``
    and ``values`` ``[entries, head_dim_v]`` in the stored dtype, ``positions`` int32 ``[entries]``,
    ``head_lengths`` int64 ``[kv_heads]``.

    Raises:
        InputError: the path cannot be read (missing, a folder, no permission).
        TruncatedFileError: the file is shorter than its header says (cut inside the header or the data).
        NotAKvpackFileError: no kvpack magic: some other file.
        CorruptFileError: malformed or inconsistent header, index, layout, metadata or tensor contents
            (head lengths, positions), or trailing bytes.
        ChecksumMismatchError: the header or a tensor does not match its checksum (SHA-256; XXH3-128 for the
            tensors of a version-3 file).
        UnsupportedVersionError: the file's format version is newer than this kvpack reads.
    """
    return _load(source)[1]


# ---------------------------------------------------------------------------------------------------------------
# internals


class _Source:
    """A file path or an in-memory file, read by byte range.

    A path is opened once, on the first read, and stays open until ``close()`` (or the end of a ``with`` block):
    a load reads the length prefix, the magic, the header and the data through one file object.
    """

    def __init__(self, source: Source):
        self._data: bytes | None = None
        self._file = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._data = bytes(source)
            self.name, self.size = "kvpack data (in memory)", len(self._data)
            return
        try:
            self.path = os.fspath(source)
        except TypeError as exc:
            raise InputError(f"cannot read {source!r}: expected a file path or bytes") from exc
        self.name = self.path
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise InputError(f"cannot read {self.path}: {exc.strerror or exc}; check the path") from exc
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"cannot read {self.path}: not a regular file; give the path of a .kvpack file")
        self.size = st.st_size

    def __enter__(self) -> "_Source":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the file, if one was opened."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def read(self, start: int, n: int) -> bytes:
        """Exactly ``n`` bytes from ``start`` (the caller has checked the range against ``size``)."""
        return bytes(self.read_into_buffer(start, n)) if self._data is None else self._data[start : start + n]

    def read_into_buffer(self, start: int, n: int) -> bytearray | np.ndarray:
        """Exactly ``n`` bytes from ``start`` in a fresh, writable buffer (tensors can then share it, no copy).

        From a file the buffer is an uninitialised uint8 array ``[n]`` that the read fills (no zero-filling first).
        """
        if self._data is not None:
            return bytearray(self._data[start : start + n])
        buf = np.empty(n, dtype=np.uint8)
        try:
            if self._file is None:
                self._file = open(self.path, "rb", buffering=0)
            self._file.seek(start)
            got = self._file.readinto(buf)
        except OSError as exc:
            raise InputError(f"cannot read {self.path}: {exc.strerror or exc}; check the path") from exc
        if got != n:
            raise TruncatedFileError(f"{self.path}: the file became shorter while being read; {_RECOPY}")
        return buf


def _load(source: Source) -> tuple[PackHeader, Pack]:
    """Validate a whole file and build its Pack."""
    with _Source(source) as src:
        header, sums = _parse_header(src)
        data = memoryview(src.read_into_buffer(header.header_bytes, header.file_bytes - header.header_bytes))
    digest = _DIGESTS[header.checksum]
    for name, info in header.tensors.items():
        b, e = info.offsets
        if digest(data[b:e]) != sums[name]:
            section = name.rsplit(".", 1)[-1]
            raise ChecksumMismatchError(
                f"{src.name}: section {section!r} (tensor {name!r}) does not match its "
                f"{C.CHECKSUM_NAMES[header.checksum]}: the file was altered or damaged; {_RECOPY}"
            )
    decompressor = _decompressor(header)
    t = {name: _tensor(data, info, src.name, name, decompressor) for name, info in header.tensors.items()}
    meta = dict(header.metadata)
    sink = meta.pop(C.SINK_TOKENS_KEY)
    split = _checked_split(t, header, sink)
    if header.format_version >= C.FORMAT_VERSION_V5:  # per-layer views of the stacked tensors, named as in v4
        problem = _unstacked(t, header, sink, None if split is None else split[1].numpy())
        if problem is not None:
            raise CorruptFileError(f"{src.name}: {problem}; {_REBUILD}")
    all_lengths = t[C.HEAD_LENGTHS].to(torch.int64)
    header_dims = (t[C.layer_tensor_name(0, C.KEYS)].shape[1], t[C.layer_tensor_name(0, C.VALUES)].shape[1])
    layers = []
    for l in range(header.num_layers):
        positions = t[C.layer_tensor_name(l, C.POSITIONS)]
        head_lengths = all_lengths[l]
        quant = None
        if header.group_size is not None:
            compact = header.quant_layout == C.QUANT_LAYOUT_COMPACT
            if split is not None:
                sinks, body = split[0][l], split[1][l]
            elif int(head_lengths.min()) >= 0 and int(head_lengths.sum()) == positions.shape[0]:
                if compact:
                    sinks, body = compact_split(positions, head_lengths, sink, header.group_size)
                else:
                    sinks, body, _ = split_lengths(positions, head_lengths, sink, header.group_size)
            else:  # _pack_problem reports the bad head lengths below
                sinks = body = torch.zeros_like(head_lengths)
            if compact:
                parts = {part: t[C.layer_tensor_name(l, part)] for part in C.COMPACT_PARTS}
                quant = QuantizedRows(header.quant_type, header.group_size, sinks, body, parts[C.KEY_CODES], None,
                                      None, parts[C.VALUE_CODES], None, None, layout=C.QUANT_LAYOUT_COMPACT,
                                      key_bits=parts[C.KEY_BITS], key_params=parts[C.KEY_PARAMS],
                                      value_params=parts[C.VALUE_PARAMS], quant_grid=parts[C.QUANT_GRID])
            else:
                parts = [t[C.layer_tensor_name(l, part)] for part in C.QUANT_PARTS]
                quant = QuantizedRows(header.quant_type, header.group_size, sinks, body, *parts)
        layers.append(LayerEntries(
            keys=t[C.layer_tensor_name(l, C.KEYS)],
            values=t[C.layer_tensor_name(l, C.VALUES)],
            positions=positions,
            head_lengths=head_lengths,
            quant=quant,
        ))
    if split is not None and header.quant_layout == C.QUANT_LAYOUT_COMPACT:  # shapes: checked with the header
        if header.format_version >= C.FORMAT_VERSION_V5:
            widths, grids = t[C.KEY_BITS].numpy(), t[C.QUANT_GRID].numpy()
        else:
            widths = np.stack([layer.quant.key_bits.numpy() for layer in layers])
            grids = np.stack([layer.quant.quant_grid.numpy() for layer in layers])
        problem = compact_values_problem(widths, grids, header.quant_type, header_dims[0])
        if problem is not None:
            raise CorruptFileError(f"{src.name}: {problem}; {_REBUILD}")
    if C.BIASES in t:
        total = sum(layer.num_entries for layer in layers)
        if t[C.BIASES].shape[0] != total or not bool(torch.isfinite(t[C.BIASES]).all()):
            raise CorruptFileError(f"{src.name}: tensor {C.BIASES!r} must hold {total} finite values (one per entry), "
                                   f"it has {t[C.BIASES].shape[0]}; {_REBUILD}")
        start = 0
        for layer in layers:
            layer.biases = t[C.BIASES][start : start + layer.num_entries]
            start += layer.num_entries
    pack = Pack(token_ids=t[C.TOKEN_IDS].to(torch.int64), layers=layers, sink_tokens=sink, metadata=meta)
    if split is None:  # something is wrong: the full check names it
        problem = _pack_problem(pack)
        if problem is None:
            raise RuntimeError(f"internal error: {src.name} failed the vectorised pack checks but passes _pack_problem")
        raise CorruptFileError(f"{src.name}: {problem}; {_REBUILD}")
    return header, pack


def _unstacked(t: dict[str, torch.Tensor], header: PackHeader, sink: int, body: np.ndarray | None = None
               ) -> str | None:
    """Add to ``t`` (a version-5 file's tensors) each layer's share of every stacked part as a view named as in a
    version-4 file (``layers.{l}.{part}``), so the per-layer checks and the loader treat both versions alike.

    Layer ``l`` owns ``sum(head_lengths[l])`` positions, of which its heads' compact body rows (``compact_split``:
    every non-sink row when there are at least ``G`` of them) are quantized rows and key groups, and the rest
    full-precision rows (``body``: the body rows ``[layers, kv_heads]`` when ``_checked_split`` has them, else
    derived here); ``key_bits[l]`` and ``quant_grid[l]`` are its own. Returns the problem (and adds nothing)
    if the head lengths cannot be split (negative, or not summing to the positions) or the split does not add up to
    a stacked tensor's rows.
    """
    lengths = t[C.HEAD_LENGTHS].numpy().astype(np.int64)  # [layers, kv_heads]
    positions = t[C.POSITIONS].numpy()
    if lengths.min() < 0 or lengths.sum() != positions.shape[0]:
        return (f"{C.HEAD_LENGTHS!r} must be non-negative and sum to the {positions.shape[0]} entries of "
                f"{C.POSITIONS!r}")
    g = header.group_size
    if body is None:
        body = _head_split(lengths.reshape(-1), positions, sink, g, compact=True)[1].reshape(lengths.shape)
    counts = {  # part -> (rows of each layer, axis)
        C.POSITIONS: (lengths.sum(axis=1), 0),
        C.KEYS: (lengths.sum(axis=1) - body.sum(axis=1), 0),
        C.KEY_CODES: (body.sum(axis=1), 0),
        C.VALUE_CODES: (body.sum(axis=1), 0),
        C.VALUE_PARAMS: (body.sum(axis=1), 1),
        C.KEY_PARAMS: (((body + g - 1) // g).sum(axis=1), 1),
    }
    counts[C.VALUES] = counts[C.KEYS]
    for part, (rows, axis) in counts.items():
        if int(rows.sum()) != t[part].shape[axis]:
            what = "key groups" if part == C.KEY_PARAMS else "rows"
            return (f"the head lengths and positions call for {int(rows.sum())} {what} in {part!r} over all layers "
                    f"(each head's non-sink rows are quantized when there are at least {g}), but it has "
                    f"{t[part].shape[axis]}")
    for part, (rows, axis) in counts.items():
        start = 0
        for l, n in enumerate(rows.tolist()):
            t[C.layer_tensor_name(l, part)] = t[part][start : start + n] if axis == 0 else t[part][:, start : start + n]
            start += n
    for part in (C.KEY_BITS, C.QUANT_GRID):
        for l in range(lengths.shape[0]):
            t[C.layer_tensor_name(l, part)] = t[part][l]
    return None


def _head_split(flat: np.ndarray, positions: np.ndarray, sink: int, group_size: int, compact: bool
                ) -> tuple[np.ndarray, np.ndarray]:
    """Sink and body rows of each head, ``(sinks, body)`` int64 ``[heads]``, for heads of ``flat[i]`` rows whose
    ``positions`` lie back to back (increasing within a head, so its sink rows, positions below ``sink``, lead it).
    Body rows: every non-sink row when there are at least ``group_size`` (compact layout, ``compact.compact_split``),
    else as many whole groups as fit (KIVI layout, ``quant.split_lengths``)."""
    ends = np.cumsum(flat)
    below = np.concatenate([[0], np.cumsum(positions < sink)])
    sinks = below[ends] - below[ends - flat]
    rest = flat - sinks
    return sinks, (np.where(rest >= group_size, rest, 0) if compact else rest // group_size * group_size)


def _checked_split(t: dict[str, torch.Tensor], header: PackHeader, sink: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The value checks of ``_pack_problem`` on a file's tensors, for all layers at once; plus the quantized split.

    ``t`` are the file's tensors (int32 ``token_ids``, ``head_lengths`` ``[layers, kv_heads]``, ``positions``, per
    layer or, version 5, stacked over the layers; the header has validated every dtype and shape). Checks: token
    ids >= 0; per layer, head lengths >= 0 summing to the layer's entries, positions in ``[0, tokens)`` and
    strictly increasing within each head; for a quantized file, that the body rows the layout rule gives
    (``_head_split``) add up to each layer's quantized rows (and, compact, that its key groups add up to its key
    parameter rows); in a version-5 file, to the stacked tensors' rows.

    Returns ``None`` if any check fails (``_pack_problem`` then says which), else ``(sink_lengths, body_lengths)``:
    int64 ``[layers, kv_heads]`` (per ``split_lengths``; zeros for an unquantized file).
    """
    layers = header.num_layers
    tokens = t[C.TOKEN_IDS].numpy()
    if tokens.size and tokens.min() < 0:  # int32 ids are <= INT32_MAX by type
        return None
    lengths = t[C.HEAD_LENGTHS].numpy().astype(np.int64)  # [layers, kv_heads]
    stacked = C.POSITIONS in t  # version 5: one tensor per part for all layers
    if stacked:
        allpos = t[C.POSITIONS].numpy()
        if lengths.min() < 0 or lengths.sum() != allpos.shape[0]:
            return None
    else:
        pos = [t[C.layer_tensor_name(l, C.POSITIONS)].numpy() for l in range(layers)]
        if lengths.min() < 0 or lengths.sum(axis=1).tolist() != [p.shape[0] for p in pos]:
            return None
        allpos = np.concatenate(pos)
    flat = lengths.reshape(-1)  # (layer, head) segments, in the order of the concatenated positions
    ends = np.cumsum(flat)
    starts = ends - flat
    if allpos.size:
        if allpos.min() < 0 or allpos.max() >= tokens.shape[0]:
            return None
        rises = allpos[1:] > allpos[:-1]
        rises[starts[(flat > 0) & (starts > 0)] - 1] = True  # a new segment may start lower
        if not rises.all():
            return None
    if header.group_size is None:
        zeros = torch.zeros(lengths.shape, dtype=torch.int64)
        return zeros, zeros
    g = header.group_size
    compact = header.quant_layout == C.QUANT_LAYOUT_COMPACT
    sinks, body = _head_split(flat, allpos, sink, g, compact)
    if compact:
        groups = ((body + g - 1) // g).reshape(layers, -1).sum(axis=1).tolist()
        if (sum(groups) != t[C.KEY_PARAMS].shape[1] if stacked else
                groups != [t[C.layer_tensor_name(l, C.KEY_PARAMS)].shape[1] for l in range(layers)]):
            return None
    if stacked:
        if int(body.sum()) != t[C.KEY_CODES].shape[0]:
            return None
    elif body.reshape(layers, -1).sum(axis=1).tolist() != [t[C.layer_tensor_name(l, C.KEY_CODES)].shape[0]
                                                            for l in range(layers)]:
        return None
    return torch.from_numpy(sinks.reshape(lengths.shape)), torch.from_numpy(body.reshape(lengths.shape))


def _tensor(data: memoryview, info: TensorInfo, where: str, name: str,
            decompressor: zstandard.ZstdDecompressor | None) -> torch.Tensor:
    """A tensor over the data-buffer range of ``info`` (decoded into its own buffer if it is encoded).

    ``data`` is a writable buffer private to this load, so plain tensors are views into it, not copies.
    ``decompressor`` is shared by the encoded tensors of one load (``_decompressor``; ``None`` if there are none)."""
    dtype = C.DTYPE_BY_CODE[info.dtype]
    b, e = info.offsets
    raw = data[b:e] if info.codec is None else _decode(where, name, data[b:e], info, decompressor)
    if len(raw) == 0:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype).reshape(info.shape)


def _parse_header(src: _Source) -> tuple[PackHeader, dict[str, str]]:
    """Validate everything up to the tensor data; return the header and the tensor checksums."""
    name, size = src.name, src.size

    def corrupt(problem: str) -> CorruptFileError:
        return CorruptFileError(f"{name}: {problem}; {_REBUILD}")

    # 1. sizes and magic
    if size < C.LENGTH_PREFIX_BYTES:
        what = "is empty" if size == 0 else f"is only {size} bytes long"
        raise TruncatedFileError(f"{name} {what}, too short for a kvpack file; {_RECOPY}")
    n = int.from_bytes(src.read(0, C.LENGTH_PREFIX_BYTES), "little")
    avail = min(len(C.MAGIC), n, size - C.LENGTH_PREFIX_BYTES)
    if n < len(C.MAGIC) or src.read(C.MAGIC_OFFSET, avail) != C.MAGIC[:avail]:
        raise NotAKvpackFileError(
            f"{name} is not a kvpack file (no kvpack magic at byte {C.MAGIC_OFFSET}); check the path, "
            "or make a .kvpack file with `kvpack build`"
        )
    if n > C.MAX_HEADER_BYTES:
        raise corrupt(f"the header length {n} exceeds the {C.MAX_HEADER_BYTES}-byte limit")
    if n > size - C.LENGTH_PREFIX_BYTES:
        raise TruncatedFileError(
            f"{name} is cut inside its header ({n}-byte header declared, {size - C.LENGTH_PREFIX_BYTES} bytes "
            f"present); {_RECOPY}"
        )
    if n % C.HEADER_ALIGNMENT:
        raise corrupt(f"the header length {n} is not a multiple of {C.HEADER_ALIGNMENT}")

    # 2. JSON object, format, version
    raw = src.read(C.LENGTH_PREFIX_BYTES, n)
    obj, canonical = _parse_canonical(raw)
    if obj is None:  # not canonical: parse again, rejecting duplicate keys and NaN, to say what is wrong
        try:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise corrupt(f"the header is not valid JSON ({_short(exc)})") from None
    if not isinstance(obj, dict):
        raise corrupt("the header is not a JSON object")
    meta = obj.get(C.METADATA_KEY)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise corrupt(f"{C.METADATA_KEY!r} is missing or not a string-to-string map")
    if meta.get(C.META_FORMAT) != C.FORMAT_NAME:
        raise corrupt(f"{C.META_FORMAT!r} is {str(meta.get(C.META_FORMAT))[:20]!r}, not {C.FORMAT_NAME!r}")
    v = meta.get(C.META_FORMAT_VERSION, "")
    if not (v.isascii() and v.isdigit()) or v.startswith("0") or len(v) > 18:
        raise corrupt(f"{C.META_FORMAT_VERSION!r} is {v[:20]!r}, not a positive integer")
    version = int(v)
    if version > C.MAX_READABLE_VERSION:
        raise UnsupportedVersionError(
            f"{name} uses kvpack file format version {version}, but this kvpack reads versions up to "
            f"{C.MAX_READABLE_VERSION}; {_UPGRADE}"
        )
    checksum = C.CHECKSUM_XXH3 if version >= C.FORMAT_VERSION_V3 else C.CHECKSUM_SHA256
    sums_key = C.TENSOR_CHECKSUM_KEY[checksum]
    missing = [k for k in C.METADATA_KEYS + (sums_key,) if k not in meta]
    if missing:
        raise corrupt(f"{C.METADATA_KEY!r} lacks {missing[0]!r}")
    other = [k for k in C.TENSOR_CHECKSUM_KEY.values() if k != sums_key and k in meta]
    if other:
        raise corrupt(f"a version-{version} file keeps its tensor checksums in {sums_key!r}, not {other[0]!r}")
    features = [k for k in C.METADATA_KEYS_V2 if k in meta]
    if version >= C.FORMAT_VERSION_V4 and C.META_QUANT not in meta:
        raise corrupt(f"it declares format version {version} but has no {C.META_QUANT!r} (a version-{version} file "
                      "is one with compact-layout quantization); a file must declare the lowest version it needs")
    if version < C.FORMAT_VERSION_V2 and features:
        raise corrupt(f"a version-{version} file cannot have {features[0]!r} (a version-{C.FORMAT_VERSION_V2} feature)")
    if version == C.FORMAT_VERSION_V2 and not features:
        raise corrupt(f"it declares format version {version} but uses no version-{version} feature (quantization "
                      "or zstd); a file must declare the lowest version it needs")

    # 3. tensor index entries and their layout in the data buffer
    tensors: dict[str, TensorInfo] = {}
    for tname, entry in obj.items():
        if tname == C.METADATA_KEY:
            continue
        problem = _entry_problem(entry)
        if problem is not None:
            raise corrupt(f"tensor {tname[:80]!r}: {problem}")
        tensors[tname] = TensorInfo(entry[C.INDEX_DTYPE], tuple(entry[C.INDEX_SHAPE]), tuple(entry[C.INDEX_OFFSETS]))
    order = sorted(tensors, key=lambda t: (-C.DTYPE_BY_CODE[tensors[t].dtype].itemsize, t))
    end = 0
    for tname in order:
        info = tensors[tname]
        want = (end, end + math.prod(info.shape) * C.DTYPE_BY_CODE[info.dtype].itemsize)
        if info.offsets != want:
            raise corrupt(
                f"tensor {tname[:80]!r} has data_offsets {list(info.offsets)}, but the layout rule "
                f"(contiguous, by descending itemsize then name) puts it at {list(want)}"
            )
        end = want[1]
    tensors = {t: tensors[t] for t in order}
    data_len = size - C.LENGTH_PREFIX_BYTES - n
    if end > data_len:
        raise TruncatedFileError(f"{name} is cut inside its data ({end} bytes declared, {data_len} present); {_RECOPY}")
    if end < data_len:
        raise corrupt(f"{data_len - end} unexpected bytes follow the last tensor")

    # 3b. version-2 features: encoded tensors (their own dtype and shape) and quantization
    if C.META_TENSOR_CODECS in meta:
        codecs = _parse_json(meta[C.META_TENSOR_CODECS], corrupt)
        if not isinstance(codecs, dict) or not codecs:
            raise corrupt(f"{C.META_TENSOR_CODECS!r} must be a non-empty JSON object")
        for tname, codec in codecs.items():
            stored = tensors.get(tname)
            if stored is None:
                raise corrupt(f"{C.META_TENSOR_CODECS!r} names {tname[:80]!r}, which is not in the tensor index")
            problem = _codec_problem(codec)
            if problem is None and (stored.dtype != C.STORED_CODE or len(stored.shape) != 1):
                problem = (f"its index entry must be {C.STORED_CODE} [stored bytes], not {stored.dtype} "
                           f"{list(stored.shape)}")
            if problem is not None:
                raise corrupt(f"encoded tensor {tname[:80]!r}: {problem}")
            tensors[tname] = TensorInfo(codec["dtype"], tuple(codec["shape"]), stored.offsets,
                                        TensorCodec(codec["codec"], codec["filter"], codec["level"]))
        expanded = sum(tensors[t].raw_nbytes for t in codecs)
        if expanded > max(C.EXPANSION_FLOOR_BYTES, C.MAX_EXPANSION * size):
            raise corrupt(f"its compressed tensors would decompress to {expanded} bytes, more than {C.MAX_EXPANSION} "
                          f"times the {size}-byte file: refusing a possible decompression bomb")
    quant_type, group_size, layout = C.QUANT_NONE, None, None
    if C.META_QUANT in meta:
        q = _parse_json(meta[C.META_QUANT], corrupt)
        v4 = version >= C.FORMAT_VERSION_V4
        keys = C.QUANT_INFO_KEYS_V4 if v4 else C.QUANT_INFO_KEYS
        if (not isinstance(q, dict) or set(q) != set(keys) or q["type"] not in C.QUANT_TYPES
                or not _is_int(q["group_size"]) or not 1 <= q["group_size"] <= C.MAX_GROUP_SIZE
                or (v4 and q["layout"] != C.QUANT_LAYOUT_COMPACT)):
            layout_key = f"\"layout\": {C.QUANT_LAYOUT_COMPACT!r}, " if v4 else ""
            raise corrupt(f"{C.META_QUANT!r} must be {{\"group_size\": 1..{C.MAX_GROUP_SIZE}, {layout_key}\"type\": "
                          f"{' or '.join(map(repr, C.QUANT_TYPES))}}} in a version-{version} file")
        quant_type, group_size = q["type"], q["group_size"]
        layout = C.QUANT_LAYOUT_COMPACT if v4 else C.QUANT_LAYOUT_KIVI
    problem = _index_problem(tensors, quant_type, group_size, layout, version >= C.FORMAT_VERSION_V5)
    if problem is not None:
        raise corrupt(problem)

    # 4. canonical bytes and the header checksum
    if canonical is None:
        raise corrupt("the header is not in canonical form (sorted keys, compact, ASCII, space padding)")
    stored = meta[C.META_HEADER_SHA256]
    if not _is_digest(stored, C.CHECKSUM_SHA256):
        raise corrupt(f"{C.META_HEADER_SHA256!r} is not a lowercase hex SHA-256")
    if _sha256(_unsigned_canonical(canonical, obj, v, stored)) != stored:
        raise ChecksumMismatchError(
            f"{name}: section 'header' does not match its SHA-256: the file was altered or damaged; {_RECOPY}"
        )

    # 5. kvpack metadata and tensor checksums
    try:
        kv = json.loads(meta[C.META_KVPACK], object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        sums = json.loads(meta[sums_key], object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise corrupt(f"a JSON string in {C.METADATA_KEY!r} does not parse ({_short(exc)})") from None
    if not isinstance(kv, dict):
        raise corrupt(f"{C.META_KVPACK!r} is not a JSON object")
    sink = kv.get(C.SINK_TOKENS_KEY)
    tokens = tensors[C.TOKEN_IDS].shape[0]
    if type(sink) is not int or not 0 <= sink <= tokens:
        raise corrupt(f"{C.SINK_TOKENS_KEY!r} is missing or not an integer in [0, {tokens}] (the number of tokens)")
    if (not isinstance(sums, dict) or set(sums) != set(tensors)
            or not all(_is_digest(x, checksum) for x in sums.values())):
        raise corrupt(f"{sums_key!r} must map exactly the tensor names to lowercase hex {C.CHECKSUM_NAMES[checksum]}s")
    header = PackHeader(version, kv, tensors, C.LENGTH_PREFIX_BYTES + n, size, quant_type, group_size, checksum,
                        layout)
    return header, sums


def _parse_canonical(raw: bytes) -> tuple[Any, bytes | None]:
    """``(header object, canonical text)`` if ``raw`` is a canonical, padded JSON header; else ``(None, None)``.

    A header that equals the canonical re-encoding of what it parses to has no duplicate keys, NaN or
    infinities (the encoding of a dict has none), so one fast parse without hooks is enough. For any other header
    the caller parses again with the strict hooks, to report the first problem in the reader's usual order.
    """
    try:
        obj = json.loads(raw)
        canonical = _canonical(obj)
    except (ValueError, RecursionError, TypeError):
        return None, None
    if raw != _padded(canonical):
        return None, None
    return obj, canonical


def _unsigned_canonical(canonical: bytes, obj: dict[str, Any], version: str, stored: str) -> bytes:
    """The canonical header without ``header_sha256`` (what that checksum covers), from the canonical header.

    ``__metadata__`` is the first key and its keys are sorted, so after ``format`` and ``format_version`` comes
    ``header_sha256`` unless some unknown key sorts in between; cutting that member out of the text gives exactly
    the re-encoding of the unsigned header. Any other layout is re-encoded the slow way.
    """
    head = (f'{{"{C.METADATA_KEY}":{{"{C.META_FORMAT}":"{C.FORMAT_NAME}","{C.META_FORMAT_VERSION}":"{version}",'
            .encode("ascii"))
    member = f'"{C.META_HEADER_SHA256}":"{stored}",'.encode("ascii")
    if canonical.startswith(head) and canonical.startswith(member, len(head)):
        return head + canonical[len(head) + len(member):]
    meta = obj[C.METADATA_KEY]
    unsigned = {**obj, C.METADATA_KEY: {k: x for k, x in meta.items() if k != C.META_HEADER_SHA256}}
    return _canonical(unsigned)


def _parse_json(text: str, corrupt) -> Any:
    """Parse a JSON string of ``__metadata__`` (no duplicate keys, no NaN), raising ``corrupt(...)``."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise corrupt(f"a JSON string in {C.METADATA_KEY!r} does not parse ({_short(exc)})") from None


def _codec_problem(codec: Any) -> str | None:
    """Why a ``tensor_codecs`` entry is malformed, or None."""
    if not isinstance(codec, dict) or codec.keys() != _CODEC_KEY_SET:
        return f"its codec entry must be an object with exactly the keys {list(C.CODEC_KEYS)}"
    if codec["codec"] != C.CODEC_ZSTD:
        return f"unknown codec {str(codec['codec'])[:20]!r} (known: {C.CODEC_ZSTD!r})"
    dtype, shape, level, filt = codec["dtype"], codec["shape"], codec["level"], codec["filter"]
    if dtype not in C.DTYPE_BY_CODE:
        return f"unknown dtype {str(dtype)[:20]!r} (known: {sorted(C.DTYPE_BY_CODE)})"
    if not _is_shape(shape):
        return f"the shape must be a list of integers in [0, {C.INT32_MAX}]"
    if not _is_int(level) or not C.ZSTD_MIN_LEVEL <= level <= C.ZSTD_MAX_LEVEL:
        return f"the level must be an integer in [{C.ZSTD_MIN_LEVEL}, {C.ZSTD_MAX_LEVEL}]"
    itemsize = C.DTYPE_BY_CODE[dtype].itemsize
    allowed = [C.FILTER_NONE] + ([C.FILTER_SHUFFLE] if itemsize > 1 else [])
    allowed += [C.FILTER_DELTA_SHUFFLE] if dtype == C.INDEX_INT_CODE else []
    if filt not in allowed:
        return f"filter {str(filt)[:20]!r} is not one of {allowed} for {dtype}"
    raw = math.prod(shape) * itemsize
    if not _is_int(codec["raw_bytes"]) or codec["raw_bytes"] != raw or raw == 0:
        return f"raw_bytes must be the tensor's size, shape x itemsize = {raw} > 0"
    return None


def _writer_filter(name: str, code: str) -> str:
    """The filter the reference writer uses: delta + shuffle for positions, shuffle for multi-byte, else none."""
    if name.endswith("." + C.POSITIONS) and code == C.INDEX_INT_CODE:
        return C.FILTER_DELTA_SHUFFLE
    return C.FILTER_SHUFFLE if C.DTYPE_BY_CODE[code].itemsize > 1 else C.FILTER_NONE


def _shuffle(raw: bytes, itemsize: int) -> bytes:
    """Byte planes: byte 0 of every element, then byte 1, ... (``[n, k]`` bytes transposed to ``[k, n]``)."""
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, itemsize).t().contiguous().numpy().tobytes()


def _encode(raw: bytes, code: str, filt: str, level: int) -> bytes:
    """Filter the raw little-endian bytes of a ``code`` tensor, then compress them into one zstd frame."""
    itemsize = C.DTYPE_BY_CODE[code].itemsize
    if filt == C.FILTER_DELTA_SHUFFLE:
        x = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64)
        d = torch.diff(x, prepend=x.new_zeros(1))
        d = (d + 2**31) % 2**32 - 2**31  # two's complement wrap-around
        raw = d.to(torch.int32).numpy().tobytes()
    if filt in (C.FILTER_SHUFFLE, C.FILTER_DELTA_SHUFFLE):
        raw = _shuffle(raw, itemsize)
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(raw)


def _decompressor(header: PackHeader) -> zstandard.ZstdDecompressor | None:
    """One zstd decompressor for all the encoded tensors of a file (``None`` if it has none), reused by later loads
    on the same thread.

    Its window limit is the largest any of the file's frames may use (the next power of two >= the tensor's size,
    at least 1 KiB). ``_decode`` hands zstd an output buffer of exactly the declared content size and the whole
    frame, so zstd decodes in a single pass straight into that buffer and allocates no window at all; the limit
    only bounds the streaming fallback zstd takes for a frame cut short (which then fails).
    """
    sizes = [info.raw_nbytes for info in header.tensors.values() if info.codec is not None]
    if not sizes:
        return None
    window = 1 << max(10, (max(sizes) - 1).bit_length())  # a power of two: few distinct values
    cached = _DECOMPRESSORS.__dict__.setdefault("by_window", {})  # one per thread: a decompressor is not thread-safe
    if window not in cached:
        cached[window] = zstandard.ZstdDecompressor(max_window_size=window)
    return cached[window]


#: Per-thread zstd decompressors by window limit (creating one costs more than decoding a small frame).
_DECOMPRESSORS = threading.local()


def _decode(where: str, name: str, data: memoryview, info: TensorInfo,
            decompressor: zstandard.ZstdDecompressor | None = None) -> memoryview:
    """The raw bytes of encoded tensor ``name`` (a writable buffer); every size is checked before anything is
    allocated.

    ``decompressor`` (default: a new one) lets the tensors of one load share one decompression context.
    Raises ``CorruptFileError`` for anything but one intact zstd frame declaring exactly ``info.raw_nbytes``.
    """
    raw = info.raw_nbytes

    def corrupt(problem: str) -> CorruptFileError:
        return CorruptFileError(f"{where}: tensor {name!r}: {problem}; {_RECOPY}")

    if bytes(data[: len(C.ZSTD_FRAME_MAGIC)]) != C.ZSTD_FRAME_MAGIC:
        raise corrupt("its stored bytes do not start a zstd frame")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise corrupt(f"its zstd frame header is damaged ({_short(exc)})") from None
    if params.content_size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise corrupt("its zstd frame does not declare its decompressed size")
    if params.content_size != raw:
        raise corrupt(f"its zstd frame declares {params.content_size} decompressed bytes, but the header says "
                      f"{raw} ({info.dtype} {list(info.shape)})")
    if params.dict_id:
        raise corrupt("its zstd frame needs a dictionary, which kvpack files never use")
    if decompressor is None:
        decompressor = zstandard.ZstdDecompressor(max_window_size=1 << max(10, (raw - 1).bit_length()))
    try:
        # the frame declared exactly `raw` bytes (checked above), so this allocates `raw` bytes, no more
        out = decompressor.decompress(data, max_output_size=raw, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise corrupt(f"its zstd frame is damaged ({_short(exc)})") from None
    if len(out) != raw:
        raise corrupt(f"its zstd frame decompressed to {len(out)} bytes instead of {raw}")
    return memoryview(_unfiltered(out, info.codec.filter, C.DTYPE_BY_CODE[info.dtype].itemsize)).cast("B")


def _unfiltered(out: bytes, filt: str, itemsize: int) -> np.ndarray:
    """Undo ``filt`` on the decompressed bytes ``out``: a new, writable uint8 array of the elements' little-endian
    bytes, ``[elements, itemsize]`` (``[bytes]`` for ``"none"``).

    ``shuffle`` stored the ``[elements, itemsize]`` byte matrix transposed (byte planes); the planes are copied
    back one column each (``itemsize`` strided copies, faster than a transposing copy, whose inner loop would run
    over only ``itemsize`` bytes). ``delta_shuffle`` then takes the wrapping prefix sum of the int32 elements.
    """
    planes = np.frombuffer(out, dtype=np.uint8)  # read-only view of the decompressed bytes
    if filt == C.FILTER_NONE:
        return planes.copy()
    planes = planes.reshape(itemsize, -1)
    plain = np.empty((planes.shape[1], itemsize), dtype=np.uint8)
    for i in range(itemsize):
        plain[:, i] = planes[i]
    if filt == C.FILTER_DELTA_SHUFFLE:
        deltas = plain.view(np.uint32).reshape(-1)
        # unsigned: wraps modulo 2**32, as the int32 two's complement encoder did
        np.cumsum(deltas, dtype=np.uint32, out=deltas)
    return plain


def _entry_problem(entry: Any) -> str | None:
    """Why a tensor index entry is malformed, or None."""
    if not isinstance(entry, dict) or entry.keys() != _INDEX_KEY_SET:
        return f"the index entry must be an object with exactly the keys {list(C.INDEX_KEYS)}"
    dtype, shape, offsets = entry[C.INDEX_DTYPE], entry[C.INDEX_SHAPE], entry[C.INDEX_OFFSETS]
    if dtype not in C.DTYPE_BY_CODE:
        return f"unknown dtype {str(dtype)[:20]!r} (known: {sorted(C.DTYPE_BY_CODE)})"
    if not _is_shape(shape):
        return f"the shape must be a list of integers in [0, {C.INT32_MAX}]"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not _is_int(offsets[0]) or not _is_int(offsets[1])
            or offsets[0] < 0 or offsets[1] < 0):
        return "data_offsets must be two non-negative integers"
    if offsets[1] - offsets[0] != math.prod(shape) * C.DTYPE_BY_CODE[dtype].itemsize:
        return f"data_offsets {offsets} do not span shape x itemsize bytes"
    return None


_INDEX_KEY_SET = frozenset(C.INDEX_KEYS)
_CODEC_KEY_SET = frozenset(C.CODEC_KEYS)


def _is_shape(x: Any) -> bool:
    """Whether ``x`` is a list of integers (not booleans) in ``[0, INT32_MAX]``: one plain loop, no generator."""
    if not isinstance(x, list):
        return False
    for d in x:
        if type(d) is not int or not 0 <= d <= C.INT32_MAX:  # type(True) is bool, not int
            return False
    return True


def _index_problem(tensors: dict[str, TensorInfo], quant_type: str = C.QUANT_NONE,
                   group_size: int | None = None, layout: str | None = None, stacked: bool = False) -> str | None:
    """Why the set of tensors, their dtypes or shapes do not describe a pack, or None. ``stacked``: a version-5
    file (one tensor per part, stacked over the layers)."""

    def bad(tname: str, codes: tuple[str, ...], ndim: int) -> str | None:
        info = tensors.get(tname)
        if info is None:
            return f"tensor {tname!r} is missing"
        if info.dtype not in codes or len(info.shape) != ndim:
            want = f"{'/'.join(codes)} with {ndim} dimensions"
            return f"tensor {tname!r} must be {want}, not {info.dtype} {list(info.shape)}"
        return None

    if C.BIASES in tensors:  # temporary (until format 1.0): optional per-entry biases, any version
        problem = bad(C.BIASES, ("F32",), 1)
        if problem:
            return problem
        tensors = {name: info for name, info in tensors.items() if name != C.BIASES}
    ints = (C.INDEX_INT_CODE,)
    problem = bad(C.TOKEN_IDS, ints, 1) or bad(C.HEAD_LENGTHS, ints, 2)
    if problem:
        return problem
    layers, heads = tensors[C.HEAD_LENGTHS].shape
    if layers < 1 or heads < 1:
        return f"{C.HEAD_LENGTHS!r} has shape {[layers, heads]}; at least one layer and one KV head are needed"
    if stacked:
        return _stacked_index_problem(tensors, quant_type, group_size, bad)
    quantized = quant_type != C.QUANT_NONE
    compact = layout == C.QUANT_LAYOUT_COMPACT
    parts = C.LAYER_PARTS + ((C.COMPACT_PARTS if compact else C.QUANT_PARTS) if quantized else ())
    expected = {C.TOKEN_IDS, C.HEAD_LENGTHS} | {C.layer_tensor_name(l, p) for l in range(layers) for p in parts}
    extra = sorted(set(tensors) - expected)
    if extra:
        return f"unexpected tensor {extra[0][:80]!r} for a {layers}-layer{' quantized' if quantized else ''} pack"
    dims = None
    for l in range(layers):
        k, v, p = (C.layer_tensor_name(l, part) for part in C.LAYER_PARTS)
        problem = bad(k, C.FLOAT_CODES, 2) or bad(v, C.FLOAT_CODES, 2) or bad(p, ints, 1)
        if problem:
            return problem
        if dims is None:
            dims = (tensors[k].shape[1], tensors[v].shape[1])
        if (tensors[k].shape[1], tensors[v].shape[1]) != dims or min(dims) < 1:
            return f"layer {l}: head_dim/head_dim_v differ from layer 0's {list(dims)} or are 0"
        entries = tensors[k].shape[0]
        if quantized:
            problem = (_compact_index_problem if compact else _quant_index_problem)(tensors, l, quant_type,
                                                                                   group_size, dims)
            if problem:
                return problem
            entries += tensors[C.layer_tensor_name(l, C.KEY_CODES)].shape[0]
        if tensors[v].shape[0] != tensors[k].shape[0] or tensors[p].shape[0] != entries:
            return (f"layer {l}: keys, values and positions have different row counts"
                    + (" (positions count the quantized rows too)" if quantized else ""))
    return None


def _stacked_index_problem(tensors: dict[str, TensorInfo], quant_type: str, group_size: int, bad) -> str | None:
    """``_index_problem`` for a version-5 file: ``STACKED_PARTS`` besides ``token_ids`` and ``head_lengths``, with
    the dtypes and shapes the compact layout gives for all layers together (``bad``: the dtype and rank check)."""
    layers, heads = tensors[C.HEAD_LENGTHS].shape
    extra = sorted(set(tensors) - {C.TOKEN_IDS, C.HEAD_LENGTHS, *C.STACKED_PARTS})
    if extra:
        return f"unexpected tensor {extra[0][:80]!r} for a version-5 (stacked, compact-layout) pack"
    ints = (C.INDEX_INT_CODE,)
    problem = bad(C.KEYS, C.FLOAT_CODES, 2) or bad(C.VALUES, C.FLOAT_CODES, 2) or bad(C.POSITIONS, ints, 1)
    if problem:
        return problem
    d, dv = tensors[C.KEYS].shape[1], tensors[C.VALUES].shape[1]
    if min(d, dv) < 1:
        return f"head_dim/head_dim_v {[d, dv]} must be at least 1"
    problem = _compact_dims_problem(quant_type, group_size, d, dv)
    if problem:
        return problem
    codes, params = tensors.get(C.KEY_CODES), tensors.get(C.KEY_PARAMS)
    rows = codes.shape[0] if codes is not None and len(codes.shape) == 2 else 0
    groups = params.shape[1] if params is not None and len(params.shape) == 3 else 0
    want = compact_shapes(quant_type, group_size, heads, d, dv, rows, groups)
    for part in (C.KEY_BITS, C.QUANT_GRID):  # one per layer
        code, shape = want[part]
        want[part] = (code, (layers, *shape))
    for part, (code, shape) in want.items():
        info = tensors.get(part)
        if info is None:
            return f"tensor {part!r} is missing"
        if info.dtype != code or info.shape != shape:
            return f"tensor {part!r} must be {code} {list(shape)}, not {info.dtype} {list(info.shape)}"
    if tensors[C.VALUES].shape[0] != tensors[C.KEYS].shape[0] or tensors[C.POSITIONS].shape[0] != (
            tensors[C.KEYS].shape[0] + rows):
        return "keys, values and positions have different row counts (positions count the quantized rows too)"
    return None


def _quant_index_problem(tensors: dict[str, TensorInfo], l: int, quant_type: str, group_size: int,
                         dims: tuple[int, int]) -> str | None:
    """Why layer ``l``'s six quantization tensors have wrong dtypes or shapes, or None."""
    spec = C.QUANT_TYPES[quant_type]
    d, dv = dims
    gv = value_group_size(group_size, dv)
    if d % spec.codes_per_byte or dv % spec.codes_per_byte or dv % gv:
        return (f"head_dim {d} / head_dim_v {dv} cannot be {quant_type}-quantized with group size {group_size} "
                f"(need multiples of {spec.codes_per_byte}, and of {gv} for head_dim_v)")
    codes = tensors.get(C.layer_tensor_name(l, C.KEY_CODES))
    rows = codes.shape[0] if codes is not None and len(codes.shape) == 2 else 0
    if rows % group_size:
        return f"layer {l}: {rows} quantized rows is not a multiple of the group size {group_size}"
    want = {
        C.KEY_CODES: (C.QUANT_CODE_CODE, (rows, d // spec.codes_per_byte)),
        C.KEY_SCALES: (C.QUANT_PARAM_CODE, (rows // group_size, d)),
        C.KEY_MINS: (C.QUANT_PARAM_CODE, (rows // group_size, d)),
        C.VALUE_CODES: (C.QUANT_CODE_CODE, (rows, dv // spec.codes_per_byte)),
        C.VALUE_SCALES: (C.QUANT_PARAM_CODE, (rows, dv // gv)),
        C.VALUE_MINS: (C.QUANT_PARAM_CODE, (rows, dv // gv)),
    }
    return _parts_problem(tensors, l, want)


def _parts_problem(tensors: dict[str, TensorInfo], l: int, want: dict[str, tuple[str, tuple[int, ...]]]
                   ) -> str | None:
    """Why one of layer ``l``'s tensors ``want`` names (part -> dtype code and shape) is missing or has another
    dtype or shape in the index, or None."""
    for part, (code, shape) in want.items():
        tname = C.layer_tensor_name(l, part)
        info = tensors.get(tname)
        if info is None:
            return f"tensor {tname!r} is missing"
        if info.dtype != code or info.shape != shape:
            return f"tensor {tname!r} must be {code} {list(shape)}, not {info.dtype} {list(info.shape)}"
    return None


def _compact_dims_problem(quant_type: str, group_size: int, d: int, dv: int) -> str | None:
    """Why head sizes ``d`` (keys) and ``dv`` (values) cannot hold the compact layout's ``quant_type`` codes with
    ``group_size`` (whole bytes per key row, whole value groups and code bytes per value row), or None."""
    spec = C.QUANT_TYPES[quant_type]
    gv = value_group_size(group_size, dv)
    if (d * spec.bits) % 8 or dv % spec.codes_per_byte or dv % gv:
        return (f"head_dim {d} / head_dim_v {dv} cannot be {quant_type}-quantized with group size {group_size} "
                f"(need whole bytes per row, and multiples of {gv} for head_dim_v)")
    return None


def _compact_index_problem(tensors: dict[str, TensorInfo], l: int, quant_type: str, group_size: int,
                           dims: tuple[int, int]) -> str | None:
    """Why layer ``l``'s compact-layout tensors have wrong dtypes or shapes as far as the header tells (the key
    groups and the widths' values are checked with the data: ``_checked_split``, ``compact_problem``), or None."""
    d, dv = dims
    problem = _compact_dims_problem(quant_type, group_size, d, dv)
    if problem:
        return problem
    codes = tensors.get(C.layer_tensor_name(l, C.KEY_CODES))
    rows = codes.shape[0] if codes is not None and len(codes.shape) == 2 else 0
    params = tensors.get(C.layer_tensor_name(l, C.KEY_PARAMS))
    groups = params.shape[1] if params is not None and len(params.shape) == 3 else 0
    want = compact_shapes(quant_type, group_size, tensors[C.HEAD_LENGTHS].shape[1], d, dv, rows, groups)
    return _parts_problem(tensors, l, want)


def _pack_problem(pack: Any) -> str | None:
    """Why ``pack`` is not a consistent Pack, or None.

    Shared by the writer (which raises InputError) and the reader (which raises CorruptFileError).
    """
    if not isinstance(pack, Pack):
        return f"expected a kvpack Pack, got {type(pack).__name__}"
    t = pack.token_ids
    if not _is_int_tensor(t) or t.dim() != 1:
        return "token_ids must be a 1-D integer tensor"
    tokens = t.shape[0]
    if tokens and (int(t.min()) < 0 or int(t.max()) > C.INT32_MAX):
        return f"token ids must lie in [0, {C.INT32_MAX}]"
    if type(pack.sink_tokens) is not int or not 0 <= pack.sink_tokens <= tokens:
        return f"sink_tokens must be an integer in [0, {tokens}] (the number of tokens)"
    if not isinstance(pack.layers, (list, tuple)) or not pack.layers:
        return "a pack needs at least one layer"
    dims = None
    quant_setting = None
    for l, layer in enumerate(pack.layers):
        if not isinstance(layer, LayerEntries):
            return f"layer {l} is not a LayerEntries"
        q = layer.quant
        setting = (q.qtype, q.group_size, q.layout) if isinstance(q, QuantizedRows) else q
        if l == 0:
            quant_setting = setting
        elif setting != quant_setting:
            return (f"layer {l} is quantized as {setting}, layer 0 as {quant_setting}; all layers must share one "
                    "quantization type, group size and layout (or none)")
        k, v, p, hl = layer.keys, layer.values, layer.positions, layer.head_lengths
        for what, x in (("keys", k), ("values", v)):
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or C.CODE_BY_DTYPE.get(x.dtype) not in C.FLOAT_CODES:
                return f"layer {l}: {what} must be a 2-D float32, float16 or bfloat16 tensor"
        if not _is_int_tensor(p) or p.dim() != 1 or not _is_int_tensor(hl) or hl.dim() != 1:
            return f"layer {l}: positions and head_lengths must be 1-D integer tensors"
        if dims is None:
            dims = (hl.shape[0], k.shape[1], v.shape[1])
        here = (hl.shape[0], k.shape[1], v.shape[1])
        if here != dims or min(dims) < 1:
            return f"layer {l}: kv_heads/head_dim/head_dim_v {list(here)} differ from layer 0's {list(dims)} or are 0"
        n = p.shape[0]
        if q is None and (k.shape[0] != n or v.shape[0] != n):
            return f"layer {l}: keys, values and positions have {k.shape[0]}, {v.shape[0]} and {n} rows"
        if int(hl.min()) < 0 or int(hl.to(torch.int64).sum()) != n:
            return f"layer {l}: head_lengths {hl.tolist()[:16]} must be non-negative and sum to the {n} entries"
        if n:
            p = p.to(torch.int64)
            if int(p.min()) < 0 or int(p.max()) >= tokens:
                return f"layer {l}: positions must lie in [0, {tokens})"
            hl = hl.to(torch.int64)
            starts = (torch.cumsum(hl, 0) - hl)[hl > 0]
            head_start = torch.zeros(n, dtype=torch.bool)
            head_start[starts] = True
            if bool(((p[1:] <= p[:-1]) & ~head_start[1:]).any()):
                return f"layer {l}: positions must be strictly increasing within each head"
        b = layer.biases
        if b is not None and (not isinstance(b, torch.Tensor) or b.dtype != torch.float32 or b.shape != (n,)
                              or not bool(torch.isfinite(b).all())):
            return f"layer {l}: biases must be a finite float32 tensor of shape [{n}] (one per entry) or None"
        if q is not None:
            problem = layer_quant_problem(layer, pack.sink_tokens)
            if problem is not None:
                return f"layer {l}: {problem}"
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_int_tensor(x: Any) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


#: Checksum algorithm -> its hex digest function, and the pattern of that digest.
_DIGESTS = {C.CHECKSUM_SHA256: _sha256, C.CHECKSUM_XXH3: xxhash.xxh3_128_hexdigest}
_HEX_DIGEST = {a: re.compile(f"[0-9a-f]{{{n}}}") for a, n in C.CHECKSUM_HEX_LENGTH.items()}


def _is_digest(x: Any, checksum: str) -> bool:
    """Whether ``x`` is a digest of ``checksum`` (``"sha256"``: 64, ``"xxh3"``: 32 lowercase hex characters)."""
    return isinstance(x, str) and _HEX_DIGEST[checksum].fullmatch(x) is not None


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, **C.JSON_DUMPS_KWARGS).encode("ascii")


def _padded(text: bytes) -> bytes:
    return text + C.HEADER_PAD_BYTE * (-len(text) % C.HEADER_ALIGNMENT)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:80]!r}")
        out[k] = v
    return out


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not allowed")


def _short(exc: BaseException) -> str:
    return str(exc)[:200] or type(exc).__name__


def _fsync_folder(folder: str) -> None:
    """Best effort: make the rename durable (POSIX only)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
