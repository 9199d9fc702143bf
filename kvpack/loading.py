"""``kvpack.load``: read a ``.kvpack`` file, check it belongs to the model, and lay it out as a cache."""

from __future__ import annotations

import os

import torch

from .attention import use_kvpack_attention
from .cache import KvpackCache
from .fileformat import load_pack
from .fingerprint import _cached_fingerprint, check_fingerprint
from .model import model_spec
from .pack import Pack

__all__ = ["load", "cache_from_pack"]


def cache_from_pack(pack: Pack, model, tokenizer=None, *, device=None, where: str = "the pack") -> KvpackCache:
    """Check ``pack`` against ``model`` (and ``tokenizer`` if given) and build its ``KvpackCache``.

    The KV is cast to the model's dtype and placed on ``device`` (default: the model's device); the model is
    switched to the ``"kvpack"`` attention. Raises ``ModelMismatchError`` naming both models on mismatch.
    """
    current = _cached_fingerprint(model, tokenizer)  # read only
    stored = dict(pack.metadata.get("fingerprint", {}))
    if tokenizer is None:
        stored.pop("tokenizer_sha256", None)
    check_fingerprint(stored, current, path=where)
    use_kvpack_attention(model)
    _guard_generate(model)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    spec = model_spec(model)
    return KvpackCache.from_pack(pack, device=dev, dtype=model.dtype, sliding_layers=spec.sliding_layers)


def load(path: str | os.PathLike, model, *, device=None, tokenizer=None) -> KvpackCache:
    """Load a ``.kvpack`` file into a cache for ``model``, ready for ``kvpack.generate`` or ``model.generate``.

    Args:
        path: the ``.kvpack`` file.
        model: the model it was built with (checked by fingerprint: architecture, shapes, RoPE, weights hash).
        device: where to place the cache (default: the model's device).
        tokenizer: if given, its hash is checked too.

    Returns:
        A ``KvpackCache`` (a ``transformers.Cache``); see its docstring for use with ``model.generate``.

    Raises:
        PackFormatError subclasses: truncated, corrupt, foreign or newer-version files (nothing is half-loaded).
        ModelMismatchError: the file was built for another model.
    """
    pack = load_pack(path)
    return cache_from_pack(pack, model, tokenizer, device=device, where=str(path))


def _guard_generate(model) -> None:
    """Wrap ``model._prefill`` (transformers 5: where ``generate`` reads the cache's length before its first forward)
    so that a ``KvpackCache`` passed as ``past_key_values`` checks the input and rewinds itself first
    (``KvpackCache.prepare_generate``). Installed once per model; other caches pass through untouched."""
    original = getattr(model, "_prefill", None)
    if original is None or getattr(original, "_kvpack_guard", False):
        return

    def _prefill(input_ids, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("past_key_values")
        first = kwargs.get("is_first_iteration", args[0] if args else True)
        if isinstance(cache, KvpackCache) and first and input_ids is not None and input_ids.numel():
            cache.prepare_generate(input_ids)
        return original(input_ids, generation_config, model_kwargs, *args, **kwargs)

    _prefill._kvpack_guard = True
    model._prefill = _prefill
