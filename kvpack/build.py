"""``kvpack build`` as a library: plan which contexts need building (no model needed), then build them.

    contexts = discover_contexts(["docs/"])                     # kvpack.inputs: mirrored names, bad ones marked
    settings = BuildSettings.make(method="kvzip", ratio=0.3)    # kvpack.build_settings: checked, no model needed
    plan = plan_build(contexts, "packs/", settings, model_id=model_identity(None))
    if plan.needs_model:                                         # False when every pack is up to date
        model, tok = kvpack.load_model()
    for result in run_build(plan, model, tok):                   # one BuildResult per context (or part)
        print(result.name, result.status, result.error)

``build(contexts, model, tok, out_dir=...)`` does all three and returns the list.

A context is ``up_to_date`` when its pack (verified: every checksum) was built from the same text (SHA-256) with the
same method, parameters, ratio, quantization, zstd level and checksum by the same model. Before the model loads
this is decided from the manifest (``kvpack.manifest``: the record names the model folder's identity,
``kvpack.model.model_identity``) and the pack's header; after it loads, from the pack's model fingerprint. A
context that cannot be built is ``failed`` with its reason, and the others are still built (``fail_fast`` stops at
the first); a rebuilt existing pack is ``replaced``; a new one ``built``. The manifest is updated as packs are
written, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from . import constants as C
from . import storage
from .build_settings import BuildSettings
from .compress import compress, max_context_tokens
from .errors import InputError, KvpackError
from .fileformat import PackHeader, read_header, save, verify
from .fingerprint import check_fingerprint, model_fingerprint
from .layout import chat_layout
from .manifest import MANIFEST_NAME, ManifestWriter, read_manifest
from .methods.params import PARAMS
from .model import model_spec
from .names import part_name
from .inputs import SUFFIXES, Context, discover_contexts, split_text

__all__ = [
    "SUFFIXES",
    "OUT_DIR_NAME",
    "Context",
    "BuildResult",
    "BuildPlan",
    "BuildSettings",
    "discover_contexts",
    "default_out_dir",
    "plan_build",
    "item_needs_model",
    "run_build",
    "build",
    "summary",
    "check_pack",
    "check_compatible",
]

#: Name of the default output folder (see ``default_out_dir``).
OUT_DIR_NAME = "packs"

#: Fingerprint fields that do not make an existing pack stale (``name`` is where the model was loaded from).
_IGNORED_FINGERPRINT_FIELDS = ("name",)
_DONE = ("built", "replaced", "up_to_date")


@dataclass(frozen=True)
class BuildResult:
    """What a build did for one context (or one part of a split context).

    Attributes:
        name: the pack's name relative to the output folder (``a/notes``; see ``kvpack.names``).
        path: the ``.kvpack`` file (written, existing, or where it would have been written).
        tokens: length of the cached sequence in tokens (chat-template prefix + context); 0 if unknown.
        entries_kept: KV entries stored, over all layers and KV heads (attention-sink entries included).
        bytes_written: size of the ``.kvpack`` file in bytes (0 for a failed context).
        seconds: wall time spent on this context (compressing and writing, or checking the existing file).
        status: ``"built"``, ``"replaced"`` (an existing pack with other settings was rebuilt), ``"up_to_date"``
            or ``"failed"``.
        error: why a ``failed`` context was not built.
        source, id, line, part, parts: as ``Context``.
        notes: what the method did not do as asked, for the user (``MethodParams.build_notes``; a built pack
            only): e.g. Attention Matching leaving most KV heads unfitted.
    """

    name: str
    path: Path
    tokens: int
    entries_kept: int
    bytes_written: int
    seconds: float
    status: str
    error: str | None = None
    source: str = ""
    id: str | None = None
    line: int | None = None
    part: int | None = None
    parts: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def skipped(self) -> bool:
        """Whether the pack was already up to date (nothing written)."""
        return self.status == "up_to_date"


@dataclass
class _Item:
    ctx: Context
    path: Path | str
    header: PackHeader | None = None  # verified header of an up-to-date pack
    known_failure: str | None = None  # recorded reason it is too long for this model (same text, settings, model)
    known_tokens: int = 0  # the tokens recorded with that failure
    parts: list[tuple[Context, PackHeader]] = field(default_factory=list)  # up-to-date parts of a split context


@dataclass
class BuildPlan:
    """What ``plan_build`` found: the contexts in order, each up to date (``header`` or ``parts`` set), failed
    (``ctx.error``) or to build, with the ``settings`` they are built with. ``needs_model`` says whether
    ``run_build`` needs a model."""

    out: Path | str
    settings: BuildSettings
    model_id: dict[str, Any] | None
    overwrite: bool
    items: list[_Item]
    records: dict[str, dict[str, Any]]
    storage_options: dict[str, Any] | None = None

    @property
    def needs_model(self) -> bool:
        """Whether any context is to be built (so the model must be loaded)."""
        return any(item_needs_model(it) for it in self.items)

    @property
    def up_to_date(self) -> int:
        """Packs found up to date without the model."""
        return sum(1 if it.header is not None else len(it.parts) for it in self.items)


def item_needs_model(item: _Item) -> bool:
    """Whether the plan's ``item`` is to be built (so the model must be loaded): readable, not up to date, not known
    to fail."""
    return item.ctx.error is None and item.header is None and not item.parts and item.known_failure is None


def default_out_dir(inputs: Iterable[str | os.PathLike]) -> Path | str:
    """The default output folder: ``packs/`` beside the first input.

    For a folder input ``docs/`` that is the sibling ``docs/../packs`` (so packs never mix with the documents);
    for a file input ``docs/a.txt`` it is ``docs/packs``. Paths are resolved first, so ``.`` gives ``../packs``.
    For a URL the same rule applies to its path: ``s3://b/docs/`` -> ``s3://b/packs``.

    Raises:
        InputError: ``inputs`` is empty.
    """
    inputs = list(inputs)
    if not inputs:
        raise InputError("no input given, so there is no default output folder; pass --out DIR")
    if storage.is_url(inputs[0]):
        protocol, rest = inputs[0].split("://", 1)
        parent = posixpath.dirname(rest.rstrip("/"))
        return f"{protocol}://{parent + '/' if parent else ''}{OUT_DIR_NAME}"
    first = storage.as_path(inputs[0]).resolve()
    return first.parent / OUT_DIR_NAME


# ---------------------------------------------------------------------------------------------------------------
# settings and plan (no model)


def plan_build(contexts: Iterable[Context], out_dir: str | os.PathLike, settings: BuildSettings, *,
               model_id: dict | None = None, overwrite: bool = False, split: bool = False,
               storage_options: dict | None = None) -> BuildPlan:
    """Check ``out_dir`` is a writable folder and find the up-to-date packs, without a model.

    A pack is up to date here when the manifest's last record for it says it was built from this text with these
    ``settings`` by the model ``model_id`` names (a local folder's ``kvpack.model.model_identity``; ``None`` or a
    hub id trusts nothing), and the pack verifies, records the same text and settings, and the same weights hash
    as the record. A split context is up to date when all its recorded parts are. Without ``split``, a context the
    manifest records as too long for that same model, text and settings is known to fail again.

    Args:
        contexts: from ``discover_contexts`` (names distinct).
        out_dir: the output folder; created if missing.
        settings: from ``BuildSettings.make``.
        overwrite: find nothing up to date (rebuild everything).
        split: the run will split contexts that are too long (so recorded "too long" failures are retried).
        storage_options: fsspec options when ``out_dir`` is a URL (``s3://bucket/packs``): its packs' headers are
            then read by range (their checksum and declared size against the object's), not verified whole.

    Raises:
        InputError: ``settings`` is not a ``BuildSettings``; ``out_dir`` cannot be created, is not a folder, or
            cannot be written.
    """
    if not isinstance(settings, BuildSettings):
        raise InputError(f"plan_build takes the settings as a BuildSettings (BuildSettings.make(...)), got "
                         f"{type(settings).__name__}")
    wanted = settings.to_json()
    out = storage.as_path(out_dir)
    so = storage_options
    _check_writable(out, so)
    records = read_manifest(out, storage_options=so)
    trusted = model_id is not None and model_id.get("local") is True
    items = []
    for ctx in contexts:
        item = _Item(ctx, storage.join(out, ctx.pack))
        if ctx.error is None and trusted and not overwrite:
            sha = _sha(ctx.text)
            item.header = _recorded(out, records.get(ctx.pack), sha, wanted, model_id, so=so)
            if item.header is None:
                item.parts = _recorded_parts(out, ctx, records, sha, wanted, model_id, so)
            rec = records.get(ctx.pack)
            if not split and not item.parts and isinstance(rec, dict) and rec.get("status") == "failed" and rec.get(
                    "kind") == "too_long" and rec.get("source_sha256") == sha \
                    and _same_settings(rec.get("settings"), wanted) \
                    and rec.get("model") == model_id and isinstance(rec.get("error"), str):
                item.known_failure = rec["error"]
                item.known_tokens = rec["tokens"] if type(rec.get("tokens")) is int else 0
        items.append(item)
    return BuildPlan(out, settings, model_id, overwrite, items, records, so)


def _check_writable(out: Path | str, storage_options: dict | None = None) -> None:
    if storage.is_url(out):  # create the folder where the backend has folders; read-only protocols are refused
        storage.makedirs(out, storage_options)
        return
    if out.exists() and not out.is_dir():
        raise InputError(f"the output path {out} is not a folder; pass another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the output folder {out}: {exc.strerror or exc}; pass another --out") from None
    if not out.is_dir():
        raise InputError(f"the output path {out} is not a folder; pass another --out")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvpack-write-test-", dir=out)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise InputError(f"cannot write to the output folder {out}: {exc.strerror or exc}; pass another --out "
                         "or fix its permissions") from None
    manifest = out / MANIFEST_NAME
    if manifest.exists() and not manifest.is_file():
        raise InputError(f"{manifest} is not a file, so the build cannot record its packs there; remove it or pass "
                         "another --out")
    storage.remove_stale_temps(out)  # temporary files of saves killed in an earlier run (never a live writer's)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _recorded(out: Path | str, record: dict | None, sha: str, settings: dict, model_id: dict, part: bool = False,
              so: dict | None = None) -> PackHeader | None:
    """The verified header of the pack ``record`` describes, if it is up to date (see ``plan_build``). A part's
    pack records its own text's hash, which only its record ties to the document's (``part``)."""
    if not isinstance(record, dict) or record.get("status") not in _DONE or record.get("source_sha256") != sha:
        return None
    if record.get("model") != model_id or not _same_settings(record.get("settings"), settings):
        return None
    header = _matching_header(storage.join(out, record["pack"]), None if part else sha, settings, so)
    if header is None or (header.metadata.get("fingerprint") or {}).get("weights_sha256") != record.get(
            "weights_sha256") or header.file_bytes != record.get("bytes"):
        return None
    return header


def _same_settings(recorded: Any, wanted: dict) -> bool:
    """Whether a manifest record's ``settings`` (``BuildSettings.to_json`` of its build, untrusted) build what
    ``wanted`` does: every field equal, the recorded method parameters completed and made canonical as
    ``_with_defaults`` does, and ``options`` (which of them the user spelled out) left out, so a default given
    explicitly, or a parameter the others make inert, is the same build. Raises nothing."""
    if not isinstance(recorded, dict):
        return False
    mine = {**recorded, "method_params": _with_defaults(recorded.get("method"), recorded.get("method_params"))}
    return {k: v for k, v in mine.items() if k != "options"} == {k: v for k, v in wanted.items() if k != "options"}


def _recorded_parts(out: Path | str, ctx: Context, records: dict, sha: str, settings: dict, model_id: dict,
                    so: dict | None = None) -> list[tuple[Context, PackHeader]]:
    first = records.get(part_name(ctx.name, 1) + ".kvpack")
    n = first.get("parts") if isinstance(first, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 100_000:
        return []
    found = []
    for k in range(1, n + 1):
        rec = records.get(part_name(ctx.name, k) + ".kvpack")
        if not isinstance(rec, dict) or rec.get("parts") != n or rec.get("part") != k:
            return []
        header = _recorded(out, rec, sha, settings, model_id, part=True, so=so)
        if header is None:
            return []
        found.append((Context(part_name(ctx.name, k), None, ctx.source, ctx.file, ctx.id, ctx.line, k, n), header))
    return found


def _with_defaults(method: Any, params: Any) -> Any:
    """``params`` recorded for ``method`` completed with the defaults of the method's parameters they lack (a pack
    from an older kvpack records none of those added since), its inert ones at their defaults
    (``MethodParams.canonical``), from the method's dataclass fields: nothing is
    instantiated and no file a recorded parameter names is read (``kvpack.methods.params``). As given for an unknown
    method."""
    cls = PARAMS.get(method) if isinstance(method, str) else None
    if cls is None or not isinstance(params, dict):
        return params
    defaults = cls.recorded_defaults()
    try:
        return json.loads(json.dumps(cls.canonical({**defaults, **params})))
    except (TypeError, ValueError):
        return params


def _header_settings(header: PackHeader) -> dict:
    meta = header.metadata
    quant = ([header.quant_type, header.group_size, header.quant_layout] if header.group_size
             else [C.QUANT_NONE, None, None])
    return {"method": meta.get("method"), "ratio": meta.get("ratio"),
            "method_params": _with_defaults(meta.get("method"), meta.get("method_params")),
            "quant": quant, "zstd_level": header.zstd_level, "checksum": header.checksum,
            "kv_dtype": header.kv_dtype_name}


def _stored_as(kv_dtype: Any, asked: str) -> Any:
    """``asked`` when a pack whose keys are stored in ``kv_dtype`` (a name, from the tensor index) is what a build
    asking for ``asked`` writes: ``auto`` writes the model's 16-bit dtype (the model is not known yet, so either
    16-bit dtype passes). Else ``kv_dtype``."""
    if asked == "auto" and kv_dtype in ("bfloat16", "float16"):
        return asked
    return kv_dtype


def _matching_header(path: Path | str, sha: str | None, settings: dict, so: dict | None = None
                     ) -> PackHeader | None:
    """The verified header of ``path`` if it holds a pack of the text with SHA-256 ``sha`` (any, if ``None``) built
    with ``settings`` (``BuildSettings.to_json``; model not compared), else ``None`` (missing, damaged or foreign
    files included). A local pack is verified whole; a URL only by its header (range reads), so resuming against a
    remote store reads no pack data."""
    try:
        if not storage.is_file(path, so):
            return None
        header = read_header(path, storage_options=so) if storage.is_url(path) else verify(path)
    except KvpackError:
        return None  # damaged or foreign: rebuild it
    source = header.metadata.get("source")
    if not isinstance(source, dict) or (sha is not None and source.get("sha256") != sha):
        return None
    want = {k: settings[k] for k in ("method", "method_params", "ratio", "quant", "zstd_level", "checksum", "kv_dtype")}
    found = _header_settings(header)
    found["kv_dtype"] = _stored_as(found["kv_dtype"], want["kv_dtype"])
    return header if found == want else None


# ---------------------------------------------------------------------------------------------------------------
# running


def run_build(plan: BuildPlan, model=None, tokenizer=None, *, split: bool = False, fail_fast: bool = False,
              progress_factory: Callable[..., Any] | None = None, manifest=None) -> Iterator[BuildResult]:
    """Build the planned contexts in order, yielding one ``BuildResult`` per context (per part when split).

    Contexts up to date in the plan are reported (and re-recorded) first in their place; the others are checked
    against the model's fingerprint (an existing pack built by this model with these settings is up to date) and
    otherwise compressed with ``kvpack.compress`` and saved atomically. A context too long for the model
    (``kvpack.compress.max_context_tokens``) fails, or with ``split`` is cut at paragraph boundaries into parts
    ``NAME.part-001``, ... that each fit. A context that cannot be built (``KvpackError`` or ``OSError``: too long,
    unwritable) is yielded as ``failed``; with ``fail_fast`` the run then stops. Every result is appended to the
    manifest as it is made; the manifest is compacted when the run ends, is interrupted (``KeyboardInterrupt``
    propagates) or the generator is closed.

    Args:
        plan: from ``plan_build``.
        model, tokenizer: from ``kvpack.load_model``; needed only when ``plan.needs_model``.
        split: cut contexts that are too long instead of failing them.
        fail_fast: stop after the first failed context.
        progress_factory: called once, when a context is to be built, as ``progress_factory(total=T)`` with ``T``
            the tokens of the contexts to build; must return an object with ``update(tokens)``, ``close()`` and
            ``set_description(str)`` (``tqdm.tqdm`` fits): the description names the context being built.
        manifest: where the records go instead of ``plan.out``'s manifest: an object with ``write(record)``
            (``kvpack.ray_build`` collects each actor's records and the driver writes them, in order).

    Raises:
        InputError: a model is needed but not given; the quantization does not fit the model's head size.
        UnsupportedModelError: the model is not supported.
    """
    expected, limit, layout, prefix = None, None, None, 0
    if plan.needs_model:
        if model is None or tokenizer is None:
            raise InputError("some contexts need building, so run_build needs the model and tokenizer")
        plan.settings.check_head_dim(model_spec(model).head_dim)
        expected = _comparable(model_fingerprint(model, tokenizer))
        limit = max_context_tokens(model)
        layout = chat_layout(tokenizer)
        prefix = len(layout.prefix_ids(tokenizer))
    model_id = plan.model_id if plan.model_id is not None else {"name": getattr(model, "kvpack_name", None)}
    run = _Run(plan, model, tokenizer, model_id, progress_factory)
    writer = ManifestWriter(plan.out, plan.records, storage_options=plan.storage_options) if manifest is None \
        else contextlib.nullcontext(manifest)
    with writer as manifest:
        run.manifest = manifest
        try:
            todo = [it for it in plan.items if item_needs_model(it)]
            sizes = {id(it): prefix + len(layout.encode_text(tokenizer, it.ctx.text)) for it in todo}
            # the bar's total: the tokens to compress (a context too long without --split fails before any)
            total = sum(n for n in sizes.values() if split or limit is None or n <= limit)
            for item in plan.items:
                for result in run.item(item, sizes.get(id(item)), limit, split, layout, tokenizer, expected, total):
                    yield result
                    if fail_fast and result.status == "failed":
                        return
        finally:
            run.close()


class _Run:
    """State of one ``run_build``: the manifest, the progress bar, and how one item becomes results."""

    def __init__(self, plan: BuildPlan, model, tokenizer, model_id: dict, progress_factory):
        self.plan, self.model, self.tokenizer, self.model_id = plan, model, tokenizer, model_id
        self.progress_factory, self.bar, self.manifest = progress_factory, None, None
        self.skipped = 0  # the bar's share of contexts found up to date before the bar was made

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def record(self, result: BuildResult, sha: str | None, weights: str | None, kind: str | None = None
               ) -> BuildResult:
        self.manifest.write({
            "pack": result.name + C.FILE_SUFFIX, "source": result.source, "id": result.id, "line": result.line,
            "part": result.part, "parts": result.parts, "status": result.status, "error": result.error,
            "tokens": result.tokens, "entries_kept": result.entries_kept, "bytes": result.bytes_written,
            "source_sha256": sha, "settings": self.plan.settings.to_json(), "model": self.model_id,
            "weights_sha256": weights, "kind": kind, "time": time.time()})
        return result

    def result(self, ctx: Context, path: Path, status: str, t0: float, sha: str | None, *,
               header: PackHeader | None = None, tokens: int = 0, entries: int = 0, size: int = 0,
               error: str | None = None, kind: str | None = None) -> BuildResult:
        if header is not None:
            tokens, entries, size = header.tokens, header.entries, header.file_bytes
        res = BuildResult(ctx.name, path, tokens, entries, size, time.perf_counter() - t0, status, error,
                          ctx.source, ctx.id, ctx.line, ctx.part, ctx.parts)
        weights = (header.metadata.get("fingerprint") or {}).get("weights_sha256") if header is not None else None
        return self.record(res, sha, weights, kind)

    def item(self, item: _Item, tokens: int | None, limit: int | None, split: bool, layout, tokenizer,
             expected: dict | None, total: int) -> Iterator[BuildResult]:
        ctx, t0 = item.ctx, time.perf_counter()
        sha = _sha(ctx.text) if ctx.text is not None else None  # of the whole document, recorded for its parts too
        if item.header is not None:
            yield self.result(ctx, item.path, "up_to_date", t0, sha, header=item.header)
            return
        if item.parts:
            for part, header in item.parts:
                yield self.result(part, storage.join(self.plan.out, part.pack), "up_to_date", t0, sha,
                                  header=header)
            return
        if ctx.error is not None or item.known_failure is not None:
            kind = "too_long" if item.known_failure is not None else None
            yield self.result(ctx, item.path, "failed", t0, sha, error=ctx.error or item.known_failure, kind=kind,
                              tokens=item.known_tokens)
            return
        pieces = [ctx]
        if limit is not None and tokens > limit:
            if not split:
                yield self.result(ctx, item.path, "failed", t0, sha, tokens=tokens, kind="too_long", error=(
                    f"{tokens:,} tokens is too long for this model (at most {limit:,}); pass --split to cut it "
                    "at paragraph boundaries into parts that fit"))
                return
            prefix = tokens - len(layout.encode_text(tokenizer, ctx.text))
            try:
                texts = split_text(ctx.text, lambda t: prefix + len(layout.encode_text(tokenizer, t)) <= limit)
            except InputError as exc:
                _Progress(self.open_bar(total, ctx.name), 0, 1, worth=tokens).finish()
                yield self.result(ctx, item.path, "failed", t0, sha, tokens=tokens, error=str(exc))
                return
            pieces = ctx.parts_of(texts)
        counts = [tokens] if len(pieces) == 1 else [prefix + len(layout.encode_text(tokenizer, p.text))
                                                    for p in pieces]
        for piece, n, worth in zip(pieces, counts, _shares(counts, tokens)):  # the parts fill the context's share
            yield self.build_one(piece, sha, expected, total, t0 if len(pieces) == 1 else time.perf_counter(), n,
                                 worth)

    def open_bar(self, total: int, name: str):
        """The progress bar (made at the first context to build, worth ``total`` tokens, with the share of the
        contexts found up to date before it already done), naming ``name``."""
        if self.bar is None and self.progress_factory is not None:
            self.bar = self.progress_factory(total=total)
            if self.skipped:
                self.bar.update(self.skipped)
        if self.bar is not None and hasattr(self.bar, "set_description"):
            self.bar.set_description(name, refresh=True)
        return self.bar

    def build_one(self, ctx: Context, sha: str, expected: dict, total: int, t0: float, tokens: int, worth: int
                  ) -> BuildResult:
        path, so, s = storage.join(self.plan.out, ctx.pack), self.plan.storage_options, self.plan.settings
        if not self.plan.overwrite:
            header = _matching_header(path, _sha(ctx.text), s.to_json(), so)
            if header is not None and _comparable(header.metadata.get("fingerprint")) == expected:
                _Progress(self.bar, 0, 1, worth=worth).finish()
                self.skipped += worth if self.bar is None else 0  # no bar until something is built
                return self.result(ctx, path, "up_to_date", t0, sha, header=header)
        tracker = _Progress(self.open_bar(total, ctx.name), tokens, stages=1 if s.ratio >= 1.0 else 2, worth=worth)
        existed = storage.is_file(path, so)
        try:
            pack = compress(self.model, self.tokenizer, ctx.text, source_name=_short(ctx.source_name),
                            progress=tracker, **s.compress_kwargs())
            if storage.is_url(path):
                storage.makedirs(storage.parent_of(path), so)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
            written = save(pack, path, zstd_level=s.zstd_level, checksum=s.checksum, storage_options=so)
        except (KvpackError, OSError, torch.OutOfMemoryError) as exc:
            tracker.finish()
            return self.result(ctx, path, "failed", t0, sha, tokens=tokens, error=_reason(exc, path))
        tracker.finish()
        res = BuildResult(ctx.name, path, pack.original_tokens, pack.kept_entries(), written,
                          time.perf_counter() - t0, "replaced" if existed else "built", None, ctx.source, ctx.id,
                          ctx.line, ctx.part, ctx.parts,
                          tuple(PARAMS[s.method].build_notes(pack.metadata["method_params"],
                                                             pack.metadata.get("stats") or {})))
        return self.record(res, sha, pack.metadata["fingerprint"].get("weights_sha256"))


def _short(name: str) -> str:
    """``name`` cut to the ``C.MAX_SHORT_TEXT`` characters a pack records as its source: a deep path keeps its
    end, after an ellipsis."""
    return name if len(name) <= C.MAX_SHORT_TEXT else "\u2026" + name[-(C.MAX_SHORT_TEXT - 1):]


def _reason(exc: BaseException, path: Path) -> str:
    if isinstance(exc, OSError):
        return f"cannot write {path}: {exc.strerror or exc}; check the output folder"
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory; use a smaller --chunk-size, --split, or a bigger device"
    return str(exc)


def build(contexts: Iterable[Context], model, tokenizer, *, out_dir: str | os.PathLike,
          settings: BuildSettings | None = None, overwrite: bool = False,
          progress_factory: Callable[..., Any] | None = None, split: bool = False, fail_fast: bool = False,
          model_id: dict | None = None, **setting_args) -> list[BuildResult]:
    """``BuildSettings.make`` + ``plan_build`` + ``run_build``: compress every context into
    ``<out_dir>/<name>.kvpack``.

    Args:
        contexts: from ``discover_contexts``.
        model, tokenizer: from ``kvpack.load_model``.
        out_dir: output folder, created if missing.
        settings: the build's settings; or give ``**setting_args`` instead.
        **setting_args: ``BuildSettings.make``'s arguments (``method``, ``ratio``, ``chunk_size``, ``quant``,
            ``group_size``, ``zstd_level``, ``checksum``, ``kv_dtype`` and the method's options), its defaults for
            those not given; none with ``settings``.
        overwrite, model_id: as ``plan_build``. split, fail_fast, progress_factory: as ``run_build``.

    Returns:
        One ``BuildResult`` per context (per part of a split one), in order; failed ones have ``error`` set.

    Raises:
        InputError: bad settings (as ``BuildSettings.make``; or both ``settings`` and ``setting_args``) or
            ``out_dir`` (before anything is written).
        UnsupportedModelError: the model is not supported.
    """
    if settings is not None and setting_args:
        raise InputError(f"give build either settings or {', '.join(setting_args)}, not both")
    if settings is None:
        settings = BuildSettings.make(**setting_args)
    plan = plan_build(contexts, out_dir, settings, model_id=model_id, overwrite=overwrite, split=split)
    return list(run_build(plan, model, tokenizer, split=split, fail_fast=fail_fast,
                          progress_factory=progress_factory))


def _comparable(fingerprint: Any) -> dict:
    if not isinstance(fingerprint, dict):
        return {}
    return {k: v for k, v in fingerprint.items() if k not in _IGNORED_FINGERPRINT_FIELDS}


def _shares(counts: list[int], total: int) -> list[int]:
    """``counts`` scaled to integers summing to ``total`` (largest remainders first): the bar's worth of each part
    of a split context, whose token counts add up to more than the whole (each part repeats the template)."""
    whole = sum(counts)
    if whole <= 0:
        return [0] * len(counts)
    exact = [c * total / whole for c in counts]
    out = [int(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: out[i] - exact[i])[: total - sum(out)]:
        out[i] += 1
    return out


class _Progress:
    """Turns ``compress``'s per-stage ``progress(n)`` calls on a context of ``tokens`` tokens into bar updates worth
    ``worth`` in all (default ``tokens``).

    ``compress`` reports cumulative counts per stage (prefill, then scoring); a count not above the previous one
    starts the next stage. Each stage is worth ``worth / stages``; ``finish`` tops the context up to ``worth`` (also
    for a context that failed or turned out up to date, so the bar ends at its total).
    """

    def __init__(self, bar, tokens: int, stages: int, worth: int | None = None):
        self.bar, self.tokens, self.stages = bar, tokens, max(1, stages)
        self.worth = tokens if worth is None else worth
        self.stage, self.last, self.done = 0, 0, 0

    def __call__(self, n: int) -> None:
        if n <= self.last:
            self.stage += 1
        self.last = n
        frac = (min(self.stage, self.stages - 1) + min(1.0, n / max(1, self.tokens))) / self.stages
        self._advance(int(frac * self.worth))

    def finish(self) -> None:
        self._advance(self.worth)

    def _advance(self, target: int) -> None:
        target = min(target, self.worth)
        if self.bar is not None and target > self.done:
            self.bar.update(target - self.done)
        self.done = max(self.done, target)


# ---------------------------------------------------------------------------------------------------------------
# checking


def check_pack(path: str | os.PathLike, model=None, tokenizer=None, *, storage_options: dict | None = None
               ) -> PackHeader:
    """Check a ``.kvpack`` file's integrity (every length, offset and checksum) and, given a model, that it fits.

    Args:
        path: the ``.kvpack`` file (a local path or an fsspec URL; ``storage_options`` go to fsspec).
        model: if given, the pack's model fingerprint must match this model's (see ``check_compatible``).
        tokenizer: if given with ``model``, its hash must match too.

    Returns:
        The validated header.

    Raises:
        InputError, PackFormatError subclasses: as ``kvpack.fileformat.verify``.
        ModelMismatchError: the pack was built for another model; the message names both.
    """
    header = verify(path, storage_options=storage_options)
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


def summary(results: Iterable[BuildResult], out_dir: str | os.PathLike, *, interrupted: bool = False) -> dict:
    """A JSON-serialisable summary of a build: counts per status (``built``, ``up_to_date``, ``replaced``,
    ``failed``), ``bytes_written`` (bytes of packs written by this run), ``seconds``, ``interrupted``, and one
    entry per result under ``contexts`` (``pack`` relative to ``out``, ``source``, ``id``, ``line``, ``part``,
    ``status``, ``error``, ``tokens``, ``entries_kept``, ``bytes``, ``seconds``, ``notes``)."""
    results = list(results)
    counts = {s: sum(r.status == s for r in results) for s in ("built", "up_to_date", "replaced", "failed")}
    return {
        "out": str(out_dir), **counts, "interrupted": interrupted,
        "bytes_written": sum(r.bytes_written for r in results if r.status in ("built", "replaced")),
        "seconds": round(sum(r.seconds for r in results), 3),
        "contexts": [{"pack": r.name + C.FILE_SUFFIX, "source": r.source, "id": r.id, "line": r.line,
                      "part": r.part, "status": r.status, "error": r.error, "tokens": r.tokens,
                      "entries_kept": r.entries_kept, "bytes": r.bytes_written, "seconds": round(r.seconds, 3),
                      "notes": list(r.notes)}
                     for r in results],
    }
