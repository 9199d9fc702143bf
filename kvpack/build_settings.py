"""A build's settings as one type: ``BuildSettings``, checked once where it is made, then passed whole from the
command line (``kvpack build``) through ``kvpack.build`` (the plan, the manifest records, the up-to-date checks) and
Ray's actors down to ``kvpack.compress`` and ``kvpack.save``.

    settings = BuildSettings.make(method="kvzip", ratio=0.3, quant="int4")   # InputError if any value is bad
    settings.to_json()          # what the manifest records and an up-to-date pack's header must match
    compress(model, tok, text, **settings.compress_kwargs())

The checks a build shares with ``kvpack.compress`` and the benchmark (``check_ratio``, ``check_chunk_size``,
``check_quant``) live here too, so each condition and its message is written once. No torch at import time (the
command line's ``--help`` does not load it); making settings instantiates the method, which imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from . import constants as C
from . import settings as S
from .errors import InputError
from .fileformat import check_storage_args
from .methods import get_method
from .methods.params import PARAMS

__all__ = ["BuildSettings", "check_ratio", "check_chunk_size", "check_quant"]

#: The keys of ``BuildSettings.to_json``, in order (``kv_dtype`` may be missing from records of older builds).
_JSON_KEYS = ("method", "method_params", "ratio", "quant", "zstd_level", "checksum", "kv_dtype", "chunk_size",
              "options")
#: ``make``'s named arguments, which a record's method options cannot be.
_MAKE_ARGS = ("method", "ratio", "chunk_size", "quant", "group_size", "zstd_level", "checksum", "kv_dtype")


def check_ratio(ratio: Any) -> None:
    """Check a compression ratio: the fraction of a context's KV entries kept, a number in (0, 1].

    Raises:
        InputError: ``ratio`` is not an ``int``/``float`` (``bool`` excluded) in (0, 1] (NaN included).
    """
    if isinstance(ratio, bool) or not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise InputError(f"ratio must be in (0, 1] (the fraction of KV entries kept), got {ratio!r}")


def check_chunk_size(chunk_size: Any) -> None:
    """Check a prefill/scoring chunk size: a positive ``int`` number of tokens.

    Raises:
        InputError: ``chunk_size`` is not an ``int`` (``bool`` excluded) >= 1.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")


def check_quant(quant: Any, group_size: Any, head_dim: int | None = None) -> None:
    """Check a build's quantization: ``"none"`` (``group_size`` unused, not checked), or ``"int8"``/``"int4"`` with
    a group size of ``settings.GROUP_SIZES`` (tokens per key group; values use ``min(G, head_dim)`` channels) that,
    given the model's ``head_dim`` (channels per key and value head), fits it (``kvpack.quant.check_quant_args``).

    Raises:
        InputError: unknown quantization, group size not in (32, 64, 128), or a head size it does not fit; the
            message names the bad value and the accepted ones.
    """
    if quant == C.QUANT_NONE:
        return
    from .quant import check_quant_args  # imports torch, which this module does not at import time

    check_quant_args(quant, group_size, head_dim, head_dim, allowed_group_sizes=S.GROUP_SIZES)


@dataclass(frozen=True)
class BuildSettings:
    """How every context of a build is compressed and stored: what a pack records and an up-to-date check compares.

    Make it with ``make`` (from what a user gives) or ``from_json`` (from ``to_json``'s dict); both check every
    value, so the fields of one made so always hold a valid build. The constructor itself takes the fields as
    recorded and checks nothing.

    Attributes:
        method: the method's name (a key of ``kvpack.methods.METHODS``).
        method_params: every parameter of the method as the pack records it (``Method.params()``: the defaults
            completed, e.g. KVzip's ``chunk_size``), those that change nothing at their defaults
            (``MethodParams.canonical``), JSON values.
        ratio: the fraction of the context's KV entries kept, in (0, 1], as recorded (1.0 for ``none``, whatever
            was asked; for ``kvzip-head`` the fraction of (layer, KV head) pairs kept whole).
        quant: ``"none"``, ``"int8"`` or ``"int4"`` (``kvpack.quant``; stored in the compact layout).
        group_size: tokens per quantization key group (32, 64 or 128); ``None`` when ``quant`` is ``"none"``.
        zstd_level: zstd level of each stored tensor (0: off, else 1-22).
        checksum: the tensor checksum, ``"xxh3"`` or ``"sha256"``.
        kv_dtype: the dtype keys and values are stored in: ``"auto"`` (the model's 16-bit dtype,
            ``kvpack.model.resolve_kv_dtype``), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        chunk_size: tokens per prefill and scoring chunk (bounds memory; does not change which entries are kept
            except through a method parameter of that name, e.g. KVzip's, which defaults to it).
        options: the method options given (a subset of ``method_params``), JSON values.
    """

    method: str
    method_params: dict[str, Any]
    ratio: float
    quant: str
    group_size: int | None
    zstd_level: int
    checksum: str
    kv_dtype: str
    chunk_size: int
    options: dict[str, Any]

    @classmethod
    def make(cls, *, method: str = "kvzip", ratio: float = S.DEFAULT_RATIO, chunk_size: int = S.DEFAULT_CHUNK_SIZE,
             quant: str = C.QUANT_NONE, group_size: int = S.DEFAULT_GROUP_SIZE,
             zstd_level: int = S.DEFAULT_ZSTD_LEVEL, checksum: str = S.DEFAULT_CHECKSUM, kv_dtype: str = "auto",
             **options) -> BuildSettings:
        """Check a build's settings, without a model, and return them as recorded.

        Args:
            method: a key of ``kvpack.methods.METHODS``.
            ratio: fraction of KV entries kept, in (0, 1] (method ``none`` records 1.0).
            chunk_size: tokens per prefill and scoring chunk, >= 1 (a method's ``chunk_size`` defaults to it).
            quant, group_size: ``"none"`` (``group_size`` ignored), ``"int8"`` or ``"int4"`` with 32, 64 or 128.
            zstd_level, checksum: how ``kvpack.save`` stores the tensors: 0 or 1-22; ``"xxh3"`` or ``"sha256"``.
            kv_dtype: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
            **options: the method's parameters (JSON values; they are stored as their JSON round trip).

        Raises:
            InputError: bad ratio, chunk size, method, method option, quantization, group size, zstd level,
                checksum or kv_dtype (checked in that order).
            TypeError: an option or method parameter that is not a JSON value.
        """
        check_ratio(ratio)
        check_chunk_size(chunk_size)
        scorer = get_method(method, {"chunk_size": chunk_size}, **options)  # the same default compress applies
        check_quant(quant, group_size)
        check_storage_args(zstd_level, checksum)
        if kv_dtype not in S.DTYPES:
            raise InputError(f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(S.DTYPES)}")
        quantized = quant != C.QUANT_NONE
        return cls(method=scorer.name, method_params=_json_copy(PARAMS[scorer.name].canonical(scorer.params())),
                   ratio=float(scorer.kept_ratio(ratio)), quant=quant, group_size=group_size if quantized else None,
                   zstd_level=zstd_level, checksum=checksum, kv_dtype=kv_dtype, chunk_size=chunk_size,
                   options=_json_copy(options))

    @classmethod
    def from_json(cls, record: Any) -> BuildSettings:
        """The settings ``to_json`` gave (e.g. a manifest record's ``settings``), made again with ``make``.

        ``method_params`` are derived again from ``method``, ``chunk_size`` and ``options`` (a record's own are not
        read, so a record from an older kvpack gives the parameters this one builds with); a missing ``kv_dtype``
        is ``"auto"`` (records from before it).

        Raises:
            InputError: ``record`` is not such a dict (a key missing, ``quant`` not ``[type, group size, layout]``,
                ``options`` not a dict of method options), or a value ``make`` refuses.
        """
        if not isinstance(record, dict):
            raise InputError(f"build settings must be a dict (BuildSettings.to_json), got {type(record).__name__}")
        missing = [k for k in _JSON_KEYS if k != "kv_dtype" and k not in record]
        if missing:
            raise InputError(f"build settings lack {', '.join(missing)} (BuildSettings.to_json has them all)")
        quant, options = record["quant"], record["options"]
        if not (isinstance(quant, list) and len(quant) == 3 and quant[2] == (
                None if quant[0] == C.QUANT_NONE else C.QUANT_LAYOUT_COMPACT)):
            raise InputError(f"build settings' quant must be [type, group size, {C.QUANT_LAYOUT_COMPACT!r}] or "
                             f"[{C.QUANT_NONE!r}, None, None], got {quant!r}")
        if not isinstance(options, dict) or set(options) & set(_MAKE_ARGS):
            raise InputError(f"build settings' options must be a dict of method options, got {options!r}")
        quantized = quant[0] != C.QUANT_NONE
        return cls.make(method=record["method"], ratio=record["ratio"], chunk_size=record["chunk_size"],
                        quant=quant[0], group_size=quant[1] if quantized else S.DEFAULT_GROUP_SIZE,
                        zstd_level=record["zstd_level"], checksum=record["checksum"],
                        kv_dtype=record.get("kv_dtype", "auto"), **options)

    def to_json(self) -> dict[str, Any]:
        """The settings as a manifest record and the up-to-date checks hold them (a fresh dict each call):
        ``{"method", "method_params", "ratio", "quant": [type, group size, layout] ([none, None, None] when not
        quantized), "zstd_level", "checksum", "kv_dtype", "chunk_size", "options"}``."""
        quant = ([self.quant, self.group_size, C.QUANT_LAYOUT_COMPACT] if self.quant != C.QUANT_NONE
                 else [C.QUANT_NONE, None, None])
        return _json_copy({"method": self.method, "method_params": self.method_params, "ratio": self.ratio,
                           "quant": quant, "zstd_level": self.zstd_level, "checksum": self.checksum,
                           "kv_dtype": self.kv_dtype, "chunk_size": self.chunk_size, "options": self.options})

    def compress_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``kvpack.compress`` these settings give: ``method``, ``ratio``, ``chunk_size``,
        ``quant``, ``group_size`` (the default when not quantized), ``kv_dtype`` and the method ``options``.
        ``kvpack.save`` takes ``zstd_level`` and ``checksum`` from the fields."""
        return {"method": self.method, "ratio": self.ratio, "chunk_size": self.chunk_size, "quant": self.quant,
                "group_size": self.group_size or S.DEFAULT_GROUP_SIZE, "kv_dtype": self.kv_dtype,
                **_json_copy(self.options)}

    def check_head_dim(self, head_dim: int) -> None:
        """Check the quantization fits a model whose key and value heads have ``head_dim`` channels (before any
        context is compressed).

        Raises:
            InputError: it does not (int4 needs an even head size; the value groups must divide it).
        """
        check_quant(self.quant, self.group_size, head_dim)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))


def _json_copy(value: Any) -> Any:
    """``value``'s JSON round trip: a deep copy holding JSON values only (tuples become lists). ``TypeError`` for a
    value JSON cannot hold."""
    return json.loads(json.dumps(value))


