"""What ``kvpack ls``, ``info --json`` and ``verify --json`` report about pack files, as plain dicts.

    rows = list_packs("packs/")          # one dict per .kvpack under the folder, sorted by path
    describe_pack("packs/a.kvpack")      # the header's facts (no tensor is read)
    verify_report("packs/a.kvpack")      # {"file", "ok", "error", ...}: every checksum checked
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import constants as C
from .errors import InputError, KvpackError
from . import storage
from .fileformat import PackHeader, load_pack_and_header, read_header, read_index_arrays, verify
from .manifest import read_manifest
from .methods.params import PARAMS, command_line_options
from .terminal import pairs, printable, table

__all__ = ["describe_pack", "list_packs", "pack_files", "verify_report", "info_text", "method_label", "build_flags"]


def _changed(method: Any, params: Any, recorded: bool = False) -> list[tuple[str, Any]] | None:
    """``[(parameter, value)]`` of a pack's method parameters that differ from the method's defaults, sorted by name,
    ``chunk_size`` left out (the prefill chunk, ``--chunk-size``, a build setting rather than a method option), as
    are parameters the others make inert (``MethodParams.inert``: ``am``'s cap under an uncapped split), and
    values that are not printable scalars dropped; ``None`` for a method this kvpack does not know or parameters that
    are not a dict (header values are untrusted). With ``recorded``, a parameter the pack does not record counts as
    what packs from before it were built with (``MethodParams.absent_means``), as ``kvpack build`` reads it. Raises
    nothing."""
    if not isinstance(method, str) or method not in PARAMS or not isinstance(params, dict):
        return None
    if recorded:
        params = {**{k: v for k, v in PARAMS[method].absent_means.items() if k not in params}, **params}
    defaults = PARAMS[method].defaults()
    inert = PARAMS[method].inert({**defaults, **params})
    changed = []
    for k in sorted(k for k in params if isinstance(k, str)):
        v = params[k]
        if k == "chunk_size" or k in inert or not isinstance(v, (str, int, float, bool)) or not k.isprintable():
            continue
        if k in defaults and type(defaults[k]) is type(v) and defaults[k] == v:
            continue  # the default (compared with its type: on_policy=0 is not on_policy=False)
        if _text(v).isprintable():  # no control characters reach a terminal
            changed.append((k, v))
    return changed


def _effective(method: Any, params: dict) -> tuple[dict, list[str]]:
    """``(shown, unused)``: a pack's recorded method parameters less those its other parameters make inert
    (``MethodParams.inert``, read as ``kvpack build`` reads the pack), and the names of those. Raises nothing."""
    if not isinstance(method, str) or method not in PARAMS or not isinstance(params, dict):
        return params, []
    cls = PARAMS[method]
    inert = cls.inert({**cls.recorded_defaults(), **params})
    return {k: v for k, v in params.items() if k not in inert}, [k for k in params if k in inert]


def method_label(method: Any, params: Any) -> str:
    """A pack's method as ``--methods`` specs write it: the name, then the parameters that differ from the method's
    defaults in brackets (``"am[reference=both]"``, ``"kvzip"``); ``chunk_size`` is left out (the prefill chunk,
    ``--chunk-size``, a build setting rather than a method option). Header values are untrusted: a method this
    kvpack does not know, or parameters that are not a dict of scalars, give the bare name (``"?"`` for no name).
    Raises nothing."""
    if not isinstance(method, str) or not method:
        return "?"
    changed = _changed(method, params)
    if not changed:
        return method
    return f"{method}[{';'.join(f'{k}={_text(v)}' for k, v in changed)}]"


def build_flags(method: Any, params: Any) -> str | None:
    """A pack's method as ``kvpack build`` options: ``--method NAME`` and each parameter that differs from the
    method's default as its flag (``--select kvzip``, ``--no-ridge-search``), so the same build can be run again;
    a changed parameter that has no flag (an API-only one such as ``held_out_check``) follows as the ``NAME[...]``
    spec writes it (``kvpack bench --methods``, ``kvpack.compress(..., NAME=value)``). A parameter the pack does not
    record is read as ``kvpack build`` reads it (``MethodParams.recorded_defaults``: a pack from before AM's defaults
    changed shows the earlier ones). ``None`` where ``method_label`` gives the bare name for want of a known method
    or a dict of parameters. Raises nothing."""
    changed = _changed(method, params, recorded=True)
    if changed is None:
        return None
    flags = {o.param: o for o in command_line_options() if any(use[0] == method for use in o.uses)}
    words, api = [f"--method {method}"], []
    for k, v in changed:
        o = flags.get(k)
        if o is None:
            api.append(f"{k}={_text(v)}")
        elif o.type is bool:
            words.append(o.flag if v else "--no-" + o.flag[2:])
        else:
            words.append(f"{o.flag} {_text(v)}")
    return " ".join(words) + (f" (no flag: {';'.join(api)})" if api else "")


def _text(v: Any) -> str:
    """A parameter value as specs and flags write it (booleans lower-case)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def describe_pack(path: str | os.PathLike, header: PackHeader | None = None, *,
                  storage_options: dict | None = None) -> dict[str, Any]:
    """The facts of a pack's (validated) header: ``file``, ``format_version``, ``bytes`` (file size), ``checksum``,
    ``method``, ``method_params``, ``ratio`` (fraction of KV entries kept), ``tokens`` (cached sequence),
    ``sink_tokens``, ``entries_kept`` (all layers and KV heads), ``quant`` (type), ``group_size``, ``zstd_level``,
    ``source`` (name, sha256, chars), ``model`` (fingerprint name), ``architecture``, ``tokenizer_sha256`` and
    ``weights_sha256`` (the fingerprint's digests; ``None`` unless strings), ``dtype`` (the model's compute dtype at
    build), ``kv_dtype`` (the stored keys' and values' dtype),
    ``kvpack_version``, ``layer_budgets`` (context entries kept per compressed layer, when recorded as a list of
    integers, else ``None``), ``bytes_by_section`` (``PackHeader.bytes_by_section``: stored bytes of the header and
    each tensor, adding up to ``bytes``), ``build_options`` (the method's non-default parameters as ``kvpack build`` flags,
    ``build_flags``; ``None`` for a method this kvpack does not know), ``unused_params`` (the recorded parameters the
    others make inert, ``MethodParams.inert``: they change nothing in the pack) and ``fit`` (Attention Matching's fit
    statistics, ``fit_summary``; ``None`` for other methods).

    Raises:
        PackFormatError subclasses, InputError: as ``kvpack.fileformat.read_header``.
    """
    header = header if header is not None else read_header(path, storage_options=storage_options)
    meta = header.metadata
    fp = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), dict) else {}
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    stats = meta.get("stats") if isinstance(meta.get("stats"), dict) else {}
    budgets = stats.get("layer_budgets")
    return {
        "file": str(path), "format_version": header.format_version, "bytes": header.file_bytes,
        "checksum": C.CHECKSUM_NAMES.get(header.checksum, header.checksum), "method": meta.get("method"),
        "method_params": meta.get("method_params"), "ratio": meta.get("ratio"), "tokens": header.tokens,
        "sink_tokens": meta.get("sink_tokens"), "entries_kept": header.entries, "quant": header.quant_type,
        "group_size": header.group_size, "zstd_level": header.zstd_level,
        "source": {k: source.get(k) for k in ("name", "sha256", "chars")}, "model": fp.get("name"),
        "architecture": fp.get("architecture"),
        **{k: fp.get(k) if isinstance(fp.get(k), str) else None for k in ("tokenizer_sha256", "weights_sha256")},
        "dtype": fp.get("dtype"), "kv_dtype": header.kv_dtype_name,
        "kvpack_version": meta.get("kvpack_version"),
        "layer_budgets": budgets if isinstance(budgets, list) and all(type(b) is int for b in budgets) else None,
        "bytes_by_section": header.bytes_by_section(),
        "build_options": build_flags(meta.get("method"), meta.get("method_params")),
        "unused_params": _effective(meta.get("method"), meta.get("method_params"))[1],
        "fit": fit_summary(stats),
    }


#: Most compressed layers and rule or choice names ``fit_summary`` reports (a hostile header may record more).
MAX_FIT_LAYERS, MAX_FIT_NAMES = 4096, 16


def fit_summary(stats) -> dict[str, Any] | None:
    """Attention Matching's fit statistics as a pack's metadata records them (``stats["fit"]``,
    ``kvpack.methods.am``), checked field by field, for ``info --json``: ``held_out``, ``queries`` (per KV head),
    ``heads_unfitted``, ``heads_rejected`` (ints or ``None``), ``relative_error``, ``selection_error``,
    ``mass_error`` (per compressed layer, finite floats or ``None``; at most ``MAX_FIT_LAYERS``),
    ``heads_rejected_by`` and ``ridge_search`` (``{name: count}``, at most ``MAX_FIT_NAMES``; ``None`` when not
    recorded: ``ridge_search`` without ``--ridge-search``, ``heads_rejected_by`` in packs from before it).
    ``None`` when the pack records no fit. A field of the wrong type reads as ``None``: the header may
    come from anywhere. Raises nothing."""
    fit = stats.get("fit") if isinstance(stats, dict) else None
    if not isinstance(fit, dict) or not isinstance(fit.get("relative_error"), list):
        return None

    def count(x):
        return x if isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63 else None

    def number(x):
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            return None
        try:
            x = float(x)
        except OverflowError:  # an integer beyond the float range
            return None
        return x if abs(x) < float("inf") else None  # also NaN

    def per_layer(key):
        xs = fit.get(key)
        return [number(x) for x in xs[:MAX_FIT_LAYERS]] if isinstance(xs, list) else None

    def counts(key):
        d = fit.get(key)
        if not isinstance(d, dict):
            return None
        return {str(k)[:64]: count(v) for k, v in list(d.items())[:MAX_FIT_NAMES]}

    return {**{k: count(fit.get(k)) for k in ("held_out", "queries", "heads_unfitted", "heads_rejected")},
            **{k: per_layer(k) for k in ("relative_error", "selection_error", "mass_error")},
            "heads_rejected_by": counts("heads_rejected_by"), "ridge_search": counts("ridge_search")}


def list_packs(folder: str | os.PathLike, *, storage_options: dict | None = None) -> list[dict[str, Any]]:
    """``describe_pack`` of every ``.kvpack`` file under ``folder`` (a local folder or a URL, recursively, sorted by
    path; hidden entries skipped; only headers are read, by range for a URL), with ``pack``
    (the path relative to ``folder``), ``source`` taken from the folder's build manifest when it records the pack
    (else the pack's own source name), and ``error`` (``None``, or why the header cannot be read; the other fields
    are then absent).

    Raises:
        InputError: ``folder`` does not exist or is a file.
    """
    root = storage.as_path(folder)
    if not storage.is_dir(root, storage_options):
        what = "is a file, not a folder" if storage.is_file(root, storage_options) else "no such folder"
        raise InputError(f"{root}: {what}; pass the folder a build wrote (its --out)")
    records = read_manifest(root, storage_options=storage_options)
    rows = []
    for path, parts in storage.walk_files(root, (C.FILE_SUFFIX,), storage_options):
        rel = "/".join(parts)
        try:
            row = describe_pack(path, storage_options=storage_options)
        except KvpackError as exc:
            rows.append({"pack": rel, "file": str(path), "error": str(exc)})
            continue
        record = records.get(rel)
        if isinstance(record, dict) and isinstance(record.get("source"), str):
            row["source"] = {**row["source"], "name": record["source"] + (f":{record['line']}" if record.get("line")
                                                                          else "")}
        rows.append({"pack": rel, **row, "error": None})
    return rows


def pack_files(paths, *, storage_options: dict | None = None) -> list[str]:
    """``paths`` (files, folders, URLs) as the pack files they name, in order: a file as given, a folder as the
    ``.kvpack`` files under it (recursively, sorted by path, hidden entries skipped, as ``list_packs``).

    Raises:
        InputError: a folder holds no ``.kvpack`` file.
    """
    out = []
    for path in paths:
        if not storage.is_dir(path, storage_options):
            out.append(str(path))
            continue
        found = [str(p) for p, _ in storage.walk_files(storage.as_path(path), (C.FILE_SUFFIX,), storage_options)]
        if not found:
            raise InputError(f"{path}: no {C.FILE_SUFFIX} file in this folder (searched recursively)")
        out += found
    return out


def verify_report(path: str | os.PathLike, *, storage_options: dict | None = None, keep_pack: bool = False
                  ) -> dict[str, Any]:
    """Check every length, offset and checksum of ``path`` (a path or a URL): ``{"file", "ok", "error",
    "format_version", "bytes", "checksum"}`` (the last three ``None`` when the file is bad). With ``keep_pack``
    the whole file is loaded instead (one read: everything ``verify`` checks, and the tensors), and the report also
    holds the loaded ``"pack"`` (``None`` when the file is bad) and its ``"header"``. Never raises for a bad file."""
    pack = header = None
    try:
        if keep_pack:
            header, pack = load_pack_and_header(path, storage_options=storage_options)
        else:
            header = verify(path, storage_options=storage_options)
    except KvpackError as exc:
        report = {"file": str(path), "ok": False, "error": str(exc), "format_version": None, "bytes": None,
                  "checksum": None}
    else:
        report = {"file": str(path), "ok": True, "error": None, "format_version": header.format_version,
                  "bytes": header.file_bytes, "checksum": C.CHECKSUM_NAMES.get(header.checksum, header.checksum)}
    return {**report, "header": header, "pack": pack} if keep_pack else report


def info_text(file: str | os.PathLike, *, storage_options: dict | None = None) -> str:
    """The text ``kvpack info`` prints for ``file``: header facts, entries kept per layer, quantization errors,
    bytes by section. Reads the header and the index tensors only (``kvpack.fileformat.read_index_arrays``: memory
    independent of the KV's size, no torch; ``kvpack verify`` checks the rest). Raises as ``read_index_arrays``."""
    out = []
    header, pack = read_index_arrays(file, storage_options=storage_options)
    meta = header.metadata
    fp = meta.get("fingerprint") or {}
    stats = meta.get("stats") or {}
    source = meta.get("source") or {}
    params = meta.get("method_params") or {}
    shown, unused = _effective(meta.get("method"), params)
    rope = fp.get("rope") or {}
    sliding = fp.get("sliding_layers") or []
    rows = [
        ("file", str(file)),
        ("format", f"kvpack {header.format_version}, {header.file_bytes:,} bytes, tensor checksums "
                   f"{C.CHECKSUM_NAMES[header.checksum]}"),
        ("kvpack version", str(meta.get("kvpack_version", "?"))),
        ("model", str(fp.get("name") or "?")),
        ("  architecture", f"{fp.get('architecture', '?')} ({fp.get('model_type', '?')})"),
        ("  layers", str(fp.get("num_layers", "?"))),
        ("  heads", f"{fp.get('num_heads', '?')} query, {fp.get('num_kv_heads', '?')} KV"),
        ("  head dim", str(fp.get("head_dim", "?"))),
        ("  RoPE", ", ".join(f"{k}={v}" for k, v in sorted(rope.items())) or "-"),
        ("  sliding layers", (f"{', '.join(map(str, sliding))} (window {fp.get('sliding_window')}, kept intact)"
                              if sliding else "none")),
        ("  dtype", f"computed in {fp.get('dtype', '?')}, KV stored in {header.kv_dtype_name or '?'}"),
        ("  tokenizer", f"sha256 {_short(fp.get('tokenizer_sha256'))}"),
        ("  weights", f"sha256 {_short(fp.get('weights_sha256'))}"),
        ("method", f"{meta.get('method', '?')}"
                   + (f" ({', '.join(f'{k}={v}' for k, v in sorted(shown.items()))})" if shown else "")),
        *([("  unused here", ", ".join(sorted(unused)))] if unused else []),
        *([("  as build options", flags)] if (flags := build_flags(meta.get("method"), params)) else []),
        ("ratio", str(meta.get("ratio", "?"))),
        ("quantization", _quantization(header, pack)),
        ("zstd", (f"level {header.zstd_level}: {header.file_bytes:,} bytes on disk, "
                  f"{header.header_bytes + header.raw_bytes:,} decoded") if header.zstd_level else "off"),
        ("tokens", f"{pack.original_tokens:,} ({pack.sink_tokens:,} sink + "
                   f"{pack.original_tokens - pack.sink_tokens:,} context)"),
        ("entries kept", _kept(pack, stats)),
        *_budget_rows(stats),
        *_head_rows(meta, pack),
        ("source", f"{source.get('name', '?')} (sha256 {_short(source.get('sha256'))}, "
                   f"{source.get('chars', '?'):,} chars)" if isinstance(source.get("chars"), int)
                   else f"{source.get('name', '?')} (sha256 {_short(source.get('sha256'))})"),
    ]
    out.append(pairs(rows))

    kinds = meta.get("layer_kinds") or []
    out.append("\nentries kept per layer (per KV head: min / mean / max)")
    layer_rows = []
    for l, layer in enumerate(pack.layers):
        hl = layer.head_lengths.astype(np.float64)
        layer_rows.append((str(l), kinds[l] if l < len(kinds) else "?", f"{layer.num_entries:,}",
                           f"{int(hl.min()):,}", f"{float(hl.mean()):,.1f}", f"{int(hl.max()):,}"))
    out.append(table(("layer", "kind", "entries", "min", "mean", "max"), layer_rows, right=(0, 2, 3, 4, 5),
                      indent="  "))
    errors = stats.get("quant_error")
    if isinstance(errors, list) and errors and all(isinstance(e, dict) for e in errors):
        out.append("\nquantization error per layer (|dequantized - original| over all entries, KV units)")
        err_rows = [(str(e.get("layer", "?")), *(_num(e.get(k)) for k in (
            "key_max_abs", "key_mean_abs", "value_max_abs", "value_mean_abs")),
            _num(100 * e["quantized_fraction"]) + "%" if isinstance(e.get("quantized_fraction"), (int, float))
            else "?") for e in errors]
        out.append(table(("layer", "key max", "key mean", "value max", "value mean", "quantized"), err_rows,
                          right=(0, 1, 2, 3, 4, 5), indent="  "))
    out += _fit_lines(stats.get("fit"), [l for l, k in enumerate(kinds) if k == "compressed"])

    out.append("\nbytes by section")
    sections = header.bytes_by_section()
    sec_rows = [(name, f"{n:,}", f"{100 * n / max(1, header.file_bytes):.1f}%") for name, n in sections.items()]
    sec_rows.append(("total", f"{header.file_bytes:,}", "100.0%"))
    out.append(table(("section", "bytes", "share"), sec_rows, right=(1, 2), indent="  "))
    return "\n".join(out)  # header values reach it only through pairs, table and printable


def _fit_lines(fit, compressed: list[int]) -> list[str]:
    """Attention Matching's fit per compressed layer (``kvpack.methods.am``), when the pack records one."""
    if not isinstance(fit, dict) or not isinstance(fit.get("relative_error"), list):
        return []
    n = {k: printable(fit.get(k, "?")) for k in ("held_out", "queries", "heads_unfitted", "heads_rejected")}
    by = fit.get("heads_rejected_by")
    rules = ""
    if isinstance(by, dict) and by:  # which rule rejected them (packs from before it was recorded have none)
        rules = " (" + ", ".join(f"{printable(k)}: {printable(v)}" for k, v in list(by.items())[:8]) + ")"
    head = (f"\nattention matching fit (relative error of the head outputs on {n['held_out']} held-out queries per "
            f"KV head; {n['queries']} fit queries per KV head; heads left as selected: {n['heads_unfitted']} unfitted, "
            f"{n['heads_rejected']} rejected{rules})")
    cols = [fit.get(k) if isinstance(fit.get(k), list) else [] for k in ("relative_error", "selection_error",
                                                                          "mass_error")]
    rows = [(str(compressed[i]) if i < len(compressed) else "?",
             *(_num(c[i]) if i < len(c) and c[i] is not None else "-" for c in cols)) for i in range(len(cols[0]))]
    out = [head, table(("layer", "fit error", "selection alone", "mass error"), rows, right=(0, 1, 2, 3),
                       indent="  ")]
    chosen = fit.get("ridge_search")
    if isinstance(chosen, dict):  # --ridge-search: each head's validated choice (am_validate)
        counts = ", ".join(f"{printable(k)} {printable(v)}" for k, v in list(chosen.items())[:16])
        out.append(f"  heads by validated choice (--ridge-search): {counts or 'none'}")
    return out


def _num(x) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return "?"
    try:
        return f"{x:.4g}"
    except OverflowError:  # an integer beyond the float range (a hostile header)
        return "?"


def _quantization(header, pack) -> str:
    """The ``quantization`` row of ``kvpack info``: type, group size, layout (compact: the key code widths, counted
    over ``pack``'s numpy ``key_bits``, ``read_index_arrays``)."""
    if not header.group_size:
        return "none"
    head = f"{header.quant_type}, group size {header.group_size}"
    widths = np.concatenate([l.quant.key_bits.reshape(-1) for l in pack.layers if l.quant is not None])
    counts = np.bincount(widths.astype(np.int64), minlength=C.MAX_KEY_BITS + 1)
    used = [(b, int(n)) for b, n in enumerate(counts.tolist()) if n]
    widths = "/".join(str(b) for b, _ in used)
    channels = "/".join(str(n) for _, n in used)
    return (f"{head}, compact layout (key code widths {widths} bits on {channels} channels of all heads; 8-bit "
            "group parameters; sink rows in full precision)")


def _kept(pack, stats: dict) -> str:
    total = f"{pack.kept_entries():,} stored"
    kept, entries = stats.get("context_entries_kept"), stats.get("context_entries")
    if isinstance(kept, int) and isinstance(entries, int) and entries:
        try:
            share = f"{100 * (kept / entries):.1f}%"
        except OverflowError:  # integers too large for a float (a hostile header)
            share = "?"
        return f"{total}; context: {kept:,} of {entries:,} ({share}), sink always kept"
    return total


def _budget_rows(stats: dict) -> list[tuple[str, str]]:
    """``layer budgets`` (context entries kept per compressed layer) and D2O's ``merged`` line, when recorded."""
    rows = []
    budgets = stats.get("layer_budgets")
    if isinstance(budgets, list) and budgets:
        rows.append(("layer budgets", f"{', '.join(f'{b:,}' for b in budgets)} context entries "
                                      "(per compressed layer, sink not counted)"))
    merge = stats.get("merge")
    if isinstance(merge, dict):
        rows.append(("merged", f"{merge.get('merged', '?'):,} evicted entries merged into kept ones, "
                               f"{merge.get('dropped', '?'):,} dropped"
                     if all(isinstance(merge.get(k), int) for k in ("merged", "dropped")) else str(merge)))
    return rows


def _head_rows(meta: dict, pack) -> list[tuple[str, str]]:
    """kvzip-head: ``heads kept`` (how many (layer, KV head) pairs hold the whole context) and one row per
    compressed layer listing them; a head is kept when it holds every context token."""
    kinds = meta.get("layer_kinds") or []
    if meta.get("method") != "kvzip-head" or len(kinds) != len(pack.layers):
        return []
    context = pack.original_tokens - pack.sink_tokens
    rows, kept_n, total = [], 0, 0
    for l, layer in enumerate(pack.layers):
        if kinds[l] != "compressed":
            continue
        kept = [h for h, n in enumerate(layer.head_lengths.tolist()) if n - pack.sink_tokens == context]
        kept_n, total = kept_n + len(kept), total + len(layer.head_lengths)
        rows.append((f"  layer {l}", ", ".join(map(str, kept)) if kept else "none"))
    return [("heads kept", f"{kept_n} of {total} (layer, KV head) pairs hold the whole context; the others the "
                           "sink (and the window, if any)"), *rows]


def _short(digest) -> str:
    return f"{digest[:12]}..." if isinstance(digest, str) and len(digest) > 12 else str(digest or "-")
