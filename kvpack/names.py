"""Where ``kvpack build`` writes each context's pack: the output tree mirrors the input tree.

These rules are the one place that decides pack names, so every way of building (the local CLI, a distributed
build) writes the same files. They work on POSIX-style relative paths (``str``), never on local ``Path`` objects,
so sources may be local files or URLs alike::

    base = input_base(["docs/"], [True])                  # -> "docs"
    rel = relative_source(base, "docs/a/notes.txt")       # -> "a/notes.txt"
    pack_names([("a/notes.txt", None), ("b/notes.txt", None), ("data.jsonl", "q1")])
    # -> ["a/notes", "b/notes", "data/q1"]        (+ PACK_SUFFIX = ".kvpack" gives the file)

* A ``.txt``/``.md`` file ``dir/name.ext`` becomes ``dir/name``; a ``.jsonl`` file's line with id ``ID`` becomes
  ``dir/<jsonl stem>/ID`` (its line number when the line has no id).
* Unicode is kept (``résumé.txt`` -> ``résumé``, ``文档.txt`` -> ``文档``); only what common file systems
  refuse is replaced by ``_``: the characters ``< > : " / \\ | ? *``, control characters, unpaired surrogates (the
  bytes of a file name that is not UTF-8, as Python decodes them), trailing dots and spaces, a leading dot (a pack
  is never a hidden file, which ``kvpack ls`` would skip), and Windows' reserved device names (``CON``, ``NUL``,
  ``COM1``, ...). Paths here are POSIX (``kvpack.inputs`` turns a local Windows path into one first), so a backslash
  is a character of a name (replaced by ``_``), never a folder separator. A component longer than 200 UTF-8 bytes is
  cut and given an 8-hex-digit hash of the whole name.
* No two contexts get one pack: names are compared case-insensitively after Unicode NFC normalisation (so packs can
  sit side by side on macOS and Windows); within a clashing group the first context (in input order) keeps the name
  and the others get ``-2``, ``-3``, ... (skipping names already taken). ``kvpack.inputs`` names the contexts
  that can be built before those that cannot, so a failed one never takes a good one's name.
* A context too long for the model may be split into parts ``NAME.part-001``, ``NAME.part-002``, ...
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import unicodedata
from typing import Iterable, Sequence

__all__ = ["PACK_SUFFIX", "safe_component", "input_base", "relative_source", "pack_names", "part_name",
           "name_key"]

#: Suffix of a pack file.
PACK_SUFFIX = ".kvpack"

_REFUSED = re.compile('[<>:"/\\\\|?*\x00-\x1f\x7f\ud800-\udfff]')
_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
_MAX_BYTES = 200


def safe_component(name: str) -> str:
    """``name`` as one path component every common file system accepts (see the module docstring); never empty."""
    out = _REFUSED.sub("_", name).rstrip(". ")
    if out in ("", ".", ".."):
        out = "_"
    if out.startswith("."):  # a hidden file: kvpack ls and folder walks skip those
        out = "_" + out[1:]
    if out.split(".")[0].upper() in _RESERVED:
        out = "_" + out
    if len(out.encode("utf-8")) > _MAX_BYTES:
        digest = hashlib.sha256(out.encode("utf-8")).hexdigest()[:8]
        cut = out.encode("utf-8")[: _MAX_BYTES - 9].decode("utf-8", errors="ignore")
        out = f"{cut}-{digest}"
    return out


def input_base(inputs: Sequence[str], is_folder: Sequence[bool]) -> str:
    """The folder the output tree mirrors: the input itself for one folder input, else the deepest common parent
    of the inputs (a folder input counts by its parent, so ``docs/a docs/b`` mirror as ``a/...`` and ``b/...``).

    ``inputs`` are POSIX-style paths or URL paths, as given; ``is_folder[i]`` says whether input ``i`` is a folder.
    """
    paths = [posixpath.normpath(p) for p in inputs]
    if len(paths) == 1 and is_folder[0]:
        return paths[0]
    parents = [posixpath.dirname(p) for p in paths]
    absolute = {posixpath.isabs(p) for p in parents}
    if len(absolute) > 1:
        return "/"
    return posixpath.commonpath(parents) if any(parents) else ""


def relative_source(base: str, path: str) -> str:
    """``path`` relative to ``base`` as a POSIX path (``a/notes.txt``); both as ``input_base`` takes them."""
    base = posixpath.normpath(base) if base else "."
    rel = posixpath.relpath(posixpath.normpath(path), base)
    return rel if not rel.startswith("../") else posixpath.basename(path)


def _natural(source: str, ident: str | None) -> str:
    """The pack name (no suffix) of a whole file ``source`` (``ident`` None) or of a jsonl line with ``ident``."""
    folder, file = posixpath.split(source)
    stem = file.rsplit(".", 1)[0] if "." in file.lstrip(".") else file
    parts = [safe_component(p) for p in folder.split("/") if p and p != "."]
    parts.append(safe_component(stem))
    if ident is not None:
        parts.append(safe_component(ident))
    return "/".join(parts)


def name_key(name: str) -> str:
    """The form two names are compared in (NFC, case-folded): equal keys would be one file on some system."""
    return unicodedata.normalize("NFC", name).casefold()


def pack_names(items: Iterable[tuple[str, str | None]]) -> list[str]:
    """Unique pack names (relative POSIX paths without ``PACK_SUFFIX``), one per ``(source, ident)`` item.

    Args:
        items: ``(relative source path, ident)``: ``ident`` is ``None`` for a whole ``.txt``/``.md`` file, or a
            jsonl line's id (or its line number as a string).

    Returns:
        Names in the order of ``items``; no two equal under ``name_key``.
    """
    natural = [_natural(s, i) for s, i in items]
    taken = {name_key(n) for n in natural}
    seen: set[str] = set()
    out = []
    for name in natural:
        key = name_key(name)
        if key in seen:
            k = 2
            while name_key(f"{name}-{k}") in taken:
                k += 1
            name = f"{name}-{k}"
            key = name_key(name)
            taken.add(key)
        seen.add(key)
        out.append(name)
    return out


def part_name(name: str, part: int) -> str:
    """Name of part ``part`` (1-based) of a split context: ``NAME.part-001``."""
    return f"{name}.part-{part:03d}"
