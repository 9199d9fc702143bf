"""``kvpack build`` as a library: find the contexts in files and folders, compress each into ``<name>.kvpack``.

    contexts = discover_contexts(["docs/"])                  # .txt, .md: one context each; .jsonl: one per line
    model, tok = kvpack.load_model()
    results = build(contexts, model, tok, out_dir=default_out_dir(["docs/"]), method="kvzip", ratio=0.3)

A context whose output file already holds a pack built from the same text, with the same method, parameters,
ratio, quantization and zstd level, by the same model (weights, tokenizer, architecture, KV dtype), is skipped; so
re-running a build after adding documents only compresses the new ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from . import constants as C
from .compress import DEFAULT_CHUNK_SIZE, DEFAULT_RATIO, compress
from .errors import InputError, KvpackError
from .container import remove_stale_temps
from .fileformat import PackHeader, check_storage_args, save, verify
from .fingerprint import check_fingerprint, model_fingerprint
from .layout import chat_layout
from .methods import get_method
from .model import model_spec
from .quant import check_quant_args

__all__ = [
    "SUFFIXES",
    "OUT_DIR_NAME",
    "Context",
    "BuildResult",
    "discover_contexts",
    "default_out_dir",
    "build",
    "check_pack",
    "check_compatible",
]

#: File suffixes ``discover_contexts`` reads; other files inside folders are skipped.
SUFFIXES = (".txt", ".md", ".jsonl")
#: Name of the default output folder (see ``default_out_dir``).
OUT_DIR_NAME = "packs"

#: Fingerprint fields that do not make an existing pack stale (``name`` is where the model was loaded from).
_IGNORED_FINGERPRINT_FIELDS = ("name",)
_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Context:
    """One document to compress.

    Attributes:
        name: output name; the pack is written to ``<out_dir>/<name>.kvpack``.
        text: the document's text.
        source: the file it came from.
        line: 1-based line number in a ``.jsonl`` file, ``None`` for ``.txt``/``.md``.
    """

    name: str
    text: str
    source: Path
    line: int | None = None

    @property
    def where(self) -> str:
        """``source`` or ``source:line``, for messages."""
        return f"{self.source}:{self.line}" if self.line is not None else str(self.source)

    @property
    def source_name(self) -> str:
        """What the pack records as its source: the file name (and ``:line`` for a jsonl line), no folders."""
        return f"{self.source.name}:{self.line}" if self.line is not None else self.source.name


@dataclass(frozen=True)
class BuildResult:
    """What ``build`` did for one context.

    Attributes:
        name: the context's name.
        path: the ``.kvpack`` file.
        tokens: length of the cached sequence in tokens (chat-template prefix + context).
        entries_kept: KV entries stored, over all layers and KV heads (attention-sink entries included).
        bytes_written: size of the ``.kvpack`` file in bytes (written by this run, or the existing file when
            skipped).
        seconds: wall time spent on this context (compressing and writing, or checking the existing file).
        skipped: ``True`` when an up-to-date file already existed and nothing was written.
    """

    name: str
    path: Path
    tokens: int
    entries_kept: int
    bytes_written: int
    seconds: float
    skipped: bool


# ---------------------------------------------------------------------------------------------------------------
# discovering contexts


def discover_contexts(inputs: Iterable[str | os.PathLike]) -> list[Context]:
    """Read the contexts in ``inputs`` (files or folders), in a deterministic order.

    Folders are walked recursively in sorted order; files and folders whose names start with ``.`` are ignored,
    as are files with a suffix other than ``.txt``, ``.md`` and ``.jsonl``. Inputs are taken in the order given;
    a file reached twice (named, and inside a named folder) is read once.

    * ``.txt``, ``.md``: the whole file (UTF-8) is one context named after the file stem (``notes.md`` -> ``notes``).
    * ``.jsonl``: one JSON object per non-blank line, with a string ``"text"`` and an optional ``"id"`` (string or
      integer); the context is named ``<stem>-<id>``, or ``<stem>-<line number>`` without an id.

    Characters other than letters, digits, ``.``, ``_`` and ``-`` in names are replaced by ``_``.

    Returns:
        The contexts, at least one.

    Raises:
        InputError: a path does not exist; an explicitly named file has an unsupported suffix; a file is not UTF-8
            or cannot be read; a jsonl line is not a JSON object with a string ``text`` (or has a bad ``id``); a
            text is empty; two contexts get the same output name (compared case-insensitively, so the packs
            can live side by side on any file system); no context was found at all.
    """
    inputs = list(inputs)
    if not inputs:
        raise InputError("no input given; pass one or more .txt, .md or .jsonl files or folders holding them")
    contexts: list[Context] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            for file in _walk(path):
                contexts.extend(_read_file(file))
        elif path.is_file():
            if path.suffix.lower() not in SUFFIXES:
                raise InputError(f"{path}: unsupported file type {path.suffix or '(no suffix)'!r}; kvpack build "
                                 f"reads {', '.join(SUFFIXES)} files (convert it to .txt, or pass a folder)")
            contexts.extend(_read_file(path))
        elif path.exists():
            raise InputError(f"{path}: not a regular file or folder; pass .txt, .md or .jsonl files or folders")
        else:
            raise InputError(f"{path}: no such file or folder; check the path")
    if not contexts:
        raise InputError(f"no .txt, .md or .jsonl files found in {', '.join(str(i) for i in inputs)}; "
                         "pass files or folders that hold some")
    seen: dict[str, Context] = {}
    unique, keys = [], set()
    for ctx in contexts:  # a file named twice (or a file and its folder) counts once
        key = (ctx.source.resolve(), ctx.line)
        if key not in keys:
            keys.add(key)
            unique.append(ctx)
    contexts = unique
    for ctx in contexts:
        other = seen.get(ctx.name.casefold())
        if other is not None:
            raise InputError(
                f"{other.where} and {ctx.where} would both be written to {ctx.name}.kvpack; rename one of the "
                "files (or give the jsonl lines distinct ids), or build them into different --out folders"
            )
        seen[ctx.name.casefold()] = ctx
    return contexts


def _walk(folder: Path) -> list[Path]:
    """Supported files under ``folder``, recursively, sorted by path; hidden entries skipped."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            if not f.startswith(".") and Path(f).suffix.lower() in SUFFIXES:
                found.append(Path(root) / f)
    return sorted(found, key=lambda p: p.relative_to(folder).parts)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not valid UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}; check the path and permissions") from None


def _safe_name(name: str) -> str:
    return _UNSAFE_NAME_CHARS.sub("_", name).strip(".") or "_"


def _read_file(path: Path) -> list[Context]:
    text = _read_text(path)
    stem = _safe_name(path.stem)
    if path.suffix.lower() != ".jsonl":
        if not text.strip():
            raise InputError(f"{path}: the file is empty; remove it or give it some text")
        return [Context(stem, text, path)]
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                             'JSON object like {"id": "doc1", "text": "..."}') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise InputError(f'{where}: no string "text" field; each line must be one JSON object like '
                             '{"id": "doc1", "text": "..."}')
        if not obj["text"].strip():
            raise InputError(f'{where}: the "text" field is empty; give it some text or remove the line')
        ident = obj.get("id")
        if ident is None:
            ident = number
        elif isinstance(ident, bool) or not isinstance(ident, (str, int)) or str(ident) == "":
            raise InputError(f'{where}: "id" must be a non-empty string or an integer, got {json.dumps(ident)}')
        out.append(Context(f"{stem}-{_safe_name(str(ident))}", obj["text"], path, number))
    if not out:
        raise InputError(f"{path}: no lines; remove the file or add lines like " '{"id": "doc1", "text": "..."}')
    return out


def default_out_dir(inputs: Iterable[str | os.PathLike]) -> Path:
    """The default output folder: ``packs/`` beside the first input.

    For a folder input ``docs/`` that is the sibling ``docs/../packs`` (so packs never mix with the documents);
    for a file input ``docs/a.txt`` it is ``docs/packs``. Paths are resolved first, so ``.`` gives ``../packs``.

    Raises:
        InputError: ``inputs`` is empty.
    """
    inputs = list(inputs)
    if not inputs:
        raise InputError("no input given, so there is no default output folder; pass --out DIR")
    first = Path(inputs[0]).resolve()
    return first.parent / OUT_DIR_NAME


# ---------------------------------------------------------------------------------------------------------------
# building


def build(contexts: Iterable[Context], model, tokenizer, *, out_dir: str | os.PathLike, method: str = "kvzip",
          ratio: float = DEFAULT_RATIO, chunk_size: int = DEFAULT_CHUNK_SIZE, overwrite: bool = False,
          progress_factory: Callable[..., Any] | None = None, quant: str = C.QUANT_NONE,
          group_size: int = C.DEFAULT_GROUP_SIZE, zstd_level: int = C.DEFAULT_ZSTD_LEVEL,
          checksum: str = C.DEFAULT_CHECKSUM, **options) -> list[BuildResult]:
    """Compress every context with ``kvpack.compress`` and write ``<out_dir>/<name>.kvpack`` (atomically).

    An existing output file is kept (the context is skipped) when it is a valid pack (``verify``: every
    checksum) built from the same text (SHA-256) with the same method, method parameters, ratio, quantization
    (type and group size), zstd level and checksum algorithm, by the same model: the fingerprint's weights and
    tokenizer hashes, architecture, shapes, RoPE and KV dtype (not the path the model was loaded from). A damaged or unreadable
    existing file is rebuilt, not reported as an error. ``overwrite=True`` rebuilds everything. Contexts are built
    in order; an error stops the build, and the packs already written stay (a re-run skips them).

    Args:
        contexts: from ``discover_contexts`` (names must be distinct).
        model, tokenizer: from ``kvpack.load_model``.
        out_dir: output folder, created if missing.
        method, ratio, chunk_size, quant, group_size, **options: as for ``kvpack.compress``.
        zstd_level: as for ``kvpack.save``, but 3 by default (as ``kvpack build``); 0 stores tensors raw.
        checksum: the tensor checksum, ``"xxh3"`` (default) or ``"sha256"``, as for ``kvpack.save``.
        overwrite: rebuild even up-to-date files.
        progress_factory: called once, when at least one context is to be built, as
            ``progress_factory(total=T, initial=S)`` with ``T`` the tokens of all contexts and ``S`` those of the
            skipped ones; must return an object with ``update(tokens)`` and ``close()`` (``tqdm.tqdm`` fits).
            Tokens are those of the cached sequence (chat-template prefix + context).

    Returns:
        One ``BuildResult`` per context, in order.

    Raises:
        InputError: bad method, option, ratio, chunk size, quantization, zstd level or checksum (checked before
            anything is written); a context ``compress`` refuses (e.g. too long for the model); ``out_dir`` cannot
            be created or written.
        UnsupportedModelError: the model is not supported.
    """
    contexts = list(contexts)
    expected = _expected_settings(model, tokenizer, method, ratio, chunk_size, options)
    expected.update(_storage_settings(model, quant, group_size, zstd_level, checksum))
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the output folder {out}: {exc.strerror or exc}; pass another --out") from None
    if not out.is_dir():
        raise InputError(f"the output path {out} is not a folder; pass another --out")
    remove_stale_temps(out)  # temporary files of saves killed in an earlier run (never a live writer's)

    # plan: which files are up to date, and how many tokens each context is
    layout = chat_layout(tokenizer)
    prefix_tokens = len(layout.prefix_ids(tokenizer))
    plan: list[tuple[Context, Path, BuildResult | None, int]] = []
    for ctx in contexts:
        t0 = time.perf_counter()
        path = out / f"{ctx.name}{C.FILE_SUFFIX}"
        header = None if overwrite else _up_to_date(path, ctx.text, expected)
        if header is not None:
            result = BuildResult(ctx.name, path, header.tokens, header.entries, header.file_bytes,
                                 time.perf_counter() - t0, True)
            plan.append((ctx, path, result, header.tokens))
        else:
            plan.append((ctx, path, None, prefix_tokens + len(layout.encode(tokenizer, ctx.text))))

    bar = None
    if progress_factory is not None and any(p[2] is None for p in plan):
        bar = progress_factory(total=sum(p[3] for p in plan), initial=sum(p[3] for p in plan if p[2] is not None))
    results = []
    try:
        for ctx, path, skipped, tokens in plan:
            if skipped is not None:
                results.append(skipped)
                continue
            t0 = time.perf_counter()
            tracker = _Progress(bar, tokens, stages=1 if ratio >= 1.0 else 2)
            pack = compress(model, tokenizer, ctx.text, method=method, ratio=ratio, chunk_size=chunk_size,
                            source_name=ctx.source_name, progress=tracker, quant=quant, group_size=group_size,
                            **options)
            written = save(pack, path, zstd_level=zstd_level, checksum=checksum)
            tracker.finish()
            results.append(BuildResult(ctx.name, path, pack.original_tokens, pack.kept_entries(), written,
                                       time.perf_counter() - t0, False))
    finally:
        if bar is not None:
            bar.close()
    return results


def _expected_settings(model, tokenizer, method: str, ratio: float, chunk_size: int, options: dict) -> dict:
    """The metadata an up-to-date pack carries; validates the arguments the way ``compress`` does."""
    if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 < ratio <= 1.0):
        raise InputError(f"ratio must be in (0, 1] (the fraction of KV entries kept), got {ratio!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    scorer = get_method(method, {"chunk_size": chunk_size}, **options)  # the same default compress applies
    fingerprint = model_fingerprint(model, tokenizer)
    return {"method": scorer.name, "method_params": json.loads(json.dumps(scorer.params())),
            "ratio": float(scorer.kept_ratio(ratio)), "fingerprint": _comparable(fingerprint)}


def _storage_settings(model, quant: str, group_size: int, zstd_level: int, checksum: str) -> dict:
    """How an up-to-date pack is stored: ``quant`` (type, group size or None), ``zstd_level`` and ``checksum``;
    validates them."""
    if quant != C.QUANT_NONE:
        spec = model_spec(model)
        check_quant_args(quant, group_size, spec.head_dim, spec.head_dim, allowed_group_sizes=C.GROUP_SIZES)
    check_storage_args(zstd_level, checksum)
    return {"quant": (quant, group_size) if quant != C.QUANT_NONE else (C.QUANT_NONE, None),
            "zstd_level": zstd_level, "checksum": checksum}


def _comparable(fingerprint: Any) -> dict:
    if not isinstance(fingerprint, dict):
        return {}
    return {k: v for k, v in fingerprint.items() if k not in _IGNORED_FINGERPRINT_FIELDS}


def _up_to_date(path: Path, text: str, expected: dict) -> PackHeader | None:
    """The verified header of ``path`` if it holds a pack of ``text`` built with ``expected``, else ``None``."""
    if not path.is_file():
        return None
    try:
        header = verify(path)
    except KvpackError:
        return None  # damaged or foreign: rebuild it
    meta = header.metadata
    source = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    if source.get("sha256") != hashlib.sha256(text.encode("utf-8")).hexdigest():
        return None
    if any(meta.get(k) != expected[k] for k in ("method", "method_params", "ratio")):
        return None
    if _comparable(meta.get("fingerprint")) != expected["fingerprint"]:
        return None
    stored = (header.quant_type, header.group_size)
    if stored != expected["quant"] or header.zstd_level != expected["zstd_level"]:
        return None
    if header.checksum != expected["checksum"]:
        return None
    return header


class _Progress:
    """Turns ``compress``'s per-stage ``progress(n)`` calls into bar updates worth ``tokens`` in all.

    ``compress`` reports cumulative counts per stage (prefill, then scoring); a count not above the previous one
    starts the next stage. Each stage is worth ``tokens / stages``; ``finish`` tops the context up to ``tokens``.
    """

    def __init__(self, bar, tokens: int, stages: int):
        self.bar, self.tokens, self.stages = bar, tokens, max(1, stages)
        self.stage, self.last, self.done = 0, 0, 0

    def __call__(self, n: int) -> None:
        if n <= self.last:
            self.stage += 1
        self.last = n
        frac = (min(self.stage, self.stages - 1) + min(1.0, n / max(1, self.tokens))) / self.stages
        self._advance(int(frac * self.tokens))

    def finish(self) -> None:
        self._advance(self.tokens)

    def _advance(self, target: int) -> None:
        target = min(target, self.tokens)
        if self.bar is not None and target > self.done:
            self.bar.update(target - self.done)
        self.done = max(self.done, target)


# ---------------------------------------------------------------------------------------------------------------
# checking


def check_pack(path: str | os.PathLike, model=None, tokenizer=None) -> PackHeader:
    """Check a ``.kvpack`` file's integrity (every length, offset and checksum) and, given a model, that it fits.

    Args:
        path: the ``.kvpack`` file.
        model: if given, the pack's model fingerprint must match this model's (see ``check_compatible``).
        tokenizer: if given with ``model``, its hash must match too.

    Returns:
        The validated header.

    Raises:
        InputError, PackFormatError subclasses: as ``kvpack.fileformat.verify``.
        ModelMismatchError: the pack was built for another model; the message names both.
    """
    header = verify(path)
    if model is not None:
        check_compatible(header, model, tokenizer, path=str(path))
    return header


def check_compatible(header: PackHeader, model, tokenizer=None, *, path: str = "the pack") -> None:
    """Check that the pack whose header is ``header`` was built for ``model`` (and ``tokenizer``, if given).

    Compares the stored model fingerprint with the model's: architecture, layer and head counts, head dim, RoPE,
    sliding layers, vocabulary size and weights hash; the tokenizer hash too when ``tokenizer`` is given. The KV
    dtype and the model's path may differ.

    Raises:
        ModelMismatchError: they differ; the message names both models and the differing fields.
    """
    stored = dict(header.metadata.get("fingerprint") or {})
    if tokenizer is None:
        stored.pop("tokenizer_sha256", None)
    check_fingerprint(stored, model_fingerprint(model, tokenizer), path=path)
