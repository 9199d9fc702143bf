"""The loaded cache: a ``transformers.Cache`` whose layers hold each KV head's kept entries packed back to back.

Each layer is a ``kvpack.packed_layer.PackedLayer`` (the kept rows of all KV heads back to back, as the pack stores
them, plus the tail of new tokens), or, for a quantized layer loaded with ``dequantize="on-the-fly"``, a
``kvpack.compact_cache.CompactLayer`` (the codes as stored). New tokens sit at logical positions
``original_length, original_length + 1, ...``: ``get_seq_length()`` reports the original context length plus the
tail, so transformers gives new tokens the RoPE positions they would have had after the full context. The
``"kvpack"`` attention function (``kvpack.attention``, ``kvpack.varlen``) attends each head over its own rows plus
the tail.

Reuse across questions: ``rewind()`` drops the tail and restores the cache exactly as loaded.
``kvpack.generate`` calls it before and after every answer, so asking question 2 after question 1 gives exactly
what question 2 gets from a fresh load.

Floors: ``packed_layer`` (the rows) < ``compact_cache`` (the codes) < this module (the ``Cache``); none of them
imports the attention modules, which read the layers they are handed.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .compact_cache import CompactLayer, check_on_the_fly
from .errors import InputError
from .pack import Pack
from .packed_layer import PackedLayer, lay_out
from .settings import DEQUANTIZE

__all__ = ["PackedLayer", "KvpackCache", "require_model"]


def require_model(model) -> None:
    """Raise ``InputError`` unless ``model`` is a transformers model (a ``torch.nn.Module`` with a ``config``)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError(f"model must be the transformers model the pack was built with (kvpack.load_model), got "
                         f"{type(model).__name__}")


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
        ``settings.DEQUANTIZE``, or if ``"on-the-fly"`` is asked on CUDA where the kernel cannot read a layer
        (no triton, or a group size / value width it does not take).
        """
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
        laid = iter(lay_out([e for e, fly in zip(pack.layers, on_the_fly) if not fly], dtype, device))
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
