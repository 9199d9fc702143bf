"""Decode-step attention kernels over kvpack's per-head variable-length (optionally int4) KV.

    from kvpack.kernels import varlen_decode    # this folder, installed as kvpack.kernels (pyproject.toml)
    out = varlen_decode(q, fp_keys, fp_values, fp_offsets, tail_keys, tail_values, scale)      # [H, Dv]
    out = varlen_decode(..., key_codes=..., key_scales=..., key_mins=..., value_codes=...,
                        value_scales=..., value_mins=..., q_offsets=..., group_size=64)          # with int4 rows

Shapes and layout: kernels/README.md and kernels/reference.py. Triton is optional: without it (or for CPU
tensors) `varlen_decode` runs the PyTorch reference.
"""

from __future__ import annotations

import os

from .reference import (dequantize_int4_keys, dequantize_int4_values, pack_int4, quantize_int4_keys,
                        quantize_int4_values, unpack_int4, varlen_decode_reference)

#: Whether these kernels were made for Triton's CPU interpreter: ``triton.jit`` reads ``TRITON_INTERPRET`` when it
#: wraps a kernel, i.e. when this package is imported, so that moment (not the variable's value later) decides
#: whether the kernels can take CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

try:  # triton is optional; any failure to import it means "reference path only"
    from .compact_decode import compact_decode_triton
    from .varlen_decode import varlen_decode_triton
    HAS_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken triton install
    varlen_decode_triton = compact_decode_triton = None
    HAS_TRITON = False

__all__ = ["varlen_decode", "varlen_decode_reference", "varlen_decode_triton", "compact_decode_triton", "HAS_TRITON",
           "dequantize_int4_keys", "dequantize_int4_values", "quantize_int4_keys", "quantize_int4_values",
           "pack_int4", "unpack_int4", "INTERPRETED"]


def varlen_decode(q, *args, backend: str = "auto", **kwargs):
    """Dispatch: "triton" for CUDA tensors (or any tensors when ``INTERPRETED``), else "reference".

    backend="auto" | "triton" | "reference". Extra keyword arguments of the Triton launcher (num_splits,
    block_n, validate, ...) are dropped on the reference path.
    """
    if backend == "auto":
        use_triton = HAS_TRITON and (q.is_cuda or INTERPRETED)
        backend = "triton" if use_triton else "reference"
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs the triton package (pip install 'kvpack[gpu]')")
        return varlen_decode_triton(q, *args, **kwargs)
    if backend != "reference":
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    for k in ("num_splits", "block_n", "num_warps", "num_stages", "validate"):
        kwargs.pop(k, None)
    return varlen_decode_reference(q, *args, **kwargs)
