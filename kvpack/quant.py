"""Quantize packs in the compact layout of format 1.0 (``format/SPEC.md`` §5.4) and check quantized layers: the
pack-level entry points over the codec ``kvpack.compact`` (``quantize_pack``, ``quantize_layer``, ``check_quant_args``,
``layer_quant_problem``, ``layer_error_stats``).

Keys are quantized **per channel** over groups of ``G`` consecutive rows of one KV head, values **per token** over
groups of ``Gv = min(G, head_dim_v)`` channels (KIVI's grouping, arXiv 2402.02750 §3), asymmetrically
(``x_hat = code x scale + min``), with per-channel key code widths and 8-bit group parameters. Head ``h`` keeps its
``s_h`` sink rows (position below ``sink_tokens``) in full precision; its other rows are quantized when there are at
least ``G`` of them (else the whole head stays in full precision).

The decode entry points live with the data they decode: ``kvpack.pack.dequantize_bodies`` (several layers at once)
and ``LayerEntries.dequantized`` / ``kvpack.pack.dequantize_layer``, over ``kvpack.compact.dequantize_compact_layers``;
they are re-exported here.
"""

from __future__ import annotations

import torch

from . import constants as C
from . import settings as S
from .compact import (body_row_mask, compact_problem, compact_split, dequantize_compact, pack_codes,
                      quantize_compact, unpack_codes)
from .errors import InputError
from .pack import (DequantizedBodies, LayerEntries, Pack, QuantizedRows, dequantize_bodies, dequantize_layer,
                   head_row_pieces)
from .rules import quant_type, value_group_size

__all__ = [
    "quant_type",
    "value_group_size",
    "check_quant_args",
    "pack_codes",
    "unpack_codes",
    "compact_split",
    "body_row_mask",
    "quantize_layer",
    "dequantize_rows",
    "head_row_pieces",
    "dequantize_layer",
    "dequantize_bodies",
    "DequantizedBodies",
    "quantize_pack",
    "layer_error_stats",
    "layer_quant_problem",
]


def check_quant_args(qtype: str, group_size: int, head_dim: int | None = None, head_dim_v: int | None = None,
                     *, allowed_group_sizes: tuple[int, ...] | None = None) -> C.QuantType:
    """Validate a quantization setting (and, if given, the head sizes it must fit); return the type.

    Args:
        qtype: ``"int8"`` or ``"int4"``.
        group_size: ``G`` >= 1 (and <= ``MAX_GROUP_SIZE``); if ``allowed_group_sizes`` is given, one of them.
        head_dim, head_dim_v: key and value head sizes: both even for int4, ``head_dim_v`` a multiple of ``Gv``.

    Raises:
        InputError: naming the bad value and the accepted ones.
    """
    spec = quant_type(qtype)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= C.MAX_GROUP_SIZE:
        raise InputError(f"group_size must be an integer in [1, {C.MAX_GROUP_SIZE}], got {group_size!r}")
    if allowed_group_sizes is not None and group_size not in allowed_group_sizes:
        raise InputError(f"group_size must be one of {list(allowed_group_sizes)}, got {group_size}")
    for what, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if d is not None and d % spec.codes_per_byte:
            raise InputError(f"{qtype} packs {spec.codes_per_byte} codes per byte, so {what} must be a multiple "
                             f"of {spec.codes_per_byte}; it is {d}. Use --quant int8")
    if head_dim_v is not None and head_dim_v % value_group_size(group_size, head_dim_v):
        gv = value_group_size(group_size, head_dim_v)
        raise InputError(f"values are quantized in groups of min(group_size, head_dim_v) = {gv} channels, which "
                         f"must divide head_dim_v = {head_dim_v}; choose another group size")
    return spec


def quantize_layer(entries: LayerEntries, sink_tokens: int, qtype: str, group_size: int,
                   query_energy: torch.Tensor | None = None) -> LayerEntries:
    """Quantize one layer's body rows (``compact_split``: per-channel key widths, 8-bit group parameters); sink rows,
    and heads with fewer than ``G`` non-sink rows, stay in full precision.

    Args:
        entries: an unquantized layer (``keys [E, D]``, ``values [E, Dv]``, ``positions [E]``, ``head_lengths``).
        sink_tokens: the pack's ``sink_tokens``.
        qtype, group_size: ``"int8"`` or ``"int4"``, and ``G``.
        query_energy: ``[kv_heads, D]`` mean squared queries per KV head and channel (after RoPE), for
            the key code widths; ``None``: one width.

    Returns:
        A new ``LayerEntries`` whose ``keys``/``values`` hold the full-precision rows and whose ``quant`` holds the
        body rows, head 0 first; positions, head lengths and biases as given.

    Raises:
        InputError: the layer is already quantized, or the setting does not fit its head sizes.
    """
    if entries.quant is not None:
        raise InputError("this layer is already quantized")
    d, dv = entries.keys.shape[1], entries.values.shape[1]
    check_quant_args(qtype, group_size, d, dv)
    sink, body = compact_split(entries.positions, entries.head_lengths, sink_tokens, group_size)
    is_body = body_row_mask(entries.head_lengths, sink, body)
    parts = quantize_compact(entries.keys[is_body], entries.values[is_body], body, qtype, group_size, query_energy)
    quant = QuantizedRows(qtype, int(group_size), sink, body, parts[C.KEY_CODES], parts[C.VALUE_CODES],
                          parts[C.KEY_BITS], parts[C.KEY_PARAMS], parts[C.VALUE_PARAMS], parts[C.QUANT_GRID])
    return LayerEntries(entries.keys[~is_body].clone(), entries.values[~is_body].clone(), entries.positions,
                        entries.head_lengths, quant, entries.biases)


def dequantize_rows(qr: QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's body rows in float32: keys ``[Q, head_dim]`` and values ``[Q, head_dim_v]``
    (``compact.dequantize_compact``)."""
    return dequantize_compact(qr)


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (keeps the metadata short)."""
    return float(f"{x:.4g}")


def layer_error_stats(original: LayerEntries, quantized: LayerEntries) -> dict:
    """Absolute error of a quantized layer against the layer it was made from, over all its entries.

    Returns:
        ``{"key_max_abs", "key_mean_abs", "value_max_abs", "value_mean_abs", "quantized_fraction"}``: max and mean
        of ``|dequantized - original|`` over every element of the layer's keys / values (full-precision rows count
        as exact), in the units of the KV, to 4 significant digits; and the fraction of entries quantized.
    """
    deq = quantized.dequantized(torch.float32)
    out = {}
    for name, a, b in (("key", deq.keys, original.keys), ("value", deq.values, original.values)):
        err = (a - b.float()).abs()
        out[f"{name}_max_abs"] = _sig(float(err.max())) if err.numel() else 0.0
        out[f"{name}_mean_abs"] = _sig(float(err.mean())) if err.numel() else 0.0
    rows = quantized.quant.rows if quantized.quant is not None else 0
    out["quantized_fraction"] = _sig(rows / max(1, original.num_entries))
    return out


def quantize_pack(pack: Pack, qtype: str, group_size: int = S.DEFAULT_GROUP_SIZE,
                  query_energy: list[torch.Tensor] | None = None) -> Pack:
    """Quantize every layer of ``pack`` (``quantize_layer``) and record the error (export-time report).

    Args:
        pack: an unquantized pack (``kvpack.compress`` output).
        qtype: ``"int8"`` or ``"int4"`` (``"none"`` returns ``pack`` unchanged).
        group_size: ``G``, one of ``settings.GROUP_SIZES`` for packs meant to be shared (any ``G`` >= 1 works).
        query_energy: per layer ``[kv_heads, head_dim]`` mean squared queries (``kvpack.compress``
            records them during the prefill), for per-channel key code widths; ``None``: one width.

    Returns:
        A new ``Pack`` with quantized layers and ``metadata["stats"]["quant_error"]``: one ``layer_error_stats``
        dict per layer (with its ``"layer"`` index). ``pack`` itself is not modified.

    Raises:
        InputError: unknown type, bad group size, head sizes that do not fit (see ``check_quant_args``),
            a pack already quantized, ``query_energy`` not one ``[kv_heads, head_dim]`` tensor per layer.
    """
    if qtype == C.QUANT_NONE:
        return pack
    if query_energy is not None and (len(query_energy) != len(pack.layers) or any(
            tuple(e.shape) != (l.head_lengths.shape[0], l.keys.shape[1]) for e, l in zip(query_energy, pack.layers))):
        raise InputError("query_energy must hold one [kv_heads, head_dim] tensor per layer of the pack")
    layers, errors = [], []
    for l, layer in enumerate(pack.layers):
        q = quantize_layer(layer, pack.sink_tokens, qtype, group_size,
                           None if query_energy is None else query_energy[l])
        layers.append(q)
        errors.append({"layer": l, **layer_error_stats(layer, q)})
    metadata = dict(pack.metadata)
    stats = dict(metadata.get("stats") or {})
    stats["quant_error"] = errors
    metadata["stats"] = stats
    return Pack(pack.token_ids, layers, pack.sink_tokens, metadata)


def layer_quant_problem(entries: LayerEntries, sink_tokens: int) -> str | None:
    """Why a quantized layer's ``quant`` does not fit the layout rules (``format/SPEC.md`` §5.4), or ``None``.

    Checks the type and group size, dtypes, shapes and values of the six tensors (``compact.compact_problem``), that
    ``keys``/``values`` hold exactly the full-precision rows, and that the sink and body lengths are those
    ``compact_split`` derives from the positions.
    Assumes positions and head lengths are otherwise consistent.
    """
    qr = entries.quant
    if not isinstance(qr, QuantizedRows):
        return "quant must be a QuantizedRows"
    spec = C.QUANT_TYPES.get(qr.qtype) if isinstance(qr.qtype, str) else None
    g = qr.group_size
    if spec is None or isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= C.MAX_GROUP_SIZE:
        return f"quant type {qr.qtype!r} / group size {g!r} are not valid"
    d, dv = entries.keys.shape[1], entries.values.shape[1]
    gv = value_group_size(g, dv)
    if (d * spec.bits) % 8 or dv % spec.codes_per_byte or dv % gv:
        return f"head_dim {d} / head_dim_v {dv} do not fit {qr.qtype} with group size {g}"
    return _compact_layer_problem(entries, sink_tokens)


def _compact_layer_problem(entries: LayerEntries, sink_tokens: int) -> str | None:
    """``layer_quant_problem`` (``format/SPEC.md`` §5.4)."""
    qr = entries.quant
    sink, body = compact_split(entries.positions, entries.head_lengths, sink_tokens, qr.group_size)
    for name, want_t in (("sink_lengths", sink), ("body_lengths", body)):
        t = getattr(qr, name)
        if not isinstance(t, torch.Tensor) or t.shape != want_t.shape or not torch.equal(t.to(torch.int64), want_t):
            return f"quant.{name} differ from the compact layout rule (sink rows, then every other row if >= G)"
    problem = compact_problem(qr, entries.keys.shape[1], entries.values.shape[1])
    if problem is not None:
        return problem
    rows = int(body.sum())
    if entries.keys.shape[0] != entries.num_entries - rows or entries.values.shape[0] != entries.keys.shape[0]:
        return (f"keys/values must hold the {entries.num_entries - rows} full-precision rows "
                f"({entries.num_entries} entries - {rows} quantized), not {entries.keys.shape[0]}")
    return None
