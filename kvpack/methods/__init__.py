"""The registry of compression methods: name -> class. It drives ``--method`` and the per-method tests
(``tests/test_methods.py`` runs every entry on every tiny architecture); the methods' parameters, which the CLI's
method options and ``--methods`` specs are made from, are declared in ``kvpack.methods.params`` (``PARAMS``)."""

from __future__ import annotations

from ..errors import InputError
from .params import PARAMS

__all__ = ["METHODS", "Method", "PARAMS", "get_method"]


def _registry() -> dict:
    """``METHODS``, made on first use: the methods import torch, their parameters (``PARAMS``) do not."""
    from .am import AttentionMatching
    from .d2o import D2O
    from .h2o import H2O
    from .knorm import KNorm
    from .kvzip import KVzip
    from .kvzip_head import KVzipHead
    from .none import NoCompression
    from .pyramidkv import PyramidKV
    from .random import RandomScores
    from .snapkv import SnapKV
    from .streaming import StreamingLLM

    classes = {cls.name: cls for cls in (KVzip, KVzipHead, AttentionMatching, D2O, StreamingLLM, H2O, SnapKV,
                                         PyramidKV, KNorm, RandomScores, NoCompression)}
    return {name: classes[name] for name in PARAMS}  # one order for both


def __getattr__(name: str):
    """``METHODS`` (method name -> class, in ``PARAMS``' order) and ``Method``, imported on first use."""
    if name == "METHODS":
        globals()["METHODS"] = value = _registry()
        return value
    if name == "Method":
        from .base import Method

        return Method
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_method(name: str, defaults: dict | None = None, **params):
    """Instantiate method ``name`` with ``params``.

    Args:
        name: a key of ``METHODS``.
        defaults: values used for the method's parameters that ``params`` does not set, when the method has
            such a parameter (e.g. ``{"chunk_size": 2048}`` from ``kvpack.compress`` for KVzip); others ignored.
        **params: the method's parameters; each must be one of its dataclass fields (``kvpack.methods.params``).

    Raises:
        InputError: unknown method, a parameter the method does not take (naming the ones it does), or a bad
            value (the method's own check).
    """
    if name not in PARAMS:
        raise InputError(f"unknown method {name!r}; choose one of: {', '.join(sorted(PARAMS))}")
    cls = (globals().get("METHODS") or __getattr__("METHODS"))[name]
    accepted = cls.parameter_names()
    unknown = [p for p in params if p not in accepted]
    if unknown:
        takes = f"it takes: {', '.join(accepted)}" if accepted else "it takes no parameters"
        raise InputError(f"bad parameters for method {name!r}: it has no parameter "
                         f"{', '.join(repr(p) for p in unknown)} ({takes})")
    merged = {k: v for k, v in (defaults or {}).items() if k in accepted}
    merged.update(params)
    return cls(**merged)
