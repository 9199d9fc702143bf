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
import tempfile
from pathlib import Path
from typing import Any, Iterable

__all__ = ["MANIFEST_NAME", "STATUSES", "FIELDS", "read_manifest", "parse_manifest", "ManifestWriter"]

#: File name of the manifest inside ``--out``.
MANIFEST_NAME = "kvpack-manifest.jsonl"
#: What a build did with a context.
STATUSES = ("built", "replaced", "up_to_date", "failed")
#: Fields of every record, in the order they are written.
FIELDS = ("pack", "source", "id", "line", "part", "parts", "status", "error", "tokens", "entries_kept", "bytes",
          "source_sha256", "settings", "model", "weights_sha256", "kind", "time")


def parse_manifest(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The last valid record of each pack in manifest ``lines``, keyed by ``pack`` (invalid lines skipped)."""
    records: dict[str, dict[str, Any]] = {}
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("pack"), str) and obj.get("status") in STATUSES:
            records.pop(obj["pack"], None)  # keep file order = order of last update
            records[obj["pack"]] = obj
    return records


def read_manifest(out_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``parse_manifest`` of ``out_dir``'s manifest; ``{}`` when there is none or it cannot be read."""
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

    Raises:
        OSError: the manifest cannot be opened for appending (``kvpack.build`` checks ``--out`` first).
    """

    def __init__(self, out_dir: str | os.PathLike, previous: dict[str, dict[str, Any]] | None = None):
        self.path = Path(out_dir) / MANIFEST_NAME
        self.records: dict[str, dict[str, Any]] = dict(previous or {})
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (its ``FIELDS``, missing ones as ``null``) and flush it to the file."""
        rec = {k: record.get(k) for k in FIELDS}
        self.records.pop(rec["pack"], None)
        self.records[rec["pack"]] = rec
        self._file.write(json.dumps(rec, ensure_ascii=False, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Rewrite the manifest atomically with the last record of each pack (temp file + rename)."""
        if self._file.closed:
            return
        self._file.close()
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for rec in self.records.values():
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def __enter__(self) -> "ManifestWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
