"""The quantization codec of ``.kvpack`` format 1.0, the compact layout: per-channel key code widths and 8-bit group
parameters (``format/SPEC.md`` §5.4). Pure tensor arithmetic: it imports nothing of kvpack's but the constants and
errors; ``kvpack.quant`` applies it to packs.

It keeps KIVI's grouping (arXiv 2402.02750 §3: keys per channel over ``G`` consecutive rows of one head, values
per row over ``Gv = min(G, head_dim_v)`` channels; asymmetric ``x_hat = code x scale + min``) and changes three
things, each measured on the reference model (``BENCHMARKS.md``, "4-bit KV"):

* **Key code widths per channel.** Each KV head's key channels get their own widths (``key_bits``; 2 to 8 bits
  from the writer, ``bits`` on average, so a row takes the same bytes as with one width). The widths minimise the
  query-weighted error ``sum_c E[q_c^2] x E[range_c^2] x 4^-w_c`` over the context's own queries (after RoPE, over
  the query heads of the GQA group): the classic rate-distortion bit allocation, error variance ~ step^2 ~ 4^-w
  (``allocate_widths``). Without query statistics the widths are uniform. A row's codes are one little-endian
  bit string, channel 0 first; with uniform widths it is KIVI's nibble packing.
* **8-bit group parameters.** Each group's min and scale are one byte each, on grids shared by a parameter column
  (a key channel, or a value group position) of the layer (``quant_grid``): ``min = code x step + base`` with
  the min rounded *down* onto the grid, and ``scale`` a tiny float ``base x (32 + m) x 2**(e - 12)`` (``e`` the
  code's top 3 bits, ``m`` its low 5; code 0 is scale 0), rounded *up*; codes are then taken against the stored
  parameters, so every element stays within ``scale / 2`` of its dequantized value.
  All parameter arithmetic is float32 multiply-then-add, so every platform dequantizes to the same bits.
* **No full-precision residual.** A head with at least ``G`` non-sink rows has all of them quantized; its last
  key group may be shorter than ``G``. The attention sink and heads with fewer than ``G`` non-sink rows stay in
  full precision (quantizing the attention sink is a known failure of quantized caches, cf. KVQuant,
  arXiv 2401.18079).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from . import constants as C
from . import settings as S
from .rules import compact_values_problem, quant_type, quant_type_bits, value_group_size
from .errors import InputError

__all__ = [
    "pack_codes",
    "unpack_codes",
    "body_row_mask",
    "compact_split",
    "allocate_widths",
    "scale_table",
    "scale_codes",
    "min_grid",
    "min_codes",
    "min_values",
    "pack_bits",
    "unpack_bits",
    "group_index",
    "quantize_compact",
    "dequantize_compact",
    "dequantize_compact_layers",
    "dequantized_range",
    "dequantized_ranges",
    "compact_shapes",
    "compact_problem",
]

#: ``(32 + m) x 2**(e - 12)`` for scale codes ``e << 5 | m``: the multiplier of the column's scale base.
_SCALE_MULTIPLIERS = torch.tensor([(32 + (k & 31)) * 2.0 ** ((k >> 5) - 12) for k in range(256)], dtype=torch.float32)
#: Largest multiplier (code 255): 63/32.
_TOP_MULTIPLIER = float(_SCALE_MULTIPLIERS[255])
#: ``_SCALE_MULTIPLIERS`` with code 0 mapped to 0, as a numpy array: ``base x _CODE_MULTIPLIERS[code]`` is
#: ``scale_table(base)[code]``.
_CODE_MULTIPLIERS = np.concatenate([[0.0], _SCALE_MULTIPLIERS[1:].numpy()]).astype(np.float32)


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


def body_row_mask(head_lengths: torch.Tensor, sink: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
    """``[entries]`` bool: which rows of a layer (heads back to back, ``head_lengths`` ``[kv_heads]``) are body rows,
    given each head's ``sink`` and ``body`` row counts ``[kv_heads]`` (``compact_split``)."""
    lengths = head_lengths.to(torch.int64)
    head_of_row = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    col = torch.arange(int(lengths.sum())) - starts[head_of_row]
    return (col >= sink[head_of_row]) & (col < (sink + body)[head_of_row])


def compact_split(positions: torch.Tensor, head_lengths: torch.Tensor, sink_tokens: int, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head ``[kv_heads]`` int64: sink rows ``s_h`` (positions below ``sink_tokens``) and quantized body rows
    ``b_h = n_h - s_h`` if that is at least ``group_size``, else 0 (``format/SPEC.md`` §5.4)."""
    lengths = head_lengths.to(torch.int64)
    head_of_row = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    sink = torch.zeros(lengths.shape[0], dtype=torch.int64).index_add_(
        0, head_of_row, (positions.to(torch.int64) < sink_tokens).long())
    rest = lengths - sink
    return sink, torch.where(rest >= group_size, rest, torch.zeros_like(rest))


def allocate_widths(weights: torch.Tensor, mean_bits: int, low: int = S.ALLOCATED_KEY_BITS[0],
                    high: int = S.ALLOCATED_KEY_BITS[1]) -> torch.Tensor:
    """Integer code widths ``[heads, channels]`` int64 in ``[low, high]``, each row summing to ``mean_bits x
    channels``, minimising ``sum_c weights[h, c] x 4**-width[h, c]`` per row.

    Greedy (exact for this separable convex objective): from ``low`` everywhere, each extra bit goes to the channel
    whose weighted error it reduces most; ties go to the lowest channel. A row without a positive finite weight,
    and every row when ``mean_bits >= high``, gets ``mean_bits`` everywhere.

    Args:
        weights: ``[heads, channels]`` non-negative (query energy x mean squared group range).
        mean_bits: the average width (4 for int4, 8 for int8), in ``[low, high]``.
    """
    heads, channels = weights.shape
    uniform = torch.full((heads, channels), mean_bits, dtype=torch.int64)
    w = weights.double()
    usable = torch.isfinite(w).all(dim=1) & (w > 0).any(dim=1)
    if mean_bits >= high or not bool(usable.any()):
        return uniform
    bits = torch.full((heads, channels), low, dtype=torch.int64)
    rows = torch.arange(heads)
    for _ in range((mean_bits - low) * channels):
        gain = torch.where(bits < high, w * torch.pow(4.0, -bits.double()), torch.full_like(w, -1.0))
        bits[rows, gain.argmax(dim=1)] += 1
    return torch.where(usable[:, None], bits, uniform)


def scale_table(base: torch.Tensor) -> torch.Tensor:
    """``[columns, 256]`` float32: the scale of every code of each column (code 0: 0; code ``e << 5 | m``:
    ``base x (32 + m) x 2**(e - 12)``, one float32 rounding). ``base``: ``[columns]`` float32 >= 0."""
    table = base.float()[:, None] * _SCALE_MULTIPLIERS[None, :]
    table[:, 0] = 0.0
    return table


def _scale_base(needed_max: torch.Tensor) -> torch.Tensor:
    """Smallest float32 base ``[columns]`` whose top scale (code 255) is at least ``needed_max`` (float64 >= 0)."""
    base = (needed_max / _TOP_MULTIPLIER).float()
    for _ in range(4):
        short = (base * _TOP_MULTIPLIER).double() < needed_max
        if not bool(short.any()):
            return base
        base = torch.where(short, torch.nextafter(base, torch.full_like(base, float("inf"))), base)
    raise InputError("a quantization scale does not fit float32; the keys or values are too large to quantize")


def scale_codes(needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round each column's scales up onto its grid: ``(codes uint8 [n, columns], scales float32 [n, columns],
    base float32 [columns])``, ``scales >= needed`` (``needed``: ``[n, columns]`` float64 >= 0, in KV units).

    Raises:
        InputError: a needed scale beyond the float32 range.
    """
    base = _scale_base(needed.amax(dim=0) if needed.shape[0] else needed.new_zeros(needed.shape[1]))
    table = scale_table(base)  # increasing along the codes
    codes = torch.searchsorted(table.double().contiguous(), needed.t().contiguous()).clamp_(max=255).t()
    scales = table.gather(1, codes.t()).t()
    return codes.to(torch.uint8), scales.contiguous(), base


def min_grid(group_mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column's min grid ``(base, step)`` float32 ``[columns]`` for ``group_mins`` ``[n, columns]`` float64:
    ``base`` the column minimum rounded down to float32, ``step = (max - base) / 255`` rounded up."""
    lo, hi = group_mins.amin(dim=0), group_mins.amax(dim=0)
    base = lo.float()
    base = torch.where(base.double() > lo, torch.nextafter(base, torch.full_like(base, -float("inf"))), base)
    step = ((hi - base.double()) / 255).float()
    step = torch.where(step.double() * 255 < hi - base.double(),
                       torch.nextafter(step, torch.full_like(step, float("inf"))), step)
    return base, step


def min_values(codes: torch.Tensor, base: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``codes x step + base`` float32 ``[n, columns]`` (two float32 roundings, no fused multiply-add)."""
    return codes.float() * step + base


def min_codes(group_mins: torch.Tensor, base: torch.Tensor, step: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round each group min down onto its column's grid: ``(codes uint8, mins float32)``, ``mins <= group_mins``."""
    safe = torch.where(step > 0, step, torch.ones_like(step)).double()
    codes = torch.where(step > 0, torch.floor((group_mins - base.double()) / safe), torch.zeros_like(group_mins))
    codes = codes.clamp(0, 255)
    for _ in range(4):  # float rounding of the division: settle on the largest code whose min is not above
        over = min_values(codes, base, step).double() > group_mins
        under = (codes < 255) & (step > 0) & (min_values(codes + 1, base, step).double() <= group_mins)
        if not bool(over.any() or under.any()):
            return codes.to(torch.uint8), min_values(codes, base, step)
        codes = codes - over.double() + under.double()  # code 0 (the base) is never above a group min
    raise RuntimeError("internal error: a group min could not be rounded down onto its grid")


def pack_bits(codes: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Rows of codes ``[rows, channels]`` (channel ``c`` below ``2**widths[c]``) as little-endian bit strings:
    uint8 ``[rows, sum(widths) / 8]``; bit ``j`` of channel ``c``'s code is bit ``o_c + j`` of the row,
    ``o_c = sum(widths[:c])``, and row bit ``k`` is bit ``k mod 8`` of byte ``k div 8``."""
    bits = (codes.to(torch.int64)[..., None] >> torch.arange(8)) & 1  # [rows, channels, 8]
    keep = torch.arange(8)[None, :] < widths.to(torch.int64)[:, None]  # [channels, 8]
    stream = bits[:, keep].to(torch.uint8).numpy()  # [rows, sum(widths)], channel-major, low bit first
    return torch.from_numpy(np.packbits(stream, axis=1, bitorder="little"))


def _placements(widths: torch.Tensor) -> torch.Tensor:
    """``[heads, sum(widths[0]), channels]`` float32: ``2**j`` at ``(o_c + j, c)`` for ``j < widths[h, c]``, the
    matrix that sums a row's bits into its channels' codes (``widths``: ``[heads, channels]``, equal row sums)."""
    heads, channels = widths.shape
    j = torch.arange(C.MAX_KEY_BITS)
    used = j[None, None, :] < widths[:, :, None]  # [heads, channels, 8]
    rows = (torch.cumsum(widths, 1) - widths)[:, :, None] + j  # row bit of each (channel, j)
    place = torch.zeros(heads, int(widths[0].sum()), channels)
    h, c, k = used.nonzero(as_tuple=True)
    place[h, rows[h, c, k], c] = torch.pow(2.0, k.float())
    return place


def unpack_bits(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_bits``: float32 codes ``[rows, channels]``.

    The row's bits are expanded (``numpy.unpackbits``) and summed into channels by one matrix product with the
    ``[bits, channels]`` matrix of ``2**j`` at ``(o_c + j, c)``: exact in float32 (codes below 256).
    """
    widths = widths.to(torch.int64)
    if packed.shape[0] == 0:
        return torch.zeros(0, widths.shape[0])
    bits = torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), axis=1, bitorder="little")).float()
    return bits @ _placements(widths[None])[0]


def group_index(body_lengths: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group of each body row [Q], head of each group [K])`` int64: head ``h``'s rows form ``ceil(b_h / G)``
    groups of ``G`` consecutive rows (the last may be shorter), head 0's first."""
    body = body_lengths.to(torch.int64)
    groups = (body + group_size - 1) // group_size
    head_of_row = torch.repeat_interleave(torch.arange(body.shape[0]), body)
    row_starts = torch.cumsum(body, 0) - body
    group_starts = torch.cumsum(groups, 0) - groups
    in_head = torch.arange(int(body.sum())) - row_starts[head_of_row]
    return group_starts[head_of_row] + in_head // group_size, torch.repeat_interleave(torch.arange(body.shape[0]),
                                                                                      groups)


def _joined(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(parts, dim)``, without copying when the parts are consecutive slices along ``dim`` of one storage
    (the layers of a loaded file are views of one tensor per part, ``format/SPEC.md`` §5.4): then a view of that
    storage. ``parts``: one or more tensors, equal but for their size along ``dim``."""
    first = parts[0]
    if len(parts) == 1:
        return first
    storage, offset, rest = first.untyped_storage().data_ptr(), first.storage_offset(), first.shape[dim + 1 :]
    for p in parts:
        if (p.untyped_storage().data_ptr() != storage or p.dtype != first.dtype or p.stride() != first.stride()
                or p.storage_offset() != offset or p.shape[:dim] != first.shape[:dim] or p.shape[dim + 1 :] != rest):
            return torch.cat(parts, dim)
        offset += p.shape[dim] * first.stride(dim)
    shape = (*first.shape[:dim], sum(p.shape[dim] for p in parts), *rest)
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _padded_heads(x: torch.Tensor, rows: list[int], padded: list[int]) -> torch.Tensor:
    """``x`` (runs of ``rows[i]`` rows back to back) with each run followed by zero rows up to ``padded[i]`` rows.

    Done in numpy: a zeroed array and one slice assignment per run cost a few microseconds, where ``torch.cat`` of
    the runs and zero blocks costs several times more for these small byte tensors.
    """
    src = x.numpy()
    out = np.zeros((sum(padded), *src.shape[1:]), dtype=src.dtype)
    row = start = 0
    for n, p in zip(rows, padded):
        out[start : start + n] = src[row : row + n]
        row, start = row + n, start + p
    return torch.from_numpy(out)


def _key_codes(quants: list, widths: np.ndarray, groups: list[int], padded: torch.Tensor) -> torch.Tensor:
    """Key codes ``[K, G, head_dim]`` of the group-padded key rows ``padded`` (uint8 ``[K x G, row bytes]``: the
    ``groups[i]`` key groups of (layer, head) ``i``, whose channel widths are ``widths[i]`` (uint8), each padded
    to ``G`` rows): int16, or float32 when every width is the type's bits.

    Uniform widths take the KIVI unpacking. Otherwise a code of ``w <= 8`` bits at row bit ``o`` lies in the 16-bit
    window of bytes ``o // 8`` and ``o // 8 + 1``: it is ``(window >> o % 8) & (2**w - 1)``. The byte index, shift
    and mask of each channel are its head's; every group lies in one head, so one table row per group (made with
    numpy: small) is broadcast over its ``G`` rows (no per-row tables).
    """
    g, d = quants[0].group_size, widths.shape[1]
    if (widths == quant_type_bits(quants[0].qtype)).all():
        return _codes_as_float(padded, quants[0].qtype).view(-1, g, d)
    windows = padded.to(torch.int16)
    windows[:, :-1] |= windows[:, 1:] << 8  # the right-hand side is a new tensor: no overlap
    w = np.repeat(widths.astype(np.int16), groups, axis=0)  # [K, D]
    offsets = np.cumsum(w, axis=1, dtype=np.int16) - w
    out = torch.gather(windows.view(-1, g, windows.shape[1]), 2,
                       torch.from_numpy((offsets >> 3).astype(np.int64))[:, None, :].expand(-1, g, d))
    out.bitwise_right_shift_(torch.from_numpy(offsets & 7)[:, None, :])
    return out.bitwise_and_(torch.from_numpy((1 << w) - 1)[:, None, :])


def dequantize_compact(qr) -> tuple[torch.Tensor, torch.Tensor]:
    """The body rows of a compact-layout ``QuantizedRows``: keys ``[Q, head_dim]`` and values ``[Q, head_dim_v]``,
    float32, ``code x scale + min`` with the group's parameters from the layer's grids (``format/SPEC.md`` §5.4)."""
    keys, values, starts = dequantize_compact_layers([qr])
    rows = [torch.arange(s, s + b) for s, b in zip(starts[0].tolist(), qr.body_lengths.tolist())]
    return keys.index_select(0, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)), values


def dequantize_compact_layers(quants: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body rows of several compact-layout layers (same type, group size and head sizes) dequantized at once;
    bit-identical to ``code x scale + min`` of each layer alone (KIVI's grouping, arXiv 2402.02750 §3; each group's
    parameters come from its own layer's grid; float32 multiply, then add; ``format/SPEC.md`` §5.4). CPU tensors;
    no errors raised beyond torch's and numpy's for mismatched shapes (the reader checks shapes first).

    Returns:
        ``(keys, values, key_starts)``: keys float32 ``[K x G, head_dim]`` in group-padded rows (``K`` key groups in
        all): head ``h`` of layer ``l`` has its body rows, in order, at rows ``key_starts[l, h]`` to
        ``key_starts[l, h] + body_lengths[h]``, its groups back to back, a short last group followed by zero rows up
        to ``G``; values float32 ``[sum of Q, head_dim_v]``, the layers' body rows back to back as stored;
        ``key_starts`` int64 ``[layers, kv_heads]``. In the group-padded rows every key group is ``G`` aligned rows,
        so a group's parameters broadcast over a ``[K, G, head_dim]`` view instead of being expanded to every row.
    """
    layers, g, d = len(quants), quants[0].group_size, quants[0].key_bits.shape[1]
    body = torch.cat([q.body_lengths for q in quants]).tolist()  # rows of each (layer, head)
    groups = [(b + g - 1) // g for b in body]
    heads = len(body) // layers
    # each key group's and each value row's parameters on its layer's grid (numpy: small arrays; float32 multiply,
    # then add, as min_values and scale_table)
    grids = _joined([q.quant_grid.unsqueeze(0) for q in quants]).numpy()  # float32 [layers, 3, D + Dv / Gv]
    key_grid = np.repeat(grids[:, :, :d], [sum(groups[l * heads : (l + 1) * heads]) for l in range(layers)], axis=0)
    value_grid = np.repeat(grids[:, :, d:], [q.value_codes.shape[0] for q in quants], axis=0)
    key_params = _joined([q.key_params for q in quants], 1).numpy()  # [2, K, D]
    value_params = _joined([q.value_params for q in quants], 1).numpy()  # [2, Q, Dv / Gv]
    k_mins = torch.from_numpy(key_params[0].astype(np.float32) * key_grid[:, 1] + key_grid[:, 0])
    k_scales = torch.from_numpy(key_grid[:, 2] * _CODE_MULTIPLIERS[key_params[1]])
    v_mins = torch.from_numpy(value_params[0].astype(np.float32) * value_grid[:, 1] + value_grid[:, 0])
    v_scales = torch.from_numpy(value_grid[:, 2] * _CODE_MULTIPLIERS[value_params[1]])
    kcodes = _joined([q.key_codes for q in quants])
    codes = _key_codes(quants, _joined([q.key_bits for q in quants]).numpy(), groups,
                       _padded_heads(kcodes, body, [n * g for n in groups]))
    keys = codes if codes.is_floating_point() else codes.float()  # (a mixed-dtype multiply is far slower)
    keys = keys.mul_(k_scales[:, None, :]).add_(k_mins[:, None, :]).view(-1, d)
    vcodes = _joined([q.value_codes for q in quants])
    values = _codes_as_float(vcodes, quants[0].qtype)
    dv = values.shape[1]
    gv = value_group_size(g, dv)
    values.view(-1, dv // gv, gv).mul_(v_scales.unsqueeze(2)).add_(v_mins.unsqueeze(2))
    starts = np.cumsum([0] + groups[:-1], dtype=np.int64) * g
    return keys, values, torch.from_numpy(starts).view(layers, -1)


def dequantized_range(qr) -> tuple[float, float]:
    """``dequantized_ranges([qr])[0]``: the smallest and largest value one layer's dequantization can produce."""
    return dequantized_ranges([qr])[0]


def dequantized_ranges(quants: list) -> list[tuple[float, float]]:
    """Per compact-layout ``QuantizedRows`` (layers of one pack: the same type, group size and head sizes), the
    smallest and largest value its dequantization can produce, from its group parameters and grid alone (no code
    is decoded): per key group and channel ``[min, min + scale x (2^w - 1)]`` with the channel's code width ``w``
    in its head, per value group the same with the type's bits (``format/SPEC.md`` §5.4; float32 arithmetic as
    ``dequantize_compact_layers``'s, so a bound is attained exactly when the top or bottom code is used). All layers
    in one pass over their joined parameters (linear in them); ``(0.0, 0.0)`` for a layer without body rows; a
    non-finite bound comes back as such (NaN compares false). Returns one ``(low, high)`` float pair per layer, in
    KV units; raises nothing of its own (the reader has checked the shapes)."""
    if not quants:
        return []
    d = quants[0].key_bits.shape[1]
    grids = np.stack([q.quant_grid.numpy() for q in quants]).astype(np.float32)  # [layers, 3, D + Dv / Gv]
    g = quants[0].group_size
    head_groups = (torch.stack([q.body_lengths for q in quants]).long().numpy() + g - 1) // g  # [layers, heads]
    key_rows = head_groups.sum(axis=1).tolist()
    value_rows = [q.value_params.shape[1] for q in quants]
    parts = (
        # (params [2, rows, columns], each row's layer grid [rows, 3, columns], levels, rows per layer)
        (_joined([q.key_params for q in quants], 1).numpy(), np.repeat(grids[:, :, :d], key_rows, axis=0),
         2.0 ** np.repeat(_joined([q.key_bits for q in quants]).numpy(), head_groups.reshape(-1), axis=0) - 1,
         key_rows),
        (_joined([q.value_params for q in quants], 1).numpy(), np.repeat(grids[:, :, d:], value_rows, axis=0),
         2.0 ** quant_type_bits(quants[0].qtype) - 1, value_rows),
    )
    lows = [[] for _ in quants]
    highs = [[] for _ in quants]
    with np.errstate(over="ignore", invalid="ignore"):
        for params, grid, levels, rows in parts:
            if not params.shape[1]:
                continue
            mins = params[0].astype(np.float32) * grid[:, 1] + grid[:, 0]  # [rows, columns]
            tops = np.float32(levels) * (grid[:, 2] * _CODE_MULTIPLIERS[params[1]]) + mins  # multiply, then add
            filled = [l for l, n in enumerate(rows) if n]  # layers with rows: their segments are contiguous
            starts = (np.cumsum([0] + rows[:-1]))[filled]
            layer_low = np.minimum.reduceat(mins, starts, axis=0).min(axis=1).tolist()  # rows first: fast in numpy
            layer_high = np.maximum.reduceat(tops, starts, axis=0).max(axis=1).tolist()
            for l, low, high in zip(filled, layer_low, layer_high):
                lows[l].append(low)
                highs[l].append(high)
    out = []
    for low, high in zip(lows, highs):
        if not low:
            out.append((0.0, 0.0))
        elif any(x != x for x in low + high):
            out.append((float("nan"), float("nan")))
        else:
            out.append((min(low), max(high)))
    return out


def _group_params(group_min: torch.Tensor, group_max: torch.Tensor, levels: torch.Tensor):
    """Min and scale codes of groups (``[n, columns]`` float64 extremes, ``levels`` broadcastable): min codes,
    scale codes, stored mins and scales (float32), and the grid rows ``(base, step, scale base)``."""
    base, step = min_grid(group_min) if group_min.shape[0] else (group_min.new_zeros(group_min.shape[1]).float(),) * 2
    mcodes, mins = min_codes(group_min, base, step)
    needed = ((group_max - mins.double()) / levels).clamp(min=0)
    scodes, scales, sbase = scale_codes(needed)
    return mcodes, scodes, mins, scales, (base, step, sbase)


def quantize_compact(keys: torch.Tensor, values: torch.Tensor, body: torch.Tensor, qtype: str, group_size: int,
                     query_energy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize one layer's body rows in the compact layout.

    Args:
        keys, values: ``[Q, head_dim]``, ``[Q, head_dim_v]`` float, the body rows of all heads, head 0 first.
        body: ``[kv_heads]`` int64 body rows per head (``compact_split``).
        qtype, group_size: ``"int8"``/``"int4"`` and ``G``.
        query_energy: ``[kv_heads, head_dim]``, the mean of ``q_c**2`` over the context's queries of each KV head's
            GQA group (after RoPE), for the key widths (``allocate_widths``); ``None``: uniform widths.

    Returns:
        ``key_codes``, ``key_bits``, ``key_params``, ``value_codes``, ``value_params``, ``quant_grid`` as
        ``QuantizedRows`` holds them.

    Raises:
        InputError: non-finite keys or values, or values so large that a scale leaves the float32 range.
    """
    spec = quant_type(qtype)
    k, v = keys.double(), values.double()
    if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
        raise InputError("cannot quantize keys or values that contain NaN or infinity")
    heads, d, dv = body.shape[0], k.shape[1], v.shape[1]
    gidx, head_of_group = group_index(body, group_size)
    n_groups = head_of_group.shape[0]
    index = gidx[:, None].expand(-1, d)
    gmin = k.new_zeros(n_groups, d).scatter_reduce_(0, index, k, "amin", include_self=False)
    gmax = k.new_zeros(n_groups, d).scatter_reduce_(0, index, k, "amax", include_self=False)
    if query_energy is None or spec.bits >= S.ALLOCATED_KEY_BITS[1]:
        widths = torch.full((heads, d), spec.bits, dtype=torch.int64)
    else:
        range2 = k.new_zeros(heads, d).index_add_(0, head_of_group, (gmax - gmin) ** 2)
        range2 /= torch.bincount(head_of_group, minlength=heads).clamp(min=1)[:, None]
        widths = allocate_widths(query_energy.double().cpu() * range2, spec.bits)
    levels = torch.pow(2.0, widths[head_of_group].double()) - 1  # [groups, d]
    k_mc, k_sc, k_min, k_scale, k_grid = _group_params(gmin, gmax, levels)
    kcodes = torch.where(k_scale[gidx] > 0, torch.round((k - k_min[gidx].double()) / k_scale[gidx].double()
                                                         .clamp(min=torch.finfo(torch.float32).tiny)), 0.0)
    kcodes = torch.minimum(kcodes.clamp(min=0), levels[gidx])
    packed, start = [], 0
    for h, b in enumerate(body.tolist()):
        if b:
            packed.append(pack_bits(kcodes[start : start + b], widths[h]))
        start += b
    key_codes = torch.cat(packed) if packed else torch.zeros(0, d * spec.bits // 8, dtype=torch.uint8)
    q = v.shape[0]
    gv = value_group_size(group_size, dv)
    grouped = v.view(q, dv // gv, gv)
    v_mc, v_sc, v_min, v_scale, v_grid = _group_params(grouped.amin(dim=2), grouped.amax(dim=2),
                                                        float(spec.levels))
    vcodes = torch.where(v_scale[..., None] > 0, torch.round((grouped - v_min[..., None].double())
                                                             / v_scale[..., None].double().clamp(min=1e-38)), 0.0)
    vcodes = vcodes.clamp(0, spec.levels).view(q, dv)
    grid = torch.stack([torch.cat([a, b]) for a, b in zip(k_grid, v_grid)]).float()
    return {
        C.KEY_CODES: key_codes,
        C.KEY_BITS: widths.to(torch.uint8),
        C.KEY_PARAMS: torch.stack([k_mc, k_sc]) if n_groups else torch.zeros(2, 0, d, dtype=torch.uint8),
        C.VALUE_CODES: pack_codes(vcodes, qtype),
        C.VALUE_PARAMS: torch.stack([v_mc, v_sc]),
        C.QUANT_GRID: grid,
    }


def compact_shapes(qtype: str, group_size: int, heads: int, d: int, dv: int, rows: int, groups: int
                   ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Dtype code and shape of each compact-layout tensor of a layer (``format/SPEC.md`` §5.4) with ``heads`` KV
    heads, head sizes ``d`` / ``dv``, ``rows`` quantized rows and ``groups`` key groups: ``{part: (code, shape)}``."""
    spec = quant_type(qtype)
    gv = value_group_size(group_size, dv)
    return {
        C.KEY_CODES: (C.QUANT_CODE_CODE, (rows, d * spec.bits // 8)),
        C.KEY_BITS: (C.QUANT_CODE_CODE, (heads, d)),
        C.KEY_PARAMS: (C.QUANT_CODE_CODE, (2, groups, d)),
        C.VALUE_CODES: (C.QUANT_CODE_CODE, (rows, dv // spec.codes_per_byte)),
        C.VALUE_PARAMS: (C.QUANT_CODE_CODE, (2, rows, dv // gv)),
        C.QUANT_GRID: (C.CODE_BY_DTYPE[torch.float32], (3, d + dv // gv)),
    }


def compact_problem(qr, d: int, dv: int) -> str | None:
    """Why a compact-layout ``QuantizedRows`` has the wrong dtypes, shapes or values, or ``None``: the widths
    (``MIN_KEY_BITS`` .. ``MAX_KEY_BITS``, summing to ``bits x head_dim`` per head), the key groups its body lengths
    call for, and a finite grid with non-negative steps and scale bases. Shared by the writer and the reader."""
    groups = int(((qr.body_lengths + qr.group_size - 1) // qr.group_size).sum())
    want = compact_shapes(qr.qtype, qr.group_size, qr.body_lengths.shape[0], d, dv, int(qr.body_lengths.sum()),
                          groups)
    for name, (code, shape) in want.items():
        dtype = C.DTYPE_BY_CODE[code]
        t = getattr(qr, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"quant.{name} must be {dtype} {list(shape)}, not {got}"
    return compact_values_problem(qr.key_bits.cpu().numpy()[None], qr.quant_grid.cpu().numpy()[None], qr.qtype, d)
