"""The format's rules on what a file's header declares, checked before any tensor is read (``format/SPEC.md`` §4.4
the kvpack metadata, §5.4 the quantization types and the compact layout's code widths and grids): plain Python and
numpy, no torch, so reading a header (``kvpack ls``, ``kvpack verify``) never imports it. The writer applies the
same rules (a pack ``save`` writes is one a reader accepts). Each ``..._problem`` returns the problem as a sentence,
or ``None``; the caller raises the typed error (``InputError`` when writing, ``CorruptFileError`` when reading).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import constants as C
from . import settings as S
from .errors import InputError

__all__ = ["LAYER_KINDS", "metadata_problem", "quant_type", "quant_type_bits", "value_group_size",
           "compact_values_problem"]

#: Values of the ``layer_kinds`` metadata.
LAYER_KINDS = ("compressed", "sliding_intact")


def metadata_problem(meta: Any, layers: int, tokens: int) -> str | None:
    """Why a file's kvpack metadata (``format/SPEC.md`` §4.4) is unusable, or ``None``: every field kvpack reads is
    type-checked (values of other keys are passed through unchecked).

    ``sink_tokens`` (required): an integer in ``[0, tokens]``. When present: ``method``, ``kvpack_version``: strings
    of at most 1024 characters; ``method_params``: an object; ``stats``: an object (its ``layer_budgets`` a list of integers); ``ratio``: a number in ``(0, 1]``;
    ``fingerprint``: an object (its name, architecture, model type, hashes and dtype short strings or null, its
    ``rope`` an object, its ``sliding_layers`` a list of integers);
    ``source``: an object whose ``name`` and ``sha256`` (when present) are short strings; ``layout``: an object with
    the strings ``prefix``, ``separator``, ``turn_end`` (at most ``MAX_LAYOUT_CHARS`` characters each) and the
    boolean ``templated``; ``layer_kinds``: one of ``LAYER_KINDS`` per layer.
    """
    if type(meta) is not dict:
        return f"{C.META_KVPACK!r} is not a JSON object"
    sink = meta.get(C.SINK_TOKENS_KEY)
    if type(sink) is not int or not 0 <= sink <= tokens:
        return f"{C.SINK_TOKENS_KEY!r} is missing or not an integer in [0, {tokens}] (the number of tokens)"
    checks = {
        "method": lambda x: _short_str(x), "kvpack_version": lambda x: _short_str(x),
        "method_params": lambda x: type(x) is dict, "stats": _stats_ok,
        "ratio": lambda x: type(x) in (int, float) and 0 < x <= 1 and math.isfinite(x),
        "fingerprint": _fingerprint_ok, "source": _source_ok, "layout": _layout_ok,
        "layer_kinds": lambda x: type(x) is list and len(x) == layers and all(
            type(k) is str and k in LAYER_KINDS for k in x),
    }
    for key, ok in checks.items():
        if key in meta and not ok(meta[key]):
            return f"metadata field {key!r} is malformed ({_WHAT[key]})"
    return None


_WHAT = {
    "method": "a string of at most 1024 characters", "kvpack_version": "a string of at most 1024 characters",
    "method_params": "an object", "stats": "an object whose 'layer_budgets' is a list of integers",
    "ratio": "a number in (0, 1]",
    "fingerprint": "an object whose name, architecture, model_type, hashes and dtype are short strings or null, "
                   "'rope' an object and 'sliding_layers' a list of integers",
    "source": "an object with string 'name' and 'sha256'",
    "layout": f"an object with the strings 'prefix', 'separator', 'turn_end' of at most {C.MAX_LAYOUT_CHARS} "
              "characters and the boolean 'templated'",
    "layer_kinds": f"one of {list(LAYER_KINDS)} per layer",
}


def _short_str(x: Any) -> bool:
    return type(x) is str and len(x) <= C.MAX_SHORT_TEXT


def _fingerprint_ok(x: Any) -> bool:
    """An object (compared with the model's by ``fingerprint.check_fingerprint``) whose ``name``, ``architecture`` and
    hashes, which messages print, are short strings or null when present."""
    return (type(x) is dict and all(x.get(k) is None or _short_str(x[k]) for k in _FINGERPRINT_STRINGS)
            and type(x.get("rope", {})) is dict and _int_list(x.get("sliding_layers", [])))


def _stats_ok(x: Any) -> bool:
    """An object whose ``layer_budgets`` (printed by ``kvpack info``) is a list of integers when present."""
    return type(x) is dict and _int_list(x.get("layer_budgets", []))


def _int_list(x: Any) -> bool:
    return type(x) is list and len(x) <= C.MAX_LAYERS and all(type(i) is int for i in x)


_FINGERPRINT_STRINGS = ("name", "architecture", "model_type", "weights_sha256", "tokenizer_sha256", "dtype")


def _source_ok(x: Any) -> bool:
    return type(x) is dict and all(_short_str(x[k]) for k in ("name", "sha256") if k in x)


def _layout_ok(x: Any) -> bool:
    if type(x) is not dict or type(x.get("templated")) is not bool:
        return False
    return all(type(x.get(k)) is str and len(x[k]) <= C.MAX_LAYOUT_CHARS for k in ("prefix", "separator", "turn_end"))


def quant_type(qtype: str) -> C.QuantType:
    """The ``constants.QuantType`` named ``qtype`` (``"int8"`` or ``"int4"``).

    Raises:
        InputError: unknown name (``"none"`` is not a quantized type).
    """
    spec = C.QUANT_TYPES.get(qtype) if isinstance(qtype, str) else None
    if spec is None:
        raise InputError(f"unknown quantization {qtype!r}; use one of {list(S.QUANT_CHOICES)}")
    return spec


def value_group_size(group_size: int, head_dim_v: int) -> int:
    """``Gv = min(G, head_dim_v)``: channels sharing one value scale and min."""
    return min(int(group_size), int(head_dim_v))


def quant_type_bits(qtype: str) -> int:
    """Bits per code of ``qtype`` (8 for ``"int8"``, 4 for ``"int4"``)."""
    return C.QUANT_TYPES[qtype].bits


def compact_values_problem(widths: np.ndarray, grids: np.ndarray, qtype: str, d: int) -> str | None:
    """The value checks of ``compact_problem`` for several layers at once (the reader's), on their key code widths
    ``[layers, kv_heads, d]`` and grids ``[layers, 3, columns]`` (numpy; a file stores them so): widths in
    ``[MIN_KEY_BITS, MAX_KEY_BITS]`` summing to ``bits x d`` per head; a finite grid with non-negative min steps and
    scale bases. ``None`` if they pass, else the problem (naming the first bad layer)."""
    bits = quant_type_bits(qtype)
    bad = (widths < C.MIN_KEY_BITS).any(axis=(1, 2)) | (widths > C.MAX_KEY_BITS).any(axis=(1, 2))
    if bad.any():
        return f"layer {int(bad.argmax())}: key code widths must lie in [{C.MIN_KEY_BITS}, {C.MAX_KEY_BITS}] bits"
    bad = (widths.sum(axis=2, dtype=np.int64) != bits * d).any(axis=1)
    if bad.any():
        return (f"layer {int(bad.argmax())}: each head's key code widths must sum to {bits * d} "
                f"({qtype} x head_dim {d})")
    bad = ~np.isfinite(grids).all(axis=(1, 2)) | (grids[:, 1:] < 0).any(axis=(1, 2))
    if bad.any():
        return (f"layer {int(bad.argmax())}: the quantization grid must be finite, with non-negative min steps "
                "and scale bases")
    return None
