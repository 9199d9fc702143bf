"""The loaded cache: a ``transformers.Cache`` whose layers hold each KV head's kept entries packed back to back.

Each layer stores its kept entries exactly as the pack does (``kvpack.pack``): the rows of all KV heads back to
back, head 0 first, ``kept_keys`` ``[entries, head_dim]`` and ``kept_values`` ``[entries, head_dim_v]``, with
``offsets`` ``[kv_heads + 1]`` (head ``h`` owns rows ``offsets[h] : offsets[h + 1]``), the entries' original RoPE
positions ``[entries]`` and, when the pack has them, per-entry attention-logit biases ``[entries]`` (Attention
Matching's beta). Nothing is padded: the layer's tensors total its kept entries plus the tail, and a head with
zero entries costs nothing. New tokens are appended after them (the "tail", ``keys`` / ``values``
``[1, kv_heads, tail, head_dim]``, the tensors transformers sees) at logical positions ``original_length,
original_length + 1, ...``: ``get_seq_length()`` reports the original context length plus the tail, so
transformers gives new tokens the RoPE positions they would have had after the full context. The ``"kvpack"``
attention function (``kvpack.attention``, ``kvpack.varlen``) attends each head over its own rows plus the tail.

Reuse across questions: ``rewind()`` drops the tail and restores the cache exactly as loaded.
``kvpack.generate`` calls it before and after every answer, so asking question 2 after question 1 gives exactly
what question 2 gets from a fresh load.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import InputError
from .pack import LayerEntries, Pack
from .quant import dequantize_bodies, head_row_pieces

__all__ = ["PackedLayer", "KvpackCache", "require_model"]


def require_model(model) -> None:
    """Raise ``InputError`` unless ``model`` is a transformers model (a ``torch.nn.Module`` with a ``config``)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError(f"model must be the transformers model the pack was built with (kvpack.load_model), got "
                         f"{type(model).__name__}")


class PackedLayer(CacheLayerMixin):
    """One layer of a ``KvpackCache``: per-head packed kept entries plus the tail of new tokens.

    Args:
        keys: ``[entries, head_dim]`` kept keys (post-RoPE), heads back to back in head order.
        values: ``[entries, head_dim_v]`` kept values, same order.
        positions: ``[entries]`` int64 original RoPE positions, increasing within a head.
        head_lengths: ``kv_heads`` entries per head (a list of ints or an int tensor), summing to ``entries``.
        original_length: tokens in the original context (the logical length before any new token).
        sliding: whether this is a sliding-window layer kept intact (informational; the window itself comes from
            the model's attention call).
        biases: ``[entries]`` float32 additive attention-logit biases (Attention Matching's beta), or ``None``
            (zeros). New tokens have none.

    Attributes:
        kept_keys, kept_values, kept_positions, biases: the tensors above, on the cache's device.
        offsets: ``[kv_heads + 1]`` int64 row offsets of the heads (on the cache's device); ``head_lengths``: the
            same as a Python list.
        keys, values: ``[1, kv_heads, tail, head_dim(_v)]`` the tail (question and generated tokens).
        kept: the longest head's entries (every head's when ``dense``).
        dense: every head holds the same number of entries (the rows are then a ``[kv_heads, kept, d]`` view).
        scores: ``[kv_heads, kept]`` float32 buffer set while KVzip scores (``kvpack.methods.kvzip``); ``None``
            otherwise.

    Raises ``InputError`` if the head lengths do not sum to the rows of ``keys``, ``values`` and ``positions`` (or
    of ``biases``).
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, head_lengths,
                 original_length: int, sliding: bool = False, biases: torch.Tensor | None = None):
        super().__init__()
        lengths = [int(n) for n in (head_lengths.tolist() if torch.is_tensor(head_lengths) else head_lengths)]
        n = sum(lengths)
        if not lengths or min(lengths) < 0 or any(t is not None and t.shape[0] != n
                                                  for t in (keys, values, positions, biases)):
            raise InputError(f"a cache layer's rows ({keys.shape[0]} keys, {values.shape[0]} values, "
                             f"{positions.shape[0]} positions) do not match its head lengths {lengths}; build the "
                             "pack again with kvpack.compress or load it from a file")
        # a pack straight from kvpack.compress holds inference-mode tensors, which a forward pass with autograd on
        # may not save: those rows are copied once into ordinary tensors
        keys, values, positions, biases = (t.clone() if t is not None and t.is_inference() and
                                           not torch.is_inference_mode_enabled() else t
                                           for t in (keys, values, positions, biases))
        self.kept_keys, self.kept_values, self.kept_positions = keys, values, positions.long()
        self.biases = None if biases is None else biases.float()
        self._index_heads(lengths, keys.device)
        heads = len(lengths)
        self.keys = keys.new_empty(1, heads, 0, keys.shape[-1])
        self.values = values.new_empty(1, heads, 0, values.shape[-1])
        self.original_length = int(original_length)
        self.is_sliding = sliding
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self.scores: torch.Tensor | None = None
        #: KVzip+'s ``(entry, query)`` weights of those scores (``kvpack.attention.masked_attention``), or ``None``.
        self.score_weights: tuple[torch.Tensor, torch.Tensor] | None = None
        #: a list while Attention Matching records reference queries (``kvpack.methods.am``): the attention
        #: function appends ``(query [heads, q, head_dim], scaling)`` of every call; ``None`` otherwise.
        self.queries: list | None = None
        self._head_views: list | None = None

    def _index_heads(self, lengths: list[int], device) -> None:
        """Set ``head_lengths``, ``row_starts``, ``offsets`` (on ``device``), ``kept`` and ``dense`` from the
        per-head entry counts."""
        starts = [0]
        for m in lengths:
            starts.append(starts[-1] + m)
        self.head_lengths, self.row_starts = lengths, starts
        self.offsets = torch.tensor(starts, dtype=torch.int64, device=device)
        self.kept = max(lengths)
        self.dense = min(lengths) == self.kept

    @property
    def tail_length(self) -> int:
        """Tokens appended after the kept entries (question and generated tokens)."""
        return int(self.keys.shape[-2])

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the layer."""
        return len(self.head_lengths)

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D102 - always initialised
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[1, kv_heads, new, head_dim]`` states to the tail; return the tail's keys and values, the keys
        tagged with this layer (read by ``kvpack.attention``, which adds the kept rows)."""
        self.keys = torch.cat([self.keys, key_states.to(self.dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.dtype)], dim=-2)
        self.keys._kvpack_layer = self
        return self.keys, self.values

    def head_rows(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys ``[n_h, head_dim]``, values ``[n_h, head_dim_v]``, positions ``[n_h]`` and biases ``[n_h]`` (or
        ``None``) of KV head ``h``'s kept entries (views)."""
        s, e = self.row_starts[h], self.row_starts[h + 1]
        b = None if self.biases is None else self.biases[s:e]
        return self.kept_keys[s:e], self.kept_values[s:e], self.kept_positions[s:e], b

    def head_views(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per KV head: keys ``[1, 1, n_h, head_dim]``, values ``[1, 1, n_h, head_dim_v]`` and biases
        ``[1, 1, 1, n_h]`` (or ``None``), views of the packed rows made once (no memory of their own)."""
        if self._head_views is None:
            views = []
            for h in range(self.num_kv_heads):
                k, v, _, b = self.head_rows(h)
                views.append((k[None, None], v[None, None], None if b is None else b.view(1, 1, 1, -1)))
            self._head_views = views
        return self._head_views

    def tail_positions(self) -> torch.Tensor:
        """``[tail]`` int64 logical positions of the tail's tokens."""
        start = self.original_length
        return torch.arange(start, start + self.tail_length, device=self.device)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Kept entries and tail as per-head padded tensors, for the paths that need one ``[kv_heads, kv]`` grid
        (KVzip's scoring pass, ``kvpack.attention.masked_attention``): ``keys`` ``[1, kv_heads, kept + tail,
        head_dim]``, ``values``, ``positions`` ``[kv_heads, kept + tail]`` int64 (``-1`` marks padding) and
        ``biases`` ``[kv_heads, kept + tail]`` float32 (zeros for the tail and padding) or ``None``. A copy, made
        per call (a view of the rows when ``dense`` and the tail is empty)."""
        heads, m, t = self.num_kv_heads, self.kept, self.tail_length
        tail_pos = self.tail_positions().expand(heads, t)
        if self.dense:
            k = self.kept_keys.view(1, heads, m, self.kept_keys.shape[-1])
            v = self.kept_values.view(1, heads, m, self.kept_values.shape[-1])
            p = self.kept_positions.view(heads, m)
            b = None if self.biases is None else self.biases.view(heads, m)
        else:
            k = self.kept_keys.new_zeros(1, heads, m, self.kept_keys.shape[-1])
            v = self.kept_values.new_zeros(1, heads, m, self.kept_values.shape[-1])
            p = self.kept_positions.new_full((heads, m), -1)
            b = None if self.biases is None else self.biases.new_zeros(heads, m)
            for h in range(heads):
                hk, hv, hp, hb = self.head_rows(h)
                n = hk.shape[0]
                k[0, h, :n], v[0, h, :n], p[h, :n] = hk, hv, hp
                if b is not None:
                    b[h, :n] = hb
        if t:
            k, v = torch.cat([k, self.keys], dim=-2), torch.cat([v, self.values], dim=-2)
            p = torch.cat([p, tail_pos], dim=-1)
            b = None if b is None else torch.cat([b, b.new_zeros(heads, t)], dim=-1)
        return k, v, p, b

    def nbytes(self) -> int:
        """Bytes held by the layer's tensors: kept rows, positions, offsets, biases and the tail."""
        parts = (self.kept_keys, self.kept_values, self.kept_positions, self.offsets, self.biases, self.keys,
                 self.values)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def rewind(self) -> None:
        """Drop the tail: back to the entries as loaded."""
        self.keys = self.keys.new_empty(1, self.num_kv_heads, 0, self.keys.shape[-1])
        self.values = self.values.new_empty(1, self.num_kv_heads, 0, self.values.shape[-1])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Logical sizes (the mask transformers builds from them is not used by the ``"kvpack"`` attention)."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Logical length: original context tokens plus the tail."""
        return self.original_length + self.tail_length

    def get_max_length(self) -> int:
        """No maximum (-1)."""
        return -1

    def reset(self) -> None:
        """Same as ``rewind``: the kept entries are never discarded."""
        self.rewind()


class KvpackCache(Cache):
    """A compressed context loaded into a model, ready for ``generate()``.

    Build it with ``kvpack.load(path, model)`` (or ``KvpackCache.from_pack``). To use it with plain
    ``model.generate``, pass the context's token ids followed by the question's as ``input_ids`` and the cache as
    ``past_key_values``; transformers feeds only the tokens after the context::

        ids = torch.cat([cache.context_ids, question_ids], dim=-1)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

    The model must use the ``"kvpack"`` attention (``kvpack.load`` switches it, and hooks ``generate`` so that each
    call checks its input and rewinds the cache first: ``prepare_generate``). Batch size 1.

    Attributes:
        token_ids: ``[tokens]`` int64 ids of the original cached sequence (prefix + context), on CPU.
        metadata: the pack's metadata (method, ratio, fingerprint, layout, ...).
    """

    def __init__(self, layers: list[PackedLayer], token_ids: torch.Tensor, metadata: dict[str, Any]):
        super().__init__(layers=layers)
        self.token_ids = token_ids
        self.metadata = metadata

    @property
    def context_ids(self) -> torch.Tensor:
        """``[1, tokens]`` int64 ids of the cached sequence on the cache's device."""
        return self.token_ids.unsqueeze(0).to(self.layers[0].device)

    @property
    def original_length(self) -> int:
        """Tokens of the original cached sequence."""
        return int(self.token_ids.shape[0])

    def rewind(self) -> None:
        """Drop every token appended since loading (question and answer), restoring the loaded state exactly."""
        for layer in self.layers:
            layer.rewind()

    def prepare_generate(self, input_ids: torch.Tensor, model=None) -> None:
        """Called (by the hook ``kvpack.load`` installs) when ``model.generate`` starts on this cache: check that
        ``input_ids`` ``[1, tokens + question_tokens]`` start with the cached context (and, given the ``model``,
        that it still runs the ``"kvpack"`` attention in the cache's dtype), then ``rewind()``, so the tokens after
        the context are fed afresh. A cache reused without ``rewind()`` thus answers as a fresh one (a
        conversation continues by passing it whole).

        Raises:
            InputError: a batch larger than one; ``input_ids`` that do not start with the context's ids (e.g. only
                the question's); a model switched to another attention or cast to another dtype since the load;
                the message says what to do.
        """
        if model is not None:
            self.check_model(model)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InputError(f"a loaded KvpackCache serves one sequence, got input_ids of shape {list(input_ids.shape)}"
                             "; call generate once per question (batch size 1), or load one cache per sequence")
        n = self.original_length
        if input_ids.shape[1] <= n or not torch.equal(input_ids[0, :n].cpu(), self.token_ids):
            raise InputError(f"input_ids ({input_ids.shape[1]} tokens) do not start with the cached context's {n} "
                             "token ids; pass the context's ids followed by the question's, "
                             "torch.cat([cache.context_ids, question_ids], dim=-1), which "
                             "kvpack.generation.question_input_ids(tokenizer, cache, question) builds")
        self.rewind()

    def check_model(self, model) -> None:
        """Raise ``InputError`` unless ``model`` can attend over this cache: a transformers model on the ``"kvpack"``
        attention, in the cache's dtype (``kvpack.load`` casts the entries to the model's dtype at load)."""
        require_model(model)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != "kvpack":
            raise InputError(f"the model now uses the {impl!r} attention, which cannot read a KvpackCache; "
                             "call kvpack.attention.use_kvpack_attention(model) again (kvpack.load and "
                             "kvpack.generate switch it to 'kvpack')")
        dtype = getattr(model, "dtype", None)
        if self.layers and dtype is not None and dtype != self.layers[0].dtype:
            raise InputError(f"the cache holds {str(self.layers[0].dtype).replace('torch.', '')} entries but the "
                             f"model now runs in {str(dtype).replace('torch.', '')}; load the pack again into "
                             "the model as it is now (kvpack.load casts the entries to the model's dtype)")

    def kept_entries(self) -> torch.Tensor:
        """``[layers, kv_heads]`` int64 kept entries per head."""
        return torch.tensor([layer.head_lengths for layer in self.layers], dtype=torch.int64)

    def nbytes(self) -> int:
        """Bytes held by all layers' tensors (kept rows, positions, offsets, biases, tail): no padding."""
        return sum(layer.nbytes() for layer in self.layers)

    @classmethod
    def from_pack(cls, pack: Pack, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  sliding_layers: tuple[int, ...] = (), dequantize: str = "at-load") -> "KvpackCache":
        """Lay a ``Pack`` out as per-layer packed tensors on ``device`` (cast to ``dtype`` if given).

        ``dequantize="at-load"`` (default): a quantized layer is dequantized once here (on CPU, ``kvpack.quant``:
        ``code x scale + min`` in float32, then ``dtype``), so the cache holds ordinary full-precision rows, packed
        per head like the pack's own (no padding). ``dequantize="on-the-fly"``: a quantized layer keeps its codes as
        stored (``kvpack.compact_cache.CompactLayer``, about 3x fewer bytes than bf16 rows at int4), and attention
        dequantizes them as it reads them (the Triton kernel on CUDA; elsewhere a per-call dequantization, slow).
        Unquantized layers and sliding-window layers (``sliding_layers``) are laid out as at load either way.
        Without ``dtype`` each layer keeps the dtype of its keys (its values are cast to it). Biases
        (``LayerEntries.biases``) stay float32.

        Raises ``InputError`` if the pack has no layers, if a layer's tensors do not have the rows its head
        lengths (and, quantized, its sink and body lengths) call for, if ``dequantize`` is neither of
        ``compact_cache.DEQUANTIZE``, or if ``"on-the-fly"`` is asked on CUDA where the kernel cannot read a layer
        (no triton, or a group size / value width it does not take).
        """
        from .compact_cache import DEQUANTIZE, CompactLayer, check_on_the_fly

        if not pack.layers:
            raise InputError("the pack has no layers")
        if dequantize not in DEQUANTIZE:
            raise InputError(f"dequantize must be one of {', '.join(DEQUANTIZE)}, got {dequantize!r}")
        n = pack.original_tokens
        on_the_fly = [dequantize == "on-the-fly" and e.quant is not None and e.quant.layout == "compact"
                      and idx not in sliding_layers for idx, e in enumerate(pack.layers)]
        for idx, (entries, fly) in enumerate(zip(pack.layers, on_the_fly)):
            if fly:
                check_on_the_fly(entries, device, idx)  # before any layer is laid out
        laid = iter(_laid_out([e for e, fly in zip(pack.layers, on_the_fly) if not fly], dtype, device))
        layers: list[PackedLayer] = []
        for idx, (entries, fly) in enumerate(zip(pack.layers, on_the_fly)):
            if fly:
                layers.append(CompactLayer(entries, n, dtype or entries.keys.dtype, device,
                                           sliding=idx in sliding_layers))
                continue
            keys, values, positions, biases = next(laid)
            layers.append(PackedLayer(keys, values, positions, entries.head_lengths, n,
                                      sliding=idx in sliding_layers, biases=biases))
        return cls(layers, pack.token_ids.long().cpu(), dict(pack.metadata))


def _laid_out(layers: list[LayerEntries], dtype: torch.dtype | None, device: torch.device | str
              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Every layer of a pack in full precision, packed per head: ``(keys, values, positions, biases)`` per layer.

    ``keys`` ``[entries, head_dim]`` and ``values`` ``[entries, head_dim_v]`` in ``dtype`` (default: the layer's
    keys' dtype), heads back to back; ``positions`` ``[entries]`` int64; ``biases`` ``[entries]`` float32 or
    ``None``.

    Layers that share the target dtype, head sizes, head count and quantization setting (all layers of a normal
    pack) are laid out together by ``_laid_out_group``: one dequantization and one concatenation for all of them.
    """
    groups: dict[tuple, list[int]] = {}
    for idx, entries in enumerate(layers):
        q = entries.quant
        key = (dtype or entries.keys.dtype, entries.keys.shape[1], entries.values.shape[1],
               entries.head_lengths.shape[0], None if q is None else (q.qtype, q.group_size, q.layout))
        groups.setdefault(key, []).append(idx)
    out: list = [None] * len(layers)
    for key, members in groups.items():
        for idx, laid in zip(members, _laid_out_group([layers[i] for i in members], key[0], device)):
            out[idx] = laid
    return out


def _laid_out_group(layers: list[LayerEntries], dt: torch.dtype, device: torch.device | str
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``_laid_out`` for layers with one dtype ``dt``, head sizes, head count and quantization setting.

    The quantized body rows of all the layers are dequantized at once (``dequantize_bodies``, float32, then ``dt``).
    Head ``h`` of a layer is then up to three row blocks, its sink rows (full precision), its body rows and its
    residual rows (full precision); the blocks of every head of every layer go into one concatenation (one copy)
    per tensor kind, moved to ``device`` in one transfer, and each layer's tensors are views of it.
    An unquantized layer is one block per head.
    """
    d, dv = layers[0].keys.shape[1], layers[0].values.shape[1]
    body_keys = body_values = None
    if layers[0].quant is not None:
        body_keys, body_values, key_starts, value_starts = dequantize_bodies([e.quant for e in layers])
        body_keys, body_values = body_keys.to(dt), body_values.to(dt)
        key_starts, value_starts = key_starts.tolist(), value_starts.tolist()
    key_parts, value_parts, rows = [], [], []
    for l, entries in enumerate(layers):
        ns = entries.head_lengths.tolist()
        body = 0 if body_keys is None else sum(entries.quant.body_lengths.tolist())
        fp = sum(ns) - body  # full-precision rows
        if entries.keys.shape[0] != fp or entries.values.shape[0] != fp or entries.positions.shape[0] != sum(ns) or (
                body_keys is not None and entries.quant.key_codes.shape[0] != body) or (
                entries.biases is not None and entries.biases.shape[0] != sum(ns)):
            raise InputError(f"layer {l} of the group: its tensors' rows do not match its head lengths {ns}; "
                             "build the pack again with kvpack.compress or load it from a file")
        layer_bodies = None if body_keys is None else (body_keys, body_values, key_starts[l], value_starts[l])
        _, key_blocks, value_blocks = head_row_pieces(entries, dt, layer_bodies)
        key_parts += [b for blocks in key_blocks for b in blocks]
        value_parts += [b for blocks in value_blocks for b in blocks]
        rows.append(sum(ns))
    all_keys = torch.cat(key_parts) if key_parts else torch.empty(0, d, dtype=dt)
    all_values = torch.cat(value_parts) if value_parts else torch.empty(0, dv, dtype=dt)
    all_positions = torch.empty(sum(rows), dtype=torch.int64)
    if sum(rows):
        torch.cat([e.positions for e in layers], out=all_positions)  # int32 positions are widened by the copy
    all_keys, all_values, all_positions = all_keys.to(device), all_values.to(device), all_positions.to(device)
    out, start = [], 0
    for entries, n in zip(layers, rows):
        # (a copy: a loaded pack's biases are views of the file's memory map, which may change after the load)
        biases = None if entries.biases is None else entries.biases.to(device=device, dtype=torch.float32, copy=True)
        out.append((all_keys[start : start + n], all_values[start : start + n], all_positions[start : start + n],
                    biases))
        start += n
    return out
