"""A loaded cache layer that keeps a quantized pack's codes as stored and dequantizes them on the fly.

``KvpackCache.from_pack(..., dequantize="on-the-fly")`` (``kvpack.load(..., dequantize="on-the-fly")``) lays each
layer quantized in format 1.0's compact layout (``format/SPEC.md`` §5.4) out as a ``CompactLayer``: the body rows
stay as their codes and byte-coded group parameters on the device, the full-precision rows (sink and residual
rows) as rows in the model's dtype; nothing is dequantized at load. At int4 the cache then holds about 3x fewer
bytes than its dequantized bf16 rows (``nbytes``: 3.25x on the Qwen2.5-0.5B shape, 4K tokens, keep 0.3;
BENCHMARKS.md), which lets more contexts stay resident on one GPU. Unquantized layers are laid out as usual.

Attention over such a layer (``kvpack.varlen.packed_attention``):

* where the Triton kernel runs (CUDA, or CPU under Triton's interpreter: ``kernel_runs_on``) and the layer has no
  sliding window: ``kvpack.kernels.compact_decode_triton``, which reads the codes and never writes dequantized rows; a
  question of ``q`` tokens is ``q`` kernel calls, token ``i`` over the kept rows and the tail up to itself
  (causal, exact);
* elsewhere (plain CPU, or a layout the kernel does not take there, which CUDA refuses at load): the layer's rows
  are dequantized for that one call (``materialized``, the loader's own dequantization, ``kvpack.cache``) and
  dropped after it: correct, and slow, since every call pays a layer's dequantization.

Sliding-window layers (kept intact, attended through a window the kernel does not apply) are always dequantized at
load. A ``CompactLayer`` also keeps the pack's CPU tensors of its layer (``entries``, the codes as stored) for that
per-call dequantization: host memory about the size of the codes, which ``nbytes`` does not count.

Which of the two placements decodes faster on a GPU is measured by ``tools/gpu_main_job.py`` (its
``on-the-fly`` rows beside the ``at-load`` ones) and ``tools/bench_decode.py`` (``ours-keep-compact-int4``).
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import InputError
from .pack import LayerEntries
from .packed_layer import PackedLayer, lay_out_group
from .quant import body_row_mask, quant_type

__all__ = ["CompactLayer", "kernel_runs_on", "compact_layout_problem", "check_on_the_fly", "compact_kernel_args"]


def kernel_runs_on(device: torch.device | str) -> bool:
    """Whether ``kvpack.kernels.compact_decode_triton`` can run on tensors of ``device``: triton imports, and the
    device is CUDA, or CPU with the kernels made for Triton's interpreter (``kvpack.kernels.INTERPRETED``:
    ``TRITON_INTERPRET=1`` when they were first imported). Raises nothing."""
    from . import kernels

    dev = torch.device(device)
    return kernels.HAS_TRITON and (dev.type == "cuda" or (dev.type == "cpu" and kernels.INTERPRETED))


def compact_layout_problem(entries: LayerEntries) -> str | None:
    """Why ``kvpack.kernels.compact_decode_triton`` cannot read this layer's quantized rows (``None`` when it can): the
    kernel takes group sizes that are powers of two >= 16 and a head_dim_v that is a power of two. ``entries`` must
    be quantized (``entries.quant`` set); raises nothing else."""
    q = entries.quant
    g, dv = int(q.group_size), int(entries.values.shape[1])
    if g < 16 or g & (g - 1):
        return f"group size {g} (the kernel needs a power of two >= 16)"
    if dv & (dv - 1):
        return f"head_dim_v {dv} (the kernel needs a power of two)"
    return None


def compact_kernel_args(entries, dtype: torch.dtype, device) -> dict:
    """The arguments of ``kvpack.kernels.compact_decode_triton`` for one compact-layout layer (``format/SPEC.md``
    §5.6), except ``q``, the tail and ``scale``: its full-precision rows (``entries.keys`` / ``values`` in
    ``dtype``, with per-head offsets), its body rows' codes and parameters as stored (no dequantization), the
    per-head body row and key group offsets, and its biases split between the two (``fp_biases``, ``q_biases``).

    Raises ``InputError`` if the layer is not in the compact layout.
    """
    qr = entries.quant
    if qr is None or qr.layout != "compact":
        raise InputError("compact_kernel_args needs a layer quantized in the compact layout (kvpack build --quant)")
    lengths, body = entries.head_lengths.long(), qr.body_lengths.long()
    zero = torch.zeros(1, dtype=torch.int64)
    groups = (body + qr.group_size - 1) // qr.group_size
    args = dict(fp_keys=entries.keys.to(dtype), fp_values=entries.values.to(dtype),
                fp_offsets=torch.cat([zero, (lengths - body).cumsum(0)]), key_codes=qr.key_codes,
                key_bits=qr.key_bits, key_params=qr.key_params, value_codes=qr.value_codes,
                value_params=qr.value_params, quant_grid=qr.quant_grid, q_offsets=torch.cat([zero, body.cumsum(0)]),
                group_offsets=torch.cat([zero, groups.cumsum(0)]), group_size=qr.group_size,
                bits=quant_type(qr.qtype).bits)
    if entries.biases is not None:
        in_body = body_row_mask(entries.head_lengths, qr.sink_lengths, qr.body_lengths)
        args.update(fp_biases=entries.biases[~in_body].float(), q_biases=entries.biases[in_body].float())
    return {k: v.to(device).contiguous() if torch.is_tensor(v) else v for k, v in args.items()}


class CompactLayer(PackedLayer):
    """A ``PackedLayer`` whose quantized body rows stay compact (module doc); ``KvpackCache.from_pack`` builds it.
    The codes are format 1.0's compact layout (``format/SPEC.md`` §5.4: KIVI's grouping, arXiv 2402.02750 §3, with
    per-channel key code widths), read by ``kvpack.kernels.compact_decode_triton`` (online softmax, FlashAttention
    arXiv 2205.14135 §3.1).

    Args:
        entries: the pack's ``LayerEntries`` for the layer, quantized in the compact layout (CPU tensors).
        original_length: tokens in the original context.
        dtype: the cache's dtype (full-precision rows, tail).
        device: the cache's device.
        sliding: whether the layer is a sliding-window layer (informational, as ``PackedLayer``'s).

    Attributes:
        compact: the arguments of ``kvpack.kernels.compact_decode_triton`` on ``device`` except the query, the tail
            and the scale (``compact_kernel_args``): full-precision rows ``[Nfp, head_dim]`` in
            ``dtype`` with their per-head offsets, body codes ``[Q, head_dim x bits / 8]`` uint8, group parameters,
            grids, biases.
        entries: ``entries`` (codes as stored, on CPU), which ``materialized`` dequantizes.
        kernel_problem: why ``kernels.compact_decode_triton`` cannot read the layer, or ``None``.
        head_lengths, offsets, kept_positions, kept, dense, keys, values: as ``PackedLayer``'s. ``kept_keys``,
            ``kept_values`` and ``biases`` are ``None``: the rows exist only as codes (``head_rows``, ``head_views``
            and ``padded`` dequantize).

    Raises ``InputError`` if the layer is not quantized in the compact layout.
    """

    def __init__(self, entries: LayerEntries, original_length: int, dtype: torch.dtype, device, sliding=False):
        d, dv = entries.keys.shape[1], entries.values.shape[1]
        lengths = [int(n) for n in entries.head_lengths.tolist()]
        super().__init__(torch.empty(0, d, dtype=dtype, device=device), torch.empty(0, dv, dtype=dtype, device=device),
                         torch.empty(0, dtype=torch.int64, device=device), [0] * len(lengths), original_length,
                         sliding)
        entries = _owned(entries)  # not views of the file's memory map: a file changed after load cannot reach it
        self.compact = compact_kernel_args(entries, dtype, device)  # InputError unless compact
        self.entries = entries
        self._index_heads(lengths, device)
        self.kept_positions = entries.positions.long().to(device)
        self.kept_keys = self.kept_values = self.biases = None
        #: why the compact kernel cannot read this layer (``compact_layout_problem``), or ``None``
        self.kernel_problem = compact_layout_problem(entries)

    def materialized(self) -> PackedLayer:
        """A full-precision ``PackedLayer`` of this layer's kept rows (dequantized now, on CPU, then moved to the
        cache's device), sharing this layer's tail tensors. ``[entries, head_dim]`` rows in the cache's dtype; a
        copy per call."""
        (keys, values, positions, biases), = lay_out_group([self.entries], self.dtype, self.device)
        full = PackedLayer(keys, values, positions, self.head_lengths, self.original_length, self.is_sliding, biases)
        full.keys, full.values = self.keys, self.values
        return full

    def reads_codes(self, device: torch.device | str, window: int | None) -> bool:
        """Whether attention on ``device`` with sliding ``window`` (``None``: none) reads the codes through
        ``compact_attention``: no window, a layout the kernel takes (``kernel_problem`` is ``None``) and a device it
        runs on (``kernel_runs_on``). Otherwise ``kvpack.varlen.packed_attention`` attends over ``materialized()``."""
        return window is None and self.kernel_problem is None and kernel_runs_on(device)

    def compact_attention(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The layer's last ``q`` tail tokens attending through ``kvpack.kernels.compact_decode_triton``, one call per
        token over the kept rows and the tail up to and including itself. ``query``: ``[1, heads, q, head_dim]``;
        returns ``[1, q, heads, head_dim_v]`` in the query's dtype. ``kvpack.varlen.packed_attention`` calls it only
        when ``kernel_problem`` is ``None``; otherwise the launcher raises ``ValueError``."""
        from .kernels import compact_decode_triton

        q_len, tail = query.shape[2], self.tail_length
        ends = range(tail - q_len + 1, tail + 1)  # query token i sees the tail up to and including itself
        outs = [compact_decode_triton(query[0, :, i], tail_keys=self.keys[0, :, :end],
                                      tail_values=self.values[0, :, :end], scale=scaling, **self.compact)
                for i, end in enumerate(ends)]
        return torch.stack(outs).unsqueeze(0)

    def head_rows(self, h: int):
        """As ``PackedLayer.head_rows``, from a dequantized copy (slow: dequantizes the layer)."""
        return self.materialized().head_rows(h)

    def head_views(self):
        """As ``PackedLayer.head_views``, from a dequantized copy (slow: dequantizes the layer)."""
        return self.materialized().head_views()

    def dense_views(self):
        """As ``PackedLayer.dense_views``, from a dequantized copy (slow: dequantizes the layer)."""
        return self.materialized().dense_views()

    def padded(self):
        """As ``PackedLayer.padded``, from a dequantized copy (slow: dequantizes the layer)."""
        return self.materialized().padded()

    def nbytes(self) -> int:
        """Bytes held on the device: the compact tensors (rows, codes, parameters, grids, offsets, biases), the
        positions, the offsets and the tail."""
        parts = [t for t in self.compact.values() if torch.is_tensor(t)]
        parts += [self.kept_positions, self.offsets, self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in parts)


def _owned(entries: LayerEntries) -> LayerEntries:
    """A copy of ``entries`` whose tensors own their memory. A loaded pack's tensors are copy-on-write views of the
    file's memory map; the at-load layout copies them anyway, and this does the same for the compact codes (a few
    MB), so a file truncated or rewritten after the load can neither crash the process (SIGBUS) nor change the
    cache."""
    quant = entries.quant
    if quant is not None:
        quant = dataclasses.replace(quant, **{f.name: getattr(quant, f.name).clone()
                                              for f in dataclasses.fields(quant)
                                              if torch.is_tensor(getattr(quant, f.name))})
    return dataclasses.replace(entries, keys=entries.keys.clone(), values=entries.values.clone(),
                               positions=entries.positions.clone(), head_lengths=entries.head_lengths.clone(),
                               quant=quant, biases=None if entries.biases is None else entries.biases.clone())


def check_on_the_fly(entries: LayerEntries, device: torch.device, index: int) -> None:
    """Raise ``InputError`` (naming ``dequantize='at-load'``) when ``dequantize="on-the-fly"`` would decode layer
    ``index`` (a quantized ``LayerEntries``) on a CUDA ``device`` without the kernel: triton missing, or a layout the
    kernel cannot read. On CPU every layer is allowed (dequantized per call)."""
    if torch.device(device).type != "cuda":
        return
    from . import kernels

    problem = None if kernels.HAS_TRITON else "triton is not installed (pip install 'kvpack[gpu]')"
    problem = problem or compact_layout_problem(entries)
    if problem:
        raise InputError(f"layer {index} cannot be decoded on the fly on {device}: {problem}; load it with "
                         "dequantize='at-load' (the default)")
