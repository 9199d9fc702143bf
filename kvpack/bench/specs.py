"""Method specs of ``kvpack bench --methods``: a method name with options, ``name[key=value;key=value]``.

    d2o                                  the method with its defaults
    d2o[merge=values]                    D2O merging values only
    am[values=copy;queries=1024]         Attention Matching's selection with the values copied
    kvzip[scoring=plus]                  KVzip+
    kvzip-head[heads=runs/h.safetensors;window=16]

Keys are the method's parameters, the fields declared in ``kvpack.methods.params``; each value is read as its
field's type (an integer, a number, ``true``/``false``, or the text as it is: ``kvpack.methods.params.parse_value``)
and checked by building the method (``get_method``). The spec string itself is the variant's name in the report.
"""

from __future__ import annotations

import re

from ..errors import InputError
from ..methods import get_method
from ..methods.params import PARAMS, parse_value

__all__ = ["parse_method_spec"]

_SPEC = re.compile(r"^([A-Za-z0-9_-]+)(?:\[(.*)\])?$")


def parse_method_spec(spec: str, *, validate: bool = True) -> tuple[str, dict]:
    """``(method name, options)`` of a spec (module docstring). ``validate=False`` skips building the method (for a
    caller that builds it right after with more options).

    Raises:
        InputError: not ``name`` or ``name[k=v;...]``, an unknown method, an option without ``=`` or given twice,
            a value not of its parameter's type, or (``validate``) options the method rejects (a parameter it does
            not take, a bad value: ``get_method``).
    """
    m = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
    if m is None:
        raise InputError(f"bad method spec {spec!r}; write NAME or NAME[key=value;key=value], e.g. d2o[merge=values]")
    name, body = m.group(1), m.group(2)
    if name not in PARAMS:
        raise InputError(f"unknown method {name!r}; choose from: {', '.join(sorted(PARAMS))}")
    options: dict = {}
    for item in (body or "").split(";"):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise InputError(f"bad option {item!r} in method spec {spec!r}; write key=value")
        if key in options:
            raise InputError(f"option {key!r} given twice in method spec {spec!r}")
        options[key] = parse_value(name, key, value.strip())
    if validate:
        get_method(name, **options)  # validates the options (kvzip-head reads its head file here)
    return name, options

