"""The registry of compression methods: name -> class. It drives ``--method`` and the per-method tests."""

from __future__ import annotations

from .base import Method
from .kvzip import KVzip

__all__ = ["METHODS", "Method", "get_method"]

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (KVzip,)}


def get_method(name: str, **params) -> Method:
    """Instantiate method ``name`` with ``params``. Raises ``InputError`` for unknown names or parameters."""
    from ..errors import InputError

    if name not in METHODS:
        raise InputError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    try:
        return METHODS[name](**params)
    except TypeError as exc:
        raise InputError(f"bad parameters for method {name!r}: {exc}") from None
