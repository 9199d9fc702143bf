"""KVzip's head-level (context-independent) scores: one importance score per (compressed layer, KV head), found once
per model from a few contexts, then used to compress any context with no scoring pass (arXiv 2505.23416, §3.3
"context-independent eviction"; ``kvpack.methods.kvzip_head``).

What is computed, per context ``c`` (``head_scores``): the context is prefilled and scored exactly as ``kvpack
build --method kvzip`` does (the repeat pass, ``kvpack.methods.kvzip.KVzip.score``: ``[compressed_layers,
kv_heads, context_tokens]`` entry scores, the max attention probability each entry receives while the model
repeats the context); a head's score is the maximum of its entry scores, ``s_c[l, h] = max_i score[l, h, i]``. The
contexts are combined by the maximum, ``s[l, h] = max_c s_c[l, h]``. This is what the official code does:
``test.py --save_head_score`` saves ``stack(kv.score).amax(-1)`` (``[layers, kv_heads]``) for one context, and
``model/wrapper.py`` ``load_head_score`` stacks the saved files and takes ``amax(0)`` over them (snu-mllab/KVzip).
Two differences: kvpack scores only the compressed (full-attention) layers (sliding-window layers are kept
intact), and scores in float32 (the official code in the model's dtype).

The file is safetensors (never pickle), written atomically: tensors ``scores`` (``[compressed_layers, kv_heads]``
float32, the combined scores) and ``context_scores`` (``[contexts, compressed_layers, kv_heads]`` float32); string
metadata ``format`` (``"kvpack-head-scores"``), ``version`` (``"1"``), and JSON ``fingerprint`` (the model's,
``kvpack.fingerprint``), ``contexts`` (``[{"name", "sha256", "tokens"}]``: the SHA-256 of each context's UTF-8
text), ``compressed_layers`` and ``method`` (``{"scoring", "chunk_size", "tail_tokens"}``). ``load_head_scores``
treats the file as hostile: size cap, safetensors' own header checks, then every name, dtype, shape, value and
metadata field checked before use.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import storage
from .errors import InputError, ModelMismatchError
from .fingerprint import check_fingerprint, model_fingerprint
from .layout import chat_layout
from .methods.kvzip import KVzip
from .model import model_spec
from .prefill import prefill

__all__ = ["HeadScores", "head_scores", "top_heads", "save_head_scores", "load_head_scores", "check_head_scores",
           "HEADS_FORMAT", "HEADS_VERSION", "MAX_HEADS_FILE_BYTES"]

HEADS_FORMAT = "kvpack-head-scores"
HEADS_VERSION = "1"
#: Largest head-score file read (a 100-layer x 64-head model over 1,000 contexts is 26 MB).
MAX_HEADS_FILE_BYTES = 64 * 2**20
_MAKE_IT = "make one with `kvpack heads DOC.txt ... --model M --out heads.safetensors`"


@dataclass
class HeadScores:
    """Head-level importance scores of one model.

    Attributes:
        scores: ``[compressed_layers, kv_heads]`` float32, ``max`` over contexts of each head's max entry score.
        context_scores: ``[contexts, compressed_layers, kv_heads]`` float32, per context.
        compressed_layers: the layer index of each row of ``scores``.
        fingerprint: the model's (``kvpack.fingerprint.model_fingerprint``).
        contexts: ``[{"name": str, "sha256": str (hex of the UTF-8 text), "tokens": int}]``, one per context.
        method: ``{"scoring": "attention" | "plus", "chunk_size": int, "tail_tokens": int}``, the KVzip settings.
    """

    scores: torch.Tensor
    context_scores: torch.Tensor
    compressed_layers: list[int]
    fingerprint: dict[str, Any]
    contexts: list[dict[str, Any]]
    method: dict[str, Any] = field(default_factory=dict)

    def kept_heads(self, ratio: float) -> torch.Tensor:
        """``top_heads(self.scores, ratio)``."""
        return top_heads(self.scores, ratio)


def top_heads(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[layers, kv_heads]`` bool marking the top ``round(ratio x layers x kv_heads)`` pairs of ``scores``
    (``[layers, kv_heads]``) by score; ties go to the lower flat index (the earlier layer, then the lower head).
    ``ratio`` in [0, 1]."""
    flat = scores.detach().float().cpu().reshape(-1)
    k = int(round(ratio * flat.numel()))
    order = torch.sort(flat, descending=True, stable=True).indices
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order[:k]] = True
    return keep.view(scores.shape)


def head_scores(model, tokenizer, texts: list[str], *, names: list[str] | None = None, scoring: str = "attention",
                chunk_size: int = 2048, tail_tokens: int = 8,
                progress: Callable[[int, int], None] | None = None) -> HeadScores:
    """KVzip head-level scores of ``model`` from ``texts`` (module docstring; arXiv 2505.23416, §3.3).

    Args:
        model, tokenizer: from ``kvpack.load_model`` or transformers.
        texts: the contexts (non-empty strings); a few thousand tokens each of the kind of text to be compressed.
        names: one name per text, recorded in the file (default ``context-0``, ``context-1``, ...).
        scoring: ``"attention"`` (KVzip) or ``"plus"`` (KVzip+, ``kvpack.methods.kvzip_plus``).
        chunk_size, tail_tokens: KVzip's repeat-pass chunk (tokens) and quoted tail (tokens).
        progress: called with ``(contexts done, contexts)`` after each context.

    Returns:
        ``HeadScores``; cost: one prefill and one repeat pass per context (about 2-3x a prefill each).

    Raises:
        InputError: no texts, an empty text, names not matching the texts, a bad KVzip option, a text too long
            for the model.
    """
    if isinstance(texts, str) or not texts:
        raise InputError("head_scores needs a list of one or more context texts")
    names = [f"context-{i}" for i in range(len(texts))] if names is None else list(names)
    if len(names) != len(texts):
        raise InputError(f"head_scores: {len(names)} names for {len(texts)} texts")
    scorer = KVzip(chunk_size=chunk_size, tail_tokens=tail_tokens, scoring=scoring)
    spec = model_spec(model)
    layout = chat_layout(tokenizer)
    prefix_ids = layout.prefix_ids(tokenizer)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    per_context, contexts = [], []
    for i, (name, text) in enumerate(zip(names, texts)):
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{name}: the context is empty; give a non-empty text")
        ids = prefix_ids + layout.encode(tokenizer, text)
        if max_pos and len(ids) + 256 > max_pos:
            raise InputError(f"{name}: {len(ids)} tokens is too long for this model (max_position_embeddings="
                             f"{max_pos}); use a shorter context")
        full = prefill(model, ids, len(prefix_ids), layout, spec, chunk_size)
        entry = scorer.score(model, tokenizer, full)  # [compressed_layers, kv_heads, context_tokens]
        per_context.append(entry.amax(dim=-1).float().cpu())
        contexts.append({"name": str(name), "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                         "tokens": full.context_tokens})
        if progress:
            progress(i + 1, len(texts))
    stacked = torch.stack(per_context)
    return HeadScores(scores=stacked.amax(dim=0), context_scores=stacked,
                      compressed_layers=list(spec.compressed_layers),
                      fingerprint=model_fingerprint(model, tokenizer), contexts=contexts,
                      method={"scoring": scoring, "chunk_size": chunk_size, "tail_tokens": tail_tokens})


def save_head_scores(scores: HeadScores, path: str | os.PathLike, storage_options: dict | None = None) -> int:
    """Write ``scores`` to ``path`` (a local path or an fsspec URL, ``kvpack.storage``) as safetensors (module
    docstring), atomically (``storage.write_atomic``: temp file + rename, or one put on object stores).

    Returns the bytes written. Raises ``InputError`` if the destination cannot be written.
    """
    from safetensors.torch import save

    metadata = {"format": HEADS_FORMAT, "version": HEADS_VERSION,
                "fingerprint": json.dumps(scores.fingerprint, sort_keys=True),
                "contexts": json.dumps(scores.contexts), "compressed_layers": json.dumps(scores.compressed_layers),
                "method": json.dumps(scores.method, sort_keys=True)}
    tensors = {"scores": scores.scores.detach().float().cpu().clone().contiguous(),  # own storage each
               "context_scores": scores.context_scores.detach().float().cpu().clone().contiguous()}
    return storage.write_atomic(path, save(tensors, metadata=metadata), storage_options)


def load_head_scores(path: str | os.PathLike, storage_options: dict | None = None) -> HeadScores:
    """Read and validate a head-score file written by ``save_head_scores`` (a local path or an fsspec URL).

    Raises:
        InputError: the file is missing, larger than ``MAX_HEADS_FILE_BYTES``, not safetensors, of another format
            or version, or any tensor or metadata field is missing or malformed (named in the message), or a score
            is not finite or negative.
    """
    where = f"head-score file {path}"
    meta, loaded = read_safetensors(path, storage_options, MAX_HEADS_FILE_BYTES, where, _MAKE_IT)
    names = set(loaded)
    tensors = {n: loaded[n] for n in names & {"scores", "context_scores"}}
    if meta.get("format") != HEADS_FORMAT:
        raise InputError(f"{where} is not a kvpack head-score file (format {meta.get('format')!r}); {_MAKE_IT}")
    if meta.get("version") != HEADS_VERSION:
        raise InputError(f"{where} has version {meta.get('version')!r}; this kvpack reads version {HEADS_VERSION}")
    if names != {"scores", "context_scores"}:
        raise InputError(f"{where} must hold exactly the tensors context_scores and scores, found "
                         f"{', '.join(sorted(names)) or 'none'}")
    fp = _json_field(meta, "fingerprint", dict, where)
    contexts = _json_field(meta, "contexts", list, where)
    layers = _json_field(meta, "compressed_layers", list, where)
    method = _json_field(meta, "method", dict, where)
    kv_heads = check_layers_field(fp, layers, where)
    if not contexts or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                               and isinstance(c.get("sha256"), str) and _is_int(c.get("tokens"))
                               for c in contexts):
        raise InputError(f"{where}: contexts must be a non-empty list of {{name, sha256, tokens}}")
    if method.get("scoring") not in ("attention", "plus"):
        raise InputError(f"{where}: method.scoring must be attention or plus, got {method.get('scoring')!r}")
    scores, per = tensors["scores"], tensors["context_scores"]
    for name, t, shape in (("scores", scores, (len(layers), kv_heads)),
                           ("context_scores", per, (len(contexts), len(layers), kv_heads))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise InputError(f"{where}: tensor {name} must be float32 of shape {list(shape)}, got "
                             f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}")
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise InputError(f"{where}: tensor {name} holds a negative or non-finite score")
    if not torch.equal(scores, per.amax(dim=0)):
        raise InputError(f"{where}: scores is not the maximum of context_scores over the contexts")
    return HeadScores(scores=scores, context_scores=per, compressed_layers=layers, fingerprint=fp,
                      contexts=contexts, method=method)


def check_head_scores(scores: HeadScores, model, tokenizer, *, path: str = "the head-score file") -> None:
    """Raise ``ModelMismatchError`` naming both models unless ``scores`` were made for ``model`` (its fingerprint:
    architecture, shapes, RoPE, weights and tokenizer hashes; ``kvpack.fingerprint.check_fingerprint``) and cover
    its compressed layers."""
    check_fingerprint(scores.fingerprint, model_fingerprint(model, tokenizer), path=path,
                      fix=f"Use the head scores of the model given, or {_MAKE_IT}")
    layers = list(model_spec(model).compressed_layers)
    if scores.compressed_layers != layers:
        raise ModelMismatchError(f"{path} scores layers {scores.compressed_layers}, the model compresses {layers}; "
                                 f"{_MAKE_IT}")


def read_safetensors(path, storage_options: dict | None, max_bytes: int, where: str, make_it: str
                     ) -> tuple[dict, dict]:
    """``(metadata, tensors)`` of a small safetensors file of kvpack's (head scores, ``kvpack.schedule``), read as
    hostile: ``InputError`` naming ``where`` (and ``make_it``, how to make a good one) if it is missing, larger than
    ``max_bytes``, or not safetensors."""
    from safetensors.torch import load

    if not storage.is_file(path, storage_options):
        raise InputError(f"{where} does not exist; {make_it}")
    size = storage.file_size(path, storage_options)
    if size > max_bytes:
        raise InputError(f"{where} is {size:,} bytes, more than the {max_bytes:,} such a file may be; it is not one")
    data = storage.read_bytes(path, storage_options)
    try:
        return _safetensors_metadata(data), load(data)
    except Exception as exc:  # safetensors raises its own error type (and others) for malformed bytes
        raise InputError(f"{where} is not a valid safetensors file ({type(exc).__name__}: {exc}); {make_it}") \
            from None


def check_layers_field(fp: dict, layers: list, where: str) -> int:
    """The fingerprint's ``num_kv_heads``, after checking that it and ``num_layers`` are positive integers and
    ``layers`` increasing layer indices below ``num_layers``; ``InputError`` naming ``where`` otherwise."""
    kv_heads, num_layers = fp.get("num_kv_heads"), fp.get("num_layers")
    if not (_is_int(kv_heads) and kv_heads >= 1 and _is_int(num_layers) and num_layers >= 1):
        raise InputError(f"{where}: the fingerprint's num_kv_heads / num_layers are not positive integers")
    if not layers or not all(_is_int(l) and 0 <= l < num_layers for l in layers) or layers != sorted(set(layers)):
        raise InputError(f"{where}: compressed_layers must be increasing layer indices below {num_layers}")
    return kv_heads


def _json_field(meta: dict, key: str, kind: type, where: str):
    raw = meta.get(key)
    if not isinstance(raw, str):
        raise InputError(f"{where}: metadata field {key!r} is missing")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise InputError(f"{where}: metadata field {key!r} is not JSON") from None
    if not isinstance(value, kind):
        raise InputError(f"{where}: metadata field {key!r} must be a JSON {kind.__name__}")
    return value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _safetensors_metadata(data: bytes) -> dict:
    """The ``__metadata__`` of safetensors ``data`` (its 8-byte length prefix and JSON header); raises on bytes that
    are not a safetensors header (``load_head_scores`` turns that into an ``InputError``)."""
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 + n:
        raise ValueError("the header is longer than the file")
    meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("__metadata__ is not an object")
    return meta
