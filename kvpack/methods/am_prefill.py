"""Attention Matching's queries from the context's own prefill, recorded as the prefill runs.

Two uses:

- reference queries (``reference="prefill"``): the paper's ``context-prefill`` source (arXiv 2602.16284 §4.1 and
  its code's ``query_generation/context_prefill.py``: "the article studies itself"), every context position's
  queries, subsampled per KV head like any other source. They cost nothing beyond the prefill; they are the
  queries of the model reading the text, where the repeat pass's are those of the model copying it. In the fit each
  such query attends to the whole context (no causal mask), as in the paper's code: a query is used as a probe of
  the head's attention, not replayed at its own position.
- validation queries (``ridge_search``, kvpack's): the queries of the context's last ``tail`` tokens, kept whole
  with their positions, on which ``kvpack.methods.am_validate`` measures each candidate fit causally, as the
  tokens that continue the context will read it.
"""

from __future__ import annotations

import torch

from ..model import ModelSpec
from ..prefill import Prefill, prefill as run_prefill
from ..stats import AttentionRecorder

__all__ = ["PrefillQueries", "record_prefill_queries"]


class PrefillQueries(AttentionRecorder):
    """A prefill recorder (``kvpack.stats.AttentionRecorder``) that also keeps the compressed layers' queries of the
    sequence's own tokens (positions ``< tokens``: the template prefix and the context; tokens fed after the context,
    such as SnapKV's observation question, are left out), after q-norm and RoPE.

    Args:
        spec: the model's attention shape; tokens: the prefilled sequence's length (prefix + context).
        reservoirs: one ``QueryReservoir`` per compressed layer, in ``spec.compressed_layers`` order, which gets
            every position's queries (the reservoir pools the GQA group and subsamples); ``None``: not kept.
        tail: the last ``tail`` positions' queries are also kept whole in ``tail_queries`` (0: none).
        device: where the recorder's own statistics live.

    Attributes (after the prefill):
        tail_queries: per compressed layer ``[heads, n, head_dim]`` float32 on CPU, positions ``tail_start ..
            tokens - 1`` (``n = tokens - tail_start``), or ``None`` without ``tail``.
        tail: as given; tail_start: the first position in ``tail_queries``; scaling: the attention scaling the
            layers reported.
    """

    def __init__(self, spec: ModelSpec, tokens: int, reservoirs: list | None = None, tail: int = 0,
                 device: torch.device | str = "cpu"):
        super().__init__(spec, tokens, device=device)
        self.reservoirs, self.tail = reservoirs, int(tail)
        self.tail_start = max(0, self.tokens - self.tail)
        self._tail_parts = [[] for _ in spec.compressed_layers] if tail > 0 else None
        self.scaling: float | None = None

    @property
    def tail_queries(self) -> list[torch.Tensor] | None:
        if self._tail_parts is None:
            return None
        return [torch.cat(parts, dim=1) if parts else torch.zeros(0) for parts in self._tail_parts]

    def _records(self, layer_idx: int, q_start: int, q_len: int | None = None) -> bool:
        if layer_idx not in self.index or q_start >= self.tokens:
            return False
        return self.reservoirs is not None or (self._tail_parts is not None and
                                               (q_len is None or q_start + q_len > self.tail_start))

    def wants_queries(self, layer_idx: int, q_start: int) -> bool:
        return super().wants_queries(layer_idx, q_start) or self._records(layer_idx, q_start)

    def record_queries(self, layer_idx: int, query: torch.Tensor, q_start: int, scaling: float | None = None) -> None:
        """``query`` ``[1, heads, q, head_dim]`` at positions ``q_start ..`` with the layer's attention ``scaling``
        (``head_dim ** -0.5`` when ``None``)."""
        if super().wants_queries(layer_idx, q_start):
            super().record_queries(layer_idx, query, q_start, scaling)
        if not self._records(layer_idx, q_start, query.shape[2]):
            return
        i = self.index[layer_idx]
        rows = query[0, :, : self.tokens - q_start]
        self.scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        if self.reservoirs is not None:
            self.reservoirs[i].append((rows, self.scaling))
        if self._tail_parts is not None and q_start + rows.shape[1] > self.tail_start:
            self._tail_parts[i].append(rows[:, max(0, self.tail_start - q_start):].float().cpu())


@torch.inference_mode()
def record_prefill_queries(model, prefill: Prefill, chunk_size: int, reservoirs: list | None = None,
                           tail: int = 0) -> PrefillQueries:
    """Prefill ``prefill``'s tokens again (``chunk_size`` tokens a chunk) with a ``PrefillQueries`` recorder over
    ``reservoirs`` and ``tail`` and return it: for a prefill that was made without the method's recorder (the
    bench's shared prefill). Raises nothing of its own."""
    recorder = PrefillQueries(prefill.spec, prefill.tokens, reservoirs, tail, device=next(model.parameters()).device)
    run_prefill(model, prefill.token_ids.tolist(), prefill.sink, prefill.layout, prefill.spec, chunk_size,
                recorder=recorder)
    return recorder
