"""The contexts of ``kvpack build``: read files and folders into ``Context`` objects, never stopping at a bad one.

    contexts = discover_contexts(["docs/"])     # .txt, .md: one context each; .jsonl, .parquet: one per line/row
    [c.name for c in contexts]                  # pack names mirroring the tree: ["a/notes", "data/q1", ...]
    [c.error for c in contexts]                 # None, or why the context cannot be built ("the file is empty")

A document that cannot be a context (empty, binary, not UTF-8, a bad jsonl line) becomes a ``Context`` with its
``error`` set, so a build records it as failed and goes on with the others. Names come from ``kvpack.names``.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from . import storage
from .container import has_lone_surrogate
from .errors import InputError
from .manifest import MANIFEST_NAME
from .names import PACK_SUFFIX, input_base, pack_names, part_name, relative_source

__all__ = ["SUFFIXES", "Context", "discover_contexts", "split_text"]

#: File suffixes ``discover_contexts`` reads; other files inside folders are skipped.
SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")
_JSONL_HINT = 'each line must be one JSON object like {"id": "doc1", "text": "..."}'
_PARAGRAPH_END = re.compile(r"\r?\n[ \t]*\r?\n\s*")  # a blank line, LF or CRLF, and any blank lines after it


@dataclass(frozen=True)
class Context:
    """One document to compress (or one that cannot be, with ``error`` set).

    Attributes:
        name: the pack's name relative to the output folder, a POSIX path without ``.kvpack`` (``a/notes``).
        text: the document's text (``None`` when ``error`` is set).
        source: the file's path relative to the mirrored input folder (``a/notes.txt``), POSIX.
        file: the file it came from (a ``Path``, or a URL string for a remote file).
        id: a jsonl line's ``id`` as a string (``None`` for ``.txt``/``.md`` files and lines without one).
        line: 1-based line number in a ``.jsonl`` file, ``None`` for ``.txt``/``.md``.
        part, parts: for a part of a split context, its 1-based number and the number of parts.
        error: why the context cannot be built, ``None`` when it can.
    """

    name: str
    text: str | None
    source: str
    file: Path | str
    id: str | None = None
    line: int | None = None
    part: int | None = None
    parts: int | None = None
    error: str | None = None

    @property
    def where(self) -> str:
        """``file`` or ``file:line``, for messages."""
        return f"{self.file}:{self.line}" if self.line is not None else str(self.file)

    @property
    def source_name(self) -> str:
        """What the pack records as its source: ``source``, ``:line`` for a jsonl line, ``#part-NNN`` for a part."""
        name = f"{self.source}:{self.line}" if self.line is not None else self.source
        return f"{name}#part-{self.part:03d}" if self.part is not None else name

    @property
    def pack(self) -> str:
        """The pack's path relative to the output folder (``a/notes.kvpack``), POSIX."""
        return self.name + PACK_SUFFIX

    def parts_of(self, texts: list[str]) -> list["Context"]:
        """This context cut into consecutive parts holding ``texts``, named ``NAME.part-001``, ..."""
        return [replace(self, name=part_name(self.name, k), text=t, part=k, parts=len(texts))
                for k, t in enumerate(texts, start=1)]


def discover_contexts(inputs: Iterable[str | os.PathLike], *, storage_options: dict | None = None) -> list[Context]:
    """Read the contexts in ``inputs`` (files or folders), in a deterministic order, with mirrored pack names.

    Folders are walked recursively in sorted order; files and folders whose names start with ``.`` are ignored, as
    are files with a suffix other than ``.txt``, ``.md``, ``.jsonl`` and ``.parquet``, a build's own
    ``kvpack-manifest.jsonl`` (an ``--out`` inside an input folder) and folders reached through a symbolic link
    (never followed, so a link loop cannot recurse). Inputs are taken in the order given; a file reached twice
    (named, and inside a named folder, or through a symbolic link) is read once. A symbolic link to a file is named
    after the link, not its target. Names follow ``kvpack.names``:
    relative to the one folder input (or the inputs' common parent), a jsonl file's lines under a folder named after
    it.

    * ``.txt``, ``.md``: the whole file (UTF-8) is one context.
    * ``.jsonl``: one JSON object per non-blank line, with a string ``"text"`` and an optional ``"id"`` (string or
      integer; without one the line number names the pack).
    * ``.parquet`` (needs pyarrow, e.g. from ``kvpack[ray]``): one context per row, from a string column ``text``
      and an optional ``id`` column, as a jsonl line (``line`` is the 1-based row number). Only those two
      columns are read, by range for a URL (the footer, then their column chunks).

    A context that cannot be built gets ``error`` (the file is empty, holds NUL bytes, is not UTF-8, is not a
    regular file (a pipe would block the read) or cannot be read; a jsonl line or Parquet row has no non-empty
    string ``text`` or a bad ``id``; a Parquet file cannot be read or has no ``text`` column); the rest are read.
    A file name that is not UTF-8 is recorded with its bytes written as ``\\xNN``.

    Returns:
        The contexts, at least one.

    Raises:
        InputError: no input; a path does not exist; an explicitly named file has an unsupported suffix; no
            supported file was found at all; a ``.parquet`` file was found but pyarrow is not installed.
    """
    inputs = [storage.as_path(i) for i in inputs]
    if not inputs:
        raise InputError("no input given; pass one or more .txt, .md, .jsonl or .parquet files or folders holding them")
    so = storage_options
    files: list[Path | str] = []
    folders = [storage.is_dir(p, so) and not storage.is_file(p, so) for p in inputs]
    for path, folder in zip(inputs, folders):
        if folder:  # a build's own manifest (an --out inside the input folder) is never a corpus file
            files.extend(f for f, parts in storage.walk_files(path, SUFFIXES, so) if parts[-1] != MANIFEST_NAME)
        elif storage.is_file(path, so):
            suffix = posixpath.splitext(storage.name_of(path))[1]
            if suffix.lower() not in SUFFIXES:
                raise InputError(f"{path}: unsupported file type {suffix or '(no suffix)'!r}; kvpack build "
                                 f"reads {', '.join(SUFFIXES)} files (convert it to .txt, or pass a folder)")
            files.append(path)
        elif not storage.is_url(path) and path.exists():
            raise InputError(f"{path}: not a regular file or folder; pass .txt, .md, .jsonl or .parquet files or "
                             "folders")
        else:
            raise InputError(f"{path}: no such file or folder; check the path")
    if not files:
        raise InputError(f"no .txt, .md, .jsonl or .parquet files found in {', '.join(str(i) for i in inputs)}; "
                         "pass files or folders that hold some")
    seen, unique = set(), []
    for f in files:  # a file named twice (or a file and its folder, or a link to it) counts once
        if _resolved(f) not in seen:
            seen.add(_resolved(f))
            unique.append(f)
    base = input_base([_posix(p) for p in inputs], folders)
    drafts: list[Context] = []
    for f in unique:
        drafts.extend(_read_file(f, _as_text(relative_source(base, _posix(f))), so))
    # contexts that can be built are named first, so a bad line never takes a good line's name (nor changes it
    # when it is fixed); the failed ones, which write nothing, take what is left
    order = sorted(range(len(drafts)), key=lambda i: drafts[i].error is not None)
    names = pack_names((drafts[i].source, None if drafts[i].line is None else
                        (drafts[i].id if drafts[i].id is not None else str(drafts[i].line))) for i in order)
    named = dict(zip(order, names))
    return [replace(c, name=named[i]) for i, c in enumerate(drafts)]


def _posix(path: Path | str) -> str:
    """A URL as it is, a local path made absolute (symbolic links kept: a link is named after itself), as POSIX
    (what ``kvpack.names`` compares)."""
    return path if storage.is_url(path) else Path(os.path.abspath(path)).as_posix()


def _as_text(name: str) -> str:
    """``name`` with the bytes of a file name that is not UTF-8 (which Python decodes as lone surrogates) written
    as ``\\xNN``: the text a pack header, the manifest and a terminal can hold (``bad\\xff.txt``)."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # surrogates no file system decoding makes
        return name.encode("utf-8", "surrogatepass").decode("utf-8", "backslashreplace")


def _resolved(path: Path | str) -> str:
    """A URL as it is, a local path with its symbolic links resolved: one key per file however it is reached."""
    return path if storage.is_url(path) else path.resolve().as_posix()


def _read_text(path: Path | str, storage_options: dict | None = None) -> tuple[str | None, str | None]:
    """``(text, None)``, or ``(None, why it is not text)``."""
    try:
        data = storage.read_bytes(path, storage_options) if storage.is_url(path) else path.read_bytes()
    except InputError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read the file: {exc.strerror or exc}; check the path and permissions"
    nul = data.find(b"\x00")
    if nul >= 0:
        return None, f"not text: it holds NUL bytes (byte {nul}; a binary file?); pass text files"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 text (byte {exc.start}); save the file as UTF-8"


def _read_file(path: Path | str, source: str, storage_options: dict | None = None) -> list[Context]:
    if not storage.is_url(path) and path.exists() and not path.is_file():  # a FIFO would block the read forever
        return [Context("", None, source, path, error="not a regular file (a pipe, socket or device); pass regular "
                                                      "files")]
    if storage.name_of(path).lower().endswith(".parquet"):
        rows, error = _parquet_rows(path, storage_options)
        if error is None and not rows:
            error = 'no rows; remove the file or give it rows with a string column "text"'
        if error is not None:
            return [Context("", None, source, path, error=error)]
        return [_row_context(obj, source, path, number) for number, obj in enumerate(rows, start=1)]
    text, error = _read_text(path, storage_options)
    jsonl = storage.name_of(path).lower().endswith(".jsonl")
    if error is None and not (text or "").strip():
        error = "the file is empty; remove it or give it some text"
    if error is not None or not jsonl:
        return [Context("", None if error else text, source, path, error=error)]
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            out.append(_jsonl_line(line, source, path, number))
    return out or [Context("", None, source, path, error="no lines; remove the file or add lines like "
                                                         '{"id": "doc1", "text": "..."}')]


def _jsonl_line(line: str, source: str, path: Path, number: int) -> Context:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return Context("", None, source, path, line=number,
                       error=f"not valid JSON ({exc.msg} at column {exc.colno}); {_JSONL_HINT}")
    except RecursionError:
        return Context("", None, source, path, line=number,
                       error=f"JSON nested too deeply to parse; {_JSONL_HINT}")
    if has_lone_surrogate(obj):
        return Context("", None, source, path, line=number,
                       error="holds an unpaired UTF-16 surrogate escape (\\ud800 alone), which is not text; fix the "
                             "line's escapes")
    return _row_context(obj, source, path, number)


def _row_context(obj, source: str, path: Path | str, number: int) -> Context:
    """The context of a parsed jsonl line or a Parquet row (``{"text": ..., "id": ...}``), number ``number``."""
    ident = obj.get("id") if isinstance(obj, dict) else None
    bad_id = ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int)) or str(ident) == "")
    ident = None if ident is None or bad_id else str(ident)
    error = None
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        error = f'no string "text" field; {_JSONL_HINT}'
    elif bad_id:
        error = f'"id" must be a non-empty string or an integer, got {json.dumps(obj.get("id"))}'
    elif not obj["text"].strip():
        error = 'the "text" field is empty; give it some text or remove the line'
    return Context("", None if error else obj["text"], source, path, id=ident, line=number, error=error)


def _parquet_rows(path: Path | str, storage_options: dict | None) -> tuple[list[dict], str | None]:
    """``(rows, None)``: the ``text`` and ``id`` columns of a Parquet file as dicts, or ``([], why not)``.

    Raises ``InputError`` when pyarrow is missing (an install problem, not a bad file)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow; kvpack[ray] has it), "
                         "or convert the file to .jsonl") from None
    try:
        with storage.open_read(path, storage_options) as f:
            parquet = pq.ParquetFile(f)
            names = parquet.schema_arrow.names
            if "text" not in names:
                return [], (f'no "text" column (columns: {", ".join(names)}); give the Parquet file a string '
                            'column "text" (and optionally "id")')
            return parquet.read(columns=[c for c in ("id", "text") if c in names]).to_pylist(), None
    except InputError as exc:
        return [], str(exc)
    except (pa.ArrowException, OSError) as exc:
        return [], f"not a readable Parquet file ({str(exc)[:200]}); check the file"


def split_text(text: str, fits: Callable[[str], bool]) -> list[str]:
    """Cut ``text`` at paragraph boundaries (blank lines; inside a paragraph too long alone, at line ends) into
    consecutive pieces that each satisfy ``fits`` (e.g. "is at most N tokens"); joined they give ``text``.

    Pieces are filled greedily in order. Raises ``InputError`` when a single line does not fit.
    """
    pieces: list[str] = []
    current = ""
    for unit in _units(text, fits):
        if current and not fits(current + unit):
            pieces.append(current)
            current = ""
        current += unit
    if current:
        if pieces and not current.strip():
            pieces[-1] += current
        else:
            pieces.append(current)
    return pieces


def _units(text: str, fits: Callable[[str], bool]) -> list[str]:
    """Paragraphs of ``text`` (each with the blank lines after it); a paragraph that does not fit alone is given
    as its lines. Raises ``InputError`` for a line that does not fit alone."""
    units: list[str] = []
    start = 0
    for m in list(_PARAGRAPH_END.finditer(text)) + [None]:
        end = m.end() if m is not None else len(text)
        para = text[start:end]
        start = end
        if not para:
            continue
        if fits(para):
            units.append(para)
            continue
        for ln in para.splitlines(keepends=True):
            if not fits(ln):
                raise InputError(f"a single line of {len(ln):,} characters is longer than the model allows, so "
                                 "the text cannot be cut at paragraph or line boundaries; break the line")
            units.append(ln)
    return units
