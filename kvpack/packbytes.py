"""A ``.kvpack`` file to read by byte range: a path, a seekable binary file object, or the file's bytes
(``format/SPEC.md`` §3: files of any size, read in bounded pieces; raw tensors of a path memory-mapped)."""

from __future__ import annotations

import io
import os
import stat
from typing import Any, BinaryIO, Union

import numpy as np

from . import constants as C
from .errors import InputError, TruncatedFileError

__all__ = ["Source", "SourceLike", "REBUILD", "RECOPY"]

SourceLike = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]

REBUILD = "rebuild it with `kvpack build`"
RECOPY = f"copy it again or {REBUILD}"


class Source:
    """A ``.kvpack`` file to read by byte range: a path (opened once; raw tensors can be memory-mapped), a seekable
    binary file object (read with ``seek`` + ``readinto``/``read``; it is not closed), or the file's bytes.

    Raises (constructor):
        InputError: a path that cannot be read (missing, a folder, no permission), an object that is neither.
    """

    def __init__(self, source: SourceLike):
        self._data: memoryview | None = None
        self._file: Any = None
        self._owned = False
        self._readinto = True  # whether the file object's readinto works (else read is used)
        self.path: str | None = None
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._data = memoryview(source).cast("B")
            self.name, self.size = "kvpack data (in memory)", len(self._data)
            return
        if hasattr(source, "read") and hasattr(source, "seek"):
            self._file, self.name = source, str(getattr(source, "name", None) or "kvpack file object")
            try:
                self.size = source.seek(0, io.SEEK_END)
            except (OSError, ValueError) as exc:
                raise InputError(f"cannot read {self.name}: not a seekable binary file ({exc})") from exc
            if not isinstance(self.size, int):
                raise InputError(f"cannot read {self.name}: seek() did not return an offset")
            return
        try:
            self.path = os.fspath(source)
        except TypeError as exc:
            raise InputError(f"cannot read a {type(source).__name__}: expected a path, a binary file object or bytes"
                             + ("; an in-memory Pack loads with kvpack.loading.cache_from_pack(pack, model)"
                                if type(source).__name__ == "Pack" else "")) from exc
        self.name = self.path
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise InputError(f"cannot read {self.path}: {exc.strerror or exc}; check the path") from exc
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"cannot read {self.path}: not a regular file; give the path of a .kvpack file")
        self.size = st.st_size

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the file if this object opened it (a caller's file object stays open)."""
        if self._owned and self._file is not None:
            self._file.close()
        if self._owned:
            self._file, self._owned = None, False

    def _handle(self):
        if self._file is None:
            try:
                self._file = open(self.path, "rb", buffering=0)
            except OSError as exc:
                raise InputError(f"cannot read {self.path}: {exc.strerror or exc}; check the path") from exc
            self._owned = True
        return self._file

    def read(self, start: int, n: int) -> bytes:
        """Exactly ``n`` bytes from ``start`` (the caller checked the range against ``size``)."""
        if self._data is not None:
            return bytes(self._data[start : start + n])
        buf = bytearray(n)
        self.readinto(start, memoryview(buf))
        return bytes(buf)

    def readinto(self, start: int, buf: memoryview | np.ndarray) -> None:
        """Fill ``buf`` with the bytes from ``start``; ``TruncatedFileError`` if the file ends first."""
        view = memoryview(buf).cast("B")
        if self._data is not None:
            view[:] = self._data[start : start + len(view)]
            return
        f = self._handle()
        try:
            f.seek(start)
            got = 0
            while got < len(view):
                n = None
                if self._readinto:
                    try:
                        n = f.readinto(view[got:])
                    except (NotImplementedError, io.UnsupportedOperation, AttributeError):
                        self._readinto = False
                if n is None:
                    piece = f.read(len(view) - got)
                    n = len(piece)
                    view[got : got + n] = piece
                if not n:
                    break
                got += n
        except OSError as exc:
            raise InputError(f"cannot read {self.name}: {exc.strerror or exc}; check the path") from exc
        if got != len(view):
            raise TruncatedFileError(f"{self.name}: the file became shorter while being read; {RECOPY}")

    def array(self, start: int, n: int) -> np.ndarray:
        """A writable uint8 array ``[n]`` of the bytes from ``start``: a private (copy-on-write) memory map of a path
        where the platform allows, else a fresh buffer filled by reading."""
        if n and self.path is not None:
            try:
                return np.memmap(self.path, dtype=np.uint8, mode="c", offset=start, shape=(n,))
            except (OSError, ValueError):
                pass  # no mmap here (or a special file system): read instead
        out = np.empty(n, dtype=np.uint8)
        for at in range(0, n, C.READ_CHUNK_BYTES):
            self.readinto(start + at, out[at : at + C.READ_CHUNK_BYTES])
        return out
