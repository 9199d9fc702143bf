"""KVzip: query-agnostic scoring by context reconstruction (Kim et al., arXiv 2505.23416, §3.2-3.3)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .. import tasks
from ..attention import use_kvpack_attention
from ..prefill import Prefill
from .base import Method
from .params import KVzipParams
from .kvzip_plus import plus_weights

__all__ = ["KVzip"]


@dataclass
class KVzip(KVzipParams, Method):
    """Score each cached entry by how much the model needs it to repeat the context.

    For each chunk of ``chunk_size`` context tokens the model is teacher-forced on a repeat input, fed after the
    whole context but attending only to [sink, the chunk's cached entries, the repeat input itself (causal)]:

        "Repeat the previous context exactly." + assistant header + the chunk's tokens          (first chunk)
        "Repeat the part of the previous context exactly, starting with " + last 8 tokens of
        the previous chunk + assistant header + the chunk's tokens                               (later chunks)

    The score of entry (layer, KV head, position) is the maximum attention probability it receives over the
    repeat input's queries and the query heads of its GQA group (arXiv 2505.23416, Eq. 2). The repeat input is
    never added to the cache. ``scoring="plus"`` weights each probability by the entry's output norm relative to
    the query's hidden state (KVzip+, as NVIDIA kvpress's ``KVzipPress``;
    ``kvpack.methods.kvzip_plus``). The largest attention
    matrix is ``[heads, 256 queries, sink + 2 x chunk]``, so memory grows linearly with the context.

    Parameters (declared in ``kvpack.methods.params``):
        chunk_size: context tokens scored per reconstruction pass (paper: 2048).
        tail_tokens: tokens of the previous chunk quoted in later repeat prompts (paper: 8).
        scoring: ``"attention"`` (default, the paper's Eq. 2) or ``"plus"`` (KVzip+).
    """

    @torch.inference_mode()
    def score(self, model, tokenizer, prefill: Prefill, progress: Callable[[int], None] | None = None
              ) -> torch.Tensor:
        use_kvpack_attention(model)
        spec = prefill.spec
        n_ctx = prefill.context_tokens
        device = prefill.keys[0].device
        scores = torch.zeros(len(spec.compressed_layers), spec.num_kv_heads, n_ctx, dtype=torch.float32,
                             device=device)
        body = model.base_model
        grams = {}  # KVzip+: each layer's W_o^T W_o, shared by the chunks
        for start, stop, repeat_ids in self.repeat_inputs(tokenizer, prefill):
            cache = prefill.view_cache(slice(start, stop))
            buffers = []
            for l in spec.compressed_layers:
                layer = cache.layers[l]
                layer.scores = torch.zeros(spec.num_kv_heads, layer.kept, dtype=torch.float32, device=device)
                buffers.append(layer.scores)
            self._prepare_repeat_pass(cache, start)
            with plus_weights(model, spec, cache, grams) if self.scoring == "plus" else contextlib.nullcontext():
                with stop_after_attention(body, spec.compressed_layers[-1]):
                    body(input_ids=torch.tensor([repeat_ids], device=device), past_key_values=cache,
                         use_cache=True)
            for i, buf in enumerate(buffers):
                scores[i, :, start:stop] = buf[:, prefill.sink :]
            if progress:
                progress(stop)
        return scores

    def repeat_inputs(self, tokenizer, prefill: Prefill) -> Iterator[tuple[int, int, list[int]]]:
        """``(start, stop, repeat_ids)`` of every chunk: context tokens ``start .. stop - 1`` (after the sink) and
        the token ids of its repeat input (the prompt, the assistant header, the chunk's tokens)."""
        layout = prefill.layout
        context_ids = prefill.token_ids[prefill.sink:].tolist()
        for start in range(0, prefill.context_tokens, self.chunk_size):
            stop = min(prefill.context_tokens, start + self.chunk_size)
            if start == 0:
                prompt = tasks.REPEAT_PROMPT
            else:
                tail = tokenizer.decode(context_ids[max(0, start - self.tail_tokens) : start])
                prompt = tasks.repeat_from_prompt(tail)
            repeat_ids = layout.encode(tokenizer, layout.separator + prompt + layout.turn_end)
            yield start, stop, repeat_ids + context_ids[start:stop]

    def _prepare_repeat_pass(self, cache, start: int) -> None:
        """Called before the repeat pass of the chunk starting at context token ``start`` with its cache (a
        ``KvpackCache``); Attention Matching records the pass's queries here. Does nothing by default."""


class RepeatPassDone(Exception):
    """Raised by ``stop_after_attention``'s hook to end a repeat pass once its last scored layer has attended."""


@contextlib.contextmanager
def stop_after_attention(body, layer: int):
    """Within this context, a forward of ``body`` (a model's ``base_model``) ends right after layer ``layer``'s
    attention module returns: the module's forward hook raises ``RepeatPassDone``, which this context swallows.

    The repeat pass needs each compressed layer's attention probabilities (and Attention Matching its queries),
    never its output, so the output projection and MLP of the last compressed layer, every later layer and the
    final norm are skipped (1/L of the pass's MLP and projections on an L-layer model). A model whose layers are
    not at ``body.layers[layer].self_attn`` runs whole. Raises nothing of its own; any other exception of the
    forward passes through, and the hook is removed either way.
    """
    layers = getattr(body, "layers", None)
    attn = None
    if isinstance(layers, torch.nn.ModuleList) and 0 <= layer < len(layers):
        attn = getattr(layers[layer], "self_attn", None)
    if not isinstance(attn, torch.nn.Module):
        yield
        return
    token = object()

    def hook(module, args, output):
        raise RepeatPassDone(token)

    handle = attn.register_forward_hook(hook)
    try:
        yield
    except RepeatPassDone as exc:
        if not exc.args or exc.args[0] is not token:
            raise
    finally:
        handle.remove()
