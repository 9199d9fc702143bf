"""Tensor codecs of format 1.0 (``format/SPEC.md`` §6): a byte filter (shuffle, delta + shuffle) and one zstd frame.

Encoding works on whole tensors (the writer holds them anyway). Decoding streams: ``decode_zstd`` reads the stored
frame through a ``read(offset, n)`` callable in chunks of at most ``constants.READ_CHUNK_BYTES`` and writes the
unfiltered bytes straight into the caller's output array, so a reader holds the output plus a bounded buffer (zstd's
window, at most ``MAX_WINDOW_BYTES``, and one chunk), never the compressed tensor or a second copy of the raw one.
Every size is checked before anything is allocated from it; a damaged or hostile frame raises ``CodecError``.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import zstandard

from . import constants as C

__all__ = ["CodecError", "writer_filter", "allowed_filters", "encode", "decode_zstd", "iter_decoded",
           "MAX_WINDOW_BYTES"]

#: Largest zstd window a reader allocates (2^27: what level 22, the highest the writer uses, asks for).
MAX_WINDOW_BYTES = 1 << 27

#: zstd block types (RFC 8878 §3.1.1.2): raw, RLE, compressed, reserved.
_RLE_BLOCK, _RESERVED_BLOCK = 1, 3


class CodecError(ValueError):
    """A stored frame is not what its header entry says; the reader turns it into ``CorruptFileError``."""


def allowed_filters(code: str) -> tuple[str, ...]:
    """Filters a tensor of dtype ``code`` may use: ``none``; ``shuffle`` for elements over one byte;
    ``delta_shuffle`` for ``I32``."""
    itemsize = C.ITEMSIZE_BY_CODE[code]
    return ((C.FILTER_NONE,) + ((C.FILTER_SHUFFLE,) if itemsize > 1 else ())
            + ((C.FILTER_DELTA_SHUFFLE,) if code == C.INDEX_INT_CODE else ()))


def writer_filter(name: str, code: str) -> str:
    """The filter the reference writer uses: delta + shuffle for ``positions``, shuffle for other multi-byte
    elements, none for bytes."""
    if name == C.POSITIONS and code == C.INDEX_INT_CODE:
        return C.FILTER_DELTA_SHUFFLE
    return C.FILTER_SHUFFLE if C.ITEMSIZE_BY_CODE[code] > 1 else C.FILTER_NONE


def encode(raw: bytes, code: str, filt: str, level: int) -> bytes:
    """Filter the little-endian bytes ``raw`` of a ``code`` tensor, then compress them into one zstd frame that
    declares its content size and carries a content checksum (``format/SPEC.md`` §6)."""
    itemsize = C.ITEMSIZE_BY_CODE[code]
    x = np.frombuffer(raw, dtype=np.uint8)
    if filt == C.FILTER_DELTA_SHUFFLE:
        v = x.view(np.uint32)
        d = v.copy()
        d[1:] -= v[:-1]  # uint32 arithmetic wraps modulo 2**32, as two's complement int32 does
        x = d.view(np.uint8)
    if filt in (C.FILTER_SHUFFLE, C.FILTER_DELTA_SHUFFLE):
        x = x.reshape(-1, itemsize).T  # [itemsize, elements]: byte planes
    data = np.ascontiguousarray(x).tobytes()
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True).compress(data)


def decode_zstd(read: Callable[[int, int], bytes], stored: int, raw: int, filt: str, itemsize: int,
                out: np.ndarray | None) -> None:
    """Decode one stored zstd frame of ``stored`` bytes into ``out`` (uint8 ``[raw]``, the tensor's final bytes), or
    only check it when ``out`` is ``None``.

    ``read(offset, n)`` returns ``n`` bytes of the stored range from ``offset``. Checked, in order: the frame magic;
    a parsable frame header declaring exactly ``raw`` content bytes and no dictionary; the frame's blocks end
    exactly at ``stored`` bytes (no trailing data; walked from the block headers, RFC 8878 §3.1.1.2); decompression
    with a window of at most ``min(next power of two >= raw, MAX_WINDOW_BYTES)`` yields exactly ``raw`` bytes and
    zstd's content checksum agrees. The filter is undone chunk by chunk into ``out`` (shuffle: each chunk of a byte
    plane is written to its column of ``out`` seen as ``[elements, itemsize]``; delta: one wrapping prefix sum).

    Raises:
        CodecError: naming what is wrong with the frame.
    """
    reader = _frame_reader(read, stored, raw)
    chunk = np.empty(min(C.READ_CHUNK_BYTES, raw), dtype=np.uint8)
    elements = raw // itemsize
    planes = out.reshape(elements, itemsize) if out is not None and filt != C.FILTER_NONE else None
    done = 0
    try:
        while done < raw:
            n = reader.readinto(memoryview(chunk)[: min(len(chunk), raw - done)])
            if n == 0:
                raise CodecError(f"its zstd frame decompressed to {done} bytes instead of {raw}")
            if out is not None:
                if planes is None:
                    out[done : done + n] = chunk[:n]
                else:
                    _scatter(planes, chunk[:n], done, elements)
            done += n
        if reader.read(1):  # also makes zstd reach the frame end and check its content checksum
            raise CodecError(f"its zstd frame decompresses to more than {raw} bytes")
    except zstandard.ZstdError as exc:
        raise CodecError(f"its zstd frame is damaged ({str(exc)[:120]})") from None
    if out is not None and filt == C.FILTER_DELTA_SHUFFLE:
        deltas = out.view(np.uint32)
        np.cumsum(deltas, dtype=np.uint32, out=deltas)  # wraps modulo 2**32, as the int32 encoder did


def iter_decoded(read: Callable[[int, int], bytes], stored: int, raw: int, filt: str, itemsize: int,
                 chunk_elements: int) -> Iterator[tuple[int, np.ndarray]]:
    """Decode one stored zstd frame (checked as ``decode_zstd`` checks it) and yield the tensor's raw little-endian
    bytes in element order, ``(first element, uint8 [m * itemsize])`` with ``m <= chunk_elements``, never holding
    the whole tensor: the caller casts and places each chunk (the buffer is reused: consume it before the next).

    With a byte filter, byte ``j`` of element ``i`` lies at offset ``j * n + i`` of the decoded stream (``n``
    elements), so one stream reader per byte plane fills column ``j`` of each chunk; reader ``j`` first decodes and
    drops ``j * n`` bytes: ``k (k + 1) / 2`` planes decoded for ``k``-byte elements instead of ``k`` (1.5x the work
    for 2-byte elements, 2.5x for 4-byte ones), for memory bounded by ``k`` zstd windows (each at most
    ``min(next power of two >= raw, MAX_WINDOW_BYTES)``) and one chunk. The last reader runs to the frame's end,
    so zstd's content checksum is checked. ``delta_shuffle`` is undone with a running wrapping prefix sum.

    Raises:
        CodecError: naming what is wrong with the frame (before the first chunk, or while decoding).
    """
    readers = [_frame_reader(read, stored, raw)]
    n = raw // itemsize
    k = 1 if filt == C.FILTER_NONE else itemsize
    readers += [_stream(read, stored, raw) for _ in range(1, k)]
    step = max(1, min(n, chunk_elements))
    out = np.empty(step * itemsize, dtype=np.uint8)
    planes = np.empty((k, step), dtype=np.uint8) if k > 1 else None
    carry = np.zeros(1, dtype=np.uint32)
    try:
        for j in range(1, k):
            _fill(readers[j], None, j * n, raw)
        for at in range(0, n, step):
            m = min(step, n - at)
            if planes is None:
                _fill(readers[0], out[: m * itemsize], m * itemsize, raw)
            else:
                for j in range(k):
                    _fill(readers[j], planes[j, :m], m, raw)
                np.copyto(out[: m * itemsize].reshape(m, k), planes[:, :m].T)
                if filt == C.FILTER_DELTA_SHUFFLE:
                    v = out[: m * itemsize].view(np.uint32)
                    np.cumsum(v, dtype=np.uint32, out=v)
                    v += carry  # uint32: wraps modulo 2**32, as the int32 encoder did
                    carry[0] = v[-1]
            yield at, out[: m * itemsize]
        if readers[-1].read(1):  # also makes zstd reach the frame end and check its content checksum
            raise CodecError(f"its zstd frame decompresses to more than {raw} bytes")
    except zstandard.ZstdError as exc:
        raise CodecError(f"its zstd frame is damaged ({str(exc)[:120]})") from None


def _fill(reader, view: np.ndarray | None, n: int, raw: int) -> None:
    """Read exactly ``n`` decoded bytes from ``reader`` into ``view`` (or drop them, ``view`` None, in bounded
    pieces). Raises ``CodecError`` if the frame ends first."""
    scratch = np.empty(min(n, C.READ_CHUNK_BYTES), dtype=np.uint8) if view is None else None
    got = 0
    while got < n:
        target = view[got:n] if view is not None else scratch[: min(len(scratch), n - got)]
        r = reader.readinto(memoryview(target))
        if r == 0:
            raise CodecError(f"its zstd frame decompressed to fewer than its {raw} declared bytes")
        got += r


def _frame_reader(read: Callable[[int, int], bytes], stored: int, raw: int):
    """A ``zstandard`` stream reader over the one frame of ``stored`` bytes, after checking it as ``decode_zstd``
    says (magic, header, declared size ``raw``, no dictionary, blocks ending at ``stored``). Raises ``CodecError``."""
    if stored < len(C.ZSTD_FRAME_MAGIC) or read(0, len(C.ZSTD_FRAME_MAGIC)) != C.ZSTD_FRAME_MAGIC:
        raise CodecError("its stored bytes do not start a zstd frame")
    head = read(0, min(stored, 18))  # a frame header is at most 18 bytes
    try:
        params = zstandard.get_frame_parameters(head)
        header_size = zstandard.frame_header_size(head)
    except zstandard.ZstdError as exc:
        raise CodecError(f"its zstd frame header is damaged ({str(exc)[:120]})") from None
    if params.content_size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise CodecError("its zstd frame does not declare its decompressed size")
    if params.content_size != raw:
        raise CodecError(f"its zstd frame declares {params.content_size} decompressed bytes, but the header says {raw}")
    if params.dict_id:
        raise CodecError("its zstd frame needs a dictionary, which kvpack files never use")
    end = _frame_end(read, stored, header_size, bool(head[4] & 4))
    if end != stored:
        raise CodecError(f"its zstd frame ends after {end} of its {stored} stored bytes")
    return _stream(read, stored, raw)


def _stream(read: Callable[[int, int], bytes], stored: int, raw: int):
    """A stream reader over the (checked) frame, its window capped at ``min(next power of two >= raw,
    MAX_WINDOW_BYTES)``, reading the stored bytes ``_STREAM_READ_BYTES`` at a time."""
    window = min(MAX_WINDOW_BYTES, 1 << max(10, (raw - 1).bit_length()))
    return zstandard.ZstdDecompressor(max_window_size=window).stream_reader(
        _RangeFile(read, stored), read_size=min(_STREAM_READ_BYTES, max(stored, 1)), read_across_frames=False)


#: Stored bytes a stream reader takes at a time (its input buffer; ``iter_decoded`` runs one reader per byte plane).
_STREAM_READ_BYTES = 1 << 20


def _scatter(planes: np.ndarray, data: np.ndarray, start: int, elements: int) -> None:
    """Write ``data``, the shuffled stream's bytes from ``start``, into the columns of ``planes`` ``[elements,
    itemsize]`` (byte plane ``i`` of the stream is column ``i``)."""
    pos = 0
    while pos < len(data):
        plane, j = divmod(start + pos, elements)
        n = min(len(data) - pos, elements - j)
        planes[j : j + n, plane] = data[pos : pos + n]
        pos += n


def _frame_end(read: Callable[[int, int], bytes], stored: int, pos: int, has_checksum: bool) -> int:
    """Offset just past the frame whose blocks start at ``pos``: each block header is 3 little-endian bytes (bit 0:
    last block, bits 1-2: type, bits 3-23: size; an RLE block stores 1 byte), then a 4-byte checksum if the frame
    has one. Reads the stored range in chunks of ``READ_CHUNK_BYTES``; work linear in ``stored``."""
    buf, buf_at = b"", 0
    while True:
        if pos + 3 > stored:
            raise CodecError("its zstd frame is cut short (a block header lies past the stored bytes)")
        if pos + 3 > buf_at + len(buf):
            buf_at = pos
            buf = read(pos, min(C.READ_CHUNK_BYTES, stored - pos))
        h = int.from_bytes(buf[pos - buf_at : pos - buf_at + 3], "little")
        kind = (h >> 1) & 3
        if kind == _RESERVED_BLOCK:
            raise CodecError("its zstd frame has a block of the reserved type")
        pos += 3 + (1 if kind == _RLE_BLOCK else h >> 3)
        if h & 1:
            return pos + (4 if has_checksum else 0)


class _RangeFile:
    """A read-only file object over a stored range (``read(offset, n)``), for ``zstandard.stream_reader``."""

    def __init__(self, read: Callable[[int, int], bytes], size: int):
        self._read, self._size, self._pos = read, size, 0

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        data = self._read(self._pos, n)
        self._pos += n
        return data
