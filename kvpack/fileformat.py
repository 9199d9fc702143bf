"""Read and write ``.kvpack`` files, format 1.0 (``format/SPEC.md``): the KV layout on top of the container.

``kvpack.container`` parses and writes the safetensors container (canonical header, checksums, streaming reads);
``kvpack.codecs`` holds zstd and the byte filters; ``kvpack.compact`` the quantization codec. This module maps a
``Pack`` to the format's tensors (each one over all layers, layer 0's part first) and back, and checks everything
a container cannot know: the tensor set, dtypes and shapes (``_layout_problem``), the kvpack metadata
(``rules.metadata_problem``) and, once the data is read, the tensors' contents (``_contents_problem``).

Writing is deterministic (the same ``Pack`` and settings always give the same bytes). Reading validates every
length, offset, shape, checksum and content rule before any tensor is handed out; every failure is a
``PackFormatError`` subclass (or ``InputError`` for a source that cannot be read) naming the file, the problem and
the fix. ``verify`` holds the small index tensors (token ids, head lengths, positions, code widths, grids, biases)
and one bounded buffer; ``load_pack`` the output tensors and one bounded buffer (raw tensors of a path are
memory-mapped, copy-on-write).
"""

from __future__ import annotations

import bisect
import io
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import constants as C
from . import settings as S
from . import storage
from .codecs import encode, writer_filter
from .container import (Container, TensorCodec, TensorInfo, container_bytes, expansion_problem, parse_header,
                        parse_json_text, stream_tensor, tensor_bytes)
from .errors import CorruptFileError, InputError
from .packbytes import REBUILD, Source, SourceLike
from .rules import compact_values_problem, metadata_problem, quant_type, value_group_size

if TYPE_CHECKING:  # reading a header needs no tensor: torch is imported where tensors are made
    import torch

    from .pack import Pack

__all__ = ["TensorCodec", "TensorInfo", "PackHeader", "pack_to_bytes", "check_storage_args", "save", "load_pack",
           "load_pack_and_header", "load_pack_placed", "read_header", "read_index", "read_index_arrays", "PackIndex",
           "LayerIndex", "QuantIndex", "fetched", "verify"]

#: Tensors whose values the reader checks (so ``verify`` keeps them); the others are only checksummed and decoded.
_CHECKED = (C.TOKEN_IDS, C.HEAD_LENGTHS, C.POSITIONS, C.KEY_BITS, C.QUANT_GRID, C.ATTN_BIAS)
#: numpy dtype of each dtype code the checks read (little-endian).
_NP = {"I32": np.dtype("<i4"), "U8": np.dtype("u1"), "F32": np.dtype("<f4")}


@dataclass
class PackHeader:
    """The validated header of a ``.kvpack`` file (what ``read_header`` and ``verify`` return).

    Attributes:
        format_version: ``"1.0"`` (``"<major>.<minor>"``).
        metadata: the kvpack metadata: ``Pack.metadata`` plus ``"sink_tokens"`` (validated fields: §4.4).
        tensors: tensor name -> ``TensorInfo``, in data order.
        header_bytes: bytes before the data buffer (8-byte length prefix + padded JSON header).
        file_bytes: size of the whole file in bytes.
        quant_type: ``"none"``, ``"int8"`` or ``"int4"``.
        group_size: the quantization group size ``G``, or ``None`` when not quantized.
        checksum: the tensor checksum algorithm, ``"xxh3"`` or ``"sha256"``.
    """

    format_version: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    header_bytes: int
    file_bytes: int
    quant_type: str = C.QUANT_NONE
    group_size: int | None = None
    checksum: str = S.DEFAULT_CHECKSUM

    @property
    def quant_layout(self) -> str | None:
        """``"compact"`` when quantized (the one layout), else ``None``."""
        return None if self.group_size is None else C.QUANT_LAYOUT_COMPACT

    @property
    def kv_dtype_name(self) -> str | None:
        """``kv_dtype``'s name (``"float16"``, ``"bfloat16"``, ``"float32"``: ``--kv-dtype``) without importing
        torch (``ls``, the build's up-to-date check); ``None`` without a ``keys`` tensor."""
        keys = self.tensors.get(C.KEYS)
        return C.KV_DTYPE_NAMES.get(keys.dtype) if keys is not None else None

    @property
    def has_biases(self) -> bool:
        """Whether the file stores per-entry attention biases (``attn_bias``)."""
        return C.ATTN_BIAS in self.tensors

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
    def head_dims(self) -> tuple[int, int]:
        """``(head_dim, head_dim_v)``: key and value head sizes."""
        return self.tensors[C.KEYS].shape[1], self.tensors[C.VALUES].shape[1]

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the stored full-precision keys."""
        return C.DTYPE_BY_CODE[self.tensors[C.KEYS].dtype]

    @property
    def entries(self) -> int:
        """Kept entries over all layers and KV heads (the rows of ``positions``)."""
        return self.tensors[C.POSITIONS].shape[0]

    @property
    def tokens(self) -> int:
        """Length of the original cached sequence in tokens."""
        return self.tensors[C.TOKEN_IDS].shape[0]

    def bytes_by_section(self) -> dict[str, int]:
        """Stored bytes per section: ``header`` and each tensor (``token_ids``, ``head_lengths``, ``keys``,
        ``values``, ``positions``, the ``COMPACT_PARTS`` of a quantized file, ``attn_bias`` if present); the values
        add up to ``file_bytes``."""
        out = dict.fromkeys(C.SECTIONS + (C.COMPACT_PARTS if self.group_size else ()), 0)
        out[C.SECTION_HEADER] = self.header_bytes
        for name, info in self.tensors.items():
            out[name] = info.nbytes
        return out


# ---------------------------------------------------------------------------------------------------------------
# writing


def check_storage_args(zstd_level: int, checksum: str) -> None:
    """Check ``save``'s storage arguments before anything is computed or written.

    Raises:
        InputError: ``zstd_level`` is not 0 or an integer in ``[1, 22]``, or ``checksum`` is not ``"xxh3"`` or
            ``"sha256"``; the message gives the allowed values.
    """
    if type(zstd_level) is not int or not (zstd_level == 0 or C.ZSTD_MIN_LEVEL <= zstd_level <= C.ZSTD_MAX_LEVEL):
        raise InputError(f"zstd_level must be 0 (off) or an integer in [{C.ZSTD_MIN_LEVEL}, {C.ZSTD_MAX_LEVEL}], "
                         f"got {zstd_level!r}")
    if checksum not in C.CHECKSUMS:
        raise InputError(f"checksum must be one of {', '.join(map(repr, C.CHECKSUMS))}, got {checksum!r}")


def _file_parts(pack: Pack, zstd_level: int, checksum: str) -> tuple[bytes, list[bytes]]:
    """The header bytes and the tensors' stored bytes in data order (see ``pack_to_bytes``)."""
    import torch

    from .validate import kv_range_problem, pack_problem

    problem = pack_problem(pack)
    if problem is None and not isinstance(pack.metadata, dict):
        problem = "pack.metadata must be a dict"
    if problem is None and C.SINK_TOKENS_KEY in pack.metadata:
        problem = f"pack.metadata must not contain {C.SINK_TOKENS_KEY!r} (it is written from pack.sink_tokens)"
    if problem is not None:
        raise InputError(f"cannot write this pack: {problem}")
    problem = kv_range_problem(pack)
    if problem is not None:  # kvpack.load would refuse the file
        raise InputError(f"cannot write this pack: {problem}, which no loader accepts (attention over them is NaN); "
                         "a model that overflowed while building it is built again in bfloat16 or float32 "
                         "(kvpack build --dtype); an edited pack needs its values fixed")
    check_storage_args(zstd_level, checksum)
    try:
        kvpack_json = json.dumps({**pack.metadata, C.SINK_TOKENS_KEY: pack.sink_tokens}, **C.JSON_DUMPS_KWARGS)
    except (TypeError, ValueError) as exc:
        raise InputError(f"cannot write this pack: pack.metadata is not plain JSON ({exc}); use only dicts with "
                         "string keys, lists, strings, finite numbers, booleans and None") from exc
    problem = metadata_problem(json.loads(kvpack_json), len(pack.layers), int(pack.token_ids.shape[0]))
    if problem is not None:  # the reader's own rule: never write a file kvpack.load would refuse
        raise InputError(f"cannot write this pack: its metadata would be refused by every reader ({problem}); "
                         "fix the field (kvpack.compress writes valid metadata)")
    layers = pack.layers
    i32 = C.DTYPE_BY_CODE[C.INDEX_INT_CODE]
    tensors = {
        C.TOKEN_IDS: pack.token_ids.to(i32), C.HEAD_LENGTHS: pack.head_lengths().to(i32),
        C.KEYS: torch.cat([e.keys for e in layers]), C.VALUES: torch.cat([e.values for e in layers]),
        C.POSITIONS: torch.cat([e.positions.to(i32) for e in layers]),
    }
    if any(e.biases is not None for e in layers):
        tensors[C.ATTN_BIAS] = torch.cat([e.biases if e.biases is not None else torch.zeros(e.num_entries)
                                          for e in layers])
    quant = layers[0].quant
    if quant is not None:
        parts = [e.quant.parts() for e in layers]
        for part in C.COMPACT_PARTS:
            pieces = [p[part] for p in parts]
            if part in (C.KEY_BITS, C.QUANT_GRID):  # one per layer: a new leading axis
                tensors[part] = torch.stack(pieces)
            else:  # rows (or, for the parameters, axis 1) layer after layer
                tensors[part] = torch.cat(pieces, dim=1 if part in (C.KEY_PARAMS, C.VALUE_PARAMS) else 0)
    stored, codecs = {}, {}
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        code = C.CODE_BY_DTYPE[t.dtype]
        if zstd_level and raw:
            filt = writer_filter(name, code)
            blob = encode(raw, code, filt, zstd_level)
            if expansion_problem(name, len(raw), len(blob)) is not None:  # a reader would refuse it encoded
                stored[name] = (code, list(t.shape), raw)
                continue
            stored[name] = (C.STORED_CODE, [len(blob)], blob)
            codecs[name] = {"codec": C.CODEC_ZSTD, "dtype": code, "filter": filt, "level": zstd_level,
                            "raw_bytes": len(raw), "shape": list(t.shape)}
        else:
            stored[name] = (code, list(t.shape), raw)
    meta = {C.META_FORMAT: C.FORMAT_NAME, C.META_FORMAT_VERSION: C.FORMAT_VERSION, C.META_KVPACK: kvpack_json}
    if quant is not None:
        meta[C.META_QUANT] = json.dumps({"group_size": quant.group_size, "type": quant.qtype}, **C.JSON_DUMPS_KWARGS)
    if codecs:
        meta[C.META_TENSOR_CODECS] = json.dumps(codecs, **C.JSON_DUMPS_KWARGS)
    return container_bytes(meta, stored, checksum)


def pack_to_bytes(pack: Pack, zstd_level: int = S.SAVE_DEFAULT_ZSTD_LEVEL,
                  checksum: str = S.DEFAULT_CHECKSUM) -> bytes:
    """Serialise ``pack`` to the bytes of a format-1.0 ``.kvpack`` file (deterministic).

    Tensors (``format/SPEC.md`` §5): ``token_ids`` ``[tokens]`` and ``head_lengths`` ``[layers, kv_heads]`` int32;
    ``keys`` ``[F, head_dim]``, ``values`` ``[F, head_dim_v]`` (their dtype; ``F`` full-precision rows over all
    layers) and ``positions`` int32 ``[entries]``, layer after layer; ``attn_bias`` float32 ``[entries]`` when some
    layer has biases (zeros for the others); for a quantized pack the six ``COMPACT_PARTS``. Tuples in
    ``pack.metadata`` come back as lists.

    Args:
        pack: the pack (every layer with one keys dtype and one values dtype).
        zstd_level: 0 (default) stores every tensor raw; 1..22 stores every non-empty tensor as one zstd frame of
            that level after a byte filter (``kvpack.codecs``), except one that would compress beyond the reader's
            limit (``container.expansion_problem``: over 8x and 1 MiB, e.g. the token ids of a repeated text),
            which is stored raw.
        checksum: the tensor checksums: ``"xxh3"`` (default: XXH3-128, detects damage, not tampering) or
            ``"sha256"``. The header's own checksum is SHA-256 either way.

    Raises:
        InputError: the pack is inconsistent (``validate.pack_problem``), holds a key or value that is not finite
            or lies beyond +-MAX_KV_ABS (``validate.kv_range_problem``), its metadata breaks the reader's rules
            (``rules.metadata_problem``) or is not plain JSON (or has a
            ``sink_tokens`` key), a bad ``zstd_level`` or ``checksum``.
    """
    head, blobs = _file_parts(pack, zstd_level, checksum)
    return head + b"".join(blobs)


def save(pack: Pack, path: str | os.PathLike, zstd_level: int = S.SAVE_DEFAULT_ZSTD_LEVEL,
         checksum: str = S.DEFAULT_CHECKSUM, *, storage_options: dict | None = None) -> int:
    """Write ``pack`` to ``path`` atomically and return the bytes written: a local path through
    ``kvpack.storage.write_atomic`` (temporary file, fsync, rename; stale temporary files of interrupted saves in that
    folder are removed first), an fsspec URL (``s3://``, ``memory://``, ...) through it too
    (one whole-object put on object stores, temporary name + move elsewhere) with ``storage_options``.

    Arguments as ``pack_to_bytes``. Raises ``InputError``: the pack cannot be written (see ``pack_to_bytes``) or
    the file cannot be created (missing folder, no permission, disk full, read-only protocol, missing backend).
    """
    head, blobs = _file_parts(pack, zstd_level, checksum)
    return storage.write_atomic(path, [head, *blobs], storage_options)


# ---------------------------------------------------------------------------------------------------------------
# reading


@contextmanager
def _opened(source: SourceLike, storage_options: dict | None, whole: bool = False):
    """``source`` as ``Source`` takes it. An fsspec URL is opened for range reads (``kvpack.storage.open_read``);
    with ``whole`` (a load or a verify, which read every byte) its bytes are fetched in one ranged read into memory
    instead, since the reader's passes over each tensor (checksum, then decode) would each be a request."""
    if isinstance(source, (str, os.PathLike)) and storage.is_url(source):
        with storage.open_read(source, storage_options) as f:
            if whole:
                f = io.BytesIO(f.read())
                f.name = str(source)  # messages name the URL
            yield f
    else:
        yield storage.as_path(source) if isinstance(source, (str, os.PathLike)) else source


@contextmanager
def fetched(source: SourceLike, storage_options: dict | None = None):
    """``source`` ready for several reads (``read_header``, then ``kvpack.load``) from one request: an fsspec URL
    is fetched once into memory (one ranged read: the file's bytes are held), anything else is yielded as it is.
    Raises ``InputError`` for a URL that cannot be read."""
    with _opened(source, storage_options, whole=True) as opened:
        yield opened


def read_header(source: SourceLike, *, storage_options: dict | None = None) -> PackHeader:
    """Read and validate the header of a ``.kvpack`` file (a path, an fsspec URL read by range with
    ``storage_options``, a seekable binary file object or the file's bytes) without reading the data: sizes, magic, version, canonical form, header checksum, tensor index, codecs,
    the tensor set and shapes, the quantization setting and the kvpack metadata (``format/SPEC.md`` §8, steps 1-12).

    Raises: the errors of ``load_pack`` but ``ChecksumMismatchError`` for a tensor.
    """
    with _opened(source, storage_options) as opened, Source(opened) as src:
        return _header(parse_header(src), src.name)


def verify(source: SourceLike, *, storage_options: dict | None = None) -> PackHeader:
    """Check everything ``load_pack`` checks, raising on the first problem; return the header.

    Memory: the small index tensors (token ids, head lengths, positions, code widths, grids, biases) plus one buffer
    of at most ``READ_CHUNK_BYTES`` (and zstd's window, at most ``codecs.MAX_WINDOW_BYTES``); the keys, values and
    codes are streamed through their checksums and decoders, never held.

    Raises: the errors of ``load_pack``.
    """
    with _opened(source, storage_options, whole=True) as opened:
        return _read(opened, keep_all=False)[0]


def load_pack(source: SourceLike, *, storage_options: dict | None = None) -> Pack:
    """Read a ``.kvpack`` file (a path, a seekable binary file object or its bytes; or an fsspec URL, read by range
    into memory with ``storage_options``: the header, then the tensors, no download to disk) into a ``Pack`` after
    validating all of it (``format/SPEC.md`` §8).

    Returns per layer views of the file's tensors (writable; a raw tensor of a path is a private copy-on-write
    memory map): ``keys`` ``[rows, head_dim]`` and ``values`` ``[rows, head_dim_v]`` in the stored dtype,
    ``positions`` int32 ``[entries]``, ``head_lengths`` int64 ``[kv_heads]``, ``biases`` float32 ``[entries]`` or
    ``None``; ``token_ids`` int64 ``[tokens]``.

    Raises:
        InputError: the source cannot be read (missing, a folder, no permission, not a binary file object; a URL
            whose backend is missing or that the store refuses).
        TruncatedFileError: the file is shorter than its header says.
        NotAKvpackFileError: no kvpack magic: some other file.
        UnsupportedVersionError: another major format version, or a pre-1.0 draft file.
        CorruptFileError: malformed or inconsistent header, index, layout, metadata, zstd frame or tensor contents.
        ChecksumMismatchError: the header or a tensor does not match its checksum.
    """
    return load_pack_and_header(source, storage_options=storage_options)[1]


def load_pack_and_header(source: SourceLike, *, storage_options: dict | None = None) -> tuple[PackHeader, Pack]:
    """``(read_header(source), load_pack(source))`` from one read of the file (what ``verify`` checks, and the
    tensors). Arguments, returned tensors and errors as ``load_pack``'s."""
    with _opened(source, storage_options, whole=True) as opened:
        return _read(opened, keep_all=True)


@dataclass(frozen=True)
class QuantIndex:
    """The key code widths of one quantized layer (``LayerIndex.quant``): ``key_bits`` uint8 ``[kv_heads, D]`` (a
    torch tensor from ``read_index``, a numpy array from ``read_index_arrays``)."""

    key_bits: torch.Tensor | np.ndarray


@dataclass(frozen=True)
class LayerIndex:
    """One layer as the index tensors describe it (the attributes ``kvpack info`` reads of a ``LayerEntries``):
    ``head_lengths`` int64 ``[kv_heads]`` (a torch tensor from ``read_index``, a numpy array from
    ``read_index_arrays``); ``quant`` its key code widths, or ``None`` when not quantized."""

    head_lengths: torch.Tensor | np.ndarray
    quant: QuantIndex | None = None

    @property
    def num_entries(self) -> int:
        """Entries kept in this layer over all heads."""
        return int(self.head_lengths.sum())


@dataclass(frozen=True)
class PackIndex:
    """What the header and the index tensors say about a pack, without its KV (``read_index``,
    ``read_index_arrays``): ``layers`` (``LayerIndex`` each), ``original_tokens`` and ``sink_tokens``."""

    layers: list[LayerIndex]
    original_tokens: int
    sink_tokens: int

    def kept_entries(self) -> int:
        """Entries kept over all layers and heads (sink entries included)."""
        return sum(layer.num_entries for layer in self.layers)


def read_index_arrays(source: SourceLike, *, storage_options: dict | None = None) -> tuple[PackHeader, PackIndex]:
    """The validated header (``read_header``) and the index tensors ``kvpack info`` shows, as numpy arrays and
    without importing torch: ``head_lengths`` and, quantized, ``key_bits`` and ``quant_grid``, each checksummed and
    checked (head lengths non-negative and summing to the entries; code widths and grids as ``format/SPEC.md`` §8
    step 14). The keys, values, codes, positions and token ids are not read (``verify`` checks them): memory is
    the header and these small tensors.

    Returns ``(header, index)``: each ``LayerIndex.head_lengths`` int64 ``[kv_heads]`` and ``quant.key_bits`` uint8
    ``[kv_heads, head_dim]`` (numpy, views of one array each).

    Raises: the errors of ``read_header``; ``ChecksumMismatchError`` or ``CorruptFileError`` for those tensors.
    """
    with _opened(source, storage_options) as opened, Source(opened) as src:
        box = parse_header(src)
        header = _header(box, src.name)
        a = {name: _array(src, box, name) for name in box.tensors if name in (C.HEAD_LENGTHS, C.KEY_BITS,
                                                                               C.QUANT_GRID)}
    lengths = a[C.HEAD_LENGTHS].astype(np.int64)
    problem = None
    if int(lengths.min()) < 0 or int(lengths.sum()) != header.entries:
        problem = f"{C.HEAD_LENGTHS!r} must be non-negative and sum to the {header.entries} entries of {C.POSITIONS!r}"
    elif header.group_size is not None:
        problem = compact_values_problem(a[C.KEY_BITS], a[C.QUANT_GRID], header.quant_type, header.head_dims[0])
    if problem is not None:
        raise CorruptFileError(f"{src.name}: {problem}; {REBUILD}")
    bits = a.get(C.KEY_BITS)
    layers = [LayerIndex(lengths[l], None if bits is None else QuantIndex(bits[l])) for l in range(header.num_layers)]
    return header, PackIndex(layers, header.tokens, header.metadata[C.SINK_TOKENS_KEY])


def read_index(source: SourceLike, *, storage_options: dict | None = None) -> tuple[PackHeader, PackIndex]:
    """``read_index_arrays`` with torch tensors: each ``LayerIndex.head_lengths`` int64 ``[kv_heads]`` and
    ``quant.key_bits`` uint8 ``[kv_heads, head_dim]`` (CPU tensors sharing the arrays' memory). Reads and raises as
    ``read_index_arrays``."""
    import torch

    header, index = read_index_arrays(source, storage_options=storage_options)
    layers = [LayerIndex(torch.from_numpy(l.head_lengths),
                         None if l.quant is None else QuantIndex(torch.from_numpy(l.quant.key_bits)))
              for l in index.layers]
    return header, PackIndex(layers, index.original_tokens, index.sink_tokens)


def _array(src: Source, box: Container, name: str) -> np.ndarray:
    """Tensor ``name`` (an index tensor: I32, U8 or F32) as a fresh numpy array of its shape and stored dtype,
    after its checksum matched and its frame decoded (``container.tensor_bytes``; raises as that does)."""
    info = box.tensors[name]
    return np.array(tensor_bytes(src, box, name).view(_NP[info.dtype]).reshape(info.shape))


def load_pack_placed(source: SourceLike, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                     before: Callable[[PackHeader], None] | None = None, storage_options: dict | None = None
                     ) -> tuple[PackHeader, Pack, dict[int, list[tuple[str, tuple[float, float]]]]]:
    """Read and validate a file as ``load_pack_and_header`` does, but decode each tensor **once**, chunk by chunk,
    into a fresh tensor of its final dtype and device (``container.stream_tensor``): nothing memory-mapped, no
    intermediate copy, so memory is the returned tensors plus one bounded buffer (about ``READ_CHUNK_BYTES``, and
    a zstd window per byte plane of an encoded tensor).

    ``before(header)`` is called once the header is validated (``format/SPEC.md`` §8 steps 1-12) and before any
    tensor is read: the loader checks the model's shapes and its memory budget there. The index tensors are read
    and checked first (step 14), then the others in data order.

    Returns:
        ``(header, pack, kv_ranges)``. The pack's ``keys`` ``[rows, head_dim]`` and ``values`` ``[rows, head_dim_v]``
        are views of one tensor each in ``dtype`` (default: as stored) on ``device``; ``positions`` int64
        ``[entries]`` on ``device``; ``biases`` float32 on ``device`` or ``None``; the quantization parts in their
        stored dtypes on the CPU; ``token_ids`` int64 on the CPU (decoded as such: the cache's own). ``kv_ranges``: layer -> ``[("keys", (min, max)),
        ("values", (min, max))]`` of its full-precision rows as stored, before any cast (``float('nan')`` when
        some value is NaN; for ``validate.kv_range_problem``).

    Raises: the errors of ``load_pack``, and whatever ``before`` raises.
    """
    import torch

    dev = torch.device(device)
    with _opened(source, storage_options, whole=True) as opened, Source(opened) as src:
        box = parse_header(src)
        header = _header(box, src.name)
        if before is not None:
            before(header)
        cpu = torch.device("cpu")
        placed = {C.POSITIONS: (torch.int64, cpu), C.TOKEN_IDS: (torch.int64, cpu), C.KEYS: (dtype, dev),
                  C.VALUES: (dtype, dev)}  # int64: what the cache holds (positions move to ``device`` after the checks)
        t: dict[str, torch.Tensor] = {}
        first = [n for n in box.tensors if n in _CHECKED]
        for name in first:
            t[name] = _placed(src, box, name, *placed.get(name, (None, cpu)))
        split = _contents_problem(header, {name: t[name].numpy() for name in first})
        if isinstance(split, str):
            raise CorruptFileError(f"{src.name}: {split}; {REBUILD}")
        sinks, body = split
        full_rows = (t[C.HEAD_LENGTHS].to(torch.int64).sum(dim=1) - torch.from_numpy(body.sum(axis=1))).tolist()
        trackers = {name: _RangeTracker(full_rows) for name in (C.KEYS, C.VALUES)}
        for name in box.tensors:
            if name not in t:
                t[name] = _placed(src, box, name, *placed.get(name, (None, cpu)), trackers.get(name))
    kv_ranges: dict[int, list] = {l: [] for l in range(header.num_layers)}
    for name, tracker in trackers.items():
        for l, bounds in tracker.ranges().items():
            kv_ranges[l].append((name, bounds))
    for name in (C.POSITIONS, C.ATTN_BIAS):
        if name in t:
            t[name] = t[name].to(dev)
    return header, _pack_of_tensors(header, t, sinks, body), kv_ranges


def _placed(src: Source, box: Container, name: str, dtype: torch.dtype | None, device: torch.device,
            observe=None) -> torch.Tensor:
    """Tensor ``name`` decoded straight into a new tensor of its shape in ``dtype`` (default: its own) on
    ``device``: each chunk is viewed in the stored dtype, shown to ``observe(first row, rows)`` and copied (cast)
    into place once."""
    import torch

    info = box.tensors[name]
    own = C.DTYPE_BY_CODE[info.dtype]
    out = torch.empty(info.shape, dtype=dtype or own, device=device)
    flat = out.view(-1)
    row = info.shape[-1] if len(info.shape) > 1 and info.shape[-1] else 1

    def put(at: int, chunk: np.ndarray) -> None:
        piece = torch.from_numpy(chunk).view(own)
        if observe is not None:
            observe(at // row, piece.view(-1, row))
        flat[at : at + piece.numel()].copy_(piece)

    stream_tensor(src, box, name, put, row)
    return out


class _RangeTracker:
    """Per-layer min and max of a keys or values tensor's full-precision rows (``rows[l]`` rows for layer ``l``,
    layer after layer), gathered chunk by chunk as it is decoded, in the stored dtype (a later cast cannot hide or
    create an out-of-range value); NaN once a NaN is seen. ``ranges()``: layer -> ``(min, max)``, layers with rows."""

    def __init__(self, rows: list[int]):
        self.starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]).tolist()
        self.low, self.high = [math.inf] * len(rows), [-math.inf] * len(rows)

    def __call__(self, r0: int, piece: torch.Tensor) -> None:
        r1 = r0 + piece.shape[0]
        l = bisect.bisect_right(self.starts, r0) - 1  # the layer holding row r0 (after any without rows)
        while l < len(self.low) and self.starts[l] < r1:
            a, b = max(r0, self.starts[l]), min(r1, self.starts[l + 1])
            if a < b:
                lo, hi = (float(x) for x in piece[a - r0 : b - r0].aminmax())
                self.low[l] = _nan_or(min, self.low[l], lo)
                self.high[l] = _nan_or(max, self.high[l], hi)
            l += 1

    def ranges(self) -> dict[int, tuple[float, float]]:
        return {l: (self.low[l], self.high[l]) for l in range(len(self.low)) if self.starts[l + 1] > self.starts[l]}


def _nan_or(f, a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else f(a, b)


def _header(box: Container, name: str) -> PackHeader:
    """The ``PackHeader`` of a validated container, after the checks of the KV layout (§8 step 12)."""

    def corrupt(problem: str) -> CorruptFileError:
        return CorruptFileError(f"{name}: {problem}; {REBUILD}")

    meta = box.metadata
    qtype, group_size = C.QUANT_NONE, None
    if C.META_QUANT in meta:
        q = parse_json_text(meta[C.META_QUANT], repr(C.META_QUANT), corrupt)
        if (type(q) is not dict or q.keys() != set(C.QUANT_INFO_KEYS) or type(q["type"]) is not str
                or q["type"] not in C.QUANT_TYPES or type(q["group_size"]) is not int
                or not 1 <= q["group_size"] <= C.MAX_GROUP_SIZE):
            raise corrupt(f"{C.META_QUANT!r} must be {{\"group_size\": 1..{C.MAX_GROUP_SIZE}, \"type\": "
                          f"{' or '.join(map(repr, C.QUANT_TYPES))}}}")
        qtype, group_size = q["type"], q["group_size"]
    problem = _layout_problem(box.tensors, qtype, group_size)
    if problem is not None:
        raise corrupt(problem)
    kv = parse_json_text(meta[C.META_KVPACK], repr(C.META_KVPACK), corrupt)
    problem = metadata_problem(kv, box.tensors[C.HEAD_LENGTHS].shape[0], box.tensors[C.TOKEN_IDS].shape[0])
    if problem is not None:
        raise corrupt(problem)
    return PackHeader(meta[C.META_FORMAT_VERSION], kv, box.tensors, box.header_bytes, box.file_bytes, qtype,
                      group_size, box.checksum)


def _layout_problem(tensors: dict[str, TensorInfo], qtype: str, g: int | None) -> str | None:
    """Why the tensor set, dtypes or shapes are not format 1.0's (§5; sizes capped before anything is allocated
    from them), or None."""

    def bad(tname: str, codes: tuple[str, ...], ndim: int) -> str | None:
        info = tensors.get(tname)
        if info is None:
            return f"tensor {tname!r} is missing"
        if info.dtype not in codes or len(info.shape) != ndim:
            return f"tensor {tname!r} must be {'/'.join(codes)} with {ndim} dimensions, not {info.dtype} " \
                   f"{list(info.shape)}"
        return None

    ints = (C.INDEX_INT_CODE,)
    problem = (bad(C.TOKEN_IDS, ints, 1) or bad(C.HEAD_LENGTHS, ints, 2) or bad(C.POSITIONS, ints, 1)
               or bad(C.KEYS, C.FLOAT_CODES, 2) or bad(C.VALUES, C.FLOAT_CODES, 2))
    if problem:
        return problem
    allowed = {C.TOKEN_IDS, C.HEAD_LENGTHS, C.POSITIONS, C.KEYS, C.VALUES, C.ATTN_BIAS}
    allowed |= set(C.COMPACT_PARTS) if g is not None else set()
    extra = sorted(set(tensors) - allowed)
    if extra:
        return f"unexpected tensor {extra[0][:80]!r}" + ("" if g is not None else " in an unquantized pack")
    layers, heads = tensors[C.HEAD_LENGTHS].shape
    d, dv = tensors[C.KEYS].shape[1], tensors[C.VALUES].shape[1]
    if not (1 <= layers <= C.MAX_LAYERS and 1 <= heads <= C.MAX_KV_HEADS and layers * heads <= C.MAX_TOTAL_HEADS):
        return (f"{C.HEAD_LENGTHS!r} has shape {[layers, heads]}; 1 to {C.MAX_LAYERS} layers of 1 to "
                f"{C.MAX_KV_HEADS} KV heads (at most {C.MAX_TOTAL_HEADS} heads in all) are allowed")
    if not (1 <= d <= C.MAX_HEAD_DIM and 1 <= dv <= C.MAX_HEAD_DIM):
        return f"head_dim/head_dim_v {[d, dv]} must lie in [1, {C.MAX_HEAD_DIM}]"
    full = tensors[C.KEYS].shape[0]
    if tensors[C.VALUES].shape[0] != full:
        return f"keys and values have {full} and {tensors[C.VALUES].shape[0]} rows"
    entries = tensors[C.POSITIONS].shape[0]
    bias = tensors.get(C.ATTN_BIAS)
    if bias is not None and (bias.dtype != C.F32_CODE or bias.shape != (entries,)):
        return f"tensor {C.ATTN_BIAS!r} must be F32 [{entries}] (one per entry), not {bias.dtype} {list(bias.shape)}"
    if g is None:
        return None if full == entries else f"keys/values have {full} rows but positions {entries}"
    spec = quant_type(qtype)
    gv = value_group_size(g, dv)
    if (d * spec.bits) % 8 or dv % spec.codes_per_byte or dv % gv:
        return (f"head_dim {d} / head_dim_v {dv} cannot be {qtype}-quantized with group size {g} (need whole bytes "
                f"per row, and multiples of {gv} for head_dim_v)")
    codes, params = tensors.get(C.KEY_CODES), tensors.get(C.KEY_PARAMS)
    rows = codes.shape[0] if codes is not None and len(codes.shape) == 2 else 0
    groups = params.shape[1] if params is not None and len(params.shape) == 3 else 0
    want = {
        C.KEY_BITS: (C.QUANT_CODE_CODE, (layers, heads, d)),
        C.KEY_CODES: (C.QUANT_CODE_CODE, (rows, d * spec.bits // 8)),
        C.KEY_PARAMS: (C.QUANT_CODE_CODE, (2, groups, d)),
        C.VALUE_CODES: (C.QUANT_CODE_CODE, (rows, dv * spec.bits // 8)),
        C.VALUE_PARAMS: (C.QUANT_CODE_CODE, (2, rows, dv // gv)),
        C.QUANT_GRID: (C.F32_CODE, (layers, 3, d + dv // gv)),
    }
    for part, (code, shape) in want.items():
        info = tensors.get(part)
        if info is None:
            return f"tensor {part!r} is missing"
        if info.dtype != code or info.shape != shape:
            return f"tensor {part!r} must be {code} {list(shape)}, not {info.dtype} {list(info.shape)}"
    if full + rows != entries:
        return f"keys have {full} full-precision rows and key_codes {rows} quantized ones, but positions {entries}"
    return None


def _read(source: SourceLike, keep_all: bool) -> tuple[PackHeader, Pack | None]:
    """Validate a whole file (checksums, frames, contents); with ``keep_all`` also build its ``Pack``."""
    with Source(source) as src:
        box = parse_header(src)
        header = _header(box, src.name)
        data = {name: tensor_bytes(src, box, name, keep_all or name in _CHECKED) for name in box.tensors}
    arrays = {name: data[name].view(_NP[header.tensors[name].dtype]).reshape(header.tensors[name].shape)
              for name in _CHECKED if name in data}
    split = _contents_problem(header, arrays)
    if isinstance(split, str):
        raise CorruptFileError(f"{src.name}: {split}; {REBUILD}")
    if not keep_all:
        return header, None
    return header, _pack(header, data, *split)


def _contents_problem(header: PackHeader, a: dict[str, np.ndarray]) -> str | tuple[np.ndarray, np.ndarray]:
    """The content checks (§8 step 14) on the index tensors ``a`` (numpy views): token ids >= 0; head lengths >= 0
    summing to the entries; positions in ``[0, tokens)``, strictly increasing within each head; for a quantized
    file, the body rows and key groups the layout rule gives add up to the stored ones, code widths and grids are
    valid; biases finite and within ``[-MAX_ATTN_BIAS, MAX_ATTN_BIAS]``. Work and memory linear in the index
    tensors. Returns the problem, or ``(sinks, body)`` int64 ``[layers, kv_heads]`` (the rule's split of each head;
    zeros for an unquantized file)."""
    tokens, lengths, pos = a[C.TOKEN_IDS], a[C.HEAD_LENGTHS].astype(np.int64), a[C.POSITIONS]
    if tokens.size and tokens.min() < 0:
        return "token ids must be non-negative"
    if lengths.min() < 0 or int(lengths.sum()) != pos.shape[0]:
        return f"{C.HEAD_LENGTHS!r} must be non-negative and sum to the {pos.shape[0]} entries of {C.POSITIONS!r}"
    flat = lengths.reshape(-1)
    ends = np.cumsum(flat)
    starts = ends - flat
    if pos.size:
        if pos.min() < 0 or pos.max() >= tokens.shape[0]:
            return f"positions must lie in [0, {tokens.shape[0]})"
        rises = pos[1:] > pos[:-1]
        rises[starts[(flat > 0) & (starts > 0)] - 1] = True  # a new head may start lower
        if not rises.all():
            return "positions must be strictly increasing within each head"
    bias = a.get(C.ATTN_BIAS)
    if bias is not None and bias.size and not (np.isfinite(bias).all() and np.abs(bias).max() <= C.MAX_ATTN_BIAS):
        return f"attention biases must be finite and lie in [-{C.MAX_ATTN_BIAS:g}, {C.MAX_ATTN_BIAS:g}]"
    g = header.group_size
    if g is None:
        zeros = np.zeros(lengths.shape, dtype=np.int64)
        return zeros, zeros
    below = np.concatenate([[0], np.cumsum(pos < header.metadata[C.SINK_TOKENS_KEY])])
    sinks = below[ends] - below[starts]
    rest = flat - sinks
    body = np.where(rest >= g, rest, 0)
    rows, groups = header.tensors[C.KEY_CODES].shape[0], header.tensors[C.KEY_PARAMS].shape[1]
    if int(body.sum()) != rows or int(((body + g - 1) // g).sum()) != groups:
        return (f"the head lengths and positions call for {int(body.sum())} quantized rows in "
                f"{int(((body + g - 1) // g).sum())} key groups (each head's non-sink rows are quantized when there "
                f"are at least {g}), but the file has {rows} rows in {groups} groups")
    problem = compact_values_problem(a[C.KEY_BITS], a[C.QUANT_GRID], header.quant_type, header.head_dims[0])
    if problem is not None:
        return problem
    return sinks.reshape(lengths.shape), body.reshape(lengths.shape)


def _pack(header: PackHeader, data: dict[str, np.ndarray], sinks: np.ndarray, body: np.ndarray) -> Pack:
    """The ``Pack`` of a checked file: per-layer views of its tensors (``data``: their bytes)."""
    import torch

    t = {name: torch.from_numpy(data[name]).view(C.DTYPE_BY_CODE[info.dtype]).reshape(info.shape) if info.raw_nbytes
         else torch.empty(info.shape, dtype=C.DTYPE_BY_CODE[info.dtype]) for name, info in header.tensors.items()}
    return _pack_of_tensors(header, t, sinks, body)


def _pack_of_tensors(header: PackHeader, t: dict[str, torch.Tensor], sinks: np.ndarray, body: np.ndarray) -> Pack:
    """The ``Pack`` of a checked file from its tensors ``t`` (each of its own shape): per-layer views of them."""
    import torch

    from .pack import LayerEntries, Pack, QuantizedRows

    lengths = t[C.HEAD_LENGTHS].to(torch.int64)
    per_layer = lengths.sum(dim=1).tolist()
    quantized = body.sum(axis=1).tolist()
    g = header.group_size
    key_groups = ((body + g - 1) // g).sum(axis=1).tolist() if g else [0] * len(per_layer)
    bias = t.get(C.ATTN_BIAS)
    layers, e0, f0, q0, k0 = [], 0, 0, 0, 0
    for l, (e, q, k) in enumerate(zip(per_layer, quantized, key_groups)):
        f = e - q
        quant = None
        if g is not None:
            quant = QuantizedRows(header.quant_type, g, torch.from_numpy(sinks[l]), torch.from_numpy(body[l]),
                                  t[C.KEY_CODES][q0 : q0 + q], t[C.VALUE_CODES][q0 : q0 + q], t[C.KEY_BITS][l],
                                  t[C.KEY_PARAMS][:, k0 : k0 + k], t[C.VALUE_PARAMS][:, q0 : q0 + q],
                                  t[C.QUANT_GRID][l])
        layers.append(LayerEntries(t[C.KEYS][f0 : f0 + f], t[C.VALUES][f0 : f0 + f], t[C.POSITIONS][e0 : e0 + e],
                                   lengths[l], quant, None if bias is None else bias[e0 : e0 + e]))
        e0, f0, q0, k0 = e0 + e, f0 + f, q0 + q, k0 + k
    meta = dict(header.metadata)
    sink = meta.pop(C.SINK_TOKENS_KEY)
    return Pack(token_ids=t[C.TOKEN_IDS].to(torch.int64), layers=layers, sink_tokens=sink, metadata=meta)
