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
