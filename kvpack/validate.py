"""Rules a pack must follow, checked on the in-memory ``Pack`` by the writer: ``pack_problem`` and ``kv_range_problem``
(``format/SPEC.md`` §5; the rules on a file's header, which the reader checks too, are ``kvpack.rules``). Each returns
the problem as a sentence, or ``None``; the caller raises the typed error (``InputError`` when writing,
``CorruptFileError`` when reading).
"""

from __future__ import annotations

from typing import Any

import torch

from . import constants as C
from .compact import dequantized_ranges
from .pack import LayerEntries, Pack, QuantizedRows
from .quant import layer_quant_problem

__all__ = ["pack_problem", "kv_range_problem"]

def kv_range_problem(pack: Pack, full_ranges: dict[int, list[tuple[str, tuple[float, float]]]] | None = None
                     ) -> str | None:
    """Why some key or value of ``pack`` (a consistent ``Pack``: ``pack_problem`` returned ``None``), dequantized,
    is not finite or lies outside ``[-MAX_KV_ABS, MAX_KV_ABS]`` (float16's largest finite value: every dtype the
    cache may be cast to holds it), or ``None``. Such entries make attention NaN (sampling then fails inside
    ``generate``). Full-precision rows are scanned (``torch.aminmax``, no copy); quantized rows are bounded from
    their group parameters (``compact.dequantized_ranges``, all layers at once) without decoding a code. Linear in
    the pack's bytes. The sentence names the layer, the tensor and its range. ``full_ranges`` (layer ->
    ``[(name, (min, max))]``, as ``fileformat.load_pack_placed`` measures them while decoding) replaces the scan of
    the full-precision rows.
    """
    limit = C.MAX_KV_ABS
    quantized = [l for l, e in enumerate(pack.layers) if e.quant is not None]
    bounds = dict(zip(quantized, dequantized_ranges([pack.layers[l].quant for l in quantized])))
    for l, entries in enumerate(pack.layers):
        if full_ranges is not None:
            ranges = list(full_ranges.get(l, []))
        else:
            ranges = [(name, t) for name, t in (("keys", entries.keys), ("values", entries.values)) if t.numel()]
            ranges = [(name, tuple(float(x) for x in torch.aminmax(t))) for name, t in ranges]
        if l in bounds:
            ranges.append(("quantized rows", bounds[l]))
        for name, (low, high) in ranges:
            if not (-limit <= low and high <= limit):  # NaN compares false
                return (f"layer {l}'s {name} hold values outside [-{limit:g}, {limit:g}] (min {low:.4g}, "
                        f"max {high:.4g})")
    return None


def pack_problem(pack: Any) -> str | None:
    """Why ``pack`` is not a consistent ``Pack`` that format 1.0 can hold, or ``None``.

    Checks: token ids ``[tokens]`` in ``[0, INT32_MAX]``; ``0 <= sink_tokens <= tokens``; at least one layer, each
    with 2-D float keys/values (one dtype for all layers' keys, one for all values), 1-D integer positions and head
    lengths, the same KV heads and head sizes in every layer; head lengths >= 0 summing to the entries; positions in
    ``[0, tokens)``, strictly increasing within each head; one quantization setting for all layers (or none), each
    quantized layer per ``quant.layer_quant_problem``; biases ``None`` or float32 ``[entries]``, finite, within
    ``[-MAX_ATTN_BIAS, MAX_ATTN_BIAS]``.
    """
    if not isinstance(pack, Pack):
        return f"expected a kvpack Pack, got {type(pack).__name__}"
    t = pack.token_ids
    if not _is_int_tensor(t) or t.dim() != 1:
        return "token_ids must be a 1-D integer tensor"
    tokens = t.shape[0]
    if tokens and (int(t.min()) < 0 or int(t.max()) > C.INT32_MAX):
        return f"token ids must lie in [0, {C.INT32_MAX}]"
    if type(pack.sink_tokens) is not int or not 0 <= pack.sink_tokens <= tokens:
        return f"sink_tokens must be an integer in [0, {tokens}] (the number of tokens)"
    if not isinstance(pack.layers, (list, tuple)) or not pack.layers:
        return "a pack needs at least one layer"
    if len(pack.layers) > C.MAX_LAYERS:
        return f"a pack holds at most {C.MAX_LAYERS} layers, not {len(pack.layers)}"
    first = None
    for l, layer in enumerate(pack.layers):
        problem = _layer_problem(layer, tokens, pack.sink_tokens)
        if problem is not None:
            return f"layer {l}: {problem}"
        q = layer.quant
        here = ((layer.head_lengths.shape[0], layer.keys.shape[1], layer.values.shape[1]),
                (layer.keys.dtype, layer.values.dtype), None if q is None else (q.qtype, q.group_size))
        if first is None:
            first = here
            if not 1 <= here[0][0] <= C.MAX_KV_HEADS or not 1 <= min(here[0][1:]) <= max(here[0][1:]) <= C.MAX_HEAD_DIM:
                return (f"layer 0: kv_heads {here[0][0]} / head sizes {list(here[0][1:])} must lie in "
                        f"[1, {C.MAX_KV_HEADS}] / [1, {C.MAX_HEAD_DIM}]")
        elif here[0] != first[0]:
            return f"layer {l}: kv_heads/head_dim/head_dim_v {list(here[0])} differ from layer 0's {list(first[0])}"
        elif here[1] != first[1]:
            return (f"layer {l}: keys/values dtypes {here[1]} differ from layer 0's {first[1]}; format 1.0 stores one "
                    "dtype for all keys and one for all values (cast the layers first)")
        elif here[2] != first[2]:
            return (f"layer {l} is quantized as {here[2]}, layer 0 as {first[2]}; all layers must share one "
                    "quantization type and group size (or none)")
    return None


def _layer_problem(layer: Any, tokens: int, sink_tokens: int) -> str | None:
    """``pack_problem`` for one layer, without the comparisons with layer 0."""
    if not isinstance(layer, LayerEntries):
        return "not a LayerEntries"
    k, v, p, hl, q = layer.keys, layer.values, layer.positions, layer.head_lengths, layer.quant
    for what, x in (("keys", k), ("values", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or C.CODE_BY_DTYPE.get(x.dtype) not in C.FLOAT_CODES:
            return f"{what} must be a 2-D float32, float16 or bfloat16 tensor"
    if not _is_int_tensor(p) or p.dim() != 1 or not _is_int_tensor(hl) or hl.dim() != 1:
        return "positions and head_lengths must be 1-D integer tensors"
    if q is not None and not isinstance(q, QuantizedRows):
        return "quant must be None or a QuantizedRows"
    n = p.shape[0]
    if q is None and (k.shape[0] != n or v.shape[0] != n):
        return f"keys, values and positions have {k.shape[0]}, {v.shape[0]} and {n} rows"
    if hl.shape[0] == 0 or int(hl.min()) < 0 or int(hl.to(torch.int64).sum()) != n:
        return f"head_lengths {hl.tolist()[:16]} must be non-empty, non-negative and sum to the {n} entries"
    if n:
        p64, hl64 = p.to(torch.int64), hl.to(torch.int64)
        if int(p64.min()) < 0 or int(p64.max()) >= tokens:
            return f"positions must lie in [0, {tokens})"
        head_start = torch.zeros(n, dtype=torch.bool)
        head_start[(torch.cumsum(hl64, 0) - hl64)[hl64 > 0]] = True
        if bool(((p64[1:] <= p64[:-1]) & ~head_start[1:]).any()):
            return "positions must be strictly increasing within each head"
    b = layer.biases
    if b is not None:
        if not isinstance(b, torch.Tensor) or b.dtype != torch.float32 or tuple(b.shape) != (n,):
            return f"biases must be None or a float32 [{n}] tensor (one per entry)"
        if n and not bool(torch.isfinite(b).all() & (b.abs() <= C.MAX_ATTN_BIAS).all()):
            return f"biases must be finite and lie in [-{C.MAX_ATTN_BIAS:g}, {C.MAX_ATTN_BIAS:g}]"
    if q is not None:
        return layer_quant_problem(layer, sink_tokens)
    return None


def _is_int_tensor(x: Any) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    return not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
