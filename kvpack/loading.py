"""``kvpack.load``: read a ``.kvpack`` file, check it belongs to the model, and lay it out as a cache."""

from __future__ import annotations

import os
import re
import types

import torch

from . import constants as C
from .attention import use_kvpack_attention
from .cache import KvpackCache, PackedLayer, require_model
from .fileformat import PackHeader, load_pack_placed
from .fingerprint import _cached_fingerprint, check_fingerprint
from .errors import CorruptFileError, InputError, MemoryBudgetError, ModelMismatchError
from .model import ModelSpec, model_spec
from .pack import Pack
from .packbytes import REBUILD
from .validate import kv_range_problem

__all__ = ["load", "cache_from_pack", "check_shapes", "check_kv_range", "load_bytes", "available_memory",
           "check_memory", "parse_size"]


def cache_from_pack(pack: Pack, model, tokenizer=None, *, device=None, where: str = "the pack",
                    dequantize: str = "at-load") -> KvpackCache:
    """Check ``pack`` against ``model`` (and ``tokenizer`` if given) and build its ``KvpackCache``.

    First the shapes (``check_shapes``: layers, KV heads, head sizes, a float KV dtype) and the range of the KV
    (``check_kv_range``), then the fingerprint. The KV
    is cast to the model's dtype and placed on ``device`` (default: the model's device); the model is switched to
    the ``"kvpack"`` attention. ``dequantize``: as ``KvpackCache.from_pack``'s (``"at-load"`` or ``"on-the-fly"``).
    Raises ``ModelMismatchError`` naming both sides on any mismatch, ``CorruptFileError`` for KV out of range,
    ``InputError`` for a bad ``dequantize`` or a ``model`` that is not a transformers model.
    """
    require_model(model)
    check_shapes(pack, model_spec(model), model.dtype, where)
    check_kv_range(pack, where)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    return _cache(pack, model, tokenizer, dev, where, dequantize, placed=False)


def _cache(pack: Pack, model, tokenizer, dev: torch.device, where: str, dequantize: str, placed: bool
           ) -> KvpackCache:
    """The end of a load, after the shape and range checks: the fingerprint, the ``"kvpack"`` attention, the cache.
    ``placed``: the pack comes from ``load_pack_placed`` (its rows already in the model's dtype on ``dev``, fresh
    tensors nobody else holds), so an unquantized pack's layers are its own views, not copies."""
    current = _cached_fingerprint(model, tokenizer)  # read only
    stored = pack.metadata.get("fingerprint", {})
    stored = dict(stored) if isinstance(stored, dict) else {}
    if tokenizer is None:
        stored.pop("tokenizer_sha256", None)
    check_fingerprint(stored, current, path=where)
    use_kvpack_attention(model)
    _guard_generate(model)
    spec = model_spec(model)
    if placed and all(e.quant is None for e in pack.layers):
        n = pack.original_tokens
        layers = [PackedLayer(e.keys, e.values, e.positions, e.head_lengths, n, sliding=i in spec.sliding_layers,
                              biases=e.biases) for i, e in enumerate(pack.layers)]
        return KvpackCache(layers, pack.token_ids.long().cpu(), dict(pack.metadata))
    return KvpackCache.from_pack(pack, device=dev, dtype=model.dtype, sliding_layers=spec.sliding_layers,
                                 dequantize=dequantize)


def check_shapes(pack: Pack, spec: ModelSpec, dtype: torch.dtype, where: str = "the pack") -> None:
    """Check that ``pack`` fits a model of attention shape ``spec`` before anything is allocated for it: as many
    layers (``spec.num_layers``), KV heads (``spec.num_kv_heads``) and key/value head sizes (``spec.head_dim``) as the
    model, and keys/values in a float dtype the model's ``dtype`` can be cast from.

    Raises:
        ModelMismatchError: naming what differs, the pack's value and the model's.
    """
    layers = pack.layers
    kv = layers[0] if layers else None
    _check_shapes((len(layers), int(kv.head_lengths.shape[0]) if kv is not None else 0,
                   int(kv.keys.shape[1]) if kv is not None else 0, int(kv.values.shape[1]) if kv is not None else 0),
                  kv.keys.dtype if kv is not None else None, spec, dtype, where)


def _check_shapes(shape: tuple[int, int, int, int], kv_dtype: torch.dtype | None, spec: ModelSpec,
                  dtype: torch.dtype, where: str) -> None:
    """``check_shapes`` on ``(layers, KV heads, key head size, value head size)`` and the keys' dtype."""
    have = dict(zip(("layers", "KV heads", "key head size", "value head size"), shape))
    want = {"layers": spec.num_layers, "KV heads": spec.num_kv_heads, "key head size": spec.head_dim,
            "value head size": spec.head_dim}
    diffs = [f"{k}: the pack has {have[k]}, the model {want[k]}" for k in have if have[k] != want[k]]
    if kv_dtype is not None and (not kv_dtype.is_floating_point or not dtype.is_floating_point):
        diffs.append(f"dtype: the pack's keys are {kv_dtype}, the model computes in {dtype}")
    if diffs:
        raise ModelMismatchError(f"{where} does not fit this model ({'; '.join(diffs)}); load it with the model it "
                                 "was built for, or rebuild it with `kvpack build --model ...`")


def check_kv_range(pack: Pack, where: str = "the pack",
                   full_ranges: dict[int, list[tuple[str, tuple[float, float]]]] | None = None) -> None:
    """Check that every key and value of ``pack``, dequantized, is finite and within ``[-MAX_KV_ABS, MAX_KV_ABS]``
    (``validate.kv_range_problem``). A file can pass every format check with NaN, infinite or huge entries (or
    group parameters that dequantize to them), and such entries make attention NaN, so sampling fails inside
    ``generate``; they are refused here instead (the writer refuses to write them). Linear in the pack's bytes;
    ``full_ranges`` (as ``fileformat.load_pack_placed`` measured them while decoding) spares the scan.

    Raises:
        CorruptFileError: naming the layer and the tensor.
    """
    problem = kv_range_problem(pack, full_ranges)
    if problem is not None:
        raise CorruptFileError(f"{where}: {problem}; a real KV cache never does, so the file is damaged or forged; "
                               f"{REBUILD}")


def load(path: str | os.PathLike, model, *, device=None, tokenizer=None,
         storage_options: dict | None = None, dequantize: str = "at-load", max_bytes: int | None = None
         ) -> KvpackCache:
    """Load a ``.kvpack`` file into a cache for ``model``, ready for ``kvpack.generate`` or ``model.generate``.

    The header is read and checked first: the pack's layers, KV heads and head sizes against the model's
    (``check_shapes``), then what the load will allocate (``load_bytes``, from the sizes the header declares)
    against ``max_bytes``, before anything is decoded. Each tensor is then decoded once, chunk by chunk, straight
    into its final dtype (the model's) and device (``fileformat.load_pack_placed``), its range checked on the way
    (``check_kv_range``); an unquantized pack's cache layers are views of those tensors, so peak memory is the
    cache plus one bounded buffer (BENCHMARKS.md "Reliability").

    Args:
        path: the ``.kvpack`` file: a path, a seekable binary file object, or an fsspec URL (``s3://``,
            ``https://``, ...) read by range (header, then the tensors) into memory, no download to disk first.
        model: the model it was built with (checked by fingerprint: architecture, shapes, RoPE, weights hash).
        device: where to place the cache (default: the model's device).
        tokenizer: if given, its hash is checked too.
        storage_options: passed to fsspec for a URL (e.g. ``{"endpoint_url": ..., "anon": True}``).
        dequantize: for a quantized pack (``kvpack build --quant``), ``"at-load"`` (default: the cache holds
            dequantized rows in the model's dtype) or ``"on-the-fly"`` (it keeps the codes as stored, about a
            third of the memory at int4, and decodes through the Triton kernel that reads them on CUDA; on CPU
            every attention call dequantizes, slowly): ``kvpack.compact_cache``. An unquantized pack loads the same
            either way.
        max_bytes: the most bytes the load may allocate (a positive integer); default ``None``: the memory
            available on the cache's device when the load starts (``available_memory``: Linux ``MemAvailable``,
            CUDA's free memory; no limit where it cannot be read).

    Returns:
        A ``KvpackCache`` (a ``transformers.Cache``); see its docstring for use with ``model.generate``.

    Raises:
        InputError: the file cannot be read (missing, no permission, missing fsspec backend).
        PackFormatError subclasses: truncated, corrupt, foreign or newer-version files (nothing is half-loaded).
        ModelMismatchError: the file was built for another model, or its shapes do not fit this one (naming both).
        MemoryBudgetError: the load would allocate more than ``max_bytes`` (naming both; nothing decoded).
        InputError: ``dequantize`` is neither value, or ``"on-the-fly"`` on CUDA without triton (or for a layout
            the kernel does not take); ``model`` is not a transformers model (checked before the file is read); a
            ``max_bytes`` that is not a positive integer.
    """
    from .settings import DEQUANTIZE

    require_model(model)  # before the file is read
    if dequantize not in DEQUANTIZE:
        raise InputError(f"dequantize must be one of {', '.join(DEQUANTIZE)}, got {dequantize!r}")
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes <= 0):
        raise InputError(f"max_bytes must be a positive integer (bytes) or None, got {max_bytes!r}")
    spec = model_spec(model)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    where = str(getattr(path, "name", None) or path)

    def before(header: PackHeader) -> None:
        _check_shapes((header.num_layers, header.kv_heads, *header.head_dims), header.kv_dtype, spec, model.dtype,
                      where)
        check_memory(header, model.dtype, dev, dequantize, max_bytes, where)

    _, pack, ranges = load_pack_placed(path, dtype=model.dtype, device=dev, before=before,
                                       storage_options=storage_options)
    check_kv_range(pack, where, ranges)
    return _cache(pack, model, tokenizer, dev, where, dequantize, placed=True)


def load_bytes(header: PackHeader, dtype: torch.dtype, dequantize: str = "at-load") -> int:
    """Bytes ``kvpack.load`` allocates for the pack of ``header`` in a model of ``dtype``, from the declared sizes
    alone (an upper estimate; model and Python overhead not counted): the full-precision rows ``F x (D + Dv)`` in
    ``dtype``, positions int64, biases float32 and token ids (int32 and int64) per entry or token; for a quantized
    pack also its codes and parameters and, dequantized at load, the float32 body rows ``Q x (D + Dv)``, their cast
    and the laid-out cache ``E x (D + Dv)`` in ``dtype`` with its positions (``kvpack.cache``)."""
    e, f = header.entries, header.tensors[C.KEYS].shape[0]
    d, dv = header.head_dims
    size = dtype.itemsize
    n = f * (d + dv) * size + 8 * e + (4 * e if header.has_biases else 0) + 12 * header.tokens
    n += header.tensors[C.HEAD_LENGTHS].raw_nbytes
    if header.group_size is not None:
        n += sum(header.tensors[p].raw_nbytes for p in C.COMPACT_PARTS)
        if dequantize == "at-load":
            n += (e - f) * (d + dv) * (4 + size) + e * (d + dv) * size + 8 * e
    return n


def available_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes that can be allocated now on ``device``: CUDA's free memory (``torch.cuda.mem_get_info``), else the
    host's available memory (Linux ``/proc/meminfo`` ``MemAvailable``, else ``sysconf`` free pages); ``None`` where
    it cannot be read."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_memory(header: PackHeader, dtype: torch.dtype, device: torch.device | str, dequantize: str = "at-load",
                 max_bytes: int | None = None, where: str = "the pack") -> None:
    """Refuse a load that would allocate (``load_bytes``) more than ``max_bytes``, or by default more than the
    memory available on ``device`` (``available_memory``; no check where it cannot be read).

    Raises:
        MemoryBudgetError: naming the bytes the pack needs, the limit and where the limit comes from.
    """
    limit = max_bytes if max_bytes is not None else available_memory(device)
    need = load_bytes(header, dtype, dequantize)
    if limit is None or need <= limit:
        return
    what = ("the max_bytes limit (kvpack ask --max-memory)" if max_bytes is not None
            else f"the memory available on {torch.device(device)}")
    raise MemoryBudgetError(
        f"{where}: loading it needs about {need:,} bytes ({need / 2**30:.2f} GiB: {header.entries:,} entries of "
        f"head sizes {header.head_dims[0]}/{header.head_dims[1]} in {str(dtype).replace('torch.', '')}, from a "
        f"{header.file_bytes:,}-byte file), more than {what}, {limit:,} bytes ({limit / 2**30:.2f} GiB); free "
        "memory, load it on a larger device (--device), or raise the limit (max_bytes=, --max-memory) if the "
        "memory is there")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str, what: str = "the size") -> int:
    """Bytes of a size such as ``4096``, ``512MiB``, ``8GiB``, ``1.5G`` or ``2 GB`` (``K``/``M``/``G``/``T``: powers of
    1,000; ``KiB``/``MiB``/``GiB``/``TiB``: of 1,024; case-insensitive).

    Raises:
        InputError: not a positive size, naming ``what`` and the accepted forms.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or int(float(m.group(1)) * _UNITS[unit]) <= 0:
        raise InputError(f"{what} must be a positive size such as 4096, 512MiB, 8GiB or 2G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def _guard_generate(model) -> None:
    """Wrap ``model._prefill`` (transformers 5: where ``generate`` reads the cache's length before its first forward)
    so that a ``KvpackCache`` passed as ``past_key_values`` checks the input and rewinds itself first
    (``KvpackCache.prepare_generate``). Installed once per model as a method bound to it, so a ``copy.deepcopy`` of
    the model (e.g. cast to another dtype) calls its own ``_prefill``, not the original's; other caches pass through
    untouched."""
    if getattr(type(model), "_prefill", None) is None:
        return
    if getattr(model.__dict__.get("_prefill"), "__func__", None) is _guarded_prefill:
        return
    model._prefill = types.MethodType(_guarded_prefill, model)


def _guarded_prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
    """``_guard_generate``'s wrapper: the class's own ``_prefill`` after ``KvpackCache.prepare_generate``."""
    cache = model_kwargs.get("past_key_values")
    first = kwargs.get("is_first_iteration", args[0] if args else True)
    if isinstance(cache, KvpackCache) and first and input_ids is not None and input_ids.numel():
        cache.prepare_generate(input_ids, model=self)
    return type(self)._prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
