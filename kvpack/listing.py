"""What ``kvpack ls``, ``info --json`` and ``verify --json`` report about pack files, as plain dicts.

    rows = list_packs("packs/")          # one dict per .kvpack under the folder, sorted by path
    describe_pack("packs/a.kvpack")      # the header's facts (no tensor is read)
    verify_report("packs/a.kvpack")      # {"file", "ok", "error", ...}: every checksum checked
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import constants as C
from .errors import InputError, KvpackError
from .fileformat import PackHeader, read_header, verify
from .manifest import read_manifest

__all__ = ["describe_pack", "list_packs", "verify_report"]


def describe_pack(path: str | os.PathLike, header: PackHeader | None = None) -> dict[str, Any]:
    """The facts of a pack's (validated) header: ``file``, ``format_version``, ``bytes`` (file size), ``checksum``,
    ``method``, ``method_params``, ``ratio`` (fraction of KV entries kept), ``tokens`` (cached sequence),
    ``sink_tokens``, ``entries_kept`` (all layers and KV heads), ``quant`` (type), ``group_size``, ``zstd_level``,
    ``source`` (name, sha256, chars), ``model`` (fingerprint name), ``architecture``, ``dtype`` (KV),
    ``kvpack_version``.

    Raises:
        PackFormatError subclasses, InputError: as ``kvpack.fileformat.read_header``.
    """
    header = header if header is not None else read_header(path)
    meta = header.metadata
    fp = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), dict) else {}
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    return {
        "file": str(path), "format_version": header.format_version, "bytes": header.file_bytes,
        "checksum": C.CHECKSUM_NAMES.get(header.checksum, header.checksum), "method": meta.get("method"),
        "method_params": meta.get("method_params"), "ratio": meta.get("ratio"), "tokens": header.tokens,
        "sink_tokens": meta.get("sink_tokens"), "entries_kept": header.entries, "quant": header.quant_type,
        "group_size": header.group_size, "zstd_level": header.zstd_level,
        "source": {k: source.get(k) for k in ("name", "sha256", "chars")}, "model": fp.get("name"),
        "architecture": fp.get("architecture"), "dtype": fp.get("dtype"), "kvpack_version": meta.get("kvpack_version"),
    }


def list_packs(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """``describe_pack`` of every ``.kvpack`` file under ``folder`` (recursively, sorted by path), with ``pack``
    (the path relative to ``folder``), ``source`` taken from the folder's build manifest when it records the pack
    (else the pack's own source name), and ``error`` (``None``, or why the header cannot be read; the other fields
    are then absent).

    Raises:
        InputError: ``folder`` is not a folder.
    """
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"{root}: not a folder; pass the folder a build wrote (its --out)")
    records = read_manifest(root)
    rows = []
    for path in sorted(root.rglob(f"*{C.FILE_SUFFIX}"), key=lambda p: p.relative_to(root).parts):
        rel = path.relative_to(root).as_posix()
        try:
            row = describe_pack(path)
        except KvpackError as exc:
            rows.append({"pack": rel, "file": str(path), "error": str(exc)})
            continue
        record = records.get(rel)
        if isinstance(record, dict) and isinstance(record.get("source"), str):
            row["source"] = {**row["source"], "name": record["source"] + (f":{record['line']}" if record.get("line")
                                                                          else "")}
        rows.append({"pack": rel, **row, "error": None})
    return rows


def verify_report(path: str | os.PathLike) -> dict[str, Any]:
    """Check every length, offset and checksum of ``path``: ``{"file", "ok", "error", "format_version", "bytes",
    "checksum"}`` (the last three ``None`` when the file is bad). Never raises for a bad file."""
    try:
        header = verify(path)
    except KvpackError as exc:
        return {"file": str(path), "ok": False, "error": str(exc), "format_version": None, "bytes": None,
                "checksum": None}
    return {"file": str(path), "ok": True, "error": None, "format_version": header.format_version,
            "bytes": header.file_bytes, "checksum": C.CHECKSUM_NAMES.get(header.checksum, header.checksum)}
