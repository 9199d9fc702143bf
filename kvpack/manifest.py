"""The build manifest: ``kvpack-manifest.jsonl`` in the output folder, one JSON object per line and pack.

Each record says what became of one context::

    {"pack": "a/notes.kvpack", "source": "a/notes.txt", "id": null, "line": null, "part": null, "parts": null,
     "status": "built", "error": null, "tokens": 812, "entries_kept": 3120, "bytes": 40213,
     "source_sha256": "...", "settings": {...}, "model": {...}, "weights_sha256": "...", "kind": null,
     "time": 1764580000.0}

``status`` is one of ``STATUSES``; ``error`` the reason a ``failed`` context was not built, and ``kind``
``"too_long"`` when that reason is its length (the same text fails again with the same model and settings). During a build each
record is appended (and flushed) as its pack is written, so an interrupted run leaves what it did; at the end the
file is compacted (atomically rewritten with the last record of each pack). Readers take the last valid record of
each ``pack`` and ignore lines that are not JSON objects with a string ``pack`` (a torn last line, a hostile
edit): the manifest only says what may be up to date, and the pack's own verified header decides.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

from . import storage
from .container import has_lone_surrogate
from .errors import KvpackError

__all__ = ["MANIFEST_NAME", "STATUSES", "FIELDS", "read_manifest", "parse_manifest", "ManifestWriter"]

#: File name of the manifest inside ``--out``.
MANIFEST_NAME = "kvpack-manifest.jsonl"
#: What a build did with a context.
STATUSES = ("built", "replaced", "up_to_date", "failed")
#: Seconds between rewrites of a remote manifest during a build.
REMOTE_FLUSH_SECONDS = 10.0
#: Fields of every record, in the order they are written.
FIELDS = ("pack", "source", "id", "line", "part", "parts", "status", "error", "tokens", "entries_kept", "bytes",
          "source_sha256", "settings", "model", "weights_sha256", "kind", "time")


def parse_manifest(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The last valid record of each pack in manifest ``lines``, keyed by ``pack`` (invalid lines skipped: not JSON,
    nested past the parser's limit, holding an unpaired surrogate, or not a record)."""
    records: dict[str, dict[str, Any]] = {}
    for line in lines:
        try:  # a hostile line nested past the parser's recursion limit is skipped like any invalid one
            obj = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if has_lone_surrogate(obj):  # text nothing can encode or print
            continue
        if isinstance(obj, dict) and isinstance(obj.get("pack"), str) and obj.get("status") in STATUSES:
            records.pop(obj["pack"], None)  # keep file order = order of last update
            records[obj["pack"]] = obj
    return records


def read_manifest(out_dir: str | os.PathLike, *, storage_options: dict | None = None) -> dict[str, dict[str, Any]]:
    """``parse_manifest`` of ``out_dir``'s manifest (a local folder or a URL); ``{}`` when there is none or it
    cannot be read."""
    if storage.is_url(out_dir):
        try:
            data = storage.read_bytes(storage.join(out_dir, MANIFEST_NAME), storage_options)
        except KvpackError:
            return {}
        return parse_manifest(data.decode("utf-8", errors="replace").splitlines())
    try:
        with open(Path(out_dir) / MANIFEST_NAME, encoding="utf-8", errors="replace") as f:
            return parse_manifest(f)
    except OSError:
        return {}


class ManifestWriter:
    """Appends records to ``out_dir``'s manifest as a build goes, and compacts it when closed.

    Args:
        out_dir: the output folder (must exist).
        previous: the records read at the start (``read_manifest``); records of packs this run does not touch
            are kept by ``close``.

    On a URL ``out_dir`` (object stores cannot append) the whole manifest is rewritten atomically
    (``kvpack.storage.write_atomic``) at most every ``REMOTE_FLUSH_SECONDS`` as records come, and when closed; an
    interrupted run may then lose the last records, which only costs the next run a look at those packs' headers
    after the model loads.

    Raises:
        OSError: the manifest cannot be opened for appending (``kvpack.build`` checks ``--out`` first).
        InputError: a remote manifest cannot be written.
    """

    def __init__(self, out_dir: str | os.PathLike, previous: dict[str, dict[str, Any]] | None = None, *,
                 storage_options: dict | None = None):
        self.remote = storage.is_url(out_dir)
        self.path = storage.join(out_dir, MANIFEST_NAME)
        self.records: dict[str, dict[str, Any]] = dict(previous or {})
        self._options, self._flushed, self._closed = storage_options, time.monotonic(), False
        self._file = None if self.remote else open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (its ``FIELDS``, missing ones as ``null``) and flush it to the file."""
        rec = {k: record.get(k) for k in FIELDS}
        self.records.pop(rec["pack"], None)
        self.records[rec["pack"]] = rec
        if self.remote:
            if time.monotonic() - self._flushed >= REMOTE_FLUSH_SECONDS:
                self._put()
            return
        self._file.write(json.dumps(rec, ensure_ascii=False, sort_keys=False) + "\n")
        self._file.flush()

    def _put(self) -> None:
        body = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in self.records.values())
        storage.write_atomic(self.path, body.encode("utf-8"), self._options)
        self._flushed = time.monotonic()

    def close(self) -> None:
        """Rewrite the manifest atomically with the last record of each pack (temp file + rename; one put)."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        self._put()

    def __enter__(self) -> "ManifestWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
