"""The benchmark grid: variants (method x ratio x quant), building them, and loading them through a real file.

A *variant* is one way to store a context: a compression method, the fraction of KV entries it keeps, and the
quantization of what is kept. ``build_variants`` builds every ratio and quantization of one method for one context
from ONE prefill and ONE scoring pass: it runs exactly the steps of ``kvpack.compress`` (prefill with the method's
attention recorder, ``score``, then per ratio ``select``, ``gather``, ``update_entries`` and the same metadata, then
``quantize_pack``), so each pack is byte-identical to what ``kvpack.compress(..., ratio=r, quant=q)`` returns
(``tests/test_bench.py`` checks this for every registered method). Scores do not depend on the ratio, so this saves
one prefill and one scoring pass per extra ratio; each variant's reported build time is the shared part plus its
own selection and quantization, i.e. what one ``kvpack.compress`` call takes.

``open_variant`` then saves the pack with ``kvpack.save`` and loads it with ``kvpack.load``, so every answer the
benchmark scores comes from a real ``.kvpack`` file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from .. import constants as C
from .. import settings as S
from ..build_settings import check_ratio
from ..cache import KvpackCache
from ..errors import InputError
from ..fileformat import save
from ..layout import chat_layout
from ..loading import load
from ..methods import get_method
from .specs import parse_method_spec
from ..compress import assemble_pack, prefill_recorder
from ..model import model_spec, resolve_kv_dtype
from ..pack import Pack
from ..prefill import prefill
from ..quant import quantize_pack

__all__ = ["Variant", "BuiltPack", "OpenedPack", "expand_grid", "parse_method_spec", "build_variants", "open_variant",
           "QUERY_AWARE_SUFFIX"]

#: Label suffix of the query-aware variant of a method that takes ``question`` (SnapKV given the first question).
QUERY_AWARE_SUFFIX = "-q"


@dataclass(frozen=True)
class Variant:
    """One way to store a context.

    Attributes:
        method: a method spec: a key of ``kvpack.methods.METHODS`` (``none`` keeps everything), optionally with
            parameters, ``NAME[KEY=VALUE;...]`` (``kvpack.bench.specs``), e.g. ``am[values=copy]``.
        ratio: fraction of the context's KV entries kept, in (0, 1].
        quant: ``"none"``, ``"int8"`` or ``"int4"`` (``kvpack.quant``).
        query_aware: the method observes the task's first question (``question=`` option; SnapKV, PyramidKV);
            only meaningful where a task has a question before compression (multi-query).
    """

    method: str
    ratio: float
    quant: str = C.QUANT_NONE
    query_aware: bool = False

    @property
    def name(self) -> str:
        """The method's display name: ``kvzip``, or ``snapkv-q`` for the query-aware variant."""
        return self.method + (QUERY_AWARE_SUFFIX if self.query_aware else "")

    @property
    def label(self) -> str:
        """``name@ratio`` plus ``/quant`` when quantized, e.g. ``kvzip@0.3/int4``."""
        return f"{self.name}@{self.ratio:g}" + ("" if self.quant == C.QUANT_NONE else f"/{self.quant}")

    def to_dict(self) -> dict:
        """JSON form: ``{"method", "name", "ratio", "quant", "query_aware", "label"}``."""
        return {"method": self.method, "name": self.name, "ratio": self.ratio, "quant": self.quant,
                "query_aware": self.query_aware, "label": self.label}


def expand_grid(methods: list[str], ratios: list[float], quants: list[str]) -> list[Variant]:
    """The variants of a grid: ``none`` at ratio 1.0, then every method at every ratio below 1.0, each x quant.

    A method at ratio 1.0 keeps everything, so it is the ``none`` row and is not repeated. ``none`` is always
    included (it is the full-cache reference through kvpack's own file and loader).

    Raises:
        InputError: unknown method or quantization, a method spec's options the method rejects, a ratio outside
            (0, 1].
    """
    for m in methods:
        parse_method_spec(m)  # a name, or name[key=value;...] (kvpack.bench.specs)
    for q in quants:
        if q not in S.QUANT_CHOICES:
            raise InputError(f"unknown quantization {q!r}; choose from: {', '.join(S.QUANT_CHOICES)}")
    for r in ratios:
        check_ratio(r)
    out = [Variant("none", 1.0, q) for q in quants]
    for m in methods:
        if m == "none":
            continue
        out += [Variant(m, r, q) for r in sorted(set(ratios), reverse=True) if r < 1.0 for q in quants]
    return out


@dataclass
class BuiltPack:
    """A built (in-memory) pack of one variant.

    Attributes:
        variant: what was built.
        pack: the ``Pack``, identical to ``kvpack.compress``'s.
        build_s: seconds one ``kvpack.compress`` call would take for this variant (shared prefill and scoring,
            plus this ratio's selection and gathering, plus quantization), wall clock.
    """

    variant: Variant
    pack: Pack
    build_s: float


def build_variants(model, tokenizer, text: str, method: str, ratios: list[float], quants: list[str], *,
                   chunk_size: int = 2048, group_size: int = S.DEFAULT_GROUP_SIZE, query_aware: bool = False,
                   source_name: str = "<bench>", kv_dtype: str = "auto", **options) -> list[BuiltPack]:
    """Build ``method`` at every ratio x quant for ``text`` from one prefill and one scoring pass.

    Args:
        model, tokenizer: from ``kvpack.load_model``.
        text: the context.
        method: a ``METHODS`` key, or a spec with options (``d2o[merge=values]``, ``kvpack.bench.specs``); the
            variants are named after it.
        ratios: fractions kept, each in (0, 1].
        quants: quantization types (``"none"``, ``"int8"``, ``"int4"``).
        chunk_size: prefill/scoring chunk in tokens (as ``kvpack.compress``).
        group_size: quantization group (as ``kvpack.compress``).
        query_aware: marks the variants as query-aware (the caller passes ``question=`` in ``options``).
        kv_dtype: the stored KV dtype (as ``kvpack.compress``; default: the model's 16-bit dtype).
        **options: the method's parameters.

    Returns:
        One ``BuiltPack`` per (ratio, quant), ratios in the given order, quants inner.

    Raises:
        InputError: as ``kvpack.compress`` (empty text, bad ratio, unknown method or option, unknown quant).
    """
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{source_name}: the context is empty")
    for r in ratios:
        check_ratio(r)
    name, spec_options = parse_method_spec(method, validate=False)  # get_method checks them with ``options``
    scorer = get_method(name, {"chunk_size": chunk_size}, **spec_options, **options)
    kept = [scorer.kept_ratio(r) for r in ratios]
    storage_dtype = resolve_kv_dtype(kv_dtype, model)
    if any(r < 1.0 for r in kept) and any(r >= 1.0 for r in kept):
        # kvpack.compress records no attention statistics at ratio 1.0, and a recorded prefill may differ from a
        # plain one in the last float bits (H2O, D2O): build the keep-everything ratios from their own prefill
        kw = dict(chunk_size=chunk_size, group_size=group_size, query_aware=query_aware, source_name=source_name,
                  kv_dtype=kv_dtype)
        whole = build_variants(model, tokenizer, text, method, [1.0], quants, **kw, **options)
        part = build_variants(model, tokenizer, text, method, [r for r in kept if r < 1.0], quants, **kw, **options)
        out, j = [], 0
        for r in kept:
            if r >= 1.0:
                out += whole
            else:
                out += part[j * len(quants):(j + 1) * len(quants)]
                j += 1
        return out
    t0 = time.perf_counter()
    spec = model_spec(model)
    layout = chat_layout(tokenizer)
    prefix_ids = layout.prefix_ids(tokenizer)
    token_ids = prefix_ids + layout.encode_text(tokenizer, text)
    compressing = any(r < 1.0 for r in kept)
    device = next(model.parameters()).device
    quantizing = any(q != C.QUANT_NONE for q in quants)
    recorder, observed = prefill_recorder(scorer, spec, len(token_ids), device, tokenizer, layout, compressing,
                                          quantizing)
    full = prefill(model, token_ids, len(prefix_ids), layout, spec, chunk_size, None, recorder, observed)
    scores = scorer.score(model, tokenizer, full, None) if compressing else None
    fingerprint = None
    energy = recorder.mean_query_energy() if recorder is not None else None
    shared = time.perf_counter() - t0
    out = []
    for ratio in kept:
        t1 = time.perf_counter()
        if ratio < 1.0:
            keep = scorer.select(scores, ratio, full)
        else:
            keep = torch.ones(len(spec.compressed_layers), spec.num_kv_heads, full.context_tokens, dtype=torch.bool)
        pack = assemble_pack(model, tokenizer, text, scorer, ratio, full, keep, source_name, fingerprint)
        fingerprint = pack.metadata["fingerprint"]
        own = time.perf_counter() - t1
        for q in quants:
            t2 = time.perf_counter()
            qp = quantize_pack(pack, q, group_size, energy).with_kv_dtype(storage_dtype)
            out.append(BuiltPack(Variant(method, float(ratio) if method != "none" else 1.0, q, query_aware), qp,
                                 shared + own + time.perf_counter() - t2))
    return out


@dataclass
class OpenedPack:
    """A variant saved to a file and loaded back.

    Attributes:
        variant: what was built.
        cache: the loaded ``KvpackCache`` (rewind it after use; ``kvpack.generate`` does).
        file_bytes: bytes of the ``.kvpack`` file.
        context_tokens: tokens of the cached sequence (chat-template prefix + context).
        build_s, save_s, load_s: seconds to build, to write the file, to read and lay it out as a cache.
        kept_fraction: context entries kept / context entries (from the pack's metadata).
    """

    variant: Variant
    cache: KvpackCache
    file_bytes: int
    context_tokens: int
    build_s: float
    save_s: float
    load_s: float
    kept_fraction: float = field(default=1.0)

    @property
    def bytes_per_token(self) -> float:
        """File bytes per cached token (prefix included), bytes/token."""
        return self.file_bytes / max(1, self.context_tokens)


def open_variant(built: BuiltPack, model, tokenizer, folder: str | os.PathLike, *,
                 zstd_level: int = S.DEFAULT_ZSTD_LEVEL) -> OpenedPack:
    """Save ``built.pack`` under ``folder`` with ``kvpack.save`` (zstd at ``zstd_level``) and load it back.

    The file is removed after loading (the cache holds its own tensors). Raises what ``kvpack.save`` and
    ``kvpack.load`` raise (``InputError``, ``PackFormatError`` subclasses, ``ModelMismatchError``).
    """
    path = os.path.join(os.fspath(folder), "bench.kvpack")
    t0 = time.perf_counter()
    nbytes = save(built.pack, path, zstd_level=zstd_level)
    t1 = time.perf_counter()
    cache = load(path, model, tokenizer=tokenizer)
    t2 = time.perf_counter()
    os.remove(path)
    stats = built.pack.metadata.get("stats", {})
    kept = stats.get("context_entries_kept", 1) / max(1, stats.get("context_entries", 1))
    return OpenedPack(built.variant, cache, int(nbytes), built.pack.original_tokens, built.build_s, t1 - t0,
                      t2 - t1, float(kept))
