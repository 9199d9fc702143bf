"""``kvpack.compress``: prefill a context once, score its KV entries, keep the best, return a ``Pack``."""

from __future__ import annotations

import hashlib
import time
from typing import Callable

import torch

from . import __version__
from . import constants as C
from . import settings as S
from .build_settings import check_chunk_size, check_quant, check_ratio
from .errors import InputError
from .fingerprint import model_fingerprint
from .generation import check_text
from .layout import chat_layout
from .methods import get_method
from .methods.base import gather
from .model import model_spec, resolve_kv_dtype
from .pack import Pack
from .prefill import prefill
from .stats import AttentionRecorder
from .quant import quantize_pack
from .settings import DEFAULT_CHUNK_SIZE, DEFAULT_RATIO

__all__ = ["compress", "assemble_pack", "prefill_recorder", "max_context_tokens"]


def compress(model, tokenizer, text: str, *, method: str = "kvzip", ratio: float = DEFAULT_RATIO,
             chunk_size: int = DEFAULT_CHUNK_SIZE, source_name: str = "<text>",
             progress: Callable[[int], None] | None = None, quant: str = C.QUANT_NONE,
             group_size: int = S.DEFAULT_GROUP_SIZE, kv_dtype: str | torch.dtype | None = "auto",
             stage_seconds: dict[str, float] | None = None, **options) -> Pack:
    """Compress the KV cache of ``text`` for ``model`` (query-agnostic: any later question can be asked).

    The text is laid out as the start of a chat user turn (``kvpack.layout``); the template prefix is the
    attention sink, kept in every head. The context is prefilled in chunks of ``chunk_size`` tokens (recording the
    prefill attention statistics the method needs), each full-attention layer's entries are scored by ``method``,
    and ``round(ratio x entries)`` context entries over all layers x KV heads x positions are kept, chosen by the
    method's budget scope (``kvpack.methods.base``: KVzip's is global, so heads get their own budgets,
    arXiv 2505.23416 §3.3). A method may then change the kept entries (D2O merges evicted ones into them).

    Args:
        model, tokenizer: from ``kvpack.load_model`` or transformers.
        text: the context (a document), non-empty; special-token strings in it (``<|end|>``) are encoded as text,
            never as control tokens (``ChatLayout.encode_text``).
        method: a name from ``kvpack.methods.METHODS``.
        ratio: compression ratio = fraction of context KV entries kept, in (0, 1]; 1.0 keeps everything
            (method ``none`` always keeps everything and records 1.0; for ``kvzip-head`` it is the fraction of
            (layer, KV head) pairs kept whole, and ``metadata["stats"]`` records the entries kept).
        chunk_size: tokens per prefill and scoring chunk (bounds memory).
        source_name: recorded in the pack (the file name for ``kvpack build``).
        progress: called with the number of context tokens processed, per stage.
        quant: ``"none"`` (default), ``"int8"`` or ``"int4"``: after selection, quantize each head's kept entries
            except the attention sink in the compact layout (KIVI's grouping, arXiv 2402.02750, key code widths per
            channel chosen from the context's own queries recorded during the prefill, 8-bit group parameters;
            ``kvpack.quant``); the per-layer max and mean
            absolute errors go to ``metadata["stats"]["quant_error"]``.
        group_size: quantization group ``G``: 32 (default), 64 or 128 tokens per key group; values use
            ``min(G, head_dim)`` channels per group.
        kv_dtype: the dtype the pack stores its full-precision keys and values in: ``"auto"`` (default: the
            model's native 16-bit dtype, ``kvpack.model.resolve_kv_dtype``), ``"float32"``, ``"bfloat16"`` or
            ``"float16"``, whatever dtype the compute runs in. Scores, merges and quantization use the compute
            dtype; only what is stored is cast.
        stage_seconds: if given, filled with the wall-clock seconds of each stage (CUDA synchronised):
            ``tokenize``, ``prefill`` (with the method's attention statistics), ``score``, ``select``,
            ``gather_merge`` (gathering the kept entries, D2O's merge, the metadata) and ``quantize``.
        **options: the method's parameters (see its class docstring); a method with a ``chunk_size``
            parameter (KVzip) defaults it to ``chunk_size``.

    Returns:
        A ``Pack`` (in memory); ``kvpack.save`` writes it.

    Raises:
        InputError: text that is not a non-empty ``str`` of UTF-8 text (``generation.check_text``), a
            ``source_name`` that is not a short ``str``, text longer than ``max_context_tokens(model)``, ratio outside (0, 1],
            chunk_size < 1, unknown method or option, unknown quant, group size not in (32, 64, 128) or not fitting
            the head size, unknown ``kv_dtype``, ``stage_seconds`` not a dict.
        UnsupportedModelError: the model's architecture is not supported.
    """
    if not isinstance(source_name, str) or not source_name or len(source_name) > C.MAX_SHORT_TEXT:
        got = f"{len(source_name):,} characters" if isinstance(source_name, str) else type(source_name).__name__
        raise InputError(f"source_name must be a non-empty str of at most {C.MAX_SHORT_TEXT} characters "
                         f"(recorded in the pack as its source), got {got}")
    check_text(source_name, "source_name")
    check_text(text, f"{source_name}: the context")
    if not text.strip():
        raise InputError(f"{source_name}: the context is empty; give a non-empty text")
    check_ratio(ratio)
    check_chunk_size(chunk_size)
    if stage_seconds is not None and not isinstance(stage_seconds, dict):
        raise InputError(f"stage_seconds must be a dict to fill in (or None), got {type(stage_seconds).__name__}")
    scorer = get_method(method, {"chunk_size": chunk_size}, **options)
    ratio = scorer.kept_ratio(ratio)
    spec = model_spec(model)
    storage_dtype = resolve_kv_dtype(kv_dtype, model)
    check_quant(quant, group_size, spec.head_dim)
    device = next(model.parameters()).device
    clock = _StageClock(stage_seconds, device)
    layout = chat_layout(tokenizer)
    prefix_ids = layout.prefix_ids(tokenizer)
    context_ids = layout.encode_text(tokenizer, text)
    clock.lap("tokenize")
    if not context_ids:
        raise InputError(f"{source_name}: the context has no tokens")
    token_ids = prefix_ids + context_ids
    limit = max_context_tokens(model)
    if limit is not None and len(token_ids) > limit:
        raise InputError(f"{source_name}: {len(token_ids)} tokens is too long for this model "
                         f"({_limit_reason(model)}); split the document (`kvpack build --split`)")
    compressing = ratio < 1.0
    recorder, observed = prefill_recorder(scorer, spec, len(token_ids), device, tokenizer, layout, compressing,
                                          quant != C.QUANT_NONE)
    full = prefill(model, token_ids, len(prefix_ids), layout, spec, chunk_size, progress, recorder, observed)
    clock.lap("prefill")
    if compressing:
        scores = scorer.score(model, tokenizer, full, progress)
        clock.lap("score")
        keep = scorer.select(scores, ratio, full)
    else:
        keep = torch.ones(len(spec.compressed_layers), spec.num_kv_heads, full.context_tokens, dtype=torch.bool)
    clock.lap("select")
    pack = assemble_pack(model, tokenizer, text, scorer, ratio, full, keep, source_name)
    clock.lap("gather_merge")
    energy = recorder.mean_query_energy() if recorder is not None else None
    pack = quantize_pack(pack, quant, group_size, energy).with_kv_dtype(storage_dtype)
    clock.lap("quantize")
    return pack


#: Positions ``max_context_tokens`` leaves free after a context for questions and answers.
QUESTION_ROOM = 256


def max_context_tokens(model) -> int | None:
    """The longest cached sequence (chat-template prefix + context, in tokens) ``compress`` accepts for ``model``:
    ``max_position_embeddings - 256`` (room for questions), and below the sliding window when every layer slides;
    ``None`` when the config sets no limit. Raises ``UnsupportedModelError`` for unsupported models."""
    limits = _limits(model)
    return min(limits) if limits else None


def _limits(model) -> dict[int, str]:
    """Each context limit of ``model`` (tokens) with its reason."""
    spec = model_spec(model)
    limits = {}
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos:
        limits[max_pos - QUESTION_ROOM] = f"max_position_embeddings={max_pos}, leaving {QUESTION_ROOM} for questions"
    if spec.sliding_window and not spec.sliding_layers:
        limits[spec.sliding_window - 1] = f"the {spec.sliding_window}-token sliding window every layer uses"
    return limits


def _limit_reason(model) -> str:
    limits = _limits(model)
    return f"at most {min(limits)}: {limits[min(limits)]}"


class _StageClock:
    """Writes the seconds since the previous lap into ``seconds[name]`` (nothing when ``seconds`` is None)."""

    def __init__(self, seconds: dict[str, float] | None, device):
        self.seconds = seconds
        self.cuda = torch.device(device).type == "cuda"
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self.seconds is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now


def prefill_recorder(scorer, spec, tokens: int, device, tokenizer, layout, compressing: bool, query_energy: bool
                     ) -> tuple[AttentionRecorder | None, list[int] | None]:
    """The ``AttentionRecorder`` a prefill of ``tokens`` tokens needs, and the observation tokens fed after the
    context: the method's statistics when ``compressing`` (``Method.recorder``, ``Method.observed_ids``), plus the
    query energy when ``query_energy`` (the compact quantized layout's key code widths, ``kvpack.compact``).
    ``(None, None)`` when nothing is recorded."""
    recorder = scorer.recorder(spec, tokens, device) if compressing else None
    observed = scorer.observed_ids(tokenizer, layout) if recorder is not None else None
    if query_energy:
        recorder = recorder or AttentionRecorder(spec, tokens, device=device)
        recorder.track_query_energy()
    return recorder, observed


def assemble_pack(model, tokenizer, text: str, scorer, ratio: float, full, keep: torch.Tensor,
                  source_name: str, fingerprint: dict | None = None) -> Pack:
    """Gather the kept entries of a prefill into a ``Pack`` with its metadata (before quantization).

    Args:
        scorer: the ``Method`` that produced ``keep`` (its merge hook runs when ``ratio < 1``).
        full: the ``Prefill`` of ``text``.
        keep: ``[compressed_layers, kv_heads, context_tokens]`` bool keep mask.
        fingerprint: the model's fingerprint if already computed (``kvpack.fingerprint.model_fingerprint``).
    """
    spec = full.spec
    layers = gather(full, keep)
    merge_stats = scorer.update_entries(full, keep, layers) if ratio < 1.0 else {}
    kv_dtype = layers[0].keys.dtype
    metadata = {
        "method": scorer.name,
        "method_params": scorer.params(),
        "ratio": float(ratio),
        "fingerprint": dict(fingerprint) if fingerprint else model_fingerprint(model, tokenizer, kv_dtype),
        "source": {"name": source_name, "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                   "chars": len(text)},
        "layout": full.layout.to_dict(),
        "layer_kinds": ["sliding_intact" if l in spec.sliding_layers else "compressed"
                        for l in range(spec.num_layers)],
        "kvpack_version": __version__,
        "stats": {"context_tokens": full.context_tokens, "sink_tokens": full.sink,
                  "context_entries": int(keep.numel()), "context_entries_kept": int(keep.sum()),
                  "layer_budgets": [int(b) for b in keep.sum(dim=(1, 2))]},
    }
    if merge_stats:
        metadata["stats"][scorer.stats_key] = merge_stats
    return Pack(token_ids=full.token_ids.clone(), layers=layers, sink_tokens=full.sink, metadata=metadata)
