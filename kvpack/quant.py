"""Reference int8/int4 KV quantization (KIVI layout, arXiv 2402.02750): the codec of quantized ``.kvpack`` v2/v3
files, and the entry points (``quantize_pack``, ``quantize_layer``, ``dequantize_rows``) for both layouts; the
compact layout of versions 4 and 5 is ``kvpack.compact``.

Keys are quantized **per channel**: a group is ``G`` consecutive rows (tokens) of one KV head, one scale and one
min per channel. Values are quantized **per token**: a group is ``Gv = min(G, head_dim_v)`` consecutive channels
of one row. Quantization is asymmetric::

    code = clamp(round((x - min) / scale), 0, 2**bits - 1)        x_hat = code * scale + min

with float16 ``scale`` and ``min``. This reference chooses them so that every element of a group is within
``scale / 2`` of its dequantized value: ``min`` is the group minimum rounded *down* to float16, ``scale`` is
``(max - min) / (2**bits - 1)`` rounded *up* to float16, and a constant group (max == min) gets ``scale = 0`` and
``min`` = the value rounded to nearest (so it dequantizes exactly to the stored min). ``round`` is half to even.
Quantization runs in float64, dequantization in float32 (``code x scale`` is exact there), so results do not
depend on the platform. Scales and mins are clamped to the finite float16 range (±65504): only inputs beyond it
lose the bound. int4 codes are packed two per byte: the even channel in the low nibble, the odd one in the high.

In a pack (``format/SPEC.md`` §5.4), head ``h`` with ``n_h`` entries keeps its ``s_h`` sink rows (position below
``sink_tokens``; quantizing the attention sink is a known failure of quantized caches, cf. KVQuant, arXiv
2401.18079, which keeps the first token in full precision) and its
trailing ``r_h`` residual rows in full precision; the ``b_h = floor((n_h - s_h) / G) * G`` rows in between are
quantized. A head with fewer than ``G`` non-sink rows is not quantized at all.
"""

from __future__ import annotations

import itertools
import sys
from typing import NamedTuple

import torch

from . import constants as C
from .errors import InputError
from .compact import (_joined, compact_problem, compact_split, dequantize_compact, dequantize_compact_layers,
                      quantize_compact)
from .pack import LayerEntries, Pack, QuantizedRows

__all__ = [
    "quant_type",
    "value_group_size",
    "check_quant_args",
    "pack_codes",
    "unpack_codes",
    "quantize_keys",
    "quantize_values",
    "dequantize_keys",
    "dequantize_values",
    "split_lengths",
    "quantize_groups",
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

def quant_type(qtype: str) -> C.QuantType:
    """The ``constants.QuantType`` named ``qtype`` (``"int8"`` or ``"int4"``).

    Raises:
        InputError: unknown name (``"none"`` is not a quantized type).
    """
    spec = C.QUANT_TYPES.get(qtype) if isinstance(qtype, str) else None
    if spec is None:
        raise InputError(f"unknown quantization {qtype!r}; use one of {list(C.QUANT_CHOICES)}")
    return spec


def value_group_size(group_size: int, head_dim_v: int) -> int:
    """``Gv = min(G, head_dim_v)``: channels sharing one value scale and min."""
    return min(int(group_size), int(head_dim_v))


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


# ---------------------------------------------------------------------------------------------------------------
# code packing


def pack_codes(codes: torch.Tensor, qtype: str) -> torch.Tensor:
    """Pack unpacked codes ``[..., C]`` (integers in ``0 .. 2**bits - 1``) into uint8 ``[..., C / codes_per_byte]``.

    int8: the codes as bytes. int4: byte ``i`` = ``codes[2i] | codes[2i + 1] << 4`` (even channel in the low
    nibble). Raises ``InputError`` if ``C`` is not a multiple of ``codes_per_byte``.
    """
    spec = quant_type(qtype)
    c = codes.to(torch.uint8)
    if spec.codes_per_byte == 1:
        return c.contiguous()
    if c.shape[-1] % 2:
        raise InputError(f"int4 packs two codes per byte; the last dimension {c.shape[-1]} is odd")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 ``[..., C / codes_per_byte]`` -> uint8 codes ``[..., C]``."""
    spec = quant_type(qtype)
    if spec.codes_per_byte == 1:
        return packed
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def _codes_as_float(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """``unpack_codes(packed, qtype).float()``, faster: float32 ``[..., C]`` (a new tensor).

    int4 nibbles are spread with 16-bit arithmetic (``((x << 4) | x) & 0x0F0F`` puts the low nibble in the low
    byte and the high nibble in the high byte), so one little-endian int16 is the two codes in channel order;
    interleaving uint8 tensors (``torch.stack``) is several times slower.
    """
    if quant_type(qtype).codes_per_byte == 1:
        return packed.float()
    if sys.byteorder != "little":
        return unpack_codes(packed, qtype).float()
    x = packed.to(torch.int16)
    pairs = ((x << 4) | x) & 0x0F0F  # [..., C/2] int16: byte 0 = even channel's code, byte 1 = odd channel's
    return pairs.view(torch.uint8).float()


# ---------------------------------------------------------------------------------------------------------------
# float16 rounding with a direction


def _f16_step(h: torch.Tensor, up: bool) -> torch.Tensor:
    """The float16 neighbour of each finite float16 in ``h`` towards +inf (``up``) or -inf."""
    bits = h.view(torch.int16).to(torch.int32) & 0xFFFF
    mag = bits & 0x7FFF
    key = torch.where(bits >= 0x8000, -mag, mag) + (1 if up else -1)  # a monotone integer image of the value
    out = torch.where(key >= 0, key, 0x8000 | -key)
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16).view(torch.float16)


def _to_f16(x: torch.Tensor, mode: str) -> torch.Tensor:
    """float64 ``x`` clamped to ±65504 and rounded to float16: ``"down"``, ``"up"`` or ``"nearest"``."""
    x = x.clamp(-C.QUANT_PARAM_MAX, C.QUANT_PARAM_MAX)
    h = x.to(torch.float16)
    if mode == "down":
        h = torch.where(h.double() > x, _f16_step(h, up=False), h)
    elif mode == "up":
        h = torch.where(h.double() < x, _f16_step(h, up=True), h)
    return h


# ---------------------------------------------------------------------------------------------------------------
# the group codec


def quantize_groups(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of each row of ``x`` ``[m, g]`` (one group a row) to codes ``0 .. levels``.

    Returns codes uint8 ``[m, g]`` and float16 ``scale``, ``min`` ``[m]``, chosen as the module docstring says
    (every element within ``scale / 2`` of ``code x scale + min``). ``levels`` <= 255.

    Raises:
        InputError: ``x`` holds NaN or infinity.
    """
    x = x.double()
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise InputError("cannot quantize keys or values that contain NaN or infinity")
    if x.shape[1] == 0:
        empty = torch.zeros(x.shape[0], dtype=torch.float16)
        return torch.zeros(x.shape, dtype=torch.uint8), empty, empty.clone()
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    const = hi == lo
    mins = torch.where(const, _to_f16(lo, "nearest"), _to_f16(lo, "down"))
    span = (hi - mins.double()).clamp(min=0)
    scales = torch.where(const, torch.zeros_like(mins), _to_f16(span / levels, "up"))
    s = scales.double()[:, None]
    q = torch.where(s > 0, torch.round((x - mins.double()[:, None]) / torch.where(s > 0, s, 1.0)), 0.0)
    return q.clamp(0, levels).to(torch.uint8), scales, mins


def quantize_keys(keys: torch.Tensor, qtype: str, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize keys per channel over groups of ``group_size`` consecutive rows (KIVI, arXiv 2402.02750).

    Args:
        keys: ``[Q, D]`` float (any float dtype; computed in float64); ``Q`` a multiple of ``group_size``. The rows
            of one group must belong to one KV head (true for whole heads' bodies concatenated, head 0 first).
        qtype: ``"int8"`` or ``"int4"``.
        group_size: ``G`` >= 1.

    Returns:
        ``codes`` uint8 ``[Q, D / codes_per_byte]``, ``scales`` and ``mins`` float16 ``[Q / G, D]``; group ``g``
        covers rows ``g*G .. g*G + G - 1``. Every element is within ``scale / 2`` of its dequantized value
        (for inputs within the float16 range).

    Raises:
        InputError: ``Q`` not a multiple of ``G``, ``D`` odd for int4, non-finite input, bad ``qtype``/``G``.
    """
    check_quant_args(qtype, group_size)
    if keys.dim() != 2 or keys.shape[0] % group_size:
        raise InputError(f"quantize_keys needs [Q, D] with Q a multiple of group_size {group_size}, "
                         f"got {list(keys.shape)}")
    spec = check_quant_args(qtype, group_size, head_dim=keys.shape[1])
    q, d = keys.shape
    groups = keys.reshape(q // group_size, group_size, d).transpose(1, 2).reshape(-1, group_size)  # [Q/G*D, G]
    codes, scales, mins = quantize_groups(groups, spec.levels)
    codes = codes.reshape(q // group_size, d, group_size).transpose(1, 2).reshape(q, d)
    return pack_codes(codes, qtype), scales.reshape(q // group_size, d), mins.reshape(q // group_size, d)


def quantize_values(values: torch.Tensor, qtype: str, group_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize values per token over groups of ``Gv = min(group_size, Dv)`` channels (KIVI, arXiv 2402.02750).

    Args:
        values: ``[Q, Dv]`` float; ``Dv`` a multiple of ``Gv`` (and even for int4).
        qtype: ``"int8"`` or ``"int4"``.
        group_size: ``G`` >= 1.

    Returns:
        ``codes`` uint8 ``[Q, Dv / codes_per_byte]``, ``scales`` and ``mins`` float16 ``[Q, Dv / Gv]``; group
        ``j`` of row ``i`` covers channels ``j*Gv .. j*Gv + Gv - 1``. Error bound as ``quantize_keys``.

    Raises:
        InputError: ``Dv`` not a multiple of ``Gv`` or odd for int4, non-finite input, bad ``qtype``/``G``.
    """
    if values.dim() != 2:
        raise InputError(f"quantize_values needs [Q, Dv], got {list(values.shape)}")
    q, dv = values.shape
    spec = check_quant_args(qtype, group_size, head_dim_v=dv)
    gv = value_group_size(group_size, dv)
    codes, scales, mins = quantize_groups(values.reshape(-1, gv), spec.levels)
    return pack_codes(codes.reshape(q, dv), qtype), scales.reshape(q, dv // gv), mins.reshape(q, dv // gv)


def dequantize_keys(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, qtype: str,
                    group_size: int) -> torch.Tensor:
    """Keys ``[Q, D]`` float32 from ``quantize_keys``'s output: ``code x scale + min``, group = row // G.

    ``code x scale`` and ``+ min`` are two float32 roundings (no fused multiply-add), so results are exact to the
    bit on every platform. Shapes: codes uint8 ``[Q, D / codes_per_byte]``, scales/mins float16 ``[Q / G, D]``.
    """
    c = _codes_as_float(codes, qtype)
    q, d = c.shape
    # [Q/G, G, D] * [Q/G, 1, D]: each group's scale and min broadcast over its G rows
    grouped = c.view(q // group_size, group_size, d)
    grouped.mul_(scales.float().unsqueeze(1)).add_(mins.float().unsqueeze(1))
    return c


def dequantize_values(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, qtype: str,
                      group_size: int) -> torch.Tensor:
    """Values ``[Q, Dv]`` float32 from ``quantize_values``'s output: ``code x scale + min``, group = channel // Gv.

    Shapes: codes uint8 ``[Q, Dv / codes_per_byte]``, scales/mins float16 ``[Q, Dv / Gv]``; arithmetic as
    ``dequantize_keys``.
    """
    c = _codes_as_float(codes, qtype)
    q, dv = c.shape
    gv = value_group_size(group_size, dv)
    # [Q, Dv/Gv, Gv] * [Q, Dv/Gv, 1]: each row's group scale and min broadcast over its Gv channels
    grouped = c.view(q, dv // gv, gv)
    grouped.mul_(scales.float().unsqueeze(2)).add_(mins.float().unsqueeze(2))
    return c


# ---------------------------------------------------------------------------------------------------------------
# layers


def split_lengths(positions: torch.Tensor, head_lengths: torch.Tensor, sink_tokens: int, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head: sink rows ``s_h``, quantized body rows ``b_h`` and residual rows ``r_h`` (each ``[kv_heads]`` int64).

    ``s_h`` counts the head's entries with position ``< sink_tokens`` (they lead, positions being increasing);
    ``b_h = floor((n_h - s_h) / G) * G``; ``r_h = n_h - s_h - b_h`` (``format/SPEC.md`` §5.4).

    Args:
        positions: ``[entries]`` integer positions, heads back to back; head_lengths: ``[kv_heads]`` integers.
    """
    lengths = head_lengths.to(torch.int64)
    heads = lengths.shape[0]
    head_of_row = torch.repeat_interleave(torch.arange(heads), lengths)
    sink = torch.zeros(heads, dtype=torch.int64).index_add_(0, head_of_row,
                                                             (positions.to(torch.int64) < sink_tokens).long())
    body = (lengths - sink) // group_size * group_size
    return sink, body, lengths - sink - body


def body_row_mask(head_lengths: torch.Tensor, sink: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
    """``[entries]`` bool: which rows of a layer (heads back to back, ``head_lengths`` ``[kv_heads]``) are body rows,
    given each head's ``sink`` and ``body`` row counts ``[kv_heads]`` (``split_lengths``)."""
    lengths = head_lengths.to(torch.int64)
    head_of_row = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    col = torch.arange(int(lengths.sum())) - starts[head_of_row]
    return (col >= sink[head_of_row]) & (col < (sink + body)[head_of_row])


def quantize_layer(entries: LayerEntries, sink_tokens: int, qtype: str, group_size: int,
                   layout: str = C.DEFAULT_QUANT_LAYOUT, query_energy: torch.Tensor | None = None) -> LayerEntries:
    """Quantize one layer's body rows; sink rows (and, in the KIVI layout, residual rows) stay in full precision.

    Args:
        entries: an unquantized layer (``keys [E, D]``, ``values [E, Dv]``, ``positions [E]``, ``head_lengths``).
        sink_tokens: the pack's ``sink_tokens``.
        qtype, group_size: as ``quantize_keys``.
        layout: ``"compact"`` (default; ``kvpack.compact``: body rows per ``compact_split``, per-channel key widths,
            8-bit group parameters) or ``"kivi"`` (body rows per ``split_lengths``, float16 parameters).
        query_energy: compact only: ``[kv_heads, D]`` mean squared queries per KV head and channel (after RoPE), for
            the key code widths; ``None``: one width.

    Returns:
        A new ``LayerEntries`` whose ``keys``/``values`` hold the full-precision rows (per head: sink rows, then
        residual rows) and whose ``quant`` holds the body rows, head 0 first; positions and head lengths as given.

    Raises:
        InputError: the layer is already quantized, the setting does not fit its head sizes, unknown layout.
    """
    if entries.quant is not None:
        raise InputError("this layer is already quantized")
    if layout not in C.QUANT_LAYOUTS:
        raise InputError(f"unknown quantization layout {layout!r}; use one of {list(C.QUANT_LAYOUTS)}")
    d, dv = entries.keys.shape[1], entries.values.shape[1]
    check_quant_args(qtype, group_size, d, dv)
    if layout == C.QUANT_LAYOUT_COMPACT:
        sink, body = compact_split(entries.positions, entries.head_lengths, sink_tokens, group_size)
        is_body = body_row_mask(entries.head_lengths, sink, body)
        parts = quantize_compact(entries.keys[is_body], entries.values[is_body], body, qtype, group_size,
                                 query_energy)
        quant = QuantizedRows(qtype, int(group_size), sink, body, parts[C.KEY_CODES], None, None,
                              parts[C.VALUE_CODES], None, None, layout=layout, key_bits=parts[C.KEY_BITS],
                              key_params=parts[C.KEY_PARAMS], value_params=parts[C.VALUE_PARAMS],
                              quant_grid=parts[C.QUANT_GRID])
    else:
        sink, body, _ = split_lengths(entries.positions, entries.head_lengths, sink_tokens, group_size)
        is_body = body_row_mask(entries.head_lengths, sink, body)
        kc, ks, km = quantize_keys(entries.keys[is_body], qtype, group_size)
        vc, vs, vm = quantize_values(entries.values[is_body], qtype, group_size)
        quant = QuantizedRows(qtype, int(group_size), sink, body, kc, ks, km, vc, vs, vm)
    return LayerEntries(entries.keys[~is_body].clone(), entries.values[~is_body].clone(), entries.positions,
                        entries.head_lengths, quant, biases=entries.biases)


def dequantize_rows(qr: QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's body rows in float32: keys ``[Q, head_dim]`` and values ``[Q, head_dim_v]``, in either layout."""
    if qr.layout == C.QUANT_LAYOUT_COMPACT:
        return dequantize_compact(qr)
    return (dequantize_keys(qr.key_codes, qr.key_scales, qr.key_mins, qr.qtype, qr.group_size),
            dequantize_values(qr.value_codes, qr.value_scales, qr.value_mins, qr.qtype, qr.group_size))


def head_row_pieces(entries: LayerEntries, dtype: torch.dtype | None = None,
                    bodies: tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None = None
                    ) -> tuple[list[int], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Each head's keys and values in full precision, as lists of row blocks to concatenate (no copy yet).

    For an unquantized layer head ``h`` is one block of ``keys`` / ``values``. For a quantized one it is up to three
    blocks in position order: its sink rows (full precision), its body rows (``dequantize_keys`` /
    ``dequantize_values``, float32) and its residual rows (full precision). Blocks are cast to ``dtype`` (default:
    the dtype of ``entries.keys``); empty blocks are left out. ``bodies``: the layer's body rows already
    dequantized, ``(keys, values, key_starts, value_starts)`` with head ``h``'s body rows at rows ``key_starts[h]``
    and ``value_starts[h]`` onwards (``dequantize_bodies``, with the layer's rows of its starts as lists);
    dequantized here when ``None``.

    Returns:
        ``(lengths, key_blocks, value_blocks)``: ``lengths[h]`` rows of head ``h`` (Python ints, ``kv_heads`` of
        them); ``key_blocks[h]`` views ``[rows, head_dim]`` and ``value_blocks[h]`` views ``[rows, head_dim_v]``
        whose row counts add up to ``lengths[h]``. The views may share memory with ``entries``.
    """
    dt = dtype or entries.keys.dtype
    keys, values = entries.keys.to(dt), entries.values.to(dt)
    lengths = entries.head_lengths.tolist()
    qr = entries.quant
    if qr is None:
        key_blocks, value_blocks, start = [], [], 0
        for n in lengths:
            key_blocks.append([keys[start : start + n]] if n else [])
            value_blocks.append([values[start : start + n]] if n else [])
            start += n
        return lengths, key_blocks, value_blocks
    if bodies is None:
        body_keys, body_values, key_starts, value_starts = dequantize_bodies([qr])
        key_starts, value_starts = key_starts[0].tolist(), value_starts[0].tolist()
    else:
        body_keys, body_values, key_starts, value_starts = bodies
    body_keys, body_values = body_keys.to(dt), body_values.to(dt)
    key_blocks, value_blocks = [], []
    fp = 0  # next full-precision row
    for n, s, b, kq, vq in zip(lengths, qr.sink_lengths.tolist(), qr.body_lengths.tolist(), key_starts, value_starts):
        r = n - s - b
        # (first row, rows) of the sink, body and residual blocks of this head, in their sources
        key_blocks.append([x[a : a + m] for x, a, m in ((keys, fp, s), (body_keys, kq, b), (keys, fp + s, r)) if m])
        value_blocks.append([x[a : a + m] for x, a, m in ((values, fp, s), (body_values, vq, b), (values, fp + s, r))
                             if m])
        fp += s + r
    return lengths, key_blocks, value_blocks


class DequantizedBodies(NamedTuple):
    """The body rows of several quantized layers in full precision (``dequantize_bodies``; KIVI grouping,
    arXiv 2402.02750 §3, in either layout).

    ``keys`` float32 ``[key rows, head_dim]`` and ``values`` float32 ``[value rows, head_dim_v]``; the body rows of
    head ``h`` of layer ``l`` are rows ``key_starts[l, h]`` (of ``keys``) and ``value_starts[l, h]`` (of ``values``)
    onwards, ``body_lengths[h]`` of them, in order (``key_starts``, ``value_starts``: int64 ``[layers, kv_heads]``).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_starts: torch.Tensor
    value_starts: torch.Tensor


def dequantize_bodies(quants: list[QuantizedRows]) -> DequantizedBodies:
    """The body rows of several layers dequantized together, for either layout (no errors raised beyond torch's for
    mismatched shapes).

    KIVI layout (arXiv 2402.02750 §3): one ``dequantize_keys`` and one ``dequantize_values`` over the layers' rows
    back to back; bit-identical to dequantizing each layer alone, as every layer's ``Q`` is a multiple of ``G`` (the
    key groups of the concatenation are the layers' own groups) and value groups never span rows. Compact layout:
    ``compact.dequantize_compact_layers``, whose key rows are padded so that each key group is ``G`` aligned rows.

    Args:
        quants: the layers' ``QuantizedRows``, all with the same ``qtype``, ``group_size``, layout and head sizes
            (compact layers each use their own grids and widths).
    """
    body = [b for q in quants for b in q.body_lengths.tolist()]
    back_to_back = torch.tensor(list(itertools.accumulate([0] + body[:-1])), dtype=torch.int64).view(len(quants), -1)
    if quants[0].layout == C.QUANT_LAYOUT_COMPACT:
        keys, values, key_starts = dequantize_compact_layers(quants)
        return DequantizedBodies(keys, values, key_starts, back_to_back)
    qtype, g = quants[0].qtype, quants[0].group_size

    def joined(part: str) -> torch.Tensor:
        return _joined([getattr(q, part) for q in quants])

    keys = dequantize_keys(joined("key_codes"), joined("key_scales"), joined("key_mins"), qtype, g)
    values = dequantize_values(joined("value_codes"), joined("value_scales"), joined("value_mins"), qtype, g)
    return DequantizedBodies(keys, values, back_to_back, back_to_back)


def dequantize_layer(entries: LayerEntries, dtype: torch.dtype | None = None) -> LayerEntries:
    """All rows of a quantized layer in full precision (``LayerEntries.dequantized`` calls this).

    Body rows are ``dequantize_keys``/``dequantize_values`` (float32) cast to ``dtype`` (default: the dtype of
    ``entries.keys``); full-precision rows are copied. Returns an unquantized ``LayerEntries`` with the same
    positions and head lengths: keys ``[entries, head_dim]``, values ``[entries, head_dim_v]``.
    """
    if entries.quant is None:
        return entries.dequantized(dtype)
    dt = dtype or entries.keys.dtype
    _, key_blocks, value_blocks = head_row_pieces(entries, dt)
    keys = [block for blocks in key_blocks for block in blocks]
    values = [block for blocks in value_blocks for block in blocks]
    n = entries.num_entries
    keys = torch.cat(keys) if keys else torch.empty(n, entries.keys.shape[1], dtype=dt)
    values = torch.cat(values) if values else torch.empty(n, entries.values.shape[1], dtype=dt)
    return LayerEntries(keys, values, entries.positions, entries.head_lengths, biases=entries.biases)


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


def quantize_pack(pack: Pack, qtype: str, group_size: int = C.DEFAULT_GROUP_SIZE,
                  layout: str = C.DEFAULT_QUANT_LAYOUT, query_energy: list[torch.Tensor] | None = None) -> Pack:
    """Quantize every layer of ``pack`` (``quantize_layer``) and record the error (export-time report).

    Args:
        pack: an unquantized pack (``kvpack.compress`` output).
        qtype: ``"int8"`` or ``"int4"`` (``"none"`` returns ``pack`` unchanged).
        group_size: ``G``, one of ``constants.GROUP_SIZES`` for packs meant to be shared (any ``G`` >= 1 works).
        layout: ``"compact"`` (default; format versions 4-5, written as 5) or ``"kivi"`` (versions 2-3).
        query_energy: compact only: per layer ``[kv_heads, head_dim]`` mean squared queries (``kvpack.compress``
            records them during the prefill), for per-channel key code widths; ``None``: one width.

    Returns:
        A new ``Pack`` with quantized layers and ``metadata["stats"]["quant_error"]``: one ``layer_error_stats``
        dict per layer (with its ``"layer"`` index). ``pack`` itself is not modified.

    Raises:
        InputError: unknown type or layout, bad group size, head sizes that do not fit (see ``check_quant_args``),
            a pack already quantized, ``query_energy`` not one ``[kv_heads, head_dim]`` tensor per layer.
    """
    if qtype == C.QUANT_NONE:
        return pack
    if query_energy is not None and (len(query_energy) != len(pack.layers) or any(
            tuple(e.shape) != (l.head_lengths.shape[0], l.keys.shape[1]) for e, l in zip(query_energy, pack.layers))):
        raise InputError("query_energy must hold one [kv_heads, head_dim] tensor per layer of the pack")
    layers, errors = [], []
    for l, layer in enumerate(pack.layers):
        q = quantize_layer(layer, pack.sink_tokens, qtype, group_size, layout,
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

    Checks the type and group size, dtypes and shapes of the six tensors, that ``keys``/``values`` hold exactly the
    full-precision rows, and that the sink and body lengths are those ``split_lengths`` derives from the positions.
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
    cpb = spec.codes_per_byte
    gv = value_group_size(g, dv)
    if d % cpb or dv % cpb or dv % gv:
        return f"head_dim {d} / head_dim_v {dv} do not fit {qr.qtype} with group size {g}"
    if qr.layout == C.QUANT_LAYOUT_COMPACT:
        return _compact_layer_problem(entries, sink_tokens)
    if qr.layout != C.QUANT_LAYOUT_KIVI:
        return f"quant layout {qr.layout!r} is not one of {list(C.QUANT_LAYOUTS)}"
    rows = qr.key_codes.shape[0] if isinstance(qr.key_codes, torch.Tensor) else -1
    if rows % g:
        return f"{rows} quantized rows is not a multiple of the group size {g}"
    want = {
        "key_codes": (torch.uint8, (rows, d // cpb)),
        "key_scales": (torch.float16, (rows // g, d)),
        "key_mins": (torch.float16, (rows // g, d)),
        "value_codes": (torch.uint8, (rows, dv // cpb)),
        "value_scales": (torch.float16, (rows, dv // gv)),
        "value_mins": (torch.float16, (rows, dv // gv)),
    }
    for name, (dtype, shape) in want.items():
        t = getattr(qr, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"quant.{name} must be {dtype} {list(shape)}, not {got}"
    sink, body, _ = split_lengths(entries.positions, entries.head_lengths, sink_tokens, g)
    for name, want_t in (("sink_lengths", sink), ("body_lengths", body)):
        t = getattr(qr, name)
        if not isinstance(t, torch.Tensor) or t.shape != want_t.shape or not torch.equal(t.to(torch.int64), want_t):
            return f"quant.{name} differ from the layout rule (sink rows, then floor((n - sink) / G) * G rows)"
    if int(body.sum()) != rows:
        return f"the heads' body rows sum to {int(body.sum())}, but {rows} rows are quantized"
    if entries.keys.shape[0] != entries.num_entries - rows or entries.values.shape[0] != entries.keys.shape[0]:
        return (f"keys/values must hold the {entries.num_entries - rows} full-precision rows "
                f"({entries.num_entries} entries - {rows} quantized), not {entries.keys.shape[0]}")
    return None


def _compact_layer_problem(entries: LayerEntries, sink_tokens: int) -> str | None:
    """``layer_quant_problem`` for the compact layout (``format/SPEC.md`` §5.6)."""
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
