"""``kvpack.load``: read a ``.kvpack`` file, check it belongs to the model, and lay it out as a cache."""

from __future__ import annotations

import os
import types

import torch

from .attention import use_kvpack_attention
from .cache import KvpackCache, require_model
from .fileformat import load_pack
from .fingerprint import _cached_fingerprint, check_fingerprint
from .errors import CorruptFileError, ModelMismatchError
from .model import ModelSpec, model_spec
from .pack import Pack
from .source import REBUILD
from .validate import kv_range_problem

__all__ = ["load", "cache_from_pack", "check_shapes", "check_kv_range"]


def cache_from_pack(pack: Pack, model, tokenizer=None, *, device=None, where: str = "the pack",
                    dequantize: str = "at-load") -> KvpackCache:
    """Check ``pack`` against ``model`` (and ``tokenizer`` if given) and build its ``KvpackCache``.

    First the shapes (``check_shapes``: layers, KV heads, head sizes, a float KV dtype) and the range of the KV
    (``check_kv_range``), then the fingerprint. The KV
    is cast to the model's dtype and placed on ``device`` (default: the model's device); the model is switched to
    the ``"kvpack"`` attention. ``dequantize``: as ``KvpackCache.from_pack``'s (``"at-load"`` or ``"on-the-fly"``).
    Raises ``ModelMismatchError`` naming both sides on any mismatch, ``CorruptFileError`` for KV out of range,
    ``InputError`` for a bad ``dequantize`` or a ``model`` that is not a transformers model.
    """
    require_model(model)
    check_shapes(pack, model_spec(model), model.dtype, where)
    check_kv_range(pack, where)
    current = _cached_fingerprint(model, tokenizer)  # read only
    stored = pack.metadata.get("fingerprint", {})
    stored = dict(stored) if isinstance(stored, dict) else {}
    if tokenizer is None:
        stored.pop("tokenizer_sha256", None)
    check_fingerprint(stored, current, path=where)
    use_kvpack_attention(model)
    _guard_generate(model)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    spec = model_spec(model)
    return KvpackCache.from_pack(pack, device=dev, dtype=model.dtype, sliding_layers=spec.sliding_layers,
                                 dequantize=dequantize)


def check_shapes(pack: Pack, spec: ModelSpec, dtype: torch.dtype, where: str = "the pack") -> None:
    """Check that ``pack`` fits a model of attention shape ``spec`` before anything is allocated for it: as many
    layers (``spec.num_layers``), KV heads (``spec.num_kv_heads``) and key/value head sizes (``spec.head_dim``) as the
    model, and keys/values in a float dtype the model's ``dtype`` can be cast from.

    Raises:
        ModelMismatchError: naming what differs, the pack's value and the model's.
    """
    layers = pack.layers
    kv = layers[0] if layers else None
    have = {
        "layers": len(layers),
        "KV heads": int(kv.head_lengths.shape[0]) if kv is not None else 0,
        "key head size": int(kv.keys.shape[1]) if kv is not None else 0,
        "value head size": int(kv.values.shape[1]) if kv is not None else 0,
    }
    want = {"layers": spec.num_layers, "KV heads": spec.num_kv_heads, "key head size": spec.head_dim,
            "value head size": spec.head_dim}
    diffs = [f"{k}: the pack has {have[k]}, the model {want[k]}" for k in have if have[k] != want[k]]
    if kv is not None and (not kv.keys.dtype.is_floating_point or not dtype.is_floating_point):
        diffs.append(f"dtype: the pack's keys are {kv.keys.dtype}, the model computes in {dtype}")
    if diffs:
        raise ModelMismatchError(f"{where} does not fit this model ({'; '.join(diffs)}); load it with the model it "
                                 "was built for, or rebuild it with `kvpack build --model ...`")


def check_kv_range(pack: Pack, where: str = "the pack") -> None:
    """Check that every key and value of ``pack``, dequantized, is finite and within ``[-MAX_KV_ABS, MAX_KV_ABS]``
    (``validate.kv_range_problem``). A file can pass every format check with NaN, infinite or huge entries (or
    group parameters that dequantize to them), and such entries make attention NaN, so sampling fails inside
    ``generate``; they are refused here instead (the writer refuses to write them). Linear in the pack's bytes.

    Raises:
        CorruptFileError: naming the layer and the tensor.
    """
    problem = kv_range_problem(pack)
    if problem is not None:
        raise CorruptFileError(f"{where}: {problem}; a real KV cache never does, so the file is damaged or forged; "
                               f"{REBUILD}")


def load(path: str | os.PathLike, model, *, device=None, tokenizer=None,
         storage_options: dict | None = None, dequantize: str = "at-load") -> KvpackCache:
    """Load a ``.kvpack`` file into a cache for ``model``, ready for ``kvpack.generate`` or ``model.generate``.

    Args:
        path: the ``.kvpack`` file: a path, a seekable binary file object, or an fsspec URL (``s3://``,
            ``https://``, ...) read by range (header, then the tensors) into memory, no download to disk first.
        model: the model it was built with (checked by fingerprint: architecture, shapes, RoPE, weights hash).
        device: where to place the cache (default: the model's device).
        tokenizer: if given, its hash is checked too.
        storage_options: passed to fsspec for a URL (e.g. ``{"endpoint_url": ..., "anon": True}``).
        dequantize: for a quantized pack (``kvpack build --quant``), ``"at-load"`` (default: the cache holds
            dequantized rows in the model's dtype) or ``"on-the-fly"`` (it keeps the codes as stored, about a
            third of the memory at int4, and decodes through the Triton kernel that reads them on CUDA; on CPU
            every attention call dequantizes, slowly): ``kvpack.compact_cache``. An unquantized pack loads the same
            either way.

    Returns:
        A ``KvpackCache`` (a ``transformers.Cache``); see its docstring for use with ``model.generate``.

    Raises:
        InputError: the file cannot be read (missing, no permission, missing fsspec backend).
        PackFormatError subclasses: truncated, corrupt, foreign or newer-version files (nothing is half-loaded).
        ModelMismatchError: the file was built for another model, or its shapes do not fit this one (naming both).
        InputError: ``dequantize`` is neither value, or ``"on-the-fly"`` on CUDA without triton (or for a layout
            the kernel does not take); ``model`` is not a transformers model (checked before the file is read).
    """
    require_model(model)  # before the file is read
    pack = load_pack(path, storage_options=storage_options)
    return cache_from_pack(pack, model, tokenizer, device=device, where=str(path), dequantize=dequantize)


def _guard_generate(model) -> None:
    """Wrap ``model._prefill`` (transformers 5: where ``generate`` reads the cache's length before its first forward)
    so that a ``KvpackCache`` passed as ``past_key_values`` checks the input and rewinds itself first
    (``KvpackCache.prepare_generate``). Installed once per model as a method bound to it, so a ``copy.deepcopy`` of
    the model (e.g. cast to another dtype) calls its own ``_prefill``, not the original's; other caches pass through
    untouched."""
    if getattr(type(model), "_prefill", None) is None:
        return
    if getattr(model.__dict__.get("_prefill"), "__func__", None) is _guarded_prefill:
        return
    model._prefill = types.MethodType(_guarded_prefill, model)


def _guarded_prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
    """``_guard_generate``'s wrapper: the class's own ``_prefill`` after ``KvpackCache.prepare_generate``."""
    cache = model_kwargs.get("past_key_values")
    first = kwargs.get("is_first_iteration", args[0] if args else True)
    if isinstance(cache, KvpackCache) and first and input_ids is not None and input_ids.numel():
        cache.prepare_generate(input_ids, model=self)
    return type(self)._prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
